r"""Fit kvqc/tools/estimate.py's constants to committed `kvqc bench` runs, and print each shape's estimate beside
its measured time. No GPU: the split kernels are compiled for sm_90 here, as `kvqc resources` does.

    python3 benchmarks/fit_estimate.py docs/bench-catalogue-h100.json docs/bench-head-dims-h100.json \
        docs/bench-d80-96-h100.json

Least squares on log(estimate / measured) over every head-major shape of batch 8 or more, on a grid of
CYCLES_PER_INSTRUCTION (3.0-4.9), CYCLES_PER_INSTRUCTION_WIDE (5.0-7.9) and FIXED_US (8-15.5 us). SKIPPED_WEIGHT is
not fitted: it is the share of tiles that run the lazy rescale on the benchmark's random scores (estimate.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvqc from this checkout

from kvqc import modules  # noqa: E402
from kvqc.tools import estimate, resources  # noqa: E402


def shape_of(run: dict, est: dict) -> tuple:
    """shape_us's arguments for one measured shape: the split kernel `kvqc resources` estimated with, and the run's
    batch, context, bytes a token, window and head_dim."""
    assert run["kv_heads"] == estimate.KV_HEADS, run["kv_heads"]
    kernel = estimate.SplitKernel(est["loop_instructions"], est["block_n"], est["num_warps"], est["registers"],
                                  est["shared"], est["warps_per_sm"] // est["num_warps"], est["skipped_instructions"])
    window = getattr(modules.load(run["scheme"]), "WINDOW", 0)
    return kernel, run["batch"], run["context"], run["bytes_per_token"], window, run["head_dim"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="kvqc bench --json files")
    args = p.parse_args()
    runs = [r for f in args.runs for r in json.loads(Path(f).read_text())["results"]
            if r.get("status") == "ok" and r["batch"] >= 8 and r.get("layout", "bhsd") == "bhsd"]
    rows = {}
    for run in runs:
        key = run["scheme"], run["head_dim"]
        if key not in rows:
            estimated = [row for row in resources.measure(*key, layout="bhsd") if "estimate" in row]
            if not estimated:
                sys.exit(f"fit_estimate: {key[0]} at head_dim {key[1]}: no split kernel compiled (kvqc resources)")
            rows[key] = estimated[0]
    shapes = [shape_of(run, rows[run["scheme"], run["head_dim"]]["estimate"]) for run in runs]
    measured = [run["kvqc_graph_ms"] * 1e3 for run in runs]

    def estimates(cycles: float, wide: float, fixed: float) -> list[tuple[float, str]]:
        out = []
        for shape in shapes:
            us, _, bound = estimate.shape_us(*shape, cycles=cycles if shape[0].num_warps < 4 else wide, fixed=fixed)
            out.append((us, bound))
        return out

    grid = itertools.product([x / 10 for x in range(30, 50)], [x / 10 for x in range(50, 80)],
                             [x / 2 for x in range(16, 32)])
    best = min(grid, key=lambda c: sum(math.log(us / got) ** 2 for (us, _), got in zip(estimates(*c), measured)))
    errors = []
    order = sorted(zip(runs, estimates(*best), measured),
                   key=lambda x: (x[0]["head_dim"], x[0]["scheme"], x[0]["batch"], x[0]["context"]))
    for run, (us, bound), got in order:
        row = rows[run["scheme"], run["head_dim"]]
        est = row["estimate"]
        errors.append(math.log(us / got))
        print(f"{run['scheme']:<20} {run['head_dim']:>4} {run['batch']:>3} x {run['context'] // 1024:>2}k "
              f"{row['kernel']:<21} {est['loop_instructions']:>5} instructions ({est['skipped_instructions']:>3} "
              f"skipped) / {est['block_n']:>2} tokens, "
              f"{est['num_warps']} warp(s): estimated {us:7.1f} us, measured {got:7.1f} ({us / got - 1:+.0%}), {bound}")
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    print(f"CYCLES_PER_INSTRUCTION = {best[0]}, CYCLES_PER_INSTRUCTION_WIDE = {best[1]}, FIXED_US = {best[2]}: "
          f"{len(runs)} shapes, rms {rms:.1%} (log), "
          f"from {math.expm1(min(errors)):+.0%} to {math.expm1(max(errors)):+.0%}")


if __name__ == "__main__":
    main()
