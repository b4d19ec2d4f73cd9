r"""One planned decode, called three times, for a kernel profiler (Nsight Compute) to read the third.

    ncu --clock-control none --kernel-name 'regex:^_decode_kernel(_gluon)?$' --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
        --section LaunchStats \
        --metrics smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_lsu.sum \
        python3 benchmarks/decode_once.py int8_token

The cache holds random K/V at every position of batch x context tokens (head-major blocks of 64, 8 KV heads, 32
query heads, fp16); window schemes fill each sequence's ring as well.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

BLOCK_SIZE, KV_HEADS, Q_HEADS = 64, 8, 32


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scheme")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32768)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvqc from this checkout
    from kvqc import modules

    m = modules.load(args.scheme)
    d, batch, context = args.head_dim, args.batch, args.context
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    block_tables = torch.arange(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    query = torch.randn(batch, Q_HEADS, d, device="cuda", dtype=torch.float16)
    window = hasattr(m, "WINDOW")
    cache = m.allocate_cache(num_blocks, BLOCK_SIZE, KV_HEADS, d, device="cuda", dtype=torch.float16,
                             **({"max_seqs": batch} if window else {}))
    slots = block_tables[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device="cuda")
    slots = slots.flatten(1)[:, :context].flatten()
    key, value = (torch.randn(slots.numel(), KV_HEADS, d, device="cuda", dtype=torch.float16) for _ in range(2))
    if hasattr(m, "calibrate"):  # a channel split chooses each KV head's outlier channels first
        m.calibrate(cache, key, value)
    extra = {}
    if window:
        extra = {"window_index": torch.arange(batch, device="cuda")}
        m.fill(cache, key, value, slots, positions=torch.arange(context, device="cuda").repeat(batch),
               window_index=extra["window_index"].repeat_interleave(context))
    else:
        m.fill(cache, key, value, slots)
    plan = m.plan_decode(cache, block_tables, seq_lens, Q_HEADS, torch.float16, **extra)
    for _ in range(3):
        m.decode(query, cache, block_tables, seq_lens, plan=plan, **extra)
    torch.cuda.synchronize()
    print(f"{args.scheme}, head_dim {d}, {batch} x {context}: {plan.num_splits} splits a sequence, "
          f"merge: {plan.merge}")


if __name__ == "__main__":
    main()
