"""The uniform grid (codebook kind uniform): a code is an integer level, the value over its scale rounded and
clamped to the side's levels (offset by the middle code where the scale is symmetric). scales.py carries it onto
the values."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.codecs.scales import Grid
from kvqc.compiler.pieces.packing import BODY

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


class Uniform(Grid):
    def code(self, side: SideLayout, out: str, value: str) -> str:
        low, high = side.grid_levels
        offset = f" + {side.grid_offset}" if side.grid_offset else ""
        return f"{BODY}{out} = tl.minimum(tl.maximum(tl.floor({value} + 0.5).to(tl.int32), {low}), {high}){offset}\n"

    def level(self, side: SideLayout) -> str:
        return f"{BODY}level = {side.shifted(side.index_bits)}.to(tl.float32)\n"

    def largest(self, side: SideLayout) -> str:
        return str(side.level_top)
