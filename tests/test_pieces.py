"""The pieces Python lays out for the templates (kvqc/compiler/pieces/), checked on their own where they compute:
the portable codebook select trees pick every entry, the decode split's pieces name the accumulators the plan says V
has, and every code format the scheme language accepts has its codec."""

import types

import numpy as np
import pytest

from kvqc.compiler import layout as layouts
from kvqc.compiler import spec
from kvqc.compiler.pieces import codecs, selects, split_state
from kvqc.compiler.pieces.codecs import residuals
from kvqc.modules import SCHEMES


@pytest.mark.parametrize("levels", [2, 4, 8, 16, 32])
def test_codebook_select_picks_each_entry(levels):
    scope = {"triton": types.SimpleNamespace(jit=lambda f: f), "tl": types.SimpleNamespace(where=np.where)}
    exec(selects.codebook_select(levels), scope)
    entries = [float(3 * i + 1) for i in range(levels)]
    index = np.arange(4 * levels)  # bits above the codebook's are ignored
    picked = scope[f"_codebook_{levels}"](index, *entries)
    assert picked.tolist() == [entries[i % levels] for i in index]


@pytest.mark.parametrize("name", ["int8_token", "turbo_k4v2", "kivi_k2v2", "turbo_qjl_k3v3", "turbo_outlier_2p5"])
def test_split_state_covers_every_accumulator(name):
    layout = layouts.plan(spec.load_scheme(SCHEMES / f"{name}.yaml"))
    init, rescale, store = (split_state.init(layout), split_state.rescale(layout), split_state.store(layout))
    for value in layout.value_parts:
        if value.group_dots:
            accs = [f"acc_{value.tag}u{u}" for u in range(len(value.units(max(value.head_dims))))]
        else:
            accs = [f"acc_{value.tag}{t}" for t in value.acc_tiles]
        for acc in accs:
            assert f"{acc} = tl.zeros(" in init
            assert f"{acc} *= alpha" in rescale
        if not value.word_unpack:  # words are joined back into chunks before the store
            assert all(f", {acc}" in store for acc in accs)
    assert all(text.endswith("\n") for text in (init, rescale, store))


def test_every_code_format_has_a_codec():
    """A codebook kind or residual stage the spec accepts is one the compiler can write fill, flatten and decode for."""
    assert set(codecs.CODECS) == set(spec.CODEBOOK_KINDS)
    assert set(residuals.RESIDUALS) == set(spec.RESIDUAL_KINDS) - {"none"}


@pytest.mark.parametrize("name", ["int8_token", "fp8_e4m3", "kivi_k2v2", "metal_q4_0_q3_0"])
def test_grid_codecs_write_what_their_sides_read(name):
    """A grid side's fill writes each chunk's code from the scaled rows, and its tile reads the code's level back;
    a Lloyd-Max side has no grid to hand out."""
    layout = layouts.plan(spec.load_scheme(SCHEMES / f"{name}.yaml"))
    for side in layout.sides:
        if side.per_channel or side.codec == "lloyd_max":
            continue  # per-channel scales are quantized a token group at a time, by the window kernel
        encoded = codecs.of(side).encode(side, "valid")
        assert all(f"code_{c} = " in encoded for c in range(side.chunks)), encoded
        tile = codecs.of(side).tile(side, 0, "BLOCK_T", "valid")
        assert codecs.grid(side).level(side) in tile and "tile = " in tile
    lloyd = layouts.plan(spec.load_scheme(SCHEMES / "turbo_k4v2.yaml")).key
    with pytest.raises(TypeError, match="no grid"):
        codecs.grid(lloyd)
