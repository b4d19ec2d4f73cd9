"""Render: a Layout becomes the source of one self-contained module of Triton kernels.

Only numbers, dtypes and validated identifiers reach the source, and the scheme file's folder and name one header
comment, escaped; the scheme's free text (its description) never does. The same scheme file gives byte-identical
output on every run, and files are replaced atomically.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import pprint
import re
import tempfile
from pathlib import Path

import jinja2

from kvqc import __version__
from kvqc.numerics import rotation
from kvqc.compiler.fold import fold, folded_tree
from kvqc.compiler.pieces import (cache_rows, cells, codecs, constants, dequantize, flatten, gluon, packing,
                                  parts, planes, quantize, rotate, scale_groups, selects, signature, split_state,
                                  tables, tiles, unpack)
from kvqc.compiler.pieces.packing import over
from kvqc.compiler.layout import DECODE_TUNING, Layout, SideLayout, plan
from kvqc.compiler.spec import Scheme, printable
from kvqc.compiler.wrap import wrap

TEMPLATES = Path(__file__).resolve().parent / "templates"
RUNTIME = Path(__file__).resolve().parent / "runtime"
RUNTIME_MARKER = "# ---- generated modules carry the rest of this file verbatim ----\n"


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    """One environment a process: it keeps each template compiled (about 1.1 s of a render) and recompiles one whose
    file changed."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["over"] = over
    # The pieces Python lays out (kvqc/compiler/pieces/), for the templates to place.
    env.globals.update(cache_rows=cache_rows, cells=cells, codecs=codecs, constants=constants, dequantize=dequantize,
                       flatten=flatten, gluon=gluon, packing=packing, parts=parts, planes=planes, quantize=quantize,
                       rotate=rotate, scale_groups=scale_groups, selects=selects, signature=signature,
                       split_state=split_state, tables=tables, tiles=tiles, unpack=unpack)
    return env


def _floats(values: tuple[float, ...]) -> str:
    return "(" + ", ".join(repr(float(v)) for v in values) + ")"


def describe(side: SideLayout) -> str:
    """One line saying what a side stores, for docstrings and `kvqc explain`."""
    s = side.scheme
    parts = ["minus its KV head's calibrated mean"] if side.centered else []
    if s.rotation.kind == "hadamard":
        parts.append("randomized Hadamard rotation" if s.rotation.signs else "Walsh-Hadamard rotation")
    if s.per_channel:
        per = f"per-channel (shared by {s.scale.group_size} tokens)"
    else:
        per = f"per group of {s.scale.group_size} channels" if s.scale.group_size else "per-token"
    if s.scale.kind == "norm":
        law = "N(0,1/d)" if s.codebook.law == "gaussian" else "unit-sphere"
        norm = "unbiased (DRIVE/EDEN) norm" if s.scale.unbiased else "L2 norm"
        parts.append(f"per-token {norm}, {s.codebook.bits}-bit Lloyd-Max ({law} law)")
    elif s.codebook.kind == "fp8":
        parts.append(f"{per} absmax scale, fp8 {s.codebook.format}")
    elif s.scale.kind == "absmax":
        parts.append(f"{per} symmetric {s.codebook.bits}-bit (absmax scale)")
    else:
        parts.append(f"{per} affine {s.codebook.bits}-bit (scale, zero)")
    if s.residual.kind == "sign":
        parts.append("1-bit residual sign with its RMS")
    elif s.residual.kind == "qjl":
        parts.append(f"1-bit QJL residual (seed {s.residual.seed})")
    parts.append(f"{s.packing} packing")
    return ", ".join(parts)


def runtime_source(name: str) -> str:
    """What generated modules carry of kvqc/compiler/runtime/NAME.py: the text after its marker line, unchanged (the
    file's docstring and imports above the marker stay behind; runtime/__init__.py says why)."""
    text = (RUNTIME / f"{name}.py").read_text(encoding="utf-8")
    _, marker, body = text.partition("\n" + RUNTIME_MARKER)
    if not marker or RUNTIME_MARKER in body:
        raise AssertionError(f"kvqc: runtime/{name}.py needs one marker line, {RUNTIME_MARKER.strip()!r}")
    return body.strip("\n")


def helper_sources(names: tuple[str, ...], source: str = "helpers") -> str:
    """What a module carries of runtime/<source>.py (helpers.py, ptx.py): the named @triton.jit helpers, in the file's
    order, each with the comment and constants written just above it (the file's top-level pieces are two blank lines
    apart)."""
    pieces, pending = {}, []
    for chunk in runtime_source(source).split("\n\n\n"):
        pending.append(chunk.strip("\n"))
        defined = re.search(r"^def (\w+)\(", chunk, re.MULTILINE)
        if defined:
            pieces[defined.group(1)] = "\n\n\n".join(pending)
            pending = []
    unknown = sorted(set(names) - set(pieces))
    if unknown or pending:
        raise AssertionError(f"kvqc: runtime/{source}.py defines no {unknown} or ends without a function")
    return "\n\n\n".join(text for name, text in pieces.items() if name in names)


def _generator_source() -> str:
    return "\n\n\n".join(
        inspect.getsource(f).strip() for f in (rotation.splitmix64, rotation.uniform, rotation.gaussian_matrix)
    )


def decode_tuning(name: str, head_dims: tuple[int, ...] = ()) -> dict:
    """The decode launch table for one scheme, the rows its split kernel pads the query heads to at least, and its
    looping fill's register cap, programs, warps and stages for bf16 and fp32 inputs, as the module template renders
    them (see `kvqc tune`). Head dims the table does not name take its default for their size: `default_small_heads`
    at 64 or less, `default_wide_heads` above 128, `default` between."""
    table = json.loads(DECODE_TUNING.read_text(encoding="utf-8"))
    default = tuple(int(x) for x in table["default"])
    configs = {int(d): tuple(int(x) for x in cfg) for d, cfg in table["schemes"].get(name, {}).items()}
    small = [d for d in head_dims if d <= 64 and d not in configs]
    wide = [d for d in head_dims if d > 128 and d not in configs]
    if configs:
        sweep = table.get("sweeps", {}).get(name, f"{table['device']} ({table.get('shapes', '')})")
        where = sweep[: sweep.index(")") + 1] if ")" in sweep else sweep  # the device and shapes, not the run's notes
        comment = f"Tuned on {where}; templates/decode_tuning.json records the sweep."
    else:
        comment = "Not tuned for this scheme: each head_dim takes the default for its size."
    if small:
        configs.update({d: tuple(int(x) for x in table["default_small_heads"]) for d in small})
        comment += f" head_dim {', '.join(map(str, small))}: the small-head default (one warp a program)."
    if wide:
        configs.update({d: tuple(int(x) for x in table["default_wide_heads"]) for d in wide})
        comment += f" head_dim {', '.join(map(str, wide))}: the wide-head default."
    lazy = name in table.get("lazy_rescale", [])
    rotate_apart = name in table.get("rotate_query_apart", [])
    # The looping fill's register cap and programs per SM, per head_dim where measured: a cap that helps at one
    # head_dim can fail to compile at a wider one. Programs per SM: the table's, else as many as fit under the cap
    # (65536 registers over the program's warps of 32 threads: one wave for a large fill); other head dims take 8,
    # uncapped.
    fill_registers, fill_warps = _per_head_dim(table, "fill_registers", name), _per_head_dim(table, "fill_warps", name)
    fill_programs = {d: 65536 // (n * 32 * fill_warps.get(d, 4)) for d, n in fill_registers.items()}
    fill_programs.update(_per_head_dim(table, "fill_programs", name))
    split_stages = _per_head_dim(table, "fill_stages_split_inputs", name)
    query_rows = _per_head_dim(table, "query_rows", name)
    for d, rows in query_rows.items():
        if rows < 1 or rows & (rows - 1):
            raise ValueError(f"{DECODE_TUNING}: query_rows.{name}.{d}: expected a power of two (the split kernel's "
                             f"query tile), got {rows}")
    return {"configs": _literal(configs), "default": repr(default), "comment": comment, "lazy": lazy,
            "rotate_in_decode": not rotate_apart, "fill_registers": _literal(fill_registers),
            "fill_programs": _literal(fill_programs), "fill_warps": _literal(fill_warps),
            "split_input_stages": _literal(split_stages),
            "query_rows": _literal(query_rows)}


def _per_head_dim(table: dict, key: str, name: str) -> dict[int, int]:
    """The table's `key` entry for one scheme: a number per head_dim where one was measured."""
    return {int(d): int(n) for d, n in table.get(key, {}).get(name, {}).items()}


def _literal(by_head_dim: dict) -> str:
    """A per-head_dim dict as the module's source spells it, in head_dim order."""
    return repr(dict(sorted(by_head_dim.items())))


def origin(scheme: Scheme) -> str | None:
    """The scheme's file as its module's header records it: the file's folder and name (`schemes/x.yaml`), the
    same from any working directory or checkout, escaped so that no file name can end the comment's line; None
    for a scheme that came from no file."""
    if scheme.source.startswith("<"):
        return None
    path = Path(os.path.abspath(scheme.source))
    return printable(f"{path.parent.name}/{path.name}" if path.parent.name else path.name)


ORIGIN_RE = re.compile(r"# Scheme file: `(.*)` \(")


def recorded_origin(module_source: str) -> str | None:
    """The scheme file a generated module's header records (see `origin`); None where it records none."""
    lines = module_source.split("\n", 2)
    match = ORIGIN_RE.match(lines[1]) if len(lines) > 1 else None
    return match.group(1) if match else None


def render(scheme: Scheme) -> str:
    layout: Layout = plan(scheme)
    data = scheme.to_dict()
    data.pop("description")  # free text stays out of generated source
    source = _environment().get_template("module.py.j2").render(
        version=__version__,
        origin=origin(scheme),
        layout=layout,
        scheme_literal=pprint.pformat(data, width=100, sort_dicts=True),
        floats=_floats,
        describe=describe,
        example_dim=128 if 128 in scheme.head_dims else scheme.head_dims[-1],
        generator_source=_generator_source(),
        paley={m: rotation.paley_hadamard(m) for m in rotation.PALEY_ORDERS},
        tuning=decode_tuning(scheme.name, scheme.head_dims),
        runtime=runtime_source,
        helpers=helper_sources,
    )
    source = re.sub(r"[ \t]+\n", "\n", source)
    source = re.sub(r"\n{4,}", "\n\n\n", source)
    source = re.sub(r"\n{3,}(?=[ \t]+\S)", "\n\n", source)  # inside a body, one blank line at most
    rendered = ast.parse(source, f"generated/{scheme.name}.py")
    source = fold(source)
    tree = ast.parse(source, f"generated/{scheme.name}.py")
    shape = ast.dump(tree)  # the syntax tree, positions aside, taken once for both checks below
    if ast.dump(folded_tree(rendered)) != shape:  # unit terms only: a fold that did more would be a kvqc bug
        raise AssertionError(f"kvqc: folding {scheme.name}'s unit terms changed more than those terms")
    compile(tree, f"generated/{scheme.name}.py", "exec")  # a template bug fails here, not in an engine
    wrapped = wrap(source)
    if ast.dump(ast.parse(wrapped)) != shape:  # layout only: a wrap that changed the program would be a kvqc bug
        raise AssertionError(f"kvqc: wrapping {scheme.name}'s long lines changed its syntax tree")
    return wrapped


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see the old file or the new one, never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a module is an ordinary source file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
