"""Decode's lines for a side whose scales cover groups of channels (SideLayout.group_dots: the metal_* schemes' blocks
of 32): its tiles stay integer codes, a dot per run of `unit(d)` columns, and each group's scale multiplies the dots
(K) or the probabilities (V) outside the tiles. How many runs, groups and plane bytes a tile reads depends on
head_dim, so every piece is one constexpr branch per head_dim the scheme is built for (`if HEAD_DIM == d:`); the
lines are laid out here, in Python, and the decode template places them (templates/kernels/decode.py.j2).

Names in the kernel: `query_<tag><u>` (unit u's query columns) and `query_<tag>sum_<g>` (their sum over group g),
`<side>_<field>_<g><suffix>` (group g's metadata), `<side>_bytes_<plane>_<run>` (a plane's bytes of one run),
`tile_<u>` (unit u's codes - code_centre), `acc_<tag>u<u>` and `acc_<tag>shift_<g>` (V's accumulators).
"""

from __future__ import annotations

from typing import Protocol

BRANCH = " " * 8  # the tile loop's body, where a head_dim branch opens
BODY = " " * 12  # inside that branch


class GroupSide(Protocol):
    """What the pieces need of a side's plan (SideLayout)."""

    name: str
    tag: str
    head_dims: tuple[int, ...]
    group_size: int
    metadata: tuple[str, ...]
    meta_width_expr: str
    code_bits: int
    code_centre: int
    scale_kind: str
    head_pad: str

    def unit(self, head_dim: int) -> int: ...
    def units(self, head_dim: int) -> list[dict]: ...
    def unit_loads(self, head_dim: int) -> tuple[tuple[str, int], ...]: ...
    def unit_code(self, unit: dict) -> tuple[str, ...]: ...
    def unit_unpack(self, head_dim: int, unit: dict, u: int) -> str: ...
    def level_shift(self, scale: str, zero: str) -> str: ...


def query_loads(key: GroupSide) -> str:
    """K's query, one unit of columns at a time, and per group the sum of its entries (as DOT_DTYPE rounded them),
    before the tile loop."""
    lines = []
    for d in key.head_dims:
        lines.append(f"    {_branch(key, d)}")
        w, tag = key.unit(d), key.tag
        for u, unit, first, _ in _runs(key, d):
            lines.append(f"        query_{tag}{u} = tl.load(query_{tag}ptr + q_row[:, None] * HEAD_DIM + {u * w} + "
                         f"tl.arange(0, {w})[None, :], mask=q_valid[:, None], other=0.0).to(DOT_DTYPE)")
            lines.append(f"        query_{tag}sum_{unit['group']} {'=' if first else '+='} "
                         f"tl.sum(query_{tag}{u}.to(tl.float32), axis=1)")
    return "".join(line + "\n" for line in lines)


def metadata_loads(side: GroupSide, suffix: str, rows: str, indent: int, assign_from: str = "") -> str:
    """`<side>_<field>_<group><suffix>` for every scale group of the rows `row<rows>`, loaded (or moved from
    `..._<assign_from>`); a group that only the larger head_dims have behind a constexpr test."""
    lines, size, name = [], side.group_size, side.name
    for g in range(max(side.head_dims) // size):
        pad = " " * indent
        if g * size >= min(side.head_dims):
            lines.append(f"{pad}if HEAD_DIM > {g * size}:")
            pad += "    "
        for i, field in enumerate(side.metadata):
            target = f"{name}_{field}_{g}{suffix}"
            if assign_from:
                lines.append(f"{pad}{target} = {name}_{field}_{g}{assign_from}")
            else:
                at = g * len(side.metadata) + i
                lines.append(f"{pad}{target} = tl.load({name}_meta_ptr + row{rows} * {side.meta_width_expr} + {at}, "
                             f"mask=valid{rows}, other=0.0)")
    return "".join(line + "\n" for line in lines)


def key_dots(key: GroupSide, first: bool) -> str:
    """`scores` (`scores =` where `first`, else `+=`) from K's tiles: per head_dim the plane bytes a run at a time, a
    dot per unit summed over its group, then times the group's scale per token, plus what the tiles' centring left
    out (the zero, or absmax's one more level) times the query's sum over the group."""
    lines, name, tag, minmax = [], key.name, key.tag, key.scale_kind == "minmax"
    for d in key.head_dims:
        lines.append(BRANCH + _branch(key, d))
        lines += _unit_loads(key, d)
        for u, unit, first_of_group, last_of_group in _runs(key, d):
            g = unit["group"]
            lines += _unit_tile(key, d, unit, u)
            lines.append(f"{BODY}dots = _mm(query_{tag}{u}, tl.trans(tile_{u}), DOT_PRECISION"
                         f"{'' if first_of_group else ', dots'})")
            if not last_of_group:
                continue
            lines.append(f"{BODY}scale = {name}_scale_{g}_raw.to(tl.float32)")
            op = "scores = " if first and g == 0 else "scores += "
            if minmax:
                lines.append(f"{BODY}{op}dots * scale[None, :] + query_{tag}sum_{g}[:, None] * "
                             f"({name}_zero_{g}_raw.to(tl.float32) + {key.code_centre} * scale)[None, :]")
            else:
                lines.append(f"{BODY}{'scales = scale' if g == 0 else 'scales += scale'}")
                lines.append(f"{BODY}# absmax levels are code - {key.code_centre - 1}: one more than the tiles, times "
                             "the query's sum over the group")
                lines.append(f"{BODY}{op}(dots + query_{tag}sum_{g}[:, None]) * scale[None, :]")
        if not minmax:
            lines += [f"{BODY}# A non-finite scale makes the token's scores NaN for every query head (0 * inf), as it "
                      "did when scales",
                      f"{BODY}# multiplied the tiles, instead of +-inf by the sign of each head's dot.",
                      f"{BODY}scores += (scales * 0.0)[None, :]"]
    return "".join(line + "\n" for line in lines)


def value_accs(value: GroupSide, what: str, indent: int) -> str:
    """V's accumulators, `acc_<tag>u<u>` per unit of columns and `acc_<tag>shift_<g>` per group (its probabilities
    times the group's level_shift, the same for each of its columns): "init" (zeros), "rescale" (times alpha) or
    "store" (with the shift, to the split's partial output)."""
    pad, tag, shift = " " * indent, value.tag, value.level_shift("scale", "zero")
    lines = []
    for d in value.head_dims:
        lines.append(pad + _branch(value, d))
        w = value.unit(d)
        for u, unit in enumerate(value.units(d)):
            acc = f"acc_{tag}u{u}"
            if what == "init":
                lines.append(f"{pad}    {acc} = tl.zeros([GROUP_PAD, {w}], tl.float32)")
            elif what == "rescale":
                lines.append(f"{pad}    {acc} *= alpha[:, None]")
            else:
                shifted = f" + acc_{tag}shift_{unit['group']}[:, None]" if shift else ""
                lines.append(f"{pad}    tl.store(partial_{tag}out_ptr + part[:, None] * {value.head_pad} + {u * w} + "
                             f"tl.arange(0, {w})[None, :], {acc}{shifted}, mask=q_valid[:, None])")
        if shift and what != "store":
            start = " = tl.zeros([GROUP_PAD], tl.float32)" if what == "init" else " *= alpha"
            lines += [f"{pad}    acc_{tag}shift_{g}{start}" for g in range(d // value.group_size)]
    return "".join(line + "\n" for line in lines)


def value_dots(value: GroupSide) -> str:
    """acc += V's dots: per head_dim the plane bytes a run at a time; per group the probabilities times its scale
    (in DOT_DTYPE) against each of its units' tiles, and against its level_shift summed apart."""
    lines, name, tag = [], value.name, value.tag
    shift = value.level_shift("scale", "zero")
    for d in value.head_dims:
        lines.append(BRANCH + _branch(value, d))
        lines += _unit_loads(value, d)
        for u, unit, first_of_group, _ in _runs(value, d):
            g = unit["group"]
            if first_of_group:
                lines += [f"{BODY}scale = {name}_scale_{g}_raw.to(tl.float32)",
                          f"{BODY}weights = (p * scale[None, :]).to(DOT_DTYPE)"]
                if value.scale_kind == "minmax":
                    lines.append(f"{BODY}zero = {name}_zero_{g}_raw.to(tl.float32)")
                if shift:
                    lines.append(f"{BODY}acc_{tag}shift_{g} += tl.sum(p * {shift}[None, :], axis=1)")
            lines += _unit_tile(value, d, unit, u)
            lines.append(f"{BODY}acc_{tag}u{u} = _mm(weights, tile_{u}, DOT_PRECISION, acc_{tag}u{u})")
    return "".join(line + "\n" for line in lines)


def _branch(side: GroupSide, head_dim: int) -> str:
    return f"{'if' if head_dim == side.head_dims[0] else 'elif'} HEAD_DIM == {head_dim}:"


def _runs(side: GroupSide, head_dim: int):
    """Each unit at head_dim as (u, unit, first of its group, last of its group)."""
    units = side.units(head_dim)
    for u, unit in enumerate(units):
        g = unit["group"]
        yield u, unit, u == 0 or units[u - 1]["group"] != g, u == len(units) - 1 or units[u + 1]["group"] != g


def _unit_loads(side: GroupSide, head_dim: int) -> list[str]:
    """Every plane's code bytes of the rows `row` in runs of unit(d) bytes (uint8)."""
    row_bytes, w = head_dim * side.code_bits // 8, side.unit(head_dim)
    return [f"{BODY}{name} = tl.load({side.name}_codes_ptr + row[:, None] * {row_bytes} + {first} + "
            f"tl.arange(0, {w})[None, :], mask=valid[:, None], other=0)" for name, first in side.unit_loads(head_dim)]


def _unit_tile(side: GroupSide, head_dim: int, unit: dict, u: int) -> list[str]:
    """`tile_<u>` as code - code_centre in DOT_DTYPE: the PTX helper, or shifts and masks."""
    return ([f"{BODY}if FAST_UNPACK:", f"{BODY}    {side.unit_unpack(head_dim, unit, u)}", f"{BODY}else:"]
            + [f"{BODY}    code = {bits}" for bits in side.unit_code(unit)]
            + [f"{BODY}    tile_{u} = (code - {side.code_centre}).to(DOT_DTYPE)"])
