"""`kvqc bench`: time the generated kernels against fp16 SDPA and against the GPU's own copy bandwidth.

Every number comes from the GPU in the same run: the memory-bandwidth floor is a device-to-device copy measured
here, never a datasheet figure, and every shape is checked for correctness before it is timed, so a fast but
wrong kernel shows up in the table. Exit status: 0 done (shapes that failed are recorded, not fatal), 2 no GPU
or bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

NO_GPU = "kvqc bench: needs a CUDA GPU (speed is measured on the GPU, never under the interpreter)"

DEFAULT_BATCHES = (1, 8, 32)
DEFAULT_CONTEXTS = (1024, 8192, 32768)
LONG_CONTEXT = 131072  # only at batch 1: at larger batches its fp16 peer alone would not fit
DEFAULT_HEAD_DIMS = (128, 64)
QUICK = {"batch": [8], "context": [32768], "head_dim": [128]}

MiB = 1 << 20
COPY_BYTES = 1 << 30
L2_FALLBACK = 64 * MiB
L2_MULTIPLE = 4  # copies together exceed this many L2s, so no call finds its inputs still cached
MEMORY_FRACTION = 0.4  # rotation copies stay under this share of free memory; the rest is for outputs and scratch
FILL_TOKENS_PER_SEQ = 8192  # a prefill chunk, not a whole context: fill is timed on what engines write at once
FILL_CHUNK_BYTES = 256 * MiB  # fp16 input per fill call while populating a cache, to bound the staging memory
ATTEND_TOKENS = 16  # new query tokens per sequence for attend: a speculative-decoding verification step
ERR_WARN = 1e-2  # decode vs SDPA on the same dequantized cache: only fp rounding should separate them
DEVICE = "cuda"  # one place, so the pipeline can be smoke-tested on CPU under the interpreter


# ---------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register bench's options, so `kvqc bench` and this module's main share them."""
    parser.add_argument("schemes", nargs="*", metavar="SCHEME",
                        help="scheme names or files (default: every shipped scheme)")
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: 1 8 32)")
    parser.add_argument("--context", type=int, nargs="+",
                        help="context lengths (default: 1024 8192 32768, plus 131072 at batch 1)")
    parser.add_argument("--head-dim", type=int, nargs="+", help="head dims (default: 128 64)")
    parser.add_argument("--q-heads", type=int, default=32, help="query heads (default: 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default: 8)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per cache block (default: 64)")
    parser.add_argument("--layout", choices=("bhsd", "bshd"), nargs="+", default=["bhsd"],
                        help="cache layouts: head-major blocks (allocate_cache's default), token-major, or both, each "
                             "shape measured on each in the same run (default: bhsd)")
    parser.add_argument("--json", default="bench-results.json", metavar="FILE",
                        help="where to write the results (default: bench-results.json)")
    parser.add_argument("--quick", action="store_true", help="one shape: batch 8, context 32768, head_dim 128")
    parser.add_argument("--plot", metavar="FILE",
                        help="also draw decode's speedup over SDPA against context length, per scheme and layout "
                             "(PNG, matplotlib)")
    parser.add_argument("--decode-only", action="store_true",
                        help="time decode and its SDPA peer only (no fill, flatten or attend timings)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvqc bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def shapes(batches: list[int] | None, contexts: list[int] | None, head_dims: list[int] | None,
           quick: bool = False) -> list[tuple[int, int, int]]:
    """(batch, context, head_dim) in run order; the long context joins only the all-default grid."""
    if quick:
        batches, contexts, head_dims = QUICK["batch"], QUICK["context"], QUICK["head_dim"]
    grid = [(b, n) for b in (batches or DEFAULT_BATCHES) for n in (contexts or DEFAULT_CONTEXTS)]
    if not quick and batches is None and contexts is None:
        grid.append((1, LONG_CONTEXT))
    return [(b, n, d) for d in (head_dims or DEFAULT_HEAD_DIMS) for b, n in grid]


# ---------------------------------------------------------------- schemes and modules


def resolve_modules(args: list[str]) -> list[Path]:
    """The generated module file per SCHEME argument (default: one per shipped scheme), through kvqc.modules."""
    from kvqc.modules import SCHEMES, resolve

    return [resolve(arg) for arg in (args or sorted(p.stem for p in SCHEMES.glob("*.yaml")))]


# ---------------------------------------------------------------- pure arithmetic


def gbps(num_bytes: float, ms: float) -> float:
    return num_bytes / (ms * 1e6)


def floor_ms(num_bytes: float, bandwidth_gbps: float) -> float:
    """Time to move num_bytes at the measured copy bandwidth (which counts a copy's read and write)."""
    return num_bytes / (bandwidth_gbps * 1e6)


def rotation_count(copy_bytes: int, l2_bytes: int, free_bytes: int, fraction: float = MEMORY_FRACTION) -> int:
    """Copies of one input set that together exceed L2_MULTIPLE L2s, within fraction of free memory; 0: none fit."""
    fit = int(fraction * free_bytes) // max(1, copy_bytes)
    if fit < 1:
        return 0
    return min(L2_MULTIPLE * l2_bytes // max(1, copy_bytes) + 1, fit)


def decode_bytes(batch: int, context: int, kv_heads: int, bytes_per_token: int, window: int = 0,
                 head_dim: int = 0) -> int:
    """Bytes decode must read: quantized tokens, and a window scheme's last `window` tokens in fp16 (K and V)."""
    recent = min(window, context)
    return batch * kv_heads * ((context - recent) * bytes_per_token + recent * 2 * head_dim * 2)


def fp16_kv_bytes(tokens: int, kv_heads: int, head_dim: int) -> int:
    return tokens * kv_heads * head_dim * 2 * 2


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-30))


# ---------------------------------------------------------------- GPU helpers


def _bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_ms(call: Callable[[], object], count: int, timer: Callable | None = None) -> float:
    """One call's median ms when `count` consecutive calls are captured in one CUDA graph and replayed.

    What an engine that graphs its decode step pays: no Python or launch overhead between kernels. `call` should
    rotate over `count` input sets (see _rotating), so one replay reads each set once.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and build cached tables outside the capture
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            call()
    ms = (timer or _bench)(graph.replay)
    del graph
    return ms / count


def host_us(call: Callable[[], object], calls: int = 32, rounds: int = 11) -> float:
    """Median over rounds of the CPU time one call takes to return, `calls` calls queued back to back without
    waiting for the GPU: few enough launches that none waits for room in CUDA's launch queue (a few hundred would,
    and would time the GPU instead)."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
    torch.cuda.synchronize()
    return statistics.median(times[1:]) * 1e6  # the first round warms up


def _rotating(fn: Callable, arg_sets: list[tuple]) -> Callable[[], None]:
    # Each call takes the next copy set, so consecutive calls never reuse inputs that are still in L2.
    counter = [0]

    def call() -> None:
        fn(*arg_sets[counter[0] % len(arg_sets)])
        counter[0] += 1

    return call


def _free_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK)


def copy_bandwidth() -> float:
    """GB/s of a large device-to-device copy, bytes read plus written."""
    size = min(COPY_BYTES, int(0.2 * _free_bytes())) // MiB * MiB
    src = torch.ones(size, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    src = dst = None  # frees them (the timed lambda holds the names)
    torch.cuda.empty_cache()
    return gbps(2 * size, ms)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The peer: q [B, Hq, 1, D], k and v [B, Hkv, N, D], fp16, GQA without expanding K and V."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _has_enable_gqa() -> bool:
    q = torch.zeros(1, 2, 1, 8)
    try:
        sdpa(q, torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))
        return True
    except TypeError:
        return False


def _cache_bytes(cache) -> int:
    return sum(getattr(cache, f).numel() * getattr(cache, f).element_size() for f in _fields(cache))


def _fields(cache) -> tuple[str, ...]:
    # Codes and metadata of every side (and of both parts of a channel split), then a window scheme's rings.
    return tuple(f.name for f in dataclasses.fields(cache) if f.name.endswith(("_codes", "_meta", "_window")))


def _allocate(module: ModuleType, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, batch: int,
              layout: str = "bhsd"):
    rows = {"max_seqs": batch} if hasattr(module, "WINDOW") else {}  # sequence b keeps ring row b
    cache = module.allocate_cache(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=torch.float16,
                                  layout=layout, **rows)
    if hasattr(module, "calibrate"):  # a channel split: choose outlier channels (speed does not depend on which)
        sample = torch.randn(64, kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
        module.calibrate(cache, sample, sample)
    return cache


def _rows(module: ModuleType, batch: int) -> dict:
    """The ring rows decode, flatten and attend take for a window scheme (sequence b: row b), as keywords."""
    return {"window_index": torch.arange(batch, device=DEVICE)} if hasattr(module, "WINDOW") else {}


def _token_rows(module: ModuleType, batch: int, seq_len: int) -> dict:
    """positions and ring rows of the tokens slot_mapping lists, for a window scheme's fill, as keywords."""
    if not hasattr(module, "WINDOW"):
        return {}
    positions = torch.arange(seq_len, device=DEVICE).repeat(batch)
    return {"positions": positions, "window_index": torch.arange(batch, device=DEVICE).repeat_interleave(seq_len)}


def _block_tables(batch: int, blocks_per_seq: int) -> torch.Tensor:
    # A random permutation: sequences' blocks are scattered over the pool, as in a long-running engine.
    return torch.randperm(batch * blocks_per_seq, device=DEVICE).view(batch, blocks_per_seq).to(torch.int32)


def slot_mapping(block_tables: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """int64 slots of positions 0..seq_len-1 of every sequence, sequence after sequence."""
    pos = torch.arange(seq_len, device=block_tables.device)
    blocks = block_tables.long()[:, pos // block_size]
    return (blocks * block_size + pos % block_size).reshape(-1)


def _populate(module: ModuleType, cache, block_tables: torch.Tensor, seq_len: int) -> None:
    """Random fp16 K/V through fill into every sequence's slots, in chunks to bound the staging memory."""
    slots = slot_mapping(block_tables, seq_len, cache.block_size)
    window = _token_rows(module, block_tables.shape[0], seq_len)
    h, d = cache.num_kv_heads, cache.head_dim
    chunk = max(1, FILL_CHUNK_BYTES // fp16_kv_bytes(1, h, d))
    for start in range(0, slots.numel(), chunk):
        part = slots[start:start + chunk]
        key = torch.randn(part.numel(), h, d, dtype=torch.float16, device=DEVICE)
        value = torch.randn(part.numel(), h, d, dtype=torch.float16, device=DEVICE)
        module.fill(cache, key, value, part, **{k: t[start:start + chunk] for k, t in window.items()})


def _clone_cache(module: ModuleType, cache):
    batch = cache.key_window.shape[0] if hasattr(cache, "key_window") else 0
    copy = _allocate(module, cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim, batch,
                     cache.layout)
    for field in _fields(cache):
        getattr(copy, field).copy_(getattr(cache, field))
    for base in ("key", "value"):
        if getattr(cache, f"{base}_channels", None) is not None:
            setattr(copy, f"{base}_channels", getattr(cache, f"{base}_channels").clone())
    return copy


def _as_bhnd(x: torch.Tensor, batch: int, context: int) -> torch.Tensor:
    # flatten's [B*N, H, D] viewed as SDPA's [B, H, N, D]; a strided view, no copy.
    return x.view(batch, context, x.shape[1], x.shape[2]).transpose(1, 2)


# ---------------------------------------------------------------- one shape


def flattened_sdpa(module: ModuleType, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query: torch.Tensor, context: int) -> torch.Tensor:
    """fp16 SDPA over the cache's own dequantized K and V (flatten), every sequence `context` tokens long: what
    decode must give, up to kernel error."""
    batch = block_tables.shape[0]
    key, value = module.flatten(cache, block_tables, seq_lens, **_rows(module, batch))
    return sdpa(query.unsqueeze(2), _as_bhnd(key, batch, context), _as_bhnd(value, batch, context)).squeeze(2)


def _measure(module: ModuleType, row: dict, cfg: dict) -> None:
    """Fill row with one shape's numbers; raises OutOfMemoryError or whatever a kernel raises."""
    b, n, d = row["batch"], row["context"], row["head_dim"]
    hq, hkv, bs = cfg["q_heads"], cfg["kv_heads"], cfg["block_size"]
    bw, l2 = cfg["copy_gbps"], cfg["l2_bytes"]
    bpt = module.bytes_per_token(d, torch.float16)
    row["bytes_per_token"] = bpt
    free = _free_bytes()

    # The cache under test, filled with real codes.
    block_tables = _block_tables(b, math.ceil(n / bs))
    seq_lens = torch.full((b,), n, dtype=torch.int32, device=DEVICE)
    cache = _allocate(module, b * math.ceil(n / bs), bs, hkv, d, b, cfg.get("layout", "bhsd"))
    rows = _rows(module, b)
    copies = rotation_count(_cache_bytes(cache), l2, free)
    if copies == 0:
        row.update(status="skipped", note="one cache does not fit in the memory budget")
        return
    _populate(module, cache, block_tables, n)
    query = torch.randn(b, hq, d, dtype=torch.float16, device=DEVICE)

    # Correctness first: decode against SDPA over the same dequantized cache isolates kernel error from
    # quantization error.
    want = flattened_sdpa(module, cache, block_tables, seq_lens, query, n)
    got = module.decode(query, cache, block_tables, seq_lens, **rows)
    row["rel_err"] = rel_l2(got, want)
    del got, want

    # Scratch: what one decode call allocates beyond the cache and its inputs (the warm call above built its tables).
    row["scratch_mib"] = _scratch_mib(lambda: module.decode(query, cache, block_tables, seq_lens, **rows))

    # Decode and flatten over rotating cache copies.
    caches = [cache] + [_clone_cache(module, cache) for _ in range(copies - 1)]
    row["copies"] = {"kvqc": copies}
    decode_call = _rotating(lambda c: module.decode(query, c, block_tables, seq_lens, **rows), [(c,) for c in caches])
    row["kvqc_ms"] = _bench(decode_call)
    row["kvqc_graph_ms"] = graph_ms(decode_call, copies)
    # An eager engine's decode step: one plan for the batch, then a call per layer (the cache copies stand in for
    # layers). Host time is what a call costs the CPU, the GPU's work overlapping it.
    row["host_us"] = host_us(decode_call)
    if hasattr(module, "plan_decode"):  # a module built before decode's plan/run split has none
        plan = module.plan_decode(cache, block_tables, seq_lens, hq, query.dtype, **rows)
        planned = _rotating(lambda c: module.decode(query, c, block_tables, seq_lens, **rows, plan=plan),
                            [(c,) for c in caches])
        row["kvqc_plan_ms"] = _bench(planned)
        row["plan_host_us"] = host_us(planned)
    if not cfg.get("decode_only"):
        # flatten sizes its output by sum(seq_lens): given on the host, as engines keep it, nothing waits for the GPU.
        host_lens = seq_lens.cpu()
        row["flatten_ms"] = _bench(_rotating(lambda c: module.flatten(c, block_tables, host_lens, **rows),
                                             [(c,) for c in caches]))
        row["flatten_graph_ms"] = _flatten_graph_ms(module, row, caches, block_tables, seq_lens, rows)
        if hasattr(module, "attend"):
            _measure_attend(module, row, caches, block_tables, seq_lens, hq)
    caches = cache = None  # frees them (the timed lambdas hold the names)
    torch.cuda.empty_cache()

    kv_bytes = decode_bytes(b, n, hkv, bpt, getattr(module, "WINDOW", 0), d)
    fp16_bytes = fp16_kv_bytes(b * n, hkv, d)
    row["floor_ms"] = floor_ms(kv_bytes, bw)
    row["fraction_of_floor"] = row["floor_ms"] / row["kvqc_ms"]
    if "flatten_ms" in row:
        row["flatten_bytes"] = kv_bytes + fp16_bytes
        row["flatten_fraction_of_bw"] = gbps(row["flatten_bytes"], _kernel_ms(row, "flatten")) / bw

    _measure_peer(row, query, fp16_bytes, cfg)
    query = None
    if not cfg.get("decode_only"):
        _measure_fill(module, row, cfg)


def _kernel_ms(row: dict, name: str) -> float:
    """fill's or flatten's time in a CUDA graph where it has one, else its eager time. Graphed, flatten writes into
    out= buffers with the lengths on the device, so its time leaves out the host work (the read of seq_lens, the new
    output tensors) that one eager call of it includes."""
    graphed = row.get(f"{name}_graph_ms")
    return row[f"{name}_ms"] if graphed is None else graphed


def _flatten_graph_ms(module: ModuleType, row: dict, caches: list, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, rows: dict) -> float | None:
    """flatten into out= buffers (an engine's prefill path: lengths on the device, nothing read on the host) in a CUDA
    graph over the cache copies; None, with a note, where the module's flatten takes no buffers (a channel split's)
    or the capture fails."""
    cache = caches[0]
    shape = (int(seq_lens.sum()), cache.num_kv_heads, cache.head_dim)
    out = tuple(torch.empty(shape, dtype=torch.float16, device=DEVICE) for _ in "kv")
    call = _rotating(lambda c: module.flatten(c, block_tables, seq_lens, out=out, **rows), [(c,) for c in caches])
    try:
        call()
        return graph_ms(call, len(caches))
    except (ValueError, TypeError, RuntimeError) as exc:
        _note(row, f"flatten graph: {_one_line(exc)}")
        return None


def _scratch_mib(call: Callable[[], object]) -> float:
    """Peak memory one call allocates beyond what is already held, its output included."""
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - held) / MiB


def _measure_attend(module: ModuleType, row: dict, caches: list, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, q_heads: int) -> None:
    """ATTEND_TOKENS causal query tokens per sequence (the last ones of each context), over rotating caches."""
    b, d = row["batch"], row["head_dim"]
    q_len = min(ATTEND_TOKENS, row["context"])
    query = torch.randn(b * q_len, q_heads, d, dtype=torch.float16, device=DEVICE)
    starts = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32, device=DEVICE)
    row["attend_tokens"] = q_len
    rows = _rows(module, b)
    row["attend_scratch_mib"] = _scratch_mib(
        lambda: module.attend(query, caches[0], block_tables, seq_lens, starts, **rows))
    row["attend_ms"] = _bench(_rotating(lambda c: module.attend(query, c, block_tables, seq_lens, starts, **rows),
                                        [(c,) for c in caches]))


def _measure_peer(row: dict, query: torch.Tensor, fp16_bytes: int, cfg: dict) -> None:
    b, n, d, hkv = row["batch"], row["context"], row["head_dim"], cfg["kv_heads"]
    copies = rotation_count(fp16_bytes, cfg["l2_bytes"], _free_bytes())
    row["copies"]["sdpa"] = copies
    if copies == 0:
        _note(row, "fp16 peer does not fit in the memory budget")
        return
    q = query.unsqueeze(2).contiguous()
    kv = [(torch.randn(b, hkv, n, d, dtype=torch.float16, device=DEVICE),
           torch.randn(b, hkv, n, d, dtype=torch.float16, device=DEVICE)) for _ in range(copies)]
    peer_call = _rotating(lambda k, v: sdpa(q, k, v), kv)
    row["peer_ms"] = _bench(peer_call)
    row["peer_graph_ms"] = graph_ms(peer_call, copies)
    del kv
    row["speedup"] = row["peer_ms"] / row["kvqc_ms"]
    row["graph_speedup"] = row["peer_graph_ms"] / row["kvqc_graph_ms"]
    row["peer_floor_ms"] = floor_ms(fp16_bytes, cfg["copy_gbps"])
    row["peer_fraction_of_floor"] = row["peer_floor_ms"] / row["peer_ms"]


def _measure_fill(module: ModuleType, row: dict, cfg: dict) -> None:
    b, n, d = row["batch"], row["context"], row["head_dim"]
    hkv, bs = cfg["kv_heads"], cfg["block_size"]
    per_seq = min(n, FILL_TOKENS_PER_SEQ)
    tokens = b * per_seq
    blocks_per_seq = math.ceil(per_seq / bs)

    def copy_set() -> tuple:
        cache = _allocate(module, b * blocks_per_seq, bs, hkv, d, b, cfg.get("layout", "bhsd"))
        key = torch.randn(tokens, hkv, d, dtype=torch.float16, device=DEVICE)
        value = torch.randn(tokens, hkv, d, dtype=torch.float16, device=DEVICE)
        return cache, key, value, slot_mapping(_block_tables(b, blocks_per_seq), per_seq, bs)

    first = copy_set()
    set_bytes = _cache_bytes(first[0]) + fp16_kv_bytes(tokens, hkv, d) + tokens * 8
    copies = rotation_count(set_bytes, cfg["l2_bytes"], _free_bytes())
    row["copies"]["fill"] = copies
    if copies == 0:
        _note(row, "fill inputs do not fit in the memory budget")
        return
    sets = [first] + [copy_set() for _ in range(copies - 1)]
    row["fill_tokens"] = tokens
    window = _token_rows(module, b, per_seq)  # the same positions and ring rows for every copy
    fill_call = _rotating(lambda *args: module.fill(*args, **window), sets)
    row["fill_ms"] = _bench(fill_call)
    try:
        row["fill_graph_ms"] = graph_ms(fill_call, copies)
    except RuntimeError as exc:  # a fill that cannot be captured keeps its eager time
        _note(row, f"fill graph: {_one_line(exc)}")
    del sets, first, fill_call
    row["fill_bytes"] = fp16_kv_bytes(tokens, hkv, d) + tokens * hkv * row["bytes_per_token"]
    row["fill_bytes"] += fp16_kv_bytes(b * min(per_seq, getattr(module, "WINDOW", 0)), hkv, d)  # ring writes
    row["fill_fraction_of_bw"] = gbps(row["fill_bytes"], _kernel_ms(row, "fill")) / cfg["copy_gbps"]


def bench_shape(module: ModuleType, scheme: str, shape: tuple[int, int, int], cfg: dict) -> dict:
    b, n, d = shape
    row = {"scheme": scheme, "batch": b, "context": n, "head_dim": d, "q_heads": cfg["q_heads"],
           "kv_heads": cfg["kv_heads"], "block_size": cfg["block_size"],
           "layout": cfg.get("layout", "bhsd"), "status": "ok"}
    if d not in tuple(module.HEAD_DIMS):
        row.update(status="skipped", note=f"not built for head_dim {d} (built for {list(module.HEAD_DIMS)})")
        return row
    try:
        _measure(module, row, cfg)
    except torch.cuda.OutOfMemoryError:
        row.update(status="skipped", note="out of GPU memory")
    except Exception as exc:  # one broken shape must not lose the others' numbers
        row.update(status="error", note=_one_line(exc))
    finally:
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as exc:  # a sticky CUDA error: later shapes will say so themselves
            _note(row, _one_line(exc))
    return row


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _note(row: dict, text: str) -> None:
    row["note"] = f"{row['note']}; {text}" if row.get("note") else text


# ---------------------------------------------------------------- output

COLUMNS = (("B", 3), ("ctx", 7), ("D", 4), ("sdpa ms", 9), ("kvqc ms", 9), ("speedup", 8), ("sdpa graph", 10),
           ("kvqc graph", 10), ("graph x", 8), ("plan ms", 8), ("host us", 8), ("plan host", 9), ("floor ms", 9),
           ("%floor", 7), ("fill %bw", 9), ("flatten %bw", 11), ("scratch MiB", 11), ("attend ms", 10),
           ("attend MiB", 10), ("err", 9))


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_row(row: dict) -> str:
    head = f"{row['batch']:>3} {row['context']:>7} {row['head_dim']:>4}"
    if row["status"] != "ok":
        return f"{head}  {row['status']}: {row.get('note', '')}"
    pct = lambda key: _fmt(None if row.get(key) is None else 100 * row[key], ".1f")  # noqa: E731
    err = row.get("rel_err")
    cells = [_fmt(row.get("peer_ms"), ".4f"), _fmt(row.get("kvqc_ms"), ".4f"), _fmt(row.get("speedup"), ".2f"),
             _fmt(row.get("peer_graph_ms"), ".4f"), _fmt(row.get("kvqc_graph_ms"), ".4f"),
             _fmt(row.get("graph_speedup"), ".2f"), _fmt(row.get("kvqc_plan_ms"), ".4f"),
             _fmt(row.get("host_us"), ".1f"), _fmt(row.get("plan_host_us"), ".1f"),
             _fmt(row.get("floor_ms"), ".4f"), pct("fraction_of_floor"), pct("fill_fraction_of_bw"),
             pct("flatten_fraction_of_bw"), _fmt(row.get("scratch_mib"), ".2f"), _fmt(row.get("attend_ms"), ".3f"),
             _fmt(row.get("attend_scratch_mib"), ".0f"),
             _fmt(err, ".1e") + ("!" if err is not None and not err <= ERR_WARN else " ")]
    line = head + "".join(f" {c:>{w}}" for c, (_, w) in zip(cells, COLUMNS[3:]))
    return line + (f"  ({row['note']})" if row.get("note") else "")


def table_header() -> str:
    return " ".join(f"{name:>{w}}" for name, w in COLUMNS)


def _write_json(path: str, header: dict, rows: list[dict]) -> None:
    Path(path).write_text(json.dumps({**header, "results": rows}, indent=2) + "\n", encoding="utf-8")


def plot(rows: list[dict], path: str, device: str = "") -> None:
    """Decode's speedup over fp16 SDPA against context length, one line per scheme (and cache layout, where rows
    hold several; dashed: both in CUDA graphs), one panel per (batch, d)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("speedup") is not None]
    several = len({r.get("layout", "bhsd") for r in ok}) > 1  # then a line per scheme and layout

    def label(r: dict) -> str:
        return f"{r['scheme']} {r.get('layout', 'bhsd')}" if several else r["scheme"]

    panels = sorted({(r["batch"], r["head_dim"]) for r in ok})
    if not panels:
        raise ValueError("no measured speedups to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False, sharey=True)
    for ax, (b, d) in zip(axes[0], panels):
        for line_label in sorted({label(r) for r in ok}):
            mine = [r for r in ok if label(r) == line_label and r["batch"] == b and r["head_dim"] == d]
            pts = sorted((r["context"], r["speedup"]) for r in mine)
            if pts:
                line, = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{line_label} (eager)")
                graph = sorted((r["context"], r["graph_speedup"]) for r in mine if r.get("graph_speedup") is not None)
                if graph:
                    ax.plot([x for x, _ in graph], [y for _, y in graph], marker="s", linestyle="--",
                            color=line.get_color(), label=f"{line_label} (CUDA graph)")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"batch {b}, head_dim {d}")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("decode speedup over fp16 SDPA (x)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"kvqc decode vs SDPA{': ' + device if device else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    if args.q_heads < 1 or args.kv_heads < 1 or args.q_heads % args.kv_heads or args.block_size < 1:
        print("kvqc bench: --q-heads must be a positive multiple of --kv-heads, --block-size positive", file=sys.stderr)
        return 2
    if not _has_enable_gqa():
        print("kvqc bench: the SDPA peer needs torch >= 2.5 (scaled_dot_product_attention's enable_gqa)",
              file=sys.stderr)
        return 2
    try:
        modules = resolve_modules(args.schemes)
    except (ValueError, OSError) as exc:  # a SchemeError is a ValueError
        print(f"kvqc bench: {exc}", file=sys.stderr)
        return 2
    import triton

    bandwidth = copy_bandwidth()
    header = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "copy_bandwidth_gbps": bandwidth, "l2_bytes": _l2_bytes(),
              "method": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms); inputs rotated over copies "
                        f"exceeding {L2_MULTIPLE}x L2; floors = bytes / copy bandwidth (read + written); graph: "
                        "one call's share of a CUDA graph replaying one call per copy; fill and flatten %bw from "
                        "graph times (flatten into out= buffers, lengths on the device), eager where a module's "
                        "flatten takes no buffers or a capture fails (the row's note says which)"}
    print(f"device: {header['device']}")
    print(f"torch {header['torch']}, triton {header['triton']}")
    print(f"copy bandwidth: {bandwidth:.0f} GB/s (device-to-device, read + written); "
          f"L2 {header['l2_bytes'] / MiB:.0f} MiB")
    layouts = list(dict.fromkeys(args.layout))
    print(f"heads: {args.q_heads} query / {args.kv_heads} KV, block_size {args.block_size}; "
          f"err = rel L2 of decode vs SDPA on the flattened cache ('!' above {ERR_WARN:g}); attend: "
          f"{ATTEND_TOKENS} causal query tokens per sequence; MiB columns: peak allocation beyond the cache")
    cfg = {"q_heads": args.q_heads, "kv_heads": args.kv_heads, "block_size": args.block_size,
           "copy_gbps": bandwidth, "l2_bytes": header["l2_bytes"], "decode_only": args.decode_only}
    grid = shapes(args.batch, args.context, args.head_dim, args.quick)
    rows: list[dict] = []
    from kvqc.modules import load

    for path in modules:
        name = path.stem.split("-")[0]  # a module rendered from a .yaml is cached as <name>-<hash>.py
        try:
            module = load(path)
        except Exception as exc:
            print(f"\n{name} ({path}): could not import: {type(exc).__name__}: {exc}")
            rows.append({"scheme": name, "status": "error", "note": f"import: {type(exc).__name__}: {exc}"})
            continue
        for layout in layouts:
            print(f"\n{name} ({path}), layout {layout}; fill and flatten %bw from CUDA-graph times (flatten into "
                  "out= buffers), eager where flatten takes no buffers or a capture fails (see the note)")
            print(table_header(), flush=True)
            for shape in grid:
                row = bench_shape(module, name, shape, cfg | {"layout": layout})
                rows.append(row)
                print(format_row(row), flush=True)
                _write_json(args.json, header, rows)  # after every shape, so a run cut short keeps what it measured
    _write_json(args.json, header, rows)
    print(f"\nresults: {args.json}")
    if args.plot:
        try:
            plot(rows, args.plot, header["device"])
            print(f"plot: {args.plot}")
        except (ImportError, ValueError) as exc:
            print(f"kvqc bench: no plot: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
