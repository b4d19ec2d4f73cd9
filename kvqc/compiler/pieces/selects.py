"""The portable path's codebook lookups: `_codebook_<levels>(index, c0, ..., c<levels - 1>)`, a Triton helper per
codebook size some side selects from (Layout.codebook_sizes), that picks entry `index & (levels - 1)` by a tree of
selects on the index bits, least significant first, all in registers."""

from __future__ import annotations


def codebook_select(levels: int) -> str:
    """The @triton.jit source of `_codebook_<levels>`."""
    entries = ", ".join(f"c{i}" for i in range(levels))
    lines = ["@triton.jit", f"def _codebook_{levels}(index, {entries}):",
             f'    """Entry index & {levels - 1} of a codebook of {levels} scalars: a tree of selects on the index '
             "bits, least significant",
             '    first, all in registers (a gather from the table would be a load per value)."""']
    depth = (levels - 1).bit_length()
    for level in range(depth):
        entry = "c{}" if level == 0 else f"lut_{level - 1}_{{}}"
        for j in range(levels // 2 ** (level + 1)):
            lines.append(f"    lut_{level}_{j} = tl.where((index & {2 ** level}) != 0, {entry.format(2 * j + 1)}, "
                         f"{entry.format(2 * j)})")
    lines.append(f"    return lut_{depth - 1}_0")
    return "\n".join(lines)
