"""The sign residual (residual kind sign): one bit above the codebook's index, the sign of what the codebook left
(x - x_hat), and one value per row, the residual's RMS (`residual_rms`): a code reads back as its centroid or level
plus or minus the RMS (LMDeploy's nibble = idx3 | sign << 3).

Fill: take, square and align per chunk, then finish and unbias per row. Flatten and decode: tile. The bit goes into
the chunk's code and the square into the row's sum as soon as the residual exists: a residual kept to the end of the
row holds a tile of registers per chunk (turbo_k4v2's fill: 250 registers a thread, not 180)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.packing import BODY

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


def residual_of(side: SideLayout, c: int, value: str, note: str = "") -> str:
    """`residual_<c>` = `value`, zero on padding (where `note` follows it)."""
    if side.padded:
        value = f"tl.where({side.name}_in[None, :], {value}, 0.0){note}"
    return f"{BODY}residual_{c} = {value}\n"


class Sign:
    def take(self, side: SideLayout, c: int, value: str, note: str = "") -> str:
        """`residual_<c>`, and its sign in `code_<c>`."""
        return (residual_of(side, c, value, note)
                + f"{BODY}code_{c} = code_{c} | ((residual_{c} >= 0).to(tl.int32) << {side.level_bits})\n")

    def square(self, side: SideLayout, c: int) -> str:
        """The row's sum of squared residuals, chunk c's added."""
        return f"{BODY}residual_square {'=' if c == 0 else '+='} tl.sum(residual_{c} * residual_{c}, axis=1)\n"

    packs = False  # the caller packs and stores the codes

    def before_tiles(self, side: SideLayout) -> str:
        return ""

    def finish(self, side: SideLayout, valid: str) -> str:
        return f"{BODY}residual_rms = tl.sqrt(residual_square / {side.dim})\n"

    def align(self, side: SideLayout, c: int) -> str:
        """The unbiased scale's <u, u_hat> gains the residual's share: <u, sign(r)> times the RMS, which unbias
        adds."""
        return f"{BODY}align_sign {'=' if c == 0 else '+='} tl.sum(tl.where(residual_{c} >= 0, unit, -unit), axis=1)\n"

    def unbias(self, side: SideLayout) -> str:
        return f"{BODY}align += residual_rms * align_sign\n"

    def tile(self, side: SideLayout) -> str:
        """`tile` += the RMS with the residual's sign: in the tile's own units, so over the scale where it multiplies
        the tile afterwards (a norm-scaled tile holds unit-vector coordinates, as the RMS does)."""
        name = side.name
        out = f"{BODY}positive = (code & {side.levels}) != 0\n"
        if side.scale_kind == "norm":
            rms = f"{name}_residual_rms[:, None]"
            return out + f"{BODY}tile += tl.where(positive, {rms}, -{rms})\n"
        return (out + f"{BODY}# The residual's RMS in grid steps, since the row factor (the scale) multiplies the tile "
                "afterwards.\n"
                f"{BODY}step = tl.where({name}_scale > 0, {name}_residual_rms / tl.maximum({name}_scale, 1e-30), 0.0)\n"
                f"{BODY}tile += tl.where(positive, step[:, None], -step[:, None])\n")
