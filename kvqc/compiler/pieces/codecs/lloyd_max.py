"""Lloyd-Max codebooks (codebook kind lloyd_max, scale norm): a code indexes a cell of the unit vector's coordinates,
with its centroid and boundaries in the tables `<side>_centroids` and `<side>_boundaries` (pieces/tables.py). A
codebook of up to 16 entries is loaded into scalars once per program (`<side>_c<i>`, `<side>_b<i>`) and read with a
tree of selects on the index bits; larger ones are gathered from the (cached) table. The norm is the codec's own
scale: fill divides it out and decode multiplies it back into scores and probabilities, outside the tile."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.codecs import residuals
from kvqc.compiler.pieces.packing import BODY

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


def load_scalars(side: SideLayout, prefix: str, table: str, indices: tuple[int, ...]) -> str:
    """`<side>_<prefix><i>` = entry i of the table `<side>_<table>` for each i in `indices`."""
    return "".join(f"{BODY}{side.name}_{prefix}{i} = tl.load({side.name}_{table}_ptr + {i})\n" for i in indices)


def lookup(side: SideLayout, out: str, index: str) -> str:
    """`out` = centroid[index]: a select tree over the scalars, or a load from the table."""
    if side.scalar_codebook:
        return f"{BODY}{out} = _codebook_{side.levels}({index}, {side.centroid_names})\n"
    return f"{BODY}{out} = tl.load({side.name}_centroids_ptr + ({index} & {side.levels - 1}))\n"


class LloydMax:
    def load_tables(self, side: SideLayout) -> str:
        """The scalars flatten and decode read, once per program."""
        return load_scalars(side, "c", "centroids", side.centroid_scalars)

    def tile(self, side: SideLayout, c: int, rows: str, valid: str) -> str:
        """`tile` = the centroid of `code`, the row's norm left outside."""
        return lookup(side, "tile", "code") + "\n"

    def encode(self, side: SideLayout, valid: str) -> str:
        """Fill: `code_<c>` from `x_<c>` (float32 chunks of the rows in position order) with the residual stage's bit
        above it (QJL's `finish` instead packs and stores the codes, its signs or'ed into the packed bytes), and
        `norm`: the row's L2 norm, divided by <u, u_hat> where the scale is unbiased (DRIVE/EDEN)."""
        residual = residuals.of(side)
        out = (f"{BODY}norm = tl.sqrt({side.sum_squares('x')})\n"
               f"{BODY}# A zero row stores norm 0 and reads back as zeros, never NaN.\n"
               f"{BODY}inverse = 1.0 / tl.maximum(norm, 1e-30)\n"
               + load_scalars(side, "b", "boundaries", side.fill_boundaries) + "\n"
               + load_scalars(side, "c", "centroids", side.fill_centroids) + "\n")
        for c in range(side.chunks):
            out += f"{BODY}unit = x_{c} * inverse[:, None]\n"
            rest = residual.take(side, c, "unit - centroid", "  # padding has no residual") if residual else ""
            if side.fast_cell:
                # The "sign" helper returns the residual and sets its sign's bit in the code; the others leave
                # both to the lines after.
                out += f"{BODY}{fast_cell_call(side, f'code_{c}', 'unit', f'residual_{c}')}\n"
                if side.fast_cell == "sign":
                    if side.padded:
                        out += (f"{BODY}residual_{c} = tl.where({side.name}_in[None, :], residual_{c}, 0.0)  # padding "
                                "has no residual\n")
                else:
                    out += rest
            else:
                out += cell(side, f"code_{c}", "unit", c == 0) + rest
            if residual:
                out += residual.square(side, c)
            if side.unbiased:
                unit = "tl.abs(unit)" if side.centroid_magnitude else "unit"
                out += f"{BODY}align {'=' if c == 0 else '+='} tl.sum({unit} * centroid, axis=1)\n"
                if residual:
                    out += residual.align(side, c)
        if residual:
            out += residual.finish(side, valid) + (residual.unbias(side) if side.unbiased else "")
        if side.unbiased:
            out += (f"{BODY}# DRIVE/EDEN: |y| / <u, u_hat> makes <y, y_hat> = |y|^2, so <q, y_hat> is unbiased over "
                    "the rotation.\n"
                    f"{BODY}norm = tl.where(align > 1e-30, norm / tl.maximum(align, 1e-30), norm)\n")
        return out


def cell(side: SideLayout, out: str, value: str, comment: bool) -> str:
    """`out` = the cell of `value`, and `centroid` its centroid where fill carries one (the plan's cell_search)."""
    if side.symmetric:
        return symmetric_cell(side, out, value, comment)
    return sorted_cell(side, out, value) + "\n" + (lookup(side, "centroid", out) + "\n" if side.with_centroid else "")


def symmetric_cell(side: SideLayout, out: str, value: str, comment: bool) -> str:
    """`out` = the Lloyd-Max cell of `value` and `centroid` its centroid (where carried; its magnitude alone unless
    `signed`), for a symmetric codebook: |value|'s level among the positive boundaries is the cell's distance from
    the middle, and the sign picks the half. A value exactly on a negative boundary lands one cell up from where
    the sorted search puts it, inside the margin the tests allow. A scanning search ("scan") is fill's cell helper
    instead (pieces/cells.py)."""
    c1 = f"{side.name}_c1"
    if side.cell_search == "sign":
        lines = [f"upper = {value} > 0", f"{out} = upper.to(tl.int32)"]
        if side.with_centroid:
            lines.append("centroid = " + (f"tl.where(upper, {c1}, -{c1})" if side.signed
                                          else f"tl.full({value}.shape, {c1}, tl.float32)"))
        return "".join(f"{BODY}{line}\n" for line in lines)
    half, probes = side.half, side.probes
    lines = [f"magnitude = tl.abs({value})"]
    if comment:
        lines += [("# The magnitude's level by binary search: probe k halves the levels left, its threshold chosen by "
                   "the probes"),
                  f"# before it ({probes} compares and a select tree, not {half - 1} compares and a chain of selects)."]
    lines += [f"probe_{k} = magnitude > {side.probe_threshold(k)}" for k in range(probes)]
    flips = "".join(f" ^ tl.where(probe_{k}, {half // 2 ** (k + 1)}, 0)" for k in range(probes))
    lines += [f"upper = {value} > 0", "# upper: half + level; lower: half - 1 - level, i.e. level's bits flipped.",
              f"{out} = tl.where(upper, {half}, {half - 1}){flips}"]
    if side.with_centroid:
        lines.append(f"centroid = {side.probe_centroid}")
        if side.signed:
            lines.append("centroid = tl.where(upper, centroid, -centroid)")
    return "".join(f"{BODY}{line}\n" for line in lines)


def sorted_cell(side: SideLayout, out: str, value: str) -> str:
    """`out` = number of boundaries strictly below `value` (the Lloyd-Max cell), in any codebook."""
    name = side.name
    if side.cell_search == "compare":
        lines = [f"{out} = ({value} > {name}_b0).to(tl.int32)"]
        lines += [f"{out} += ({value} > {name}_b{i}).to(tl.int32)" for i in range(1, side.levels - 1)]
    else:
        bits = side.level_bits
        lines = [f"# Binary search over the sorted boundaries: {bits} probes, not {side.levels - 1} compares.",
                 f"{out} = tl.zeros({value}.shape, tl.int32)"]
        for level in range(bits):
            lines += [f"probe = {out} + {2 ** (bits - 1 - level)}",
                      f"{out} = tl.where({value} > tl.load({name}_boundaries_ptr + probe - 1), probe, {out})"]
    return "".join(f"{BODY}{line}\n" for line in lines)


def fast_cell_call(side: SideLayout, out: str, value: str, residual: str) -> str:
    """`out` and what the cell helper of pieces/cells.py returns beside it (`centroid`, or `residual` for "sign")."""
    beside = {"sign": f", {residual}", "code": ""}.get(side.fast_cell, ", centroid")
    return f"{out}{beside} = {side.cell_helper}({value}{side.cell_scalars}, FAST_CELL)"
