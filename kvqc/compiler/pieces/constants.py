"""The module's constants per side, as an engine author reads them near its top: code bits, metadata fields, scale
groups, a channel split's outliers (`<SIDE>_...`), then the Lloyd-Max centroids and rotation signs per head_dim that
`_tables` builds the kernels' tables from (`_<SIDE>_CENTROIDS`, `_<SIDE>_SIGNS`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kvqc.compiler.layout import Layout


def side_constants(layout: Layout) -> str:
    """`<SIDE>_CODE_BITS`, `<SIDE>_METADATA`, `<SIDE>_GROUP_SIZE`, and for a split's outlier part the share of channels
    it takes and how they are chosen."""
    lines = []
    for side in layout.sides:
        name = side.name.upper()
        lines += [f"{name}_CODE_BITS = {side.code_bits}", f"{name}_METADATA = {side.metadata}"]
        if side.part:
            base = side.base.upper()
            lines.append(f"{base}_OUTLIERS = {side.outlier_fraction}  # share of head_dim's channels quantized apart, "
                         "with the codebook below")
            if side.outlier_select == "fixed":
                lines.append(f"{base}_OUTLIER_CHANNELS = {list(side.outlier_channels)}  # fixed by the scheme "
                             f"(head_dim {layout.head_dims[0]})")
            else:
                lines.append(f'{base}_OUTLIER_SELECT = "{side.outlier_select}"  # calibrate() takes each KV head\'s '
                             f"channels of largest {side.outlier_select}")
        if side.per_channel:
            lines.append(f"{name}_GROUP_SIZE = {side.token_group}  # tokens sharing one scale per channel (scale axis: "
                         "channel)")
        else:
            lines.append(f"{name}_GROUP_SIZE = {side.group_size}  # channels sharing one set of metadata; None: the "
                         "whole head")
    return "\n".join(lines) + "\n"


def side_tables(layout: Layout, floats: Callable[[tuple[float, ...]], str]) -> str:
    """Each Lloyd-Max side's centroids in N(0, 1) units and each signed rotation's sign flips, per head_dim (`floats`
    writes a tuple of floats as the module shows them)."""
    lines = []
    for side in layout.sides:
        name = side.name.upper()
        if side.lloyd_max:
            lines += ["", f"# {side.name.capitalize()} Lloyd-Max centroids in N(0, 1) units, per head_dim; the unit "
                      "vector's coordinates are these / sqrt(d).", f"_{name}_CENTROIDS = {{"]
            lines += [f"    {d}: {floats(side.centroids_std(d))}," for d in layout.head_dims] + ["}"]
        if side.signs(layout.head_dims[0]):
            lines += ["", f"# {side.name.capitalize()} random sign flips applied before the Hadamard transform (seed "
                      f"{side.rotation_seed}).", f"_{name}_SIGNS = {{"]
            lines += [f"    {d}: {side.signs(d)}," for d in layout.head_dims] + ["}"]
    return "".join(line + "\n" for line in lines)


def paley_table(matrices: dict[int, list[list[int]]]) -> str:
    """`_PALEY`: Paley's Hadamard matrices by order, a row of +-1 a line."""
    lines = ["_PALEY = {"]
    for order, rows in matrices.items():
        lines += [f"    {order}: ["] + [f"        [{', '.join(map(str, row))}]," for row in rows] + ["    ],"]
    return "\n".join(lines + ["}"])
