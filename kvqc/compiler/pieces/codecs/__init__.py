"""One codec per code format: how fill turns a side's rows into codes (`encode`), how flatten and decode turn a
chunk's codes back into a `tile` (`tile`) and which scalars they read once per program (`load_tables`).

- lloyd_max.py: Lloyd-Max codebooks on the unit vector, with the norm as their own scale.
- uniform.py, fp8.py: grids (a scaled value's `code`, a code's `level`, the `largest` level), which scales.py's
  scales per token, per group of channels or per channel carry onto the values.
- sign.py, qjl.py: the residual stages, a bit above the index and a value per row (residuals.py names them).

A new codebook kind is a file here with a class of these methods, its name in CODECS, and the spec's field."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.codecs.fp8 import Fp8
from kvqc.compiler.pieces.codecs.lloyd_max import LloydMax
from kvqc.compiler.pieces.codecs.scales import Grid
from kvqc.compiler.pieces.codecs.uniform import Uniform

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout

CODECS: dict[str, Grid | LloydMax] = {"uniform": Uniform(), "fp8": Fp8(), "lloyd_max": LloydMax()}


def of(side: SideLayout) -> Grid | LloydMax:
    """The codec of the side's codebook kind."""
    return CODECS[side.codec]


def grid(side: SideLayout) -> Grid:
    """The side's grid, for the pieces that work on levels (per-channel scales, window groups, decode's
    scale-outside dots): only uniform and fp8 codebooks have one."""
    codec = of(side)
    if not isinstance(codec, Grid):
        raise TypeError(f"kvqc: {side.name}'s {side.codec} codebook has no grid of levels")  # a plan bug
    return codec
