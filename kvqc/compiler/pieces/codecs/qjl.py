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
from kvqc.compiler.pieces import packing
from kvqc.compiler.pieces.packing import BODY

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


class Qjl:
    def take(self, side: SideLayout, c: int, value: str, note: str = "") -> str:
        return residual_of(side, c, value, note)

    def square(self, side: SideLayout, c: int) -> str:
        return ""  # finish projects the whole row's residual at once

    packs = True  # finish packs and stores the codes

    def finish(self, side: SideLayout, valid: str) -> str:
        """|r|; the indices packed, and stored where no sign goes; then the sign of S r, one projected coordinate
        per position, or'ed into its plane's bytes above them, and those stored. Packing first keeps one int32 tile
        per byte range live through the products rather than every chunk's codes."""
        name = side.name
        sign_plane, _ = side.sign_plane
        out = (f"{BODY}residual_norm = tl.sqrt({side.sum_squares('residual')})\n"
               + packing.packed_codes(side) + packing.store_packed(side, valid, lambda p: p != sign_plane) +
               f"{BODY}# Only the sign of S r is kept, so the row is scaled to a largest magnitude of 1, where its "
               "fp16 halves keep\n"
               f"{BODY}# about 22 bits (_project_halves, on half the operand registers of tf32x3 dots).\n"
               f"{BODY}residual = {side.joined('residual')}\n"
               f"{BODY}residual = residual / tl.maximum(tl.max(tl.abs(residual), axis=1), 1e-30)[:, None]\n"
               f"{BODY}residual_hi, residual_lo = _halves(residual)\n")
        wide, by_chunk = self._wide(side), self._by_chunk(side)
        if set(side.qjl_wide_dims) == set(side.head_dims):
            out += wide
        elif not side.qjl_wide_dims:
            out += by_chunk
        else:
            out += (f"{BODY}if {name.upper()}_QJL_WIDE:\n" + packing.indented(wide).rstrip(" ")
                    + f"{BODY}else:\n" + packing.indented(by_chunk).rstrip(" "))
        return out + packing.store_packed(side, valid, lambda p: p == sign_plane)

    def before_tiles(self, side: SideLayout) -> str:
        """Fill's lines before its tile loop, where some head_dim projects the whole row at once (qjl_wide_dims):
        S's fp16 halves with their rows in the order that puts chunk c's position i at column i * chunks + c of
        S r, and each byte range's weights for the sign bits there (SideLayout.sign_weights)."""
        if not side.qjl_wide_dims:
            return ""
        name, pad, chunks = side.name, side.head_pad, side.chunks
        lines = [f"{name}_dim = tl.arange(0, {pad})",
                 f"{name}_chunk_of = {name}_dim % {chunks}",
                 f"{name}_s_row = {name}_chunk_of * {side.chunk_pad} + {name}_dim // {chunks}",
                 f"{name}_qjl_high = tl.load({name}_qjl_halves_ptr + {name}_s_row[:, None] * {pad} + "
                 f"{name}_dim[None, :])",
                 f"{name}_qjl_low = tl.load({name}_qjl_halves_ptr + {pad} * {pad} + {name}_s_row[:, None] * {pad} + "
                 f"{name}_dim[None, :])"]
        lines += [f"{name}_sign_{r} = {weight}" for r, weight in side.sign_weights(f"{name}_chunk_of")]
        out = (f"{BODY}# S's fp16 halves, loaded once a program: S r for a whole row in one projection, column "
               f"i * {chunks} + c chunk c's\n{BODY}# position i.\n")
        if set(side.qjl_wide_dims) == set(side.head_dims):
            return out + "".join(f"{BODY}{line}\n" for line in lines)
        wide = " ".join(map(str, side.qjl_wide_dims))
        return (out + f"{BODY}{name.upper()}_QJL_WIDE: tl.constexpr = {pad} <= {side.QJL_WIDE_WIDTH}  # head_dim "
                f"{wide}; wider halves pass the shared memory\n"
                f"{BODY}if {name.upper()}_QJL_WIDE:\n" + "".join(f"{BODY}    {line}\n" for line in lines))

    def _wide(self, side: SideLayout) -> str:
        name = side.name
        plane, _ = side.sign_plane
        out = (f"{BODY}positive = (_project_halves(residual_hi, residual_lo, {name}_qjl_high, {name}_qjl_low) >= 0)"
               ".to(tl.int32)\n")
        return out + "".join(f"{BODY}packed_{plane}_{r} |= _chunk_bits(positive, {name}_sign_{r}, {side.chunks})\n"
                             for r, _ in side.sign_weights(f"{name}_chunk_of"))

    def _by_chunk(self, side: SideLayout) -> str:
        """S r a chunk of positions at a time: S's rows for the chunk against the whole row (one operand for every
        product, few and deep products rather than many small ones)."""
        name, pad = side.name, side.head_pad
        out = f"{BODY}{name}_dim = tl.arange(0, {pad})\n"
        for c in range(side.chunks):
            first = f"{c} * {side.chunk_pad} + " if c else ""
            rows = (f"({first}{name}_chunk[:, None]) * {pad}" if c else f"{name}_chunk[:, None] * {pad}")
            plane, r, bit = side.sign_place(c)
            out += (f"{BODY}high = tl.load({name}_qjl_halves_ptr + {rows} + {name}_dim[None, :])\n"
                    f"{BODY}low = tl.load({name}_qjl_halves_ptr + {pad} * {pad} + {rows} + {name}_dim[None, :])\n"
                    f"{BODY}packed_{plane}_{r} |= (_project_halves(residual_hi, residual_lo, high, low) >= 0).to("
                    f"tl.int32) << {bit}\n")
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
        S's columns for chunk c (their fp16 halves), one dot of depth head_dim a chunk."""
        name, pad = side.name, side.head_pad
        out = f"{BODY}signs = ({side.joined('signs')}).to(tl.float16)\n{BODY}{name}_dim = tl.arange(0, {pad})\n"
        for c in range(side.chunks):
            columns = f"{name}_dim[:, None] * {pad} + {c} * {side.chunk_pad} + {name}_chunk[None, :]"
            out += (f"{BODY}high = tl.load({name}_qjl_halves_ptr + {columns})\n"
                    f"{BODY}low = tl.load({name}_qjl_halves_ptr + {pad} * {pad} + {columns})\n"
                    f"{BODY}tile_{c} += {name}_qjl_row[:, None] * _expand_signs(signs, high, low)\n")
        return out
