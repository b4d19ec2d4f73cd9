"""fp8 codebooks (codebook kind fp8, scale absmax): a code is the format's own bit pattern (e4m3 or e5m2) of the
value over its scale, max|y| mapping to FP8_TARGET. scales.py carries it (per token, per group of channels, per
channel) as it carries the uniform grid."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.codecs.scales import Grid
from kvqc.compiler.pieces.packing import BODY

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


class Fp8(Grid):
    def code(self, side: SideLayout, out: str, value: str) -> str:
        """The bit pattern of `value`, clamped to the format's largest finite value first."""
        mantissa_bits, bias, top = side.fp8
        return f"{BODY}{out} = _fp8_code(tl.minimum(tl.maximum({value}, -{top}), {top}), {mantissa_bits}, {bias})\n"

    def level(self, side: SideLayout) -> str:
        return (f"{BODY}# fp8 codes are the format's own bit patterns: the hardware converts them.\n"
                f"{BODY}level = code.to(tl.uint8).to({side.fp8_dtype}, bitcast=True).to(tl.float32)\n")

    def largest(self, side: SideLayout) -> str:
        return str(side.fp8_target)
