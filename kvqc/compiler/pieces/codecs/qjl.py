"""The QJL residual (residual kind qjl): one bit above the codebook's index at each position, the sign of S r for the
residual r = x - x_hat and the Gaussian projection S (`<side>_qjl`, in position order, pieces/tables.py), and one
value per row, |r| (`residual_norm`). E[sign(<s, r>) s] = sqrt(2/pi) r / |r| for a Gaussian row s, so
sqrt(pi/2) |r| / d * S^T sign(S r) is an unbiased estimate of r: decode applies it through the projected query,
flatten through S^T (correct).

Fill: take per chunk, then finish per row. Flatten and decode: tile (`signs`), row (the factor), correct."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvqc.compiler.pieces.codecs.sign import residual_of
from kvqc.compiler.pieces.packing import BODY

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


class Qjl:
    def take(self, side: SideLayout, c: int, value: str, note: str = "") -> str:
        return residual_of(side, c, value, note)

    def square(self, side: SideLayout, c: int) -> str:
        return ""  # finish projects the whole row's residual at once

    def finish(self, side: SideLayout) -> str:
        """|r|; and the sign of S r, one projected coordinate per position, above the index bits."""
        name, pad = side.name, side.head_pad
        out = (f"{BODY}residual_norm = tl.sqrt({side.sum_squares('residual')})\n"
               f"{BODY}# The sign of S r, one projected coordinate per position: the row's residual, its chunks side "
               "by side, against\n"
               f"{BODY}# {name.upper()}_CHUNK rows of S a dot (one operand for every dot, few and deep dots rather "
               "than many small ones).\n"
               f"{BODY}# Only the sign is kept, so the row is scaled to a largest magnitude of 1, where its fp16 "
               "halves keep about 22\n"
               f"{BODY}# bits (_project_halves, on half the operand registers of tf32x3 dots, which spill here).\n"
               f"{BODY}residual = {side.joined('residual')}\n"
               f"{BODY}residual = residual / tl.maximum(tl.max(tl.abs(residual), axis=1), 1e-30)[:, None]\n"
               f"{BODY}residual_hi, residual_lo = _halves(residual)\n"
               f"{BODY}{name}_dim = tl.arange(0, {pad})\n")
        for c in range(side.chunks):
            out += (f"{BODY}qjl = tl.load({name}_qjl_ptr + ({c} * {side.chunk_pad} + {name}_chunk[:, None]) * {pad} + "
                    f"{name}_dim[None, :])\n"
                    f"{BODY}code_{c} = code_{c} | ((_project_halves(residual_hi, residual_lo, qjl) >= 0).to(tl.int32) "
                    f"<< {side.level_bits})\n")
        return out

    def tile(self, side: SideLayout) -> str:
        """`signs` (+-1) of the current `code`: the tile itself is the codebook's alone."""
        return f"{BODY}positive = (code & {side.levels}) != 0\n{BODY}signs = tl.where(positive, 1.0, -1.0)\n"

    def row(self, side: SideLayout) -> str:
        """The per-row factor of S^T signs, from the row's norm (or scale) and residual norm."""
        name = side.name
        norm = f"{name}_norm * " if side.scale_kind == "norm" else ""
        return (f"{BODY}# E[sign(<s, r>) s] = sqrt(2/pi) r / |r| for a Gaussian row s: this factor makes the estimate "
                "unbiased.\n"
                f"{BODY}{name}_qjl_row = {norm}{name}_residual_norm * {math.sqrt(math.pi / 2):.17g} / {side.dim}")

    def correct(self, side: SideLayout) -> str:
        """Flatten: `tile_<c>` += qjl_row * (S^T signs) over chunk c: every chunk's `signs_<j>` side by side against
        S's columns for chunk c, one dot of depth head_dim a chunk."""
        name, pad = side.name, side.head_pad
        out = f"{BODY}signs = ({side.joined('signs')}).to(tl.float16)\n{BODY}{name}_dim = tl.arange(0, {pad})\n"
        for c in range(side.chunks):
            out += (f"{BODY}qjl = tl.load({name}_qjl_ptr + {name}_dim[:, None] * {pad} + {c} * {side.chunk_pad} + "
                    f"{name}_chunk[None, :])\n"
                    f"{BODY}tile_{c} += {name}_qjl_row[:, None] * _expand_signs(signs, qjl)\n")
        return out
