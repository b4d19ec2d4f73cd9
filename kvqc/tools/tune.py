"""`kvqc tune`: sweep decode's launch settings per scheme and head_dim on this GPU, print the best, --write them.

Each variant is (BLOCK_N, num_warps, num_stages, split programs per SM, most splits per sequence[, a cap on
registers per thread, ptxas' maxnreg]). Every variant's output
is checked against fp16 SDPA over the same cache's flatten (relative L2 error) before it is timed, and a variant that
disagrees anywhere, or fails to compile or launch, is out. Times are one decode call's share of a CUDA graph that
replays one call per cache copy (copies together exceed 4x L2), so the wrapper's host work does not hide the kernel.
The best variant per (scheme, head_dim) minimizes the geometric mean of its time over the default's across the
shapes; where the default itself fails (a head_dim whose tiles do not fit it), over the fastest variant's, and any
variant that runs everywhere beats it. `--write` puts the winners into kvqc/compiler/templates/decode_tuning.json,
which `kvqc build` renders into each module (a build-time choice; the table names the device it was tuned on).

Compilation dominates a sweep (one Triton compile per variant and split length), so worker processes compile every
variant first, in parallel, into Triton's on-disk cache; the timing pass then runs alone on the GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
import time
from pathlib import Path

SCHEMES = ("turbo_k4v2", "int4_token", "int8_token", "fp8_e4m3", "turbo_k4mse_v2")
HEAD_DIMS = (128, 64)
CONTEXTS = (8192, 32768)
BATCHES = (1, 8, 32)
# (BLOCK_N, num_warps, num_stages[, register cap]): 8 warps and 64-token tiles on 4 warps lost on an H200, 32-token
# tiles on 2 or 4 warps on an H100. A cap on registers per thread (ptxas maxnreg) trades spills for resident warps:
# caps of 128 and 168 lost on an H100, 200 and 216 came within a few percent (docs/benchmarks.md, "What bounds
# decode").
TILES = ((128, 4, 3), (128, 4, 2), (128, 4, 4), (64, 2, 2), (64, 2, 3), (64, 2, 4), (32, 1, 3))
# (split programs per SM, most splits per sequence)
SPLITS = ((8, 64), (4, 64), (16, 64), (16, 128))
DEFAULT = (32, 1, 3, 8, 128)  # decode_tuning.json's default: what a scheme with no entry takes at 65..128
Q_HEADS, KV_HEADS, BLOCK_SIZE = 32, 8, 64
ERR_MAX = 1e-2  # a variant must agree with fp16 SDPA to this relative L2 error on every shape (as kvqc bench warns)
KEEP_DEFAULT_WITHIN = 0.02  # a winner less than 2% faster (geometric mean) than the default is not worth a change


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("schemes", nargs="*", metavar="SCHEME", help=f"default: {' '.join(SCHEMES)}")
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--context", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--tiles", nargs="+", metavar="BN,WARPS,STAGES[,MAXNREG]",
                        help="tile settings to sweep (default: " + " ".join(",".join(map(str, t)) for t in TILES) + ")")
    parser.add_argument("--splits", nargs="+", metavar="PER_SM,MOST",
                        help="split settings to sweep (default: "
                             + " ".join(",".join(map(str, t)) for t in SPLITS) + ")")
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="processes compiling variants before the timing pass (0: compile while timing)")
    parser.add_argument("--json", default="kvqc-tune.json", metavar="FILE", help="every measurement")
    parser.add_argument("--compile-only", action="store_true",
                        help="no sweep: compile each module's own decode settings for these shapes (before a bench)")
    parser.add_argument("--write", action="store_true",
                        help="put the best variants into kvqc/compiler/templates/decode_tuning.json "
                             "(then run `kvqc build`)")


def config(tile: tuple, split: tuple) -> tuple:
    """A module's decode setting: (BLOCK_N, num_warps, num_stages, splits per SM, most splits[, register cap])."""
    return tuple(tile[:3]) + tuple(split) + tuple(tile[3:])


def variants() -> list[tuple[int, ...]]:
    out = [DEFAULT]
    for tile, split in itertools.product(TILES, SPLITS):
        if config(tile, split) != DEFAULT:
            out.append(config(tile, split))
    return out


def shapes(batches, contexts) -> list[tuple[int, int]]:
    return [(b, n) for n in contexts for b in batches]


# ---------------------------------------------------------------- setup shared by workers and the timing pass


def _setup(module, batch: int, context: int, head_dim: int, seed: int):
    import torch

    from kvqc.tools import bench

    torch.manual_seed(seed)
    blocks = math.ceil(context / BLOCK_SIZE)
    block_tables = bench._block_tables(batch, blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=bench.DEVICE)
    cache = bench._allocate(module, batch * blocks, BLOCK_SIZE, KV_HEADS, head_dim, batch)
    bench._populate(module, cache, block_tables, context)
    query = torch.randn(batch, Q_HEADS, head_dim, dtype=torch.float16, device=bench.DEVICE)
    return cache, block_tables, seq_lens, query


def _use(module, head_dim: int, variant) -> None:
    module._DECODE_CONFIGS = {**module._DECODE_CONFIGS, head_dim: tuple(variant)}


def _compile_task(task) -> tuple[str, int, tuple, int, str]:
    """Worker: run every split setting of one tile on every shape once, so Triton compiles and caches it."""
    name, head_dim, tile, grid, splits = task
    import torch

    from kvqc.tools import bench
    from kvqc.modules import load

    module = load(name)
    failures = 0
    note = ""
    for b, n in grid:
        cache, block_tables, seq_lens, query = _setup(module, b, n, head_dim, seed=0)
        for split in splits:
            _use(module, head_dim, config(tile, split))
            try:
                module.decode(query, cache, block_tables, seq_lens, **bench._rows(module, query.shape[0]))
            except Exception as exc:  # reported by the timing pass too
                failures += 1
                note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        torch.cuda.synchronize()
        del cache
        torch.cuda.empty_cache()
    return name, head_dim, tuple(tile), failures, note


def _warm_task(task) -> tuple[str, int, tuple, int, str]:
    """Worker: one decode call per shape with the module's own settings (its compiled variants into the cache)."""
    name, head_dim, grid = task
    import torch

    from kvqc.tools import bench
    from kvqc.modules import load

    module = load(name)
    failures, note = 0, ""
    for b, n in grid:
        try:
            cache, block_tables, seq_lens, query = _setup(module, b, n, head_dim, seed=0)
            module.decode(query, cache, block_tables, seq_lens, **bench._rows(module, query.shape[0]))
            torch.cuda.synchronize()
            del cache
        except Exception as exc:
            failures += 1
            note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        torch.cuda.empty_cache()
    return name, head_dim, (), failures, note


def precompile(names, head_dims, grid, workers: int, sweep: bool = True) -> None:
    import multiprocessing as mp

    if sweep:
        tasks = [(name, d, tile, grid, SPLITS) for name in names for d in head_dims for tile in TILES]
        if DEFAULT[:3] not in TILES:  # the reference every variant is checked and scored against
            tasks += [(name, d, DEFAULT[:3], grid, (DEFAULT[3:],)) for name in names for d in head_dims]
        task_fn = _compile_task
    else:
        tasks = [(name, d, [shape]) for name in names for d in head_dims for shape in grid]
        task_fn = _warm_task
    start = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        for name, d, tile, failures, note in pool.imap_unordered(task_fn, tasks):
            if failures:
                print(f"  compile {name} d={d} tile={tile}: {failures} failed ({note})", flush=True)
    print(f"compiled {len(tasks)} tasks in {time.time() - start:.0f} s ({workers} workers)", flush=True)


# ---------------------------------------------------------------- timing pass


def _quick_bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=20, return_mode="median"))


def tune_shape(module, name: str, head_dim: int, batch: int, context: int, candidates) -> list[dict]:
    import torch

    from kvqc.tools import bench

    cache, block_tables, seq_lens, query = _setup(module, batch, context, head_dim, seed=1)
    copies = max(1, bench.rotation_count(bench._cache_bytes(cache), bench._l2_bytes(), bench._free_bytes()))
    caches = [cache] + [bench._clone_cache(module, cache) for _ in range(copies - 1)]
    own = dict(module._DECODE_CONFIGS)  # put back afterwards: the sweep overrides one head_dim's entry
    want = bench.flattened_sdpa(module, cache, block_tables, seq_lens, query, context).float()
    rows = []
    for variant in candidates:
        row = {"scheme": name, "head_dim": head_dim, "batch": batch, "context": context, "variant": list(variant),
               "copies": copies}
        _use(module, head_dim, variant)
        try:
            torch.cuda.synchronize()
            out = module.decode(query, cache, block_tables, seq_lens, **bench._rows(module, query.shape[0]))
            row["rel_err"] = bench.rel_l2(out, want)
            if not row["rel_err"] <= ERR_MAX:
                row["status"] = "wrong"
            else:
                call = bench._rotating(
                    lambda c: module.decode(query, c, block_tables, seq_lens, **bench._rows(module, query.shape[0])),
                    [(c,) for c in caches],
                )
                row["ms"] = bench.graph_ms(call, copies, _quick_bench)
                row["status"] = "ok"
        except Exception as exc:
            row["status"] = "error"
            row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rows.append(row)
    module._DECODE_CONFIGS = own
    del caches, cache
    torch.cuda.empty_cache()
    return rows


def best(rows: list[dict], candidates) -> tuple[tuple, float, dict]:
    """(winner, its geometric-mean time over the default's, {variant: score}); only variants right on every shape.

    Where the default is not right on every shape, scores are over the fastest variant's time per shape and the
    winner's score is nan (the default has no time to compare with); where no variant is, the default stays."""
    shapes_ = sorted({(r["batch"], r["context"]) for r in rows})
    by = {(tuple(r["variant"]), r["batch"], r["context"]): r for r in rows}
    ok = {tuple(v): [by[(tuple(v), b, n)]["ms"] for b, n in shapes_] for v in candidates
          if all(by.get((tuple(v), b, n), {}).get("status") == "ok" for b, n in shapes_)}
    if not ok:
        return DEFAULT, 1.0, {}
    ref = ok.get(DEFAULT) or [min(times[i] for times in ok.values()) for i in range(len(shapes_))]
    scores = {v: math.exp(sum(math.log(t / r) for t, r in zip(times, ref)) / len(ref)) for v, times in ok.items()}
    winner = min(scores, key=scores.get)
    if DEFAULT not in ok:
        return winner, math.nan, scores
    if scores[winner] > 1 - KEEP_DEFAULT_WITHIN:
        winner = DEFAULT
    return winner, scores[winner], scores


def fmt_variant(v) -> str:
    return f"BN{v[0]} W{v[1]} S{v[2]} spm{v[3]} max{v[4]}" + (f" reg{v[5]}" if len(v) > 5 else "")


def write_table(path: Path, winners: dict, header: dict) -> None:
    table = json.loads(path.read_text(encoding="utf-8"))
    # The top-level device, versions and shapes describe the schemes tuned before per-scheme sweep notes existed;
    # a later sweep records its own under "sweeps" and leaves those (their modules' comments) alone.
    for key in ("device", "torch", "triton", "shapes"):
        table.setdefault(key, header[key])
    for (name, d), v in winners.items():
        table["schemes"].setdefault(name, {})[str(d)] = list(v)
        # Each scheme keeps the device and shapes of its own last sweep, for its module's comment.
        table.setdefault("sweeps", {})[name] = f"{header['device']} ({header['shapes']})"
    table["sweeps"] = dict(sorted(table["sweeps"].items()))
    table["schemes"] = {k: dict(sorted(table["schemes"][k].items(), key=lambda kv: -int(kv[0])))
                        for k in sorted(table["schemes"])}
    text = json.dumps(table, indent=2) + "\n"
    text = re.sub(r"\[\s+([\d,\s]+?)\s+\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  text)
    path.write_text(text, encoding="utf-8")


def parse_settings(texts: list[str], flag: str, forms: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """--tiles / --splits values as integer tuples with as many fields as one of `forms`; a wrong one raises
    ValueError naming the flag and the forms."""
    sizes = {form.count(",") + 1 for form in forms}
    out = []
    for text in texts:
        try:
            values = tuple(int(x) for x in text.split(","))
        except ValueError:
            values = ()
        if len(values) not in sizes or min(values) <= 0:
            raise ValueError(f"{flag}: {text!r} is not {' or '.join(forms)} (positive integers)")
        out.append(values)
    return tuple(out)


def run(args: argparse.Namespace) -> int:
    import torch

    global TILES, SPLITS
    try:
        if args.tiles:
            TILES = parse_settings(args.tiles, "--tiles", ("BN,WARPS,STAGES", "BN,WARPS,STAGES,MAXNREG"))
        if args.splits:
            SPLITS = parse_settings(args.splits, "--splits", ("PER_SM,MOST",))
    except ValueError as exc:
        print(f"kvqc tune: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("kvqc tune: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from kvqc.compiler.codegen import DECODE_TUNING
    from kvqc.modules import load

    names = args.schemes or list(SCHEMES)
    grid = shapes(args.batch, args.context)
    candidates = variants()
    header = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "shapes": f"batch {'/'.join(map(str, args.batch))}, context "
                        f"{'/'.join(f'{n // 1024}k' for n in args.context)}, {Q_HEADS} query / {KV_HEADS} KV heads, "
                        f"block_size {BLOCK_SIZE}, fp16, CUDA-graph kernel time",
              "default": list(DEFAULT)}
    print(f"device: {header['device']}; torch {header['torch']}, triton {header['triton']}; "
          f"{len(candidates)} variants x {len(grid)} shapes", flush=True)
    if args.compile_only:
        precompile(names, args.head_dim, grid, max(1, args.workers), sweep=False)
        return 0
    if args.workers > 0:
        precompile(names, args.head_dim, grid, args.workers)
    rows: list[dict] = []
    winners: dict = {}
    summary: list[str] = []
    for name in names:
        module = load(name)
        for d in args.head_dim:
            if d not in tuple(module.HEAD_DIMS):
                continue
            mine = []
            for b, n in grid:
                start = time.time()
                got = tune_shape(module, name, d, b, n, candidates)
                mine += got
                ok = sorted((r["ms"], tuple(r["variant"])) for r in got if r["status"] == "ok")
                base = next((r.get("ms") for r in got if tuple(r["variant"]) == DEFAULT), None)
                bad = [fmt_variant(r["variant"]) + f" {r['status']}" for r in got if r["status"] != "ok"]
                print(f"{name} d={d} B={b} ctx={n}: default {base or float('nan'):.4f} ms, best "
                      + (f"{ok[0][0]:.4f} ms {fmt_variant(ok[0][1])}" if ok else "none")
                      + f" ({time.time() - start:.1f} s)" + (f"; not ok: {', '.join(bad)}" if bad else ""), flush=True)
                max_err = max([r.get("rel_err") or 0.0 for r in got if r["status"] == "ok"] + [0.0])
                if max_err > 2e-3:
                    print(f"  largest error against SDPA among the variants kept: {max_err:.1e}", flush=True)
            rows += mine
            winner, score, scores = best(mine, candidates)
            winners[(module.SCHEME["name"], d)] = winner  # the table's key: a file's scheme goes by its name
            runner = sorted(scores.items(), key=lambda kv: kv[1])[:3]
            by = {(tuple(r["variant"]), r["batch"], r["context"]): r for r in mine}
            per_shape = " ".join(
                f"{b}x{n // 1024}k {by[(DEFAULT, b, n)]['ms']:.4f}->{by[(winner, b, n)]['ms']:.4f}"
                for b, n in grid if by.get((DEFAULT, b, n), {}).get("ms") and by.get((winner, b, n), {}).get("ms"))
            summary.append(f"{name:<16} d={d:<4} {fmt_variant(winner):<28} "
                           + ("(the default fails here)" if math.isnan(score) else f"{score:.3f}x default time")
                           + f" | {per_shape}"
                           f" | top: {', '.join(f'{fmt_variant(v)} {s:.3f}' for v, s in runner)}")
            Path(args.json).write_text(json.dumps({**header, "winners": {f"{k[0]} d={k[1]}": list(v) for k, v in
                                                                         winners.items()}, "results": rows}, indent=1)
                                       + "\n", encoding="utf-8")
            if args.write:  # after every (scheme, head_dim), so a sweep cut short keeps its winners
                write_table(DECODE_TUNING, {(name, d): winner}, header)
    print("\nbest per scheme and head_dim (geometric mean over the shapes; ms per shape default->best):")
    for line in summary:
        print(line)
    if args.write:
        print(f"wrote {DECODE_TUNING}; run `kvqc build` to render it")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvqc tune", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
