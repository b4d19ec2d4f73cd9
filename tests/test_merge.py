"""Decode's merge of its splits inside a kernel it launches anyway (Layout.decode_merge, templates/kernels/merge.py.j2).

Where the layout allows it and the plan's split count keeps it short (DecodePlan.merge), the last split program of
each (sequence, KV head) to take a ticket merges the pair's splits, or the window kernel does; elsewhere
_decode_reduce_kernel does. Both must give the same output, with splits past a sequence's end (and a whole empty
sequence) left out as the merge kernel leaves them, and every ticket counter back at zero after each launch.
"""

import inspect
import json

import pytest
import torch
from conftest import ALL_SCHEMES, DEVICE, ROOT, generated

from kvqc.compiler import codegen
from kvqc.compiler.layout import plan as layout_of
from kvqc.compiler.spec import load_scheme
from kvqc.tools import bench

# Sequence 0 is empty, 1 fills one split of the 5, 2 two, 3 every split: splits past each end never run.
LENS, BLOCK_SIZE, KV_HEADS, GROUP = [0, 1, 100, 300], 32, 2, 3  # 3 query heads a KV head: a padded merge row
MERGING = ["int4_token", "turbo_k4v2", "kivi_k2v2", "turbo_k4v2_w8", "turbo_k4v2_d80_96", "turbo_qjl_k3v3"]


def layout(name: str):
    return layout_of(load_scheme(ROOT / "kvqc" / "schemes" / f"{name}.yaml"))


def setup(name: str, monkeypatch, dtype=torch.float16, layers: int = 1, head_dim: int | None = None):
    """A batch of LENS over `layers` caches, and a device that takes several splits a sequence (the interpreter's
    two programs would give one)."""
    m = generated(name)
    monkeypatch.setattr(m, "_target_programs", lambda device, per_sm: 64)
    head_dim = head_dim or m.HEAD_DIMS[0]
    blocks = max(LENS) // BLOCK_SIZE + 1
    block_tables = torch.randperm(len(LENS) * blocks, device=DEVICE).view(len(LENS), blocks).to(torch.int32)
    seq_lens = torch.tensor(LENS, dtype=torch.int32, device=DEVICE)
    slots = torch.cat([bench.slot_mapping(block_tables[i:i + 1], n, BLOCK_SIZE) for i, n in enumerate(LENS)])
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in LENS])
    rows = torch.cat([torch.full((n,), i, device=DEVICE) for i, n in enumerate(LENS)])
    ring = torch.arange(len(LENS), device=DEVICE) if hasattr(m, "WINDOW") else None
    caches, queries = [], []
    for layer in range(layers):
        torch.manual_seed(layer)
        extra = {"max_seqs": len(LENS)} if ring is not None else {}
        cache = m.allocate_cache(len(LENS) * blocks, BLOCK_SIZE, KV_HEADS, head_dim, device=DEVICE, dtype=dtype,
                                 **extra)
        key = torch.randn(slots.numel(), KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
        value = torch.randn_like(key)
        if hasattr(m, "calibrate"):
            m.calibrate(cache, key, value)
        m.fill(cache, key, value, slots, positions=positions, window_index=rows)
        caches.append(cache)
        queries.append(torch.randn(len(LENS), GROUP * KV_HEADS, head_dim, dtype=dtype, device=DEVICE) * 2)
    return m, caches, queries, (block_tables, seq_lens), ring


def test_the_layout_says_which_kernel_merges():
    merges = {name: layout(name).decode_merge for name in ALL_SCHEMES}
    assert merges["int4_token"] == merges["turbo_k4v2"] == merges["turbo_k4v2_d80_96"] == "split"
    assert merges["kivi_k2v2"] == "window" and merges["turbo_k2v2_ctr_w64"] == "window"
    assert merges["turbo_outlier_2p5"] == ""  # a channel split: one merge per part, by the merge kernel


@pytest.mark.parametrize("name", MERGING)
def test_a_kernel_decode_launches_anyway_merges_as_the_merge_kernel_does(name, monkeypatch):
    m, (cache,), (query,), paging, ring = setup(name, monkeypatch)
    monkeypatch.setattr(m, "_MERGE_ROWS", 0)
    apart = m.plan_decode(cache, *paging, query.shape[1], query.dtype, window_index=ring)
    assert apart.merge == "reduce" and "counters" not in apart.scratch
    want = m.decode(query, cache, *paging, window_index=ring, plan=apart)
    monkeypatch.setattr(m, "_MERGE_ROWS", 1 << 20)
    plan = m.plan_decode(cache, *paging, query.shape[1], query.dtype, window_index=ring)
    assert plan.merge == layout(name).decode_merge and plan.num_splits >= 3, (plan.merge, plan.num_splits)
    calls = []
    real = m._decode_reduce_kernel
    spy_kernel = type("Spy", (), {"__getitem__": lambda self, grid: calls.append(grid) or real[grid]})()
    monkeypatch.setattr(m, "_decode_reduce_kernel", spy_kernel)
    for out in (None, torch.full_like(query, float("nan"))):  # a new output, and the caller's rows written in place
        got = m.decode(query, cache, *paging, window_index=ring, plan=plan, out=out)
        assert out is None or got is out
        assert not calls, "the merge kernel ran although a kernel merged"
        assert torch.equal(got[0], torch.zeros_like(got[0])), "an empty sequence attends to nothing: zeros"
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
        if plan.merge == "split":
            assert not plan.scratch["counters"].any(), "a ticket counter was left nonzero"
    # An unplanned call plans with the same rule and merges in the kernel too.
    got = m.decode(query, cache, *paging, window_index=ring)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Gluon kernels run on the GPU only")
@pytest.mark.parametrize("name", ["turbo_k4v2", "turbo_eden_k4v2", "turbo_k4mse_v2"])
def test_the_gluon_kernel_merges_as_the_merge_kernel_does(name, monkeypatch):
    m, (cache,), (query,), paging, _ = setup(name, monkeypatch, head_dim=128)
    assert m._gluon_decode(query, cache, GROUP)
    monkeypatch.setattr(m, "_MERGE_ROWS", 1 << 20)
    got = m.decode(query, cache, *paging).float()
    plan = m.plan_decode(cache, *paging, query.shape[1], query.dtype)
    assert plan.merge == "split"
    assert torch.equal(m.decode(query, cache, *paging, plan=plan).float(), got)
    assert not plan.scratch["counters"].any()
    monkeypatch.setattr(m, "_MERGE_ROWS", 0)
    want = m.decode(query, cache, *paging).float()
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert (got - want).norm() <= 1e-3 * want.norm()


@pytest.mark.parametrize("name", ["int4_token", "turbo_k4v2", "turbo_k4v2_w8", "turbo_k4v2_d80_96"])
def test_layers_through_one_plan_find_the_counters_clean(name, monkeypatch):
    """Every layer's launch takes tickets from the same counters: each must leave them at zero for the next, through
    the first layer's full call and the later layers' replays (and, on a GPU, a captured graph's replays)."""
    m, caches, queries, paging, ring = setup(name, monkeypatch, layers=3)
    monkeypatch.setattr(m, "_MERGE_ROWS", 1 << 20)
    want = [m.decode(q, c, *paging, window_index=ring) for q, c in zip(queries, caches)]
    plan = m.plan_decode(caches[0], *paging, queries[0].shape[1], queries[0].dtype, window_index=ring)
    for _ in range(2):
        for layer, (q, c) in enumerate(zip(queries, caches)):
            assert torch.equal(m.decode(q, c, *paging, window_index=ring, plan=plan), want[layer]), layer
            if plan.merge == "split":
                assert not plan.scratch["counters"].any()
    assert [type(r).__name__ for r in plan.replays.values()] == ["_Replay"]
    if DEVICE.type != "cuda":
        return
    outs = [torch.empty_like(q) for q in queries]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for q, c, o in zip(queries, caches, outs):
            m.decode(q, c, *paging, window_index=ring, plan=plan, out=o)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(len(queries)):
            assert torch.equal(outs[layer], want[layer]), layer
        if plan.merge == "split":
            assert not plan.scratch["counters"].any()


@pytest.mark.parametrize("name", ["int4_token", "turbo_k4v2_d80_96", "kivi_k2v2"])
@pytest.mark.parametrize("merge_rows", [1 << 20, 0])
def test_an_output_off_a_16_byte_boundary_takes_a_launch_of_its_own(name, merge_rows, monkeypatch):
    """Kernels compiled for a 16-byte-aligned output may store it in 16-byte vectors: a layer whose `out` starts
    elsewhere (a view into an engine's buffer) must not replay launches taken with an aligned one, and each replay's
    launches write an output as aligned as its key says, whichever kernel merges (a split program or
    _decode_reduce_kernel)."""
    m, caches, queries, paging, ring = setup(name, monkeypatch, layers=2)
    monkeypatch.setattr(m, "_MERGE_ROWS", merge_rows)
    plan = m.plan_decode(caches[0], *paging, queries[0].shape[1], queries[0].dtype, window_index=ring)
    assert (plan.merge == "reduce") == (merge_rows == 0)
    want = [m.decode(q, c, *paging, window_index=ring) for q, c in zip(queries, caches)]
    flat = torch.empty(queries[0].numel() + 1, dtype=queries[0].dtype, device=DEVICE)
    shifted = flat[1:].view(queries[0].shape)  # 2 bytes past the allocation's start
    for q, c, w in zip(queries, caches, want):
        assert torch.equal(m.decode(q, c, *paging, window_index=ring, plan=plan, out=torch.empty_like(q)), w)
        got = m.decode(q, c, *paging, window_index=ring, plan=plan, out=shifted)
        assert got.data_ptr() == shifted.data_ptr() and torch.equal(got, w)
    assert len(plan.replays) == 2, "the shifted output replayed the aligned output's launches"
    for (aligned, _), replay in plan.replays.items():
        written = [args[at] for _, _, args, _, slots, _, _ in replay.launches for at, index in slots if index == 1]
        assert written and all((t.data_ptr() % 16 == 0) == aligned[-1] for t in written), aligned


def test_query_rows_follow_what_the_dots_take(monkeypatch):
    """Decode's kernels hold the query heads padded to a power of two, or to _DOT_ROWS where the installed Triton's
    dots want more rows (16 before 3.5 on NVIDIA), or to _QUERY_ROWS' count at a head_dim where that measured
    faster: the same output every way."""
    m, (cache,), (query,), paging, _ = setup("int8_token", monkeypatch)
    taken = []
    real = m._launch_at

    def spy(launches, site, kernel, grid, *args, **constexprs):
        if "GROUP_PAD" in constexprs:
            taken.append(constexprs["GROUP_PAD"])
        return real(launches, site, kernel, grid, *args, **constexprs)

    monkeypatch.setattr(m, "_launch_at", spy)
    outs = {}
    for rows in (1, 16):
        monkeypatch.setattr(m, "_DOT_ROWS", rows)
        outs[rows] = m.decode(query, cache, *paging)
    monkeypatch.setattr(m, "_DOT_ROWS", 1)
    monkeypatch.setattr(m, "_QUERY_ROWS", {cache.head_dim: 8, cache.head_dim * 2: 32})
    outs[8] = m.decode(query, cache, *paging)
    # A table's count never lowers the padding below the power of two or _DOT_ROWS.
    monkeypatch.setattr(m, "_QUERY_ROWS", {cache.head_dim: 2})
    m.decode(query, cache, *paging)
    monkeypatch.setattr(m, "_DOT_ROWS", 16)
    m.decode(query, cache, *paging)
    assert taken == [4, 16, 8, 4, 16]  # 3 query heads a KV head
    torch.testing.assert_close(outs[1].float(), outs[16].float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(outs[1].float(), outs[8].float(), rtol=1e-3, atol=1e-3)


def test_query_rows_come_from_the_tuning_table():
    """A module pads decode's query heads to decode_tuning.json's `query_rows` at the head dims it names."""
    table = json.loads(codegen.DECODE_TUNING.read_text(encoding="utf-8"))
    for name, rows in table["query_rows"].items():
        assert generated(name)._QUERY_ROWS == {int(d): n for d, n in rows.items()}
    assert generated("int8_token")._QUERY_ROWS == {}


def test_later_layers_take_the_replay(monkeypatch):
    """The replay serves later layers of every replaying layout, a window's too (its geometry ends with max_seqs,
    which the replay once compared with the query's device, so that a window scheme never replayed)."""
    for name in ("int4_token", "kivi_k2v2", "turbo_k4v2_w8"):
        m, caches, queries, paging, ring = setup(name, monkeypatch, layers=2)
        plan = m.plan_decode(caches[0], *paging, queries[0].shape[1], queries[0].dtype, window_index=ring)
        served = []
        monkeypatch.setattr(m._Replay, "__call__", spy(m._Replay.__call__, served))
        for q, c in zip(queries, caches):
            m.decode(q, c, *paging, window_index=ring, plan=plan)
        assert served == [1], name


def spy(real, calls: list):
    def call(*args):
        calls.append(1)
        return real(*args)

    return call


def test_a_replay_follows_a_cache_changed_in_place(monkeypatch):
    """A replay takes a cache's addresses from what it kept at the cache's last full check (_replay_memo): a tensor
    swapped in place (`.data =`, as an engine that moves its pool does) must be checked and read anew."""
    m, caches, queries, paging, _ = setup("int4_token", monkeypatch, layers=2)
    plan = m.plan_decode(caches[0], *paging, queries[0].shape[1], queries[0].dtype)
    for q, c in zip(queries, caches):
        m.decode(q, c, *paging, plan=plan)
    cache = caches[1]
    for name in ("key_codes", "value_meta"):
        getattr(cache, name).data = getattr(caches[0], name).clone()  # another layer's bytes, at a new address
        want = m.decode(queries[1], cache, *paging)
        assert torch.equal(m.decode(queries[1], cache, *paging, plan=plan), want), name
    cache.value_meta.data = cache.value_meta.data[:, :, :1]  # the wrong shape: refused, not read
    with pytest.raises(ValueError, match="cache.value_meta: expected shape"):
        m.decode(queries[1], cache, *paging, plan=plan)


@pytest.mark.parametrize("name", ["metal_q8_0_q3_0", "metal_uint2_q2_0"])
def test_scale_group_dots_take_the_rotation_kernel(name):
    """K scale groups take one dot per group against the query's matching columns, read from the rotated query the
    rotation kernel writes: such a scheme never rotates in its split kernels, and has no switch that says so."""
    m = generated(name)
    assert not hasattr(m, "_ROTATE_IN_DECODE")
    assert "rotated_0" not in inspect.getsource(m._decode_kernel.fn)
    assert "_launch_at(\n        launches, (\"rotate\"" in inspect.getsource(m.decode)  # unconditionally


@pytest.mark.parametrize("name", ["turbo_k4v2", "turbo_k2v2_ctr_w64", "sign1_window"])
def test_the_split_kernels_rotate_the_query_as_the_rotation_kernel_does(name, monkeypatch):
    """With ROTATE the split kernels take the query as given and rotate it themselves; without, _rotate_query_kernel
    does it first, in a launch of its own (the tuning table's `rotate_query_apart`, `kvqc explain`). Both decode the
    same, and a plan's replay launches the rotation kernel only without."""
    m, caches, queries, paging, ring = setup(name, monkeypatch, dtype=torch.float32, layers=2)
    outs, launched = {}, {}
    for rotate in (True, False):
        monkeypatch.setattr(m, "_ROTATE_IN_DECODE", rotate)
        plan = m.plan_decode(caches[0], *paging, queries[0].shape[1], queries[0].dtype, window_index=ring)
        outs[rotate] = [m.decode(q, c, *paging, window_index=ring, plan=plan) for q, c in zip(queries, caches)]
        (replay,) = plan.replays.values()
        launched[rotate] = [kernel.__name__ for _, kernel, *_ in replay.launches]
        assert ("rotated" in plan.scratch) != rotate
    assert "_rotate_query_kernel" in launched[False] and "_rotate_query_kernel" not in launched[True]
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
