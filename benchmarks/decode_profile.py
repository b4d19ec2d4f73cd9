r"""GPU time of each kernel in one planned decode, captured alone in a CUDA graph (torch.profiler over 50 replays).

    python3 benchmarks/decode_profile.py turbo_k4v2_d80_96 --head-dim 80 --batch 8 --context 8192

The cache holds random K/V at every position of batch x context tokens (head-major blocks of 64, 8 KV heads, 32
query heads, fp16; window schemes fill each sequence's ring too). Enough copies of it to pass twice the L2 cache take
turns, a graph each, so every replay reads its cache from memory. Prints the time per replay (CUDA events over 200)
and each kernel's mean time and launches per replay.

With --once: one cache and one planned decode called three times, no graphs, for a kernel profiler to read the
third call's split kernel:

    ncu --clock-control none --kernel-name 'regex:^_decode_kernel(_gluon)?$' --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
        --section LaunchStats \
        --metrics smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_lsu.sum \
        python3 benchmarks/decode_profile.py int8_token --context 32768 --once
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

BLOCK_SIZE, KV_HEADS, Q_HEADS = 64, 8, 32
PROFILED, TIMED = 50, 200


def filled_cache(m, head_dim: int, block_tables: torch.Tensor, context: int) -> tuple:
    """A cache of random K/V at every position below `context` of each sequence, and decode's window keywords."""
    batch, blocks_per_seq = block_tables.shape
    window = hasattr(m, "WINDOW")
    cache = m.allocate_cache(batch * blocks_per_seq, BLOCK_SIZE, KV_HEADS, head_dim, device="cuda",
                             dtype=torch.float16, **({"max_seqs": batch} if window else {}))
    slots = block_tables[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device="cuda")
    slots = slots.flatten(1)[:, :context].flatten()
    key, value = (torch.randn(slots.numel(), KV_HEADS, head_dim, device="cuda", dtype=torch.float16) for _ in "kv")
    if hasattr(m, "calibrate"):  # a channel split chooses each KV head's outlier channels first
        m.calibrate(cache, key, value)
    if not window:
        m.fill(cache, key, value, slots)
        return cache, {}
    rings = torch.arange(batch, device="cuda")
    m.fill(cache, key, value, slots, positions=torch.arange(context, device="cuda").repeat(batch),
           window_index=rings.repeat_interleave(context))
    return cache, {"window_index": rings}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scheme")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--once", action="store_true", help="three planned decode calls, no graphs (for ncu)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvqc from this checkout
    from kvqc import modules

    m = modules.load(args.scheme)
    d, batch, context = args.head_dim, args.batch, args.context
    num_blocks = batch * -(-context // BLOCK_SIZE)
    block_tables = torch.arange(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    query = torch.randn(batch, Q_HEADS, d, device="cuda", dtype=torch.float16)
    out = torch.empty_like(query)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(1, -(-2 * l2 // (num_blocks * BLOCK_SIZE * KV_HEADS * m.bytes_per_token(d))))
    graphs, plans = [], []  # a graph reads and writes its plan's scratch: the plans live as long as the graphs
    for _ in range(copies):
        cache, extra = filled_cache(m, d, block_tables, context)
        plan = m.plan_decode(cache, block_tables, seq_lens, Q_HEADS, torch.float16, **extra)
        plans.append(plan)
        for _ in range(3):  # compile, then leave the plan's replay
            m.decode(query, cache, block_tables, seq_lens, plan=plan, out=out, **extra)
        if args.once:
            torch.cuda.synchronize()
            print(f"{args.scheme}, head_dim {d}, {batch} x {context}: {plan.num_splits} splits a sequence, "
                  f"merge: {plan.merge}")
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            m.decode(query, cache, block_tables, seq_lens, plan=plan, out=out, **extra)
        graphs.append(graph)
    for i in range(10):
        graphs[i % copies].replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(PROFILED):
            graphs[i % copies].replay()
        torch.cuda.synchronize()
    time_us, launches = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            time_us[e.name] += e.device_time / PROFILED
            launches[e.name] += 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(TIMED):
        graphs[i % copies].replay()
    end.record()
    torch.cuda.synchronize()
    print(f"{args.scheme}, head_dim {d}, {batch} x {context}, {torch.cuda.get_device_name()}: "
          f"{start.elapsed_time(end) / TIMED * 1000:.1f} us a replay, {copies} cache copies")
    for name in sorted(time_us, key=time_us.get, reverse=True):
        print(f"  {name}: {time_us[name]:.1f} us, {launches[name] // PROFILED} launch(es)")


if __name__ == "__main__":
    main()
