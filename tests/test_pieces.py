"""The pieces Python lays out for the templates (kvqc/compiler/pieces/), checked on their own where they compute:
the portable codebook select trees pick every entry, and the decode split's pieces name the accumulators the plan
says V has."""

import types

import numpy as np
import pytest

from kvqc.compiler import layout as layouts
from kvqc.compiler import spec
from kvqc.compiler.pieces import selects, split_state
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
