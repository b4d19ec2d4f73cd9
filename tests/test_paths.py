"""The decode path each side takes, as the plan says it (Layout: SideLayout.fast_unpack), against the generated
kernel: what `kvqc explain` and a module's DECODE_UNPACK promise is what decode runs.
"""

import inspect
import json
import re

import pytest
from conftest import ALL_SCHEMES, DEVICE, ROOT, generated

from kvqc.compiler import codegen
from kvqc.compiler.layout import GATHER_BITS, plan
from kvqc.compiler.spec import load_scheme, scheme_from_dict


TEST_SCHEMES = sorted(str(p) for p in (ROOT / "tests" / "schemes").rglob("*.yaml"))


def scheme_file(name: str) -> str:
    return name if name.endswith(".yaml") else str(ROOT / "kvqc" / "schemes" / f"{name}.yaml")


@pytest.mark.parametrize("name", ALL_SCHEMES + TEST_SCHEMES, ids=lambda n: n.rsplit("/", 1)[-1].removesuffix(".yaml"))
def test_decode_takes_the_unpacking_its_plan_promises(name):
    """The plan's word on each side's decode path (DECODE_UNPACK, `kvqc explain`) is what the kernel does: a side
    planned for PTX unpacking has its decode tiles made by that helper, behind FAST_UNPACK, which compiled CUDA turns
    on; a portable side has no such call. A template that dropped a fast path would fail here, not in a benchmark."""
    m = generated(name)
    layout = plan(load_scheme(scheme_file(name)))
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


QJL_SCHEMES = [name for name in ALL_SCHEMES + TEST_SCHEMES
               if any(side.qjl for side in plan(load_scheme(scheme_file(name))).sides)]


@pytest.mark.parametrize("name", QJL_SCHEMES, ids=lambda n: n.rsplit("/", 1)[-1].removesuffix(".yaml"))
def test_fill_projects_a_qjl_residual_as_its_plan_promises(name):
    """Fill reads S's fp16 halves, never the float32 S, and projects as SideLayout.qjl_wide_dims says (`kvqc explain`
    says it too): where some head_dim is wide, S's halves are loaded once, before the tile loop, and each byte range
    of the sign plane takes its bits from the whole row's product (`_chunk_bits`); where some head_dim is not, one
    product a chunk, and a looping fill takes one stage there (one tile a program)."""
    m = generated(name)
    layout = plan(load_scheme(scheme_file(name)))
    source = inspect.getsource(m._fill_kernel.fn)
    loop = source.find("for i in range(tiles):")
    assert (loop >= 0) == layout.fill_loops
    for side in layout.sides:
        if not side.qjl:
            continue
        assert f"{side.name}_qjl_ptr" not in source and f"{side.name}_qjl_halves_ptr" in source
        plane, _ = side.sign_plane
        ranges = len(side.sign_weights("c"))
        wide = re.findall(rf"packed_{plane}_\d+ \|= _chunk_bits\(positive, {side.name}_sign_\d+, {side.chunks}\)",
                          source)
        by_chunk = re.findall(rf"packed_{plane}_\d+ \|= \(_project_halves\(residual_hi, residual_lo, high, low\)",
                              source)
        assert len(wide) == (ranges if side.qjl_wide_dims else 0), (side.name, wide)
        assert len(by_chunk) == (side.chunks if set(side.qjl_wide_dims) != set(side.head_dims) else 0), side.name
        if side.qjl_wide_dims:
            high = source.index(f"{side.name}_qjl_high = tl.load(")
            assert loop < 0 or high < loop, f"{side.name}: S is loaded inside the tile loop"
        for d in side.head_dims:
            if layout.fill_loops and d not in side.qjl_wide_dims:
                assert m._LOOP_STAGES[d] == 1, (side.name, d)


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


def lloyd_max(bits: int, residual: str | None) -> dict:
    side = {"rotation": "hadamard", "scale": "norm", "codebook": {"kind": "lloyd_max", "bits": bits, "law": "gaussian"}}
    return side | ({"residual": {"kind": residual, "seed": 3} if residual == "qjl" else residual} if residual else {})


LLOYD_MAX = [(bits, residual) for bits in range(1, 9) for residual in (None, "sign", "qjl")
             if bits + bool(residual) <= 8]


@pytest.mark.parametrize("bits, residual", LLOYD_MAX, ids=[f"{b}{r or ''}" for b, r in LLOYD_MAX])
def test_every_lloyd_max_index_width_takes_ptx(bits, residual):
    """Every Lloyd-Max codebook the language accepts (1 to 8 index bits, with a sign or QJL bit above on K, a sign
    on V) decodes through a PTX helper, not the portable select trees or a gather through Triton's loads: the plan
    says so, the kernel calls that helper on each side, and the helper looks its entries up as the plan has it: by
    prmt over 8-entry groups and a select per further bit below GATHER_BITS, from it on by one fp16 load per code from
    the codebook's copy in shared memory, made once a program before the tile loop."""
    value_residual = residual if residual != "qjl" else None
    data = {"version": 1, "name": "lloyd_width", "head_dims": [128],
            "key": lloyd_max(bits, residual), "value": lloyd_max(bits, value_residual)}
    layout = plan(scheme_from_dict(data))
    source = codegen.render(scheme_from_dict(data))
    for side in layout.sides:
        kind = side.fast_unpack
        assert kind and not side.portable_reason, (side.name, kind)
        assert re.search(rf"= _unpack_{kind}(_pairs)?\(\s*{side.name}_(bytes|pair)_0", source), (side.name, kind)
        if not side.plane_unpack:
            continue  # a hand-written helper (runtime/ptx.py): test_runtime.py holds the module to it
        helper = re.search(rf"def _unpack_{kind}(_pairs)?\(.*?\n    \)\n", source, re.S).group(0)
        gathers = bits >= GATHER_BITS and kind != "lut1"
        assert helper.count("ld.shared.b16") == (4 if gathers else 0), (side.name, kind)
        assert "ld.global" not in helper, (side.name, kind)
        assert (f'tables["{side.name}_entries"]' in source) == gathers
        staged = f"{side.name}_entries = _{side.name}_entries_to_shared({side.name}_entries_ptr)"
        assert (staged in source) == gathers, (side.name, kind)
        groups = 2 ** bits // 8 if not gathers else 0
        assert helper.count(", m, 0xd8;") == (2 * (groups - 1) if groups > 1 else 0), (side.name, kind)


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_value_accumulates_transposed_where_the_table_lists_it(name):
    """decode_tuning.json's `transposed_value_acc` (measured faster there) is what the split kernel does: a listed
    scheme's V dots take tile^T @ p^T into [columns, GROUP_PAD] accumulators, turned back once after the tile loop;
    every other scheme's take p @ tile. A listed scheme the plan cannot transpose (a pure or QJL V) fails here."""
    listed = name in json.loads(codegen.DECODE_TUNING.read_text(encoding="utf-8"))["transposed_value_acc"]
    layout = plan(load_scheme(scheme_file(name)))
    assert [side.transposed_acc for side in layout.value_parts] == [listed] * len(layout.value_parts)
    source = inspect.getsource(generated(name)._decode_kernel.fn)
    transposed = re.findall(r"(acc_\w+) = (?:tl\.dot|_mm)\(tl\.trans\([^\n]*\), tl\.trans\(weights\)", source)
    plain = re.findall(r"(acc_\w+) = (?:tl\.dot|_mm)\(weights, ", source)
    if listed:
        assert transposed and not plain, (transposed, plain)
        for acc in set(transposed):
            assert f"    {acc} = tl.trans({acc})\n" in source, acc  # back to [GROUP_PAD, columns] once
    else:
        assert not transposed
