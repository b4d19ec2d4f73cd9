"""flatten's output for one side, as `_flatten_kernel` writes it after the side's tiles (templates/kernels/flatten.py.j2
places it, under the loop's indent): back to the input basis by the dense matrix on the tiles' fp16 halves, IN_BLOCK
output columns at a time, or chunk by chunk where the tiles are in the input basis already; a window scheme's recent
tokens from the ring instead of their codes, a centered side's mean added back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.codecs import residuals
from kvqc.compiler.pieces.dequantize import chunk_tile
from kvqc.compiler.pieces.packing import BODY, column_mask
from kvqc.compiler.pieces.rotate import row_halves

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


def tiles(side: SideLayout) -> str:
    """`tile_<c>` for every chunk of a side: codebook values, times the row factor unless it follows the matrix (and
    `signs_<c>`, a QJL residual's signs)."""
    factor = (f" * {side.name}_{side.row_factor}[:, None]" if side.row_factor and not side.factor_after_matrix
              else "")
    shift = f" + {side.name}_{side.row_shift}[:, None]" if side.row_shift else ""
    out = ""
    for c in range(side.chunks):
        out += chunk_tile(side, c, "BLOCK_T", "valid") + f"\n{BODY}tile_{c} = tile{factor}{shift}\n\n"
        out += f"{BODY}signs_{c} = signs\n" if side.qjl else ""
    return out


def correct(side: SideLayout) -> str:
    """A QJL residual's share, S^T signs times the row's factor, added to the tiles; nothing for other sides."""
    return residuals.QJL.correct(side) if side.qjl else ""


def by_matrix(side: SideLayout, window: bool) -> str:
    """out = sum over chunks of tile_c @ matrix[chunk c rows], stored IN_BLOCK columns at a time."""
    name, base, out_type = side.name, side.base, f"{side.base}_out_ptr.dtype.element_ty"
    factor = f" * {name}_{side.row_factor}" if side.factor_after_matrix else ""
    text = (f"{BODY}# Back to the input basis: out = sum over chunks of tile_c @ matrix[chunk c rows], on the tiles' "
            "fp16 halves\n"
            f"{BODY}# after dividing each row by its largest magnitude (pieces/rotate.py), IN_BLOCK output columns at "
            "a time.\n"
            f"{BODY}# An fp16 or bf16 output takes the hi halves alone (pieces/rotate.py).\n"
            f"{row_halves('tile', side)}{BODY}largest = largest * {side.matrix_unit}{factor}\n"
            f"{BODY}for k in tl.static_range(0, {side.head_pad}, IN_BLOCK):\n")
    for c in range(side.chunks):
        more = "" if c == 0 else ", out"
        text += "".join(f"{BODY * 2}{line}\n" for line in [
            f"matrix = tl.load({side.matrix_block(c)})", f"if {out_type} == tl.float32:",
            f"    out = tl.dot(lo_{c}, matrix, tl.dot(hi_{c}, matrix{more}))", "else:",
            f"    out = tl.dot(hi_{c}, matrix{more})"])
    text += f"{BODY * 2}out = out * largest[:, None]\n"
    if window:
        columns = " & (k + dim[None, :] < HEAD_DIM)" if side.padded else ""
        ring = f"{name}_window_ptr + ring_row[:, None] * HEAD_DIM + k + dim[None, :]"
        text += (f"{BODY * 2}out = tl.where(recent[:, None], tl.load({ring}, mask=recent[:, None]{columns}, "
                 "other=0.0).to(tl.float32), out)\n")
    return text + (f"{BODY * 2}tl.store({base}_out_ptr + out_at[:, None]{side.offset_term} + k + dim[None, :], "
                   f"out.to({out_type}), mask=written[:, None]{side.block_mask})\n")


def by_chunks(side: SideLayout, window: bool) -> str:
    """Each chunk's tile stored in its columns."""
    name, base, text = side.name, side.base, ""
    for c in range(side.chunks):
        columns = side.chunk_columns(c)
        if side.centered:
            text += f"{BODY}tile_{c} = tile_{c} + tl.load({name}_mean_ptr + head * HEAD_DIM + {columns})[None, :]\n"
        if window:
            text += (f"{BODY}tile_{c} = tl.where(recent[:, None], tl.load({name}_window_ptr + ring_row[:, None] * "
                     f"HEAD_DIM + {columns}[None, :], mask={column_mask(side, 'recent')}, other=0.0).to(tl.float32), "
                     f"tile_{c})\n")
        text += (f"{BODY}tl.store(\n"
                 f"{BODY * 2}{base}_out_ptr + out_at[:, None]{side.offset_term} + {columns}[None, :],\n"
                 f"{BODY * 2}tile_{c}.to({base}_out_ptr.dtype.element_ty),\n"
                 f"{BODY * 2}mask={column_mask(side, 'written')},\n{BODY})\n")
    return text
