"""The decode path each side takes, as the plan says it (Layout: SideLayout.fast_unpack), against the generated
kernel: what `kvqc explain` and a module's DECODE_UNPACK promise is what decode runs.
"""

import inspect
import re

import pytest
from conftest import ALL_SCHEMES, DEVICE, ROOT, generated

from kvqc.compiler.layout import plan
from kvqc.compiler.spec import load_scheme


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_decode_takes_the_unpacking_its_plan_promises(name):
    """The plan's word on each side's decode path (DECODE_UNPACK, `kvqc explain`) is what the kernel does: a side
    planned for PTX unpacking has its decode tiles made by that helper, behind FAST_UNPACK, which compiled CUDA turns
    on; a portable side has no such call. A template that dropped a fast path would fail here, not in a benchmark."""
    m = generated(name)
    layout = plan(load_scheme(ROOT / "kvqc" / "schemes" / f"{name}.yaml"))
    assert m.DECODE_UNPACK == {side.name: side.fast_unpack or "portable" for side in layout.sides}
    source = inspect.getsource(m._decode_kernel.fn)
    for side, kind in m.DECODE_UNPACK.items():
        # One call per tile (or per head_dim's branch, or per pair of chunks: `_pairs`), all of the planned kind.
        calls = re.findall(rf"= _unpack_(\w+?)(?:_words|_pairs)?\(\s*{side}_(?:bytes_0_0|words|pair_0)\b", source)
        assert sorted(set(calls)) == ([kind] if kind != "portable" else []), (side, calls)
    for side in layout.sides:
        if side.qjl and side.fast_unpack:
            # A QJL side's helper returns the sign tile of each chunk (or pair of chunks) too, and the projected
            # query's dot takes it.
            helper = rf"tile, signs = _unpack_{side.fast_unpack}(?:_pairs)?\(\s*{side.name}_(?:bytes|pair)_0"
            made = re.findall(helper, source)
            dots = re.findall(rf"dots_qjl \+?= tl\.dot\(query_{side.tag}qjl_p?\d+, tl\.trans\(signs\)\)", source)
            tiles = side.chunks // 2 if side.pairs else side.chunks
            assert len(made) == len(dots) == tiles, (side.name, made, dots)
    if any(kind != "portable" for kind in m.DECODE_UNPACK.values()):
        assert "if FAST_UNPACK:" in source
        assert m._FAST_UNPACK == (DEVICE.type == "cuda")


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_fill_takes_the_cell_search_its_plan_promises(name):
    """The plan's cell search for each side (SideLayout.cell_helper, kernels/cell.py.j2) is the helper the fill
    kernel calls for it, every call passing FAST_CELL, which the helper branches on (PTX or Triton compares); a side
    the plan gives none calls no helper, and a layout without one leaves FAST_CELL unread."""
    m = generated(name)
    layout = plan(load_scheme(ROOT / "kvqc" / "schemes" / f"{name}.yaml"))
    source = inspect.getsource(m._fill_kernel.fn)
    for side in layout.sides:
        calls = re.findall(rf"= (_symmetric_cell_\w+)\(\s*unit,\s*{side.name}_b\d[^()]*?(\w+),?\s*\)", source)
        helpers = {helper for helper, _ in calls}
        assert helpers == ({side.cell_helper} if side.cell_helper else set()), (side.name, calls)
        assert all(last == "FAST_CELL" for _, last in calls), (side.name, calls)
        if side.cell_helper:
            assert "if FAST_CELL:" in inspect.getsource(getattr(m, side.cell_helper).fn)
    assert ("FAST_CELL)" in source or "FAST_CELL,\n" in source) == layout.any_fast_cell


@pytest.mark.parametrize("name", ["turbo_outlier_2p5", "turbo_k4v2_d80_96"])
def test_padded_chunks_take_ptx_with_their_padding_masked(name):
    """Chunks padded to a power of two take the PTX helpers (SideLayout.fast_unpack) because each code load masks
    the padding columns to byte 0: what that decodes to meets K's zero query columns and V's dropped padding, and
    the load never reads past the row (or the tensor's end)."""
    m = generated(name)
    layout = plan(load_scheme(ROOT / "kvqc" / "schemes" / f"{name}.yaml"))
    source = inspect.getsource(m._decode_kernel.fn)
    padded = [side for side in layout.sides if side.padded]
    assert padded and all(m.DECODE_UNPACK[side.name] != "portable" for side in padded)
    for side in padded:
        masks = re.findall(rf"{side.name}_bytes_\d+_\d+ = tl\.load\(.*?mask=(.*?),\s*other=0", source, re.S)
        assert masks and all(f"{side.name}_in[None, :]" in mask for mask in masks), (side.name, masks)
