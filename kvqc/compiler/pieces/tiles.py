"""Decode's tile loop, per side: how a tile's codes become K's `dots` against the query and V's accumulators
against the weights, chunk by chunk (from dequantize.py's tiles), in pairs of chunks (a PTX helper or a select tree
per pair), or with K's per-channel scales folded into the query (channel_dots). The lines sit in the tile loop's
body (8 spaces); the templates in kernels/decode/ place them, one per SideLayout.decode_tiles variant."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces import cache_rows, packing, scale_groups, unpack
from kvqc.compiler.pieces.codecs import grid, lloyd_max, residuals, scales
from kvqc.compiler.pieces.dequantize import chunk_tile
from kvqc.compiler.pieces.packing import BODY, indented

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout

LOOP = " " * 8  # the tile loop's body
BRANCH = " " * 12  # inside a FAST_UNPACK branch of it


def centred(side: SideLayout) -> str:
    """The tile decode's dots take: levels centred on the codes' code_mid where a shift adds the rest back."""
    return f"(tile - {side.level_mid})" if side.level_mid else "tile"


def value_dot(value: SideLayout, tile: str, acc: str, fast: bool) -> str:
    """`acc` plus the weights against `tile`: tl.dot where a PTX helper made the tile, _mm (DOT_PRECISION) on the
    portable path; transposed, tile^T @ weights^T, where the plan accumulates V so (SideLayout.transposed_acc)."""
    operands = f"tl.trans({tile}), tl.trans(weights)" if value.transposed_acc else f"weights, {tile}"
    return f"tl.dot({operands}, {acc})" if fast else f"_mm({operands}, DOT_PRECISION, {acc})"


def _sum(name: str, first: bool) -> str:
    return f"{name} {'=' if first else '+='}"


def key_dots(key: SideLayout, key_qjl: bool) -> str:
    """`dots` (and `dots_qjl`) of K's chunks on the portable path: each chunk's tile against its query columns."""
    out, q = "", f"query_{key.tag}"
    for c in range(key.chunks):
        out += indented(chunk_tile(key, c, "BLOCK_N", "valid")) + "\n"
        out += f"{LOOP}{_sum('dots', c == 0)} _mm({q}{c}, tl.trans({centred(key)}.to(DOT_DTYPE)), DOT_PRECISION)\n"
        if key_qjl:
            out += f"{LOOP}{_sum('dots_qjl', c == 0)} _mm({q}qjl_{c}, tl.trans(signs.to(DOT_DTYPE)), DOT_PRECISION)\n"
    return out


def value_acc(value: SideLayout, value_qjl: bool) -> str:
    """V's accumulators on the portable path. Per-channel scales over token groups of 16 and more factor out of the
    dot: the weights against the levels, times each channel's scale, plus the weights' sum times its zero."""
    tag, out = value.tag, ""
    if value.per_channel and value.token_group >= 16:
        minmax = value.scale_kind == "minmax"
        out += indented(scales.tile_group(value)) + "\n"
        if minmax:
            out += f"{LOOP}p_sum = tl.sum(p, axis=1)\n"
        for c in range(value.chunks):
            out += (indented(packing.chunk_code(value, c)) + "\n" + indented(grid(value).level(value)) + "\n"
                    + indented(scales.group_metadata(value, c)) + "\n")
            zero = " + p_sum[:, None] * zero[None, :]" if minmax else ""
            out += f"{LOOP}acc_{tag}{c} += _mm(weights, level.to(DOT_DTYPE), DOT_PRECISION) * scale[None, :]{zero}\n"
        return out
    for c in range(value.chunks):
        out += indented(chunk_tile(value, c, "BLOCK_N", "valid")) + "\n"
        out += f"{LOOP}acc_{tag}{c} = {value_dot(value, f'{centred(value)}.to(DOT_DTYPE)', f'acc_{tag}{c}', False)}\n"
        if value_qjl:
            out += (f"{LOOP}acc_{tag}qjl_{c} = _mm(weights_qjl, signs.to(DOT_DTYPE), DOT_PRECISION, "
                    f"acc_{tag}qjl_{c})\n")
    return out


def _pair_tile(side: SideLayout, k: int) -> str:
    """The portable path's `tile` of pair k: its code's centroid or level."""
    out = packing.pair_code(side, k)
    if side.lloyd_max:
        return out + indented(lloyd_max.lookup(side, "tile", "code"), 8) + "\n"
    return out + f"{BRANCH}tile = ({side.index_bits} - {side.code_mid}).to(tl.float32)\n"


def pair_accs(value: SideLayout, value_fast: str) -> str:
    """V's accumulators a pair of chunks at a time: a PTX helper's fp16 tile per pair, or the portable select
    trees (with the sign residual's share)."""
    tag, pairs = value.tag, range(value.chunks // 2)
    out = f"{LOOP}if FAST_UNPACK:\n"
    for k in pairs:
        out += (f"{BRANCH}tile = _unpack_{value_fast}_pairs({value.pair_args(k)})\n"
                f"{BRANCH}acc_{tag}p{k} = {value_dot(value, 'tile', f'acc_{tag}p{k}', True)}\n")
    out += f"{LOOP}else:\n" + packing.int_pairs(value)
    for k in pairs:
        out += _pair_tile(value, k)
        out += (indented(residuals.SIGN.tile(value), 8) if value.residual == "sign" else "") + "\n"
        out += f"{BRANCH}acc_{tag}p{k} = {value_dot(value, 'tile.to(DOT_DTYPE)', f'acc_{tag}p{k}', False)}\n"
    return out


def pair_dots(key: SideLayout, key_fast: str) -> str:
    """`dots` and `dots_qjl` of a QJL K in pairs: per pair its codebook tile against the query, its +-1 sign tile
    against the projected query (split_state.py loads the query's pairs)."""
    q, pairs = f"query_{key.tag}", range(key.chunks // 2)
    out = f"{LOOP}if FAST_UNPACK:\n"
    for k in pairs:
        out += (f"{BRANCH}tile, signs = _unpack_{key_fast}_pairs({key.pair_args(k)})\n"
                f"{BRANCH}{_sum('dots', k == 0)} tl.dot({q}p{k}, tl.trans(tile))\n"
                f"{BRANCH}{_sum('dots_qjl', k == 0)} tl.dot({q}qjl_p{k}, tl.trans(signs))\n")
    out += f"{LOOP}else:\n" + packing.int_pairs(key)
    for k in pairs:
        out += _pair_tile(key, k) + indented(residuals.QJL.tile(key), 8) + "\n"
        out += (f"{BRANCH}{_sum('dots', k == 0)} _mm({q}p{k}, tl.trans(tile.to(DOT_DTYPE)), DOT_PRECISION)\n"
                f"{BRANCH}{_sum('dots_qjl', k == 0)} _mm({q}qjl_p{k}, tl.trans(signs.to(DOT_DTYPE)), DOT_PRECISION)\n")
    return out


def scale_loads(side: SideLayout, suffix: str, rows: str, indent: int, assign_from: str = "") -> str:
    """The scales decode loads a tile ahead, `<side>_<field>_<group or chunk><suffix>` for the rows `row<rows>`
    (moved from `..._<assign_from>` where given): per group of channels (scale_groups.metadata_loads), or a
    channel_dots side's per-channel fields, one vector per chunk, from the token group of the tile's valid rows
    (`<side>_first<rows>`, -1 where there are none). Nothing for other sides."""
    pad, name = " " * indent, side.name
    if side.group_dots:
        return scale_groups.metadata_loads(side, suffix, rows, indent, assign_from) + "\n"
    if not side.channel_dots:
        return ""
    if assign_from:
        return "".join(f"{pad}{name}_{field}_{c}{suffix} = {name}_{field}_{c}{assign_from}\n"
                       for c in range(side.chunks) for field in side.metadata)
    first = f"{name}_first{rows}"
    out = f"{pad}{first} = tl.max(tl.where(valid{rows}, {cache_rows.group_first(side, 'row' + rows)}, -1), axis=0)\n"
    for c in range(side.chunks):
        fields = scales.channel_fields(side, c, first, f"{name}_chunk", f"({name}_chunk >= 0) & ({first} >= 0)",
                                       suffix)
        out += indented(fields, indent - 4)
    return out


def _portable_tile(side: SideLayout, c: int) -> str:
    """`tile_<c>`, chunk c of a channel_dots side on the portable path: its codes' level, less tile_level."""
    level = f"(level - {side.tile_level})" if side.tile_level else "level"
    return packing.chunk_code(side, c) + grid(side).level(side) + f"{BODY}tile_{c} = {level}.to(DOT_DTYPE)"


def channel_dots(key: SideLayout) -> str:
    """`dots` of a channel_dots K: per chunk, the query times the chunk's per-channel scales (in DOT_DTYPE) against
    its tile; the query times each channel's level_shift is summed over the chunks element by element
    (`query_shift`) and reduced once a tile (H100, 8 x 32k: 0.1908 ms against 0.1961 with a reduction per
    chunk)."""
    kind, name, tag = key.fast_unpack, key.name, key.tag
    shift = key.level_shift("scale", "zero")
    out = packing.load_codes(key, kind)
    if kind and not key.plane_unpack:
        out += (f"{LOOP}if FAST_UNPACK:\n" + unpack.fast_tiles(key).strip("\n") + "\n"
                f"{LOOP}else:\n{BRANCH}{name}_bytes_0_0 = {name}_bytes_0_0.to(tl.int32)\n")
    elif kind:
        out += f"{LOOP}if not FAST_UNPACK:\n" + packing.int_planes(key) + "\n"
    for c in range(key.chunks):
        if kind and key.plane_unpack:
            out += (f"{LOOP}if FAST_UNPACK:\n{BRANCH}tile_{c} = _unpack_{kind}({key.plane_args(c)})\n"
                    f"{LOOP}else:\n")
        elif kind:
            out += f"{LOOP}if not FAST_UNPACK:\n"
        out += indented(_portable_tile(key, c), 8 if kind else 4) + "\n"
        out += f"{LOOP}scale = {name}_scale_{c}_raw.to(tl.float32)\n"
        if key.scale_kind == "minmax":
            out += f"{LOOP}zero = {name}_zero_{c}_raw.to(tl.float32)\n"
        out += (f"{LOOP}{_sum('dots', c == 0)} _mm((query_{tag}{c}.to(tl.float32) * scale[None, :]).to(DOT_DTYPE), "
                f"tl.trans(tile_{c}), DOT_PRECISION)\n")
        if shift:
            out += f"{LOOP}{_sum('query_shift', c == 0)} query_{tag}{c}.to(tl.float32) * {shift}[None, :]\n"
    if shift:
        out += f"{LOOP}dots += tl.sum(query_shift, axis=1)[:, None]\n"
    return out
