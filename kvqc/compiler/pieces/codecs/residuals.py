"""The residual stage a side's codes carry above the codebook's index (spec's residual kind), by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.codecs.qjl import Qjl
from kvqc.compiler.pieces.codecs.sign import Sign

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout

SIGN, QJL = Sign(), Qjl()
RESIDUALS = {"sign": SIGN, "qjl": QJL}


def of(side: SideLayout) -> Sign | Qjl | None:
    """The side's residual stage, None where it has none."""
    return RESIDUALS.get(side.residual)
