"""The `kvqc` command: build, check, list and explain schemes.

Exit status: 0 success, 1 a stale module under --check, 2 a bad scheme or bad arguments (one line, no traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .spec import Scheme, SchemeError, load_scheme


def _schemes(paths: list[str]) -> list[Path]:
    if paths:
        return [Path(p) for p in paths]
    found = sorted(Path("schemes").glob("*.yaml"))
    if not found:
        raise SchemeError("schemes/", "", "no *.yaml files here; pass scheme files or run from the repository root")
    return found


def _build(args: argparse.Namespace) -> int:
    from .codegen import render, write_atomic

    # Validate and render everything first, so one bad scheme leaves generated/ untouched.
    rendered: list[tuple[Scheme, Path, str]] = []
    for path in _schemes(args.schemes):
        scheme = load_scheme(path)
        rendered.append((scheme, Path(args.out) / f"{scheme.name}.py", render(scheme)))
    names = [s.name for s, _, _ in rendered]
    for name in {n for n in names if names.count(n) > 1}:
        raise SchemeError(str(rendered[names.index(name)][0].source), "name", f"'{name}' is built by two schemes")
    stale = 0
    for scheme, target, source in rendered:
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if args.check:
            if current != source:
                stale += 1
                print(f"{target}: stale, run `kvqc build {scheme.source}`", file=sys.stderr)
        elif current != source:
            write_atomic(target, source)
            print(f"{scheme.source} -> {target}")
        else:
            print(f"{target}: up to date")
    return 1 if stale else 0


def _list(args: argparse.Namespace) -> int:
    from .layout import plan

    d = args.head_dim
    schemes = [load_scheme(path) for path in _schemes(args.schemes)]  # every file valid before any output
    print(f"{'scheme':<20} {'K bits':>7} {'V bits':>7} {'bytes/token':>12} {'vs fp16':>8} {'window':>7}   "
          f"(head_dim {d}, 16-bit metadata; window: recent tokens kept unquantized)")
    for scheme in schemes:
        if d not in scheme.head_dims:
            print(f"{scheme.name:<20} (not built for head_dim {d}; built for {list(scheme.head_dims)})")
            continue
        layout = plan(scheme)
        kb, vb = scheme.bits_per_coordinate(d)
        print(f"{scheme.name:<20} {kb:>7.3f} {vb:>7.3f} {layout.bytes_per_token(d):>12} {layout.compression_ratio(d):>7.2f}x "
              f"{scheme.window or '-':>7}")
    return 0


def _explain(args: argparse.Namespace) -> int:
    from .codegen import describe
    from .layout import plan

    path = Path(args.scheme)
    # A bare name means the shipped scheme: `kvqc explain turbo_k4v2` reads schemes/turbo_k4v2.yaml.
    if not path.exists() and path.parent == Path(".") and path.suffix == "" and (Path("schemes") / f"{path}.yaml").is_file():
        path = Path("schemes") / f"{path}.yaml"
    scheme = load_scheme(path)
    layout = plan(scheme)
    d = args.head_dim if args.head_dim in scheme.head_dims else scheme.head_dims[-1]
    print(f"{scheme.name}: {' '.join(scheme.description.split()) or '(no description)'}")
    print(f"head_dims: {list(scheme.head_dims)}; shown for head_dim {d}, model dtype fp16, B = block_size, H = KV heads")
    print("cache tensors ([num_blocks, H, B, ...], allocate_cache's 'bhsd' layout; [num_blocks, B, H, ...] under 'bshd'):")
    for side in layout.sides:
        planes = " + ".join(f"{p.width}-bit" for p in side.planes)
        width = side.part_dim(d)
        which = f" of the {width} {'outlier' if side.part else 'other'} channels" if side.split else ""
        print(f"  {side.name + '_codes':<12} uint8   [num_blocks, H, B, {side.code_bytes(d)}]  {side.code_bits} bits/coord{which} ({planes} planes)")
        fields = ", ".join(side.metadata)
        if side.group_size:
            fields += f" for each of {d // side.group_size} groups of {side.group_size} channels"
        if side.per_channel:
            g = side.token_group
            fields += (f" for each of the {d} channels, per group of {g} tokens: the group's "
                       f"{d * len(side.metadata)} values spread over its {g} slots")
        print(f"  {side.name + '_meta':<12} fp16    [num_blocks, H, B, {side.meta_width(d)}]  {fields}")
    for side in layout.sides:
        if side.part:
            o = side.whole.outliers
            rule = (f"fixed by the scheme: {list(o.channels)}" if o.select == "fixed"
                    else f"calibrate(cache, key, value) takes the {side.part_dim(d)} of largest {o.select} per KV head")
            print(f"  {side.base + '_channels':<12} int64   [H, {d}]  each KV head's channel order, its {side.part_dim(d)} "
                  f"outlier channels first ({rule}); once per layer, not per token")
    if scheme.window:
        print(f"ring tensors ([max_seqs, {scheme.window}, H, d], one row per live sequence):")
        for name in ("key", "value"):
            print(f"  {name + '_window':<12} fp16    [max_seqs, {scheme.window}, H, {d}]  the sequence's last "
                  f"{scheme.window} tokens as given, at position % {scheme.window}")
    print(f"bytes per token and KV head: {layout.bytes_per_token(d)} (fp16 K+V: {4 * d}), {layout.compression_ratio(d):.2f}x smaller")
    if scheme.window:
        print(f"ring bytes per sequence and KV head: {4 * d * scheme.window} (the last {scheme.window} tokens' K and V "
              "in fp16, besides their slots)")
    for side in layout.sides:
        print(f"{side.name}: {describe(side)}")
    print("kernels:")
    if layout.split:
        print("  calibrate  once per layer, before the first fill: choose each KV head's outlier channels from sample K/V")
    print("  fill     quantize new tokens [T, H, d] and write them to slot_mapping's slots (negative = skip)")
    if layout.split:
        print("           each head's channels in its order, outliers first; each part rotated, scaled and coded apart")
    if scheme.window:
        print(f"           and copy each sequence's last {scheme.window} into its ring row (positions, window_index)")
    for side in layout.per_channel:
        print(f"           {side.name}: when a token completes a group of {side.token_group}, quantize the group "
              "from this call's tokens and the ring")
    print("  flatten  dequantize each sequence's tokens into contiguous [sum(seq_lens), H, d] K and V")
    print("  decode   attention of one query token per sequence over the packed codes (split-K, GQA);")
    print("           the query is rotated once and the output rotated back once")
    if layout.split:
        print("           a split side: scores summed over its two parts, one output per part, put back in channel order")
    if scheme.window:
        print(f"           the last {scheme.window} tokens: one more split over the ring, unquantized")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")  # a scheme's text may hold lone surrogates
    parser = argparse.ArgumentParser(prog="kvqc", description="Compile KV-cache quantization schemes to Triton kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="render schemes into generated/<name>.py")
    p.add_argument("schemes", nargs="*", help="scheme files (default: schemes/*.yaml)")
    p.add_argument("--out", default="generated", help="output directory (default: generated)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a module differs from its scheme")
    p.set_defaults(run=_build)
    p = sub.add_parser("list", help="the schemes, one line each: bits per coordinate and compression")
    p.add_argument("schemes", nargs="*", help="scheme files (default: schemes/*.yaml)")
    p.add_argument("--head-dim", type=int, default=128)
    p.set_defaults(run=_list)
    p = sub.add_parser("bench", help="time decode / fill / flatten against fp16 SDPA on a GPU")
    if argv[:1] == ["bench"]:  # bench imports torch: only when asked, so `kvqc build` stays quick
        from . import bench

        bench.add_arguments(p)
        p.set_defaults(run=bench.run)
    p = sub.add_parser("tune", help="sweep decode's launch settings on a GPU; --write the best into the modules' table")
    if argv[:1] == ["tune"]:
        from . import tune

        tune.add_arguments(p)
        p.set_defaults(run=tune.run)
    p = sub.add_parser("eval", help="a real language model with each scheme's cache: perplexity, greedy agreement")
    if argv[:1] == ["eval"]:  # eval imports transformers, and may set TRITON_INTERPRET before triton loads
        from . import eval as evaluation

        evaluation.add_arguments(p)
        p.set_defaults(run=evaluation.run)
    p = sub.add_parser("quality", help="reconstruction and attention error per scheme on random and real K/V")
    if argv[:1] == ["quality"]:
        from . import quality

        quality.add_arguments(p)
        p.set_defaults(run=quality.run)
    p = sub.add_parser("explain", help="a scheme's cache layout and kernels")
    p.add_argument("scheme")
    p.add_argument("--head-dim", type=int, default=128)
    p.set_defaults(run=_explain)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except SchemeError as exc:
        print(f"kvqc: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. --out naming a file, an unwritable directory
        print(f"kvqc: {exc.filename or args.command}: {exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
