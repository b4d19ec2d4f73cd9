"""Scales that carry a grid onto the values: the uniform grid (uniform.py) and fp8's (fp8.py) share them. A code is
an integer level over `scale`: from `zero` (minmax: codes 0 .. levels - 1) or symmetric around the middle code
(absmax: levels -top .. top). Scales come per token (one `scale`, `zero` per row, which decode applies to scores and
probabilities), per group of channels inside a chunk or over several chunks (beside the row, applied per element),
or per channel (shared by a token group, quantized by kernels/window.py.j2).

`scaled_codes` is fill's codes of the rows' chunks `x_<c>` with their scales; `scaled_tile` is flatten's and
decode's `tile` for `code`, scaled unless its scale is the row's. Both take the side's grid."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from kvqc.compiler.pieces import cache_rows
from kvqc.compiler.pieces.codecs import residuals
from kvqc.compiler.pieces.packing import BODY, indented

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout

INVERSE = f"{BODY}inverse = tl.where(scale > 0, 1.0 / tl.maximum(scale, 1e-30), 0.0)\n"


class Grid(ABC):
    """A codec whose codes are levels of a fixed grid, carried onto the values by this file's scales: it says how
    a scaled value becomes a code, how a code becomes its level, and which level max|y| maps to."""

    @abstractmethod
    def code(self, side: SideLayout, out: str, value: str) -> str:
        """`out` = the code of `value`, a value already divided by its scale (and shifted by its zero)."""

    @abstractmethod
    def level(self, side: SideLayout) -> str:
        """`level`: the grid value of `code` (its index bits, below any residual bit) before any scale."""

    @abstractmethod
    def largest(self, side: SideLayout) -> str:
        """The level max|y| maps to."""

    def encode(self, side: SideLayout, valid: str) -> str:
        return scaled_codes(side, valid, self)

    def tile(self, side: SideLayout, c: int, rows: str, valid: str) -> str:
        return scaled_tile(side, c, rows, valid, self)

    def load_tables(self, side: SideLayout) -> str:
        return ""  # a grid is arithmetic: nothing to load


def group_scale(side: SideLayout, grid: Grid, low: str, high: str, magnitude: str) -> str:
    """`scale` (and `zero`) from a group's smallest, largest and largest magnitude, and `inverse` = 1 / scale."""
    if side.scale_kind == "minmax":
        out = f"{BODY}zero = {low}\n{BODY}scale = ({high} - zero) / {side.levels - 1}\n"
    else:
        out = f"{BODY}scale = {magnitude} / {grid.largest(side)}\n"
    return out + INVERSE


def scaled_codes(side: SideLayout, valid: str, grid: Grid) -> str:
    """Fill: `code_<c>` for every chunk, and the scales: per row (stored by the caller), or per group (stored
    here)."""
    return spanning_groups(side, valid, grid) + "\n" if side.group_size else row_codes(side, grid, valid)


def row_codes(side: SideLayout, grid: Grid, valid: str) -> str:
    """One scale (and zero) per row, from every chunk; then each chunk's codes and any residual stage's bit (QJL's
    `finish` packs and stores the codes with its signs). Only uniform grids have a residual stage, so its
    reconstruction is the uniform level times the scale."""
    residual = residuals.of(side)
    out = ""
    if side.scale_kind == "minmax":
        if side.padded:
            out += f"{BODY}# Padding columns hold zeros: keep them out of the minimum and the maximum.\n"
        out += (f"{BODY}zero = {side.reduce_chunks('tl.minimum', 'tl.min(%s, axis=1)' % side.real('inf'))}\n"
                f"{BODY}high = {side.reduce_chunks('tl.maximum', 'tl.max(%s, axis=1)' % side.real('-inf'))}\n"
                f"{BODY}scale = (high - zero) / {side.levels - 1}\n")
    else:
        out += (f"{BODY}scale = {side.reduce_chunks('tl.maximum', 'tl.max(tl.abs(x_%d), axis=1)')} / "
                f"{grid.largest(side)}\n")
    out += (f"{BODY}# A constant row has scale 0: every code is the zero level and `zero` alone carries the value "
            "back.\n" + INVERSE)
    for c in range(side.chunks):
        out += grid.code(side, f"code_{c}", side.scaled(f"x_{c}", "[:, None]")) + "\n"
        if residual:
            out += residual.take(side, c, side.grid_residual(c)) + residual.square(side, c)
    return out + (residual.finish(side, valid) if residual else "")


def _store_group_fields(side: SideLayout, offsets: list[str], valid: str) -> str:
    """Each metadata field of a group stored at its offset from `<side>_meta_ptr`."""
    return "".join(f"{BODY}tl.store({side.name}_meta_ptr + {at}, {field}.to({side.name}_meta_ptr.dtype.element_ty), "
                   f"mask={valid})\n" for at, field in zip(offsets, side.metadata))


def _group_mask(side: SideLayout, valid: str) -> str:
    """rows x a chunk's scale groups: the `valid` rows, and where chunks are padded only the groups of real columns."""
    return f"{valid}[:, None]" + (f" & {side.name}_group_in[None, :]" if side.padded else "")


def grouped_codes(side: SideLayout, c: int, valid: str, grid: Grid) -> str:
    """Chunk c's codes when scale groups of G channels lie inside a chunk: the chunk is viewed as [rows, groups, G],
    reduced along G, and its groups' metadata stored right away."""
    name, fields = side.name, len(side.metadata)
    mask = _group_mask(side, valid)
    return (f"{BODY}grouped = tl.reshape(x_{c}, [BLOCK_T, {name.upper()}_GROUPS, {side.group_size}])\n"
            + group_scale(side, grid, "tl.min(grouped, axis=2)", "tl.max(grouped, axis=2)",
                          "tl.max(tl.abs(grouped), axis=2)")
            + grid.code(side, "code", side.scaled("grouped", "[:, :, None]")) + "\n"
            + f"{BODY}code_{c} = tl.reshape(code, [BLOCK_T, {side.chunk_pad}])\n"
            + f"{BODY}group = {side.chunk_groups(c)}\n"
            + _store_group_fields(side, [f"row[:, None] * {side.meta_width_expr} + group[None, :] * {fields} + {i}"
                                         for i in range(fields)], mask))


def spanning_groups(side: SideLayout, valid: str, grid: Grid) -> str:
    """Scale groups of every chunk: inside chunks (grouped_codes), or, where some head_dim makes them wider than a
    chunk, a branch per span (side.group_variants). HEAD_DIM is a constexpr, so each compiled kernel keeps one
    branch: groups inside chunks or groups over `span` consecutive chunks."""
    out = ""
    for span, branch in side.group_branches:
        if span == 1:
            body = "".join(grouped_codes(side, c, valid, grid) + "\n" for c in range(side.chunks))
        else:
            body = span_codes(side, span, valid, grid) + "\n"
        out += body if len(side.group_variants) == 1 else f"{BODY}{branch}\n" + indented(body)
    return out


def span_codes(side: SideLayout, span: int, valid: str, grid: Grid) -> str:
    """Groups of G channels over `span` consecutive chunks of G / span columns (split packing keeps a group's
    positions consecutive): each group's statistic combines its chunks' row reductions, then the chunks' codes use
    it and the group's metadata is stored once."""
    fields = len(side.metadata)
    out = (f"{BODY}# Each scale group of {side.group_size} channels covers {span} chunks: one statistic per row from "
           "all of them.\n")
    for g in range(side.chunks // span):
        chunks = range(g * span, g * span + span)
        out += f"{BODY}# group {g}: chunks {', '.join(map(str, chunks))}\n"
        out += group_scale(side, grid, side.reduce_chunks("tl.minimum", "tl.min(x_%d, axis=1)", span, g * span),
                           side.reduce_chunks("tl.maximum", "tl.max(x_%d, axis=1)", span, g * span),
                           side.reduce_chunks("tl.maximum", "tl.max(tl.abs(x_%d), axis=1)", span, g * span))
        out += "".join(grid.code(side, f"code_{c}", side.scaled(f"x_{c}", "[:, None]")) for c in chunks)
        offsets = [f"row * {side.meta_width_expr}" + (f" + {g * fields + i}" if g or i else "") for i in range(fields)]
        out += _store_group_fields(side, offsets, valid)
    return out


def scaled_tile(side: SideLayout, c: int, rows: str, valid: str, grid: Grid) -> str:
    """Flatten, decode: `tile` for chunk c's `code` in `rows` rows; scales per row are left to the caller."""
    out = grid.level(side) + "\n"
    if side.spans:
        return out + spanning_tile(side, c, rows, valid) + "\n"
    if side.group_size:
        return out + groups_inside_tile(side, c, rows, valid) + "\n"
    if side.per_channel:
        zero = " + zero" if side.scale_kind == "minmax" else ""
        return (out + f"{BODY}first = {cache_rows.group_first(side)}\n"
                + channel_fields(side, c, "first[:, None]", f"{side.name}_chunk[None, :]", f"{valid}[:, None]")
                + f"\n{BODY}tile = level * scale{zero}\n")
    return out + f"{BODY}tile = level\n"


def spanning_tile(side: SideLayout, c: int, rows: str, valid: str) -> str:
    """`tile` for chunk c where some head_dim makes scale groups wider than a chunk; HEAD_DIM is a constexpr, so
    each compiled kernel keeps one branch. A group over SPAN chunks gives chunk c the metadata of group c // SPAN:
    one value per row for all of the chunk's columns."""
    upper = side.name.upper()
    if not side.groups_inside:
        return (f"{BODY}# Chunk {c} lies in scale group {c} // {upper}_SPAN: one value per row for all its "
                "columns.\n" + span_tile(side, c, valid) + "\n")
    inside = ", ".join(map(str, side.head_dims_with_span(1)))
    spanning = ", ".join(map(str, side.spanning_head_dims))
    return (f"{BODY}if {upper}_GROUPS > 0:  # head_dim {inside}: groups inside the chunk\n"
            + indented(groups_inside_tile(side, c, rows, valid)) + "\n"
            + f"{BODY}else:  # head_dim {spanning}: chunk {c} lies in group {c} // {upper}_SPAN\n"
            + indented(span_tile(side, c, valid)) + "\n")


def groups_inside_tile(side: SideLayout, c: int, rows: str, valid: str) -> str:
    """`tile` for chunk c when its scale groups lie inside it: the chunk viewed as [rows, groups, group_size]."""
    name, fields = side.name, len(side.metadata)
    mask = _group_mask(side, valid)
    shifted = "tile + zero[:, :, None]" if side.scale_kind == "minmax" else "tile"
    return (f"{BODY}group = {side.chunk_groups(c)}\n"
            + "".join(f"{BODY}{field} = tl.load({name}_meta_ptr + row[:, None] * {side.meta_width_expr} + "
                      f"group[None, :] * {fields} + {i}, mask={mask}, other=0.0).to(tl.float32)\n"
                      for i, field in enumerate(side.metadata))
            + f"{BODY}tile = tl.reshape(level, [{rows}, {name.upper()}_GROUPS, {side.group_size}]) * "
              "scale[:, :, None]\n"
            + f"{BODY}tile = tl.reshape({shifted}, [{rows}, {side.chunk_pad}])")


def span_tile(side: SideLayout, c: int, valid: str) -> str:
    """`tile` for chunk c inside a scale group that spans <SIDE>_SPAN chunks: one value per row for all its
    columns."""
    name, fields = side.name, len(side.metadata)
    zero = " + zero[:, None]" if side.scale_kind == "minmax" else ""
    return ("".join(f"{BODY}{field} = tl.load({name}_meta_ptr + row * {side.meta_width_expr} + ({c} // "
                    f"{name.upper()}_SPAN) * {fields} + {i}, mask={valid}, other=0.0).to(tl.float32)\n"
                    for i, field in enumerate(side.metadata))
            + f"{BODY}tile = level * scale[:, None]{zero}")


def channel_fields(side: SideLayout, c: int, first: str, columns: str, mask: str, suffix: str = "") -> str:
    """Per-channel scales: a token group's head_dim x fields values lie spread over the group's slots,
    channel-major (channel 0's fields, then channel 1's), meta_width to a slot; the group's first slot is found
    from a row's slot, since groups never straddle a block. `<field>` for chunk c's `columns` from the group whose
    first row is `first`: value i = channel * fields + field lies in the slot i // meta_width after the first, at
    i % meta_width. With a `suffix`, `<side>_<field>_<c><suffix>` instead, kept in the cache's dtype (decode loads
    them a tile ahead)."""
    name, width, fields = side.name, side.meta_width_expr, len(side.metadata)
    out = ""
    for i, field in enumerate(side.metadata):
        target = f"{name}_{field}_{c}{suffix}" if suffix else field
        convert = "" if suffix else ".to(tl.float32)"
        out += (f"{BODY}index = ({c} * {name.upper()}_CHUNK + {columns}) * {fields} + {i}\n"
                f"{BODY}{target} = tl.load({name}_meta_ptr + ({first} + index // {width} * TOKEN_STRIDE) * {width} + "
                f"index % {width}, mask={mask}, other=0.0){convert}\n")
    return out


def tile_group(side: SideLayout) -> str:
    """Decode with per-channel scales and tiles inside one token group: the tile's scales are one [chunk] vector
    per field, so they factor out of the dot (scores: q * scale against the levels, plus <q, zero>) instead of
    multiplying every element. `<side>_first` is the group's first row, -1 when the tile has no valid token;
    group_metadata reads chunk c's fields from it."""
    return f"{BODY}{side.name}_first = tl.max(tl.where(valid, {cache_rows.group_first(side)}, -1), axis=0)"


def group_metadata(side: SideLayout, c: int) -> str:
    name = side.name
    return channel_fields(side, c, f"{name}_first", f"{name}_chunk", f"({name}_chunk >= 0) & ({name}_first >= 0)")
