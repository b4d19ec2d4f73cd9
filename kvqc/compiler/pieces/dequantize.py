"""Read K or V rows back (flatten, decode), one chunk at a time, leaving the per-row factors outside the tile so
decode can apply them to scores and probabilities instead of to every element:

    value[row, p] = row_factor[row] * tile_<c>[row, p'] (+ row_shift[row])   (+ qjl_row[row] * S^T signs)

row_factor is the norm or the scale, row_shift an affine zero (SideLayout.row_factor / row_shift); decode's dots take
codes centred on code_mid (a tile less level_mid) and a shift per token adds the rest back, the zero too
(SideLayout.decode_shift, shift_expr). Scales shared by groups of channels vary along the row, so those tiles come
back fully dequantized (no row factor). `tile` is in position order (the rotated basis). A QJL residual leaves
`signs` (+-1) per chunk: decode applies it through the projected query, flatten through the projection's transpose.

The side's codec (codecs/) makes `tile` from `code`, and any residual stage adds its share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces import codecs, packing
from kvqc.compiler.pieces.codecs import residuals
from kvqc.compiler.pieces.packing import BODY, indented

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


def load_rows(side: SideLayout, valid: str, raw: bool = False) -> str:
    """Flatten: the rows' plane bytes (as loaded where `raw`, for the PTX helpers), per-row metadata in float32,
    and QJL's per-row factor."""
    name = side.name
    out = packing.load_planes(side, valid, raw) + "\n"
    out += "".join(f"{BODY}{name}_{field} = tl.load({name}_meta_ptr + row * {len(side.metadata)} + {i}, "
                   f"mask={valid}, other=0.0).to(tl.float32)\n" for i, field in enumerate(side.row_metadata))
    return out + (residuals.QJL.row(side) + "\n" if side.qjl else "")


def chunk_tile(side: SideLayout, c: int, rows: str, valid: str) -> str:
    """`tile` (and `signs` for QJL) for chunk c of `rows` rows; without scale groups, the caller multiplies by
    `<side>_<row_factor>` and adds `<side>_<row_shift>`."""
    residual = residuals.of(side)
    return (packing.chunk_code(side, c) + "\n" + codecs.of(side).tile(side, c, rows, valid)
            + (residual.tile(side) if residual else ""))


def load_tables(side: SideLayout) -> str:
    """The scalars a side's codebook is read from, loaded once per program."""
    return codecs.of(side).load_tables(side)


def convert_metadata(side: SideLayout) -> str:
    """Decode: the current tile's metadata in float32 (and QJL's per-row factor, as load_rows makes it), in the
    tile loop."""
    name = side.name
    out = "".join(f"        {name}_{field} = {name}_{field}_raw.to(tl.float32)\n" for field in side.row_metadata)
    if side.decode_shift:
        out += (f"        # The dots take code - {side.code_mid}, so the tensor cores' accumulator stays near the "
                "output's size; the shift adds it back.\n"
                f"        {name}_shift = {side.shift_expr}\n")
    if side.qjl:
        out += indented(residuals.QJL.row(side)) + "\n"
    return out
