"""Channel splits (a side's `outliers`): calibration, fixed channels, the cache's size, attend, refusals, and the
quality the split buys on keys with outlier channels. Kernel-against-reference checks of every split scheme run in
test_kernels.py (shipped ones in test_kernels_match_reference, test-only ones in test_other_branches)."""

import dataclasses
import math

import pytest
import torch
from conftest import DEVICE, ROOT, SPLIT_SCHEMES, generated
from test_kernels import OUT_RTOL, rel_err

from kvqc.oracle.reference import bind, select_channels
from kvqc.compiler.spec import SchemeError, load_scheme, scheme_from_dict

TEST_SPLITS = sorted(str(p) for p in (ROOT / "tests" / "schemes").glob("split_*.yaml"))
ALL_SPLITS = SPLIT_SCHEMES + TEST_SPLITS


def outlier_keys(tokens: int, heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Keys whose channels 3, 10, 17, ... (every seventh) are 6x wider than the rest, a different offset per head:
    what LLM keys look like after RoPE."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=g)
    for h in range(heads):
        x[:, h, (3 + h) % 7 :: 7] *= 6
    return x


def small_cache(m, head_dim: int, heads: int = 2, tokens: int = 40, dtype=torch.float32):
    block_size = 16
    blocks = math.ceil(tokens / block_size)
    cache = m.allocate_cache(blocks + 1, block_size, heads, head_dim, device=DEVICE, dtype=dtype)
    block_tables = torch.arange(blocks, dtype=torch.int32, device=DEVICE)[None]
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=DEVICE)
    return cache, torch.arange(tokens, device=DEVICE), block_tables, seq_lens


@pytest.mark.parametrize("name", ALL_SPLITS, ids=lambda p: p.rsplit("/", 1)[-1].removesuffix(".yaml"))
def test_fill_needs_chosen_channels(name):
    m = generated(name)
    d = m.HEAD_DIMS[0]
    cache, slots, block_tables, seq_lens = small_cache(m, d)
    k = outlier_keys(len(slots), 2, d, 0).to(DEVICE)
    fixed = all(m.SCHEME[s].get("outliers", {}).get("select") in (None, "fixed") for s in ("key", "value"))
    if fixed:
        m.fill(cache, k, k, slots)  # fixed channels come with the cache
        return
    with pytest.raises(ValueError, match=r"_channels: .*call calibrate\(cache, key, value\)"):
        m.fill(cache, k, k, slots)
    with pytest.raises(ValueError, match="calibrate"):
        m.decode(torch.zeros(1, 2, d, device=DEVICE), cache, block_tables, seq_lens)
    with pytest.raises(ValueError, match="at least one token"):
        m.calibrate(cache, k[:0], k[:0])


@pytest.mark.parametrize("name", ALL_SPLITS, ids=lambda p: p.rsplit("/", 1)[-1].removesuffix(".yaml"))
def test_calibrate_chooses_the_reference_channels(name):
    """calibrate() in the module and select_channels() in the reference pick the same channels per head."""
    m = generated(name)
    ref = m.reference
    d = m.HEAD_DIMS[0]
    cache, *_ = small_cache(m, d, heads=3)
    k = outlier_keys(50, 3, d, 1)
    v = outlier_keys(50, 3, d, 2) * 0.5 + 1.0
    m.calibrate(cache, k.to(DEVICE), v.to(DEVICE))
    for base, x in (("key", k), ("value", v)):
        whole = getattr(ref.scheme, base)
        if not whole.outliers:
            assert not hasattr(cache, f"{base}_channels")
            continue
        got = getattr(cache, f"{base}_channels").cpu()
        want = torch.stack([select_channels(x[:, h], whole, d) for h in range(3)])
        assert torch.equal(got, want)
        n = whole.outliers.count(d)
        for h in range(3):
            assert sorted(got[h].tolist()) == list(range(d))  # a permutation
            assert (got[h, :n].tolist() == sorted(got[h, :n].tolist())
                    and got[h, n:].tolist() == sorted(got[h, n:].tolist()))
            if whole.outliers.select != "fixed":
                # Every planted wide channel (about d / 7 of them, fewer than n) is among the chosen.
                wide = {c for c in range(d) if c % 7 == (3 + h) % 7}
                assert wide <= set(got[h, :n].tolist())


def test_fixed_channels_come_from_the_scheme():
    m = generated(str(ROOT / "tests" / "schemes" / "split_fixed_uniform.yaml"))
    cache, *_ = small_cache(m, 128, heads=2)
    order = cache.key_channels.cpu()
    assert order.shape == (2, 128) and order.dtype == torch.int64
    assert order[0, :16].tolist() == sorted(m.SCHEME["key"]["outliers"]["channels"])
    assert torch.equal(order[0], order[1])
    m.calibrate(cache, torch.randn(8, 2, 128, device=DEVICE), torch.randn(8, 2, 128, device=DEVICE))
    assert torch.equal(cache.key_channels.cpu(), order)  # calibrate leaves fixed channels alone


@pytest.mark.parametrize("name", ALL_SPLITS, ids=lambda p: p.rsplit("/", 1)[-1].removesuffix(".yaml"))
def test_cache_costs_bytes_per_token(name):
    m = generated(name)
    for d in m.HEAD_DIMS:
        cache = m.allocate_cache(3, 16, 2, d, device=DEVICE, dtype=torch.float16)
        per_slot = sum(
            t.shape[-1] * t.element_size() for f, t in vars(cache).items() if f.endswith(("_codes", "_meta"))
        )
        assert per_slot == m.bytes_per_token(d, torch.float16)
        kb, vb = bind(m.SCHEME).scheme.bits_per_coordinate(d)
        assert (kb + vb) * d / 8 == pytest.approx(per_slot)


def test_turbo_outlier_2p5_is_two_and_a_half_bits():
    s = load_scheme(ROOT / "kvqc" / "schemes" / "turbo_outlier_2p5.yaml")
    for d in (128, 256):
        kb, vb = s.bits_per_coordinate(d, metadata_bytes=0)
        assert kb == vb == 2.5


@pytest.mark.parametrize("name", ALL_SPLITS, ids=lambda p: p.rsplit("/", 1)[-1].removesuffix(".yaml"))
def test_attend_and_decode_agree_with_the_reference(name):
    """Several query tokens (attend: flatten, then SDPA) and one (decode) over a calibrated split cache."""
    m = generated(name)
    d = m.HEAD_DIMS[0]
    cache, slots, block_tables, seq_lens = small_cache(m, d, heads=2, tokens=37)
    k = outlier_keys(37, 2, d, 3).to(DEVICE)
    v = torch.randn(37, 2, d, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    m.calibrate(cache, k, v)
    m.fill(cache, k, v, slots)
    q = (torch.randn(5, 4, d, generator=torch.Generator().manual_seed(5)) / 3).to(DEVICE)
    out = m.attend(q, cache, block_tables, seq_lens, torch.tensor([0, 5], dtype=torch.int32, device=DEVICE))
    want_k, want_v = m.reference.flatten(cache, block_tables, seq_lens)
    kk, vv = want_k.transpose(0, 1).repeat_interleave(2, 0), want_v.transpose(0, 1).repeat_interleave(2, 0)
    visible = torch.arange(37)[None, :] <= torch.arange(32, 37)[:, None]
    s = torch.einsum("qhd,hnd->hqn", q.cpu().double(), kk) / math.sqrt(d)
    want = torch.einsum("hqn,hnd->qhd", torch.softmax(s.masked_fill(~visible, -math.inf), -1), vv)
    assert rel_err(out, want) < OUT_RTOL[torch.float32]
    last = q[-1:]
    assert rel_err(m.decode(last, cache, block_tables, seq_lens),
                   m.reference.decode(last, cache, block_tables, seq_lens)) < OUT_RTOL[torch.float32]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs; on CPU every call checks the order first")
@pytest.mark.parametrize("name", ALL_SPLITS, ids=lambda p: p.rsplit("/", 1)[-1].removesuffix(".yaml"))
def test_an_order_spoiled_under_a_graph_stays_inside_the_rows(name):
    """A graph replays decode's launches without the wrappers' check of the channel order: an order overwritten
    with channels out of range (an engine's bug) must neither fault nor write past the output's rows. Channels
    head_dim and -1 would land just past the last query row and just before the first, in the NaN guards."""
    m = generated(name)
    d = m.HEAD_DIMS[0]
    cache, slots, block_tables, seq_lens = small_cache(m, d, heads=2, tokens=37, dtype=torch.float16)
    k = outlier_keys(37, 2, d, 3).to(DEVICE, torch.float16)
    v = torch.randn(37, 2, d, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.float16)
    m.calibrate(cache, k, v)
    m.fill(cache, k, v, slots)
    q = torch.randn(1, 4, d, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    guarded = torch.full((3, 4, d), float("nan"), dtype=torch.float16, device=DEVICE)
    plan = m.plan_decode(cache, block_tables, seq_lens, 4, torch.float16)
    want = m.decode(q, cache, block_tables, seq_lens, plan=plan, out=guarded[1:2])
    assert want.isfinite().all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.decode(q, cache, block_tables, seq_lens, plan=plan, out=guarded[1:2])
    for base in ("key", "value"):
        order = getattr(cache, f"{base}_channels", None)
        if order is not None:
            order[:, ::2] = d
            order[:, 1::2] = -1
    graph.replay()
    torch.cuda.synchronize()
    assert want.data_ptr() == guarded[1:2].data_ptr()
    assert guarded[0].isnan().all() and guarded[2].isnan().all() and guarded[1].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rows_are_permuted_per_head(dtype):
    """fill's and flatten's channel permutation (_take, one Triton kernel) equals indexing, for strided rows too, and
    an index out of range (an order spoiled under a graph) reads inside the row."""
    m = generated("turbo_outlier_2p5")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 128, generator=g).to(DEVICE, dtype)
    order = torch.stack([torch.randperm(128, generator=g) for _ in range(3)]).to(DEVICE)
    want = x[:, torch.arange(3, device=DEVICE)[:, None], order]
    assert torch.equal(m._take(x, order), want)
    strided = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(m._take(strided, order), want)
    order[1, 5], order[2, 7] = 128, -1
    spoiled = m._take(x, order)
    assert torch.equal(spoiled[:, 1, 5], x[:, 1, 127]) and torch.equal(spoiled[:, 2, 7], x[:, 2, 0])


def test_split_beats_the_plain_grid_on_outlier_channels():
    """The reason for the split: at 2.5 bits, keys with wide channels come back closer than at a plain 2 bits, and
    choosing the channels by variance beats a fixed, wrong choice. Float64 reference, d=128, 400 tokens x 4 heads."""
    split = bind(load_scheme(ROOT / "kvqc" / "schemes" / "turbo_outlier_2p5.yaml"))
    base = load_scheme(ROOT / "kvqc" / "schemes" / "turbo_outlier_2p5.yaml").to_dict()
    for side in ("key", "value"):
        del base[side]["outliers"]
    plain = bind(scheme_from_dict(base))
    x = outlier_keys(400, 4, 128, 7)

    def err(ref):
        hat = torch.stack([ref.roundtrip("key", x[:, h], torch.float32) for h in range(4)], dim=1)
        return float((hat - x).pow(2).sum() / x.pow(2).sum())

    fixed = scheme_from_dict({**base, "head_dims": [128], "key": {**base["key"], "outliers": {
        "fraction": 0.25, "select": "fixed", "channels": list(range(32)),
        "codebook": {"kind": "lloyd_max", "bits": 4, "law": "sphere"}}}})
    e_split, e_plain, e_fixed = err(split), err(plain), err(bind(fixed))
    assert e_split < 0.8 * e_plain, (e_split, e_plain)
    assert e_split < e_fixed, (e_split, e_fixed)


@pytest.mark.parametrize(
    "change, field, message",
    [
        ({"fraction": 0.3}, "key.outliers.fraction", "not a whole number of channels"),
        ({"fraction": 1.5}, "key.outliers.fraction", "between 0 and 1"),
        ({"codebook": {"kind": "lloyd_max", "bits": 3}}, "key.outliers.codebook", "4-column chunks"),
        ({"fraction": 0.75}, "key.codebook", "8-column chunks"),
        ({"select": "varience"}, "key.outliers.select", "did you mean 'variance'"),
        ({"channels": [1, 2]}, "key.outliers.channels", "only meaningful with select: fixed"),
        ({"select": "fixed"}, "key.outliers.channels", "missing required field"),
        ({"select": "fixed", "channels": list(range(32))}, "key.outliers.channels", "one head_dim"),
        ({"codebook": {"kind": "uniform", "bits": 4}}, "key.outliers.codebook", "needs scale: minmax or absmax"),
        ({"sign": True}, "key.outliers.sign", "unknown field"),
    ],
)
def test_bad_splits_are_refused_with_one_line(change, field, message):
    data = load_scheme(ROOT / "kvqc" / "schemes" / "turbo_outlier_2p5.yaml").to_dict()
    data["key"]["outliers"].update(change)
    with pytest.raises(SchemeError) as e:
        scheme_from_dict(data, "x.yaml")
    assert str(e.value).startswith(f"x.yaml: {field}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_split_with_window_or_per_channel_scales_is_refused():
    data = load_scheme(ROOT / "kvqc" / "schemes" / "turbo_outlier_2p5.yaml").to_dict()
    with pytest.raises(SchemeError, match="key.outliers: a channel split with a recent-token window"):
        scheme_from_dict({**data, "window": 64}, "x.yaml")
    kivi = load_scheme(ROOT / "kvqc" / "schemes" / "kivi_k2v2.yaml").to_dict()
    kivi["key"]["outliers"] = {"fraction": 0.25, "codebook": {"kind": "uniform", "bits": 4}}
    with pytest.raises(SchemeError, match="key.outliers: per-channel scales already"):
        scheme_from_dict(kivi, "x.yaml")


@pytest.mark.parametrize("name", ALL_SPLITS, ids=lambda p: p.rsplit("/", 1)[-1].removesuffix(".yaml"))
@pytest.mark.parametrize("block_size, seq_lens", [(1, [3, 0, 5]), (3, [7, 1]), (256, [0])])
def test_odd_block_sizes_and_empty_sequences(name, block_size, seq_lens):
    """The edge shapes test_edges.py gives unsplit schemes: one-slot and three-slot blocks, empty sequences."""
    import test_kernels as tk

    case = tk.make_case(name, generated(name).HEAD_DIMS[0], block_size, 2, seq_lens, torch.float16, 5)
    before = tk.snapshot(case.cache)
    case.module.fill(case.cache, case.key, case.value, case.slot_mapping)
    tk.check_fill(case, before)
    tk.check_flatten(case)
    # seq_lens on the host (as engines keep it) reads the same, back in channel order too.
    host = case.module.flatten(case.cache, case.block_tables, case.seq_lens.cpu())
    for got, want in zip(host, case.module.flatten(case.cache, case.block_tables, case.seq_lens)):
        assert torch.equal(got, want)
    tk.check_decode(case, 3, 6)


@pytest.mark.parametrize("name", ALL_SPLITS, ids=lambda p: p.rsplit("/", 1)[-1].removesuffix(".yaml"))
def test_a_nan_coordinate_stays_in_its_token(name):
    import test_kernels as tk

    case = tk.make_case(name, generated(name).HEAD_DIMS[0], 16, 1, [20], torch.float32, 7)
    key = case.key.clone()
    first = int((case.slot_mapping >= 0).nonzero()[0])  # a token with a slot gets one NaN coordinate
    key[first, 0, 5] = float("nan")
    case.module.fill(case.cache, key, case.value, case.slot_mapping)
    k, _ = case.module.flatten(case.cache, case.block_tables, case.seq_lens)
    finite = torch.isfinite(k).all(dim=-1).all(dim=-1).cpu()
    # Its position in the sequence: the slot's block is at column p // 16 of the block table.
    slot = int(case.slot_mapping[first])
    position = case.block_tables[0].cpu().tolist().index(slot // 16) * 16 + slot % 16
    others = torch.ones_like(finite)
    others[position] = False
    assert finite[others].all()


def _swap_in(order: torch.Tensor, head: int, at: int, channel: int) -> torch.Tensor:
    order = order.clone()
    order[head, at] = channel
    return order


@pytest.mark.parametrize("name", SPLIT_SCHEMES)
def test_channel_orders_must_be_permutations(name):
    """A channel order that repeats a channel (flatten would return unwritten memory) or names one out of range
    (gather fails inside torch) is refused as a ValueError naming the field, whether it is assigned or edited in
    place after a passing call."""
    m = generated(name)
    d = m.HEAD_DIMS[0]
    cache, slots, block_tables, seq_lens = small_cache(m, d)
    k = outlier_keys(len(slots), 2, d, 0).to(DEVICE)
    m.calibrate(cache, k, k)
    m.fill(cache, k, k, slots)
    good = cache.key_channels
    bad = {
        "repeated": _swap_in(good, 1, 0, int(good[1, 1])),
        "too large": _swap_in(good, 0, 3, d),
        "negative": _swap_in(good, 1, 5, -1),
    }
    for what, order in bad.items():
        cache.key_channels = order
        with pytest.raises(ValueError, match=r"^cache\.key_channels: row [01] is not a permutation"):
            m.flatten(cache, block_tables, seq_lens)
    cache.key_channels = good
    m.flatten(cache, block_tables, seq_lens)
    good[0, 0], good[0, 1] = good[0, 1].clone(), good[0, 1].clone()  # in place: a repeated channel
    with pytest.raises(ValueError, match=r"^cache\.key_channels: row 0 is not a permutation"):
        m.decode(torch.zeros(1, 2, d, device=DEVICE), cache, block_tables, seq_lens)
    with pytest.raises(ValueError, match=r"^cache\.value_channels: expected an int64 tensor"):
        m.fill(dataclasses.replace(cache, key_channels=cache.value_channels, value_channels=cache.value_channels.int()),
               k, k, slots)
