"""Where decode and flatten meet a side's codes: the lookup operands a program loads once (SideLayout.lookup_loads),
the PTX helper's call that turns a tile's code bytes into fp16 tiles (runtime/ptx.py's or planes.py's
`_unpack_<kind>`), and the per-token metadata each tile loads, kept in the cache's dtype (a conversion there would
wait for the load)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


def load_luts(side: SideLayout) -> str:
    """The lookup operands of the side's PTX helper, before the tile loop."""
    return "".join(f"        {name} = {expr}\n" for name, expr in side.lookup_loads)


def fast_tiles(side: SideLayout, indent: int = 12) -> str:
    """`tile_0 .. tile_<chunks - 1>` (fp16) from the current tile's bytes, at the loop body's indent."""
    tiles = ", ".join(f"tile_{c}" for c in range(side.chunks))
    return f"{' ' * indent}{tiles} = _unpack_{side.fast_unpack}({side.name}_bytes_0_0{side.lookup_args})\n"


def load_metadata(side: SideLayout, suffix: str, rows: str, indent: int) -> str:
    """`<side>_<field><suffix>` for every per-row metadata field of the rows `row<rows>`. Scales per group of
    channels are read per chunk (dequantize.chunk_tile) or per group (scale_groups.py)."""
    name, width = side.name, len(side.metadata)
    return "".join(f"{' ' * indent}{name}_{field}{suffix} = tl.load({name}_meta_ptr + row{rows} * {width} + {i}, "
                   f"mask=valid{rows}, other=0.0)\n" for i, field in enumerate(side.row_metadata))
