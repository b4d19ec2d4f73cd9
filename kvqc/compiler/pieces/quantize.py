"""Fill: quantize one tile of K or V rows and write codes and metadata. The rows come in position order (the rotated
basis, rotate.py); the side's codec (codecs/) turns them into codes and scales, any residual stage adds its bit, and
packing.py packs and stores (a residual stage that `packs`, QJL's, packs and stores them itself). Lines at the
kernel body's indent."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces import codecs, packing, rotate
from kvqc.compiler.pieces.codecs import residuals
from kvqc.compiler.pieces.packing import BODY

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


def rows(side: SideLayout, valid: str) -> str:
    """The side's rows of the tile (the `valid` ones), from the input to the cache: codes, then per-row
    metadata."""
    stores = "".join(f"{BODY}tl.store({side.name}_meta_ptr + row * {len(side.metadata)} + {i}, "
                     f"{field}.to({side.name}_meta_ptr.dtype.element_ty), mask={valid})\n"
                     for i, field in enumerate(side.row_metadata))
    residual = residuals.of(side)
    packed = "" if residual and residual.packs else packing.pack_and_store(side, valid)  # else the residual stores
    return load_chunks(side, valid) + "\n" + codecs.of(side).encode(side, valid) + packed + "\n" + stores


def before_tiles(side: SideLayout) -> str:
    """What fill loads once per program, before its tile loop, for this side: a wide QJL projection's S."""
    residual = residuals.of(side)
    return residual.before_tiles(side) if residual else ""


def load_chunks(side: SideLayout, valid: str) -> str:
    """`x_<c>`: chunk c of the rows in position order (the rotated basis), float32 [rows, <SIDE>_CHUNK]."""
    if side.dense_matrix:
        return "\n" + rotate.rotate_in_by_matrix(side, valid)
    out = load_inputs(side, valid) + "\n"
    if side.hadamard_blocks:
        return out + rotate.rotate_in_blocks(side) + "\n"
    return out + "".join(f"{BODY}x_{c} = {side.name}_input_{c}.to(tl.float32)\n" for c in range(side.chunks))


def load_inputs(side: SideLayout, valid: str) -> str:
    """`<side>_input_<c>`: chunk c of the side's new rows as given (their dtype), all asked for before the first is
    used. (Asking for every side's rows at once, before any is quantized, measured slower: 190 registers instead of
    167 for turbo_k4v2's fill, one program fewer per SM.) The dense matrix path reads its rows inside its column
    loop instead."""
    out = ""
    for c in range(side.chunks):
        name, columns = f"{side.name}_input_{c}", side.chunk_columns(c)
        out += (f"{BODY}{name} = tl.load({side.input_rows} + {columns}[None, :], "
                f"mask={packing.column_mask(side, valid)}, other=0.0)\n")
        if side.centered:
            out += (f"{BODY}{name} = {name}.to(tl.float32) - tl.load({side.name}_mean_ptr + head * HEAD_DIM + "
                    f"{columns})[None, :]\n")
    return out
