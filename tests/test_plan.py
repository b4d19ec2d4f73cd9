"""decode's plan/run split: plan_decode once per step, decode(..., plan=plan) once per layer.

A plan holds what depends on the batch alone (paging tensors, split-K shape, scratch, compiled launchers), so its
layers must decode exactly what an unplanned call decodes, whatever each layer's cache holds, and a plan must
refuse what it was not made for. On a GPU the planned launches call the compiled kernels directly.
"""

import pytest
import torch
from conftest import ALL_SCHEMES, DEVICE, ROOT, generated

from kvqc.compiler.layout import plan as layout_of
from kvqc.compiler.spec import load_scheme
from kvqc.tools import bench

LENS, BLOCK_SIZE, KV_HEADS, Q_HEADS = [5, 70, 33], 32, 2, 4
CASES = ["turbo_k4v2", "int4_token", "sign1_window", "turbo_outlier_2p5"]


def layers(name: str, count: int = 3, dtype=torch.float16):
    """`count` caches of one shape filled with different tokens, their paging tensors, queries and ring rows."""
    m = generated(name)
    head_dim = 128 if 128 in m.HEAD_DIMS else m.HEAD_DIMS[0]
    batch = len(LENS)
    blocks = max(LENS) // BLOCK_SIZE + 1
    block_tables = torch.arange(batch * blocks, device=DEVICE, dtype=torch.int32).flip(0).view(batch, blocks)
    seq_lens = torch.tensor(LENS, dtype=torch.int32, device=DEVICE)
    slots = torch.cat([bench.slot_mapping(block_tables[i : i + 1], n, BLOCK_SIZE) for i, n in enumerate(LENS)])
    window = hasattr(m, "WINDOW")
    ring = torch.arange(batch, device=DEVICE) if window else None  # window_index: sequence b keeps ring row b
    caches, queries = [], []
    for layer in range(count):
        torch.manual_seed(layer)
        rows = {"max_seqs": batch} if window else {}
        cache = m.allocate_cache(batch * blocks, BLOCK_SIZE, KV_HEADS, head_dim, device=DEVICE, **rows)
        key = torch.randn(slots.numel(), KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
        value = torch.randn_like(key)
        if hasattr(m, "calibrate"):
            m.calibrate(cache, key, value)
        positions = torch.cat([torch.arange(n, device=DEVICE) for n in LENS])
        rows = torch.cat([torch.full((n,), i, device=DEVICE) for i, n in enumerate(LENS)])
        m.fill(cache, key, value, slots, positions=positions, window_index=rows)  # a windowless scheme ignores them
        caches.append(cache)
        queries.append(torch.randn(batch, Q_HEADS, head_dim, dtype=dtype, device=DEVICE))
    return m, caches, queries, (block_tables, seq_lens), ring


@pytest.mark.parametrize("name", CASES)
def test_planned_layers_decode_what_unplanned_calls_decode(name):
    m, caches, queries, paging, ring = layers(name)
    want = [m.decode(q, c, *paging, window_index=ring) for q, c in zip(queries, caches)]
    plan = m.plan_decode(caches[0], *paging, Q_HEADS, queries[0].dtype, window_index=ring)
    for _ in range(2):  # a second step through the same plan: its launchers are found by now
        got = [m.decode(q, c, *paging, window_index=ring, plan=plan) for q, c in zip(queries, caches)]
        for layer, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"{name}: layer {layer} differs with a plan"
    if DEVICE.type == "cuda":
        assert plan.launches and all(entry is not None for entry in plan.launches.values())


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_later_layers_replay_what_the_plan_promises(name):
    """Where the plan says decode is kernel launches alone (Layout.decode_replays, `kvqc explain`), a plan's first
    layer leaves its launches and the next layer replays them with its own tensors, decoding what an unplanned call
    decodes, a strided query (an engine's view into its QKV projection) too; a scale the first layer did not show
    takes the whole call, and leaves a replay of its own. Elsewhere no layer replays."""
    m, caches, queries, paging, ring = layers(name, count=2)
    replays = layout_of(load_scheme(ROOT / "kvqc" / "schemes" / f"{name}.yaml")).decode_replays
    plan = m.plan_decode(caches[0], *paging, Q_HEADS, queries[0].dtype, window_index=ring)
    for query, cache in zip(queries, caches):
        want = m.decode(query, cache, *paging, window_index=ring)
        assert torch.equal(m.decode(query, cache, *paging, window_index=ring, plan=plan), want)
    taken = [type(r).__name__ for r in getattr(plan, "replays", {}).values()]
    assert taken == (["_Replay"] if replays else []), taken
    rows = torch.full_like(queries[1], float("nan"))  # an engine's output buffer: decode writes every element
    assert m.decode(queries[1], caches[1], *paging, window_index=ring, plan=plan, out=rows) is rows
    assert torch.equal(rows, want)
    if not replays:
        return
    strided = queries[1].transpose(0, 1).contiguous().transpose(0, 1)  # the same values, rows not contiguous
    want = m.decode(strided, caches[1], *paging, window_index=ring)
    assert torch.equal(m.decode(strided, caches[1], *paging, window_index=ring, plan=plan), want)
    want = m.decode(queries[1], caches[1], *paging, window_index=ring, scale=0.25)
    for cache in (caches[0], caches[1]):  # the second call replays the first's
        got = m.decode(queries[1], cache, *paging, window_index=ring, scale=0.25, plan=plan)
    assert torch.equal(got, want) and len(plan.replays) == 2


def test_a_split_replay_needs_the_channel_orders():
    """A channel split's decode replays (its parts map in kernels/parts.py.j2), but only for a cache whose channel
    orders are set: a later layer's cache that calibrate() never chose them for takes the whole call, which refuses
    it, instead of a replay reading whatever its slot holds."""
    m, caches, queries, paging, _ = layers("turbo_outlier_2p5", count=2)
    plan = m.plan_decode(caches[0], *paging, Q_HEADS, queries[0].dtype)
    m.decode(queries[0], caches[0], *paging, plan=plan)
    assert len(plan.replays) == 1
    caches[1].value_channels = None
    with pytest.raises(ValueError, match="calibrate"):
        m.decode(queries[1], caches[1], *paging, plan=plan)


def test_a_plan_refuses_what_it_was_not_made_for():
    m, caches, queries, paging, _ = layers("int4_token", count=1)
    plan = m.plan_decode(caches[0], *paging, Q_HEADS, torch.float16)
    block_tables, seq_lens = paging
    with pytest.raises(ValueError, match="plan: made for other block_tables"):
        m.decode(queries[0], caches[0], block_tables.clone(), seq_lens, plan=plan)
    with pytest.raises(ValueError, match=r"query: the plan takes \[3, 4, head_dim\]"):
        m.decode(queries[0].float(), caches[0], *paging, plan=plan)
    other = m.allocate_cache(caches[0].num_blocks + 1, BLOCK_SIZE, KV_HEADS, caches[0].head_dim, device=DEVICE)
    with pytest.raises(ValueError, match="cache: the plan serves caches shaped"):
        m.decode(queries[0], other, *paging, plan=plan)
    with pytest.raises(ValueError, match=r"out: expected dtype in \(torch.float16,\)"):
        m.decode(queries[0], caches[0], *paging, plan=plan, out=queries[0].float())
    with pytest.raises(ValueError, match=r"out: expected shape \[3, 4, 128\]"):
        m.decode(queries[0], caches[0], *paging, plan=plan, out=queries[0][:1])
    with pytest.raises(ValueError, match="plan: expected a DecodePlan"):
        m.decode(queries[0], caches[0], *paging, plan=object())
    with pytest.raises(ValueError, match="num_q_heads: expected a positive multiple"):
        m.plan_decode(caches[0], *paging, 3, torch.float16)
    with pytest.raises(ValueError, match="dtype: expected the query's dtype"):
        m.plan_decode(caches[0], *paging, Q_HEADS, torch.int8)


@pytest.mark.parametrize("name", ["turbo_k4v2", "int4_token", "sign1_window"])
def test_graph_padded_block_tables_change_nothing(name):
    """Engines capture decode with block tables as wide as their whole pool (LMDeploy: every block) and replay it
    over any lengths: the split plan follows seq_lens in the kernel and flatten's programs stride over the tiles,
    so padding columns change no result (their cost shows in benchmarks/lmdeploy_engine.py)."""
    m, caches, queries, (block_tables, seq_lens), ring = layers(name, count=1)
    padded = torch.zeros(block_tables.shape[0], 4096, dtype=block_tables.dtype, device=DEVICE)
    padded[:, : block_tables.shape[1]] = block_tables
    want = m.decode(queries[0], caches[0], block_tables, seq_lens, window_index=ring)
    got = m.decode(queries[0], caches[0], padded, seq_lens, window_index=ring)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    key, value = m.flatten(caches[0], block_tables, seq_lens, window_index=ring)
    k_out, v_out = torch.empty_like(key), torch.empty_like(value)
    m.flatten(caches[0], padded, seq_lens, window_index=ring, out=(k_out, v_out))
    assert torch.equal(k_out, key) and torch.equal(v_out, value)
