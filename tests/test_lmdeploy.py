"""kvqc.engines.lmdeploy on CPU, with synthetic inputs in LMDeploy 0.18's layout (LMDeploy itself is not installed).

Caches are allocated the way LMDeploy allocates them for a quant_policy (uint8 codes, model-dtype scales_zeros,
[num_blocks, block_size, num_kv_heads, ...]); batches are described the way its attention layer describes them
(q_start_loc, q_seq_length, kv_seq_length, block_offsets), with scattered blocks, chunked prefill over a history,
padding rows and GQA. Checks: fill writes exactly what the module's fill writes at hand-computed slots; flatten and
paged attention agree with the float64 reference; a cache written by the adapter decodes, through a separate
implementation of LMDeploy's quant_policy=42 dequantization written from its kernels, to the values the adapter's
flatten returns, and its bytes are what LMDeploy's quantizer writes; install swaps and restores functions.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

import kvqc.engines.lmdeploy as kl

HEAD_DIM = 64
BLOCK = 4
KV_HEADS = 2
Q_HEADS = 4  # GQA: two query heads per KV head
CASES = [(42, "turbo_k4v2"), (4, "int4_token"), (8, "int8_token")]
RTOL = {torch.float32: 2e-5, torch.float16: 3e-3}
# The engine's tensors are built on CPU here (kernels under Triton's interpreter); on a GPU the same checks would
# need every tensor moved, which these tests do not do yet.
pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU (interpreter) tests")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.cpu().double(), want.cpu().double()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def engine_cache(policy: int, num_blocks: int, dtype: torch.dtype, seed: int) -> dict:
    """LMDeploy's per-layer tensors for `policy`, filled with garbage as a reused pool would be."""
    key_bits, key_fields, value_bits, value_fields, _ = kl.POLICIES[policy]
    rows = (num_blocks, BLOCK, KV_HEADS)
    g = torch.Generator().manual_seed(seed)
    return {
        "k_caches": torch.randint(0, 256, rows + (HEAD_DIM * key_bits // 8,), dtype=torch.uint8, generator=g),
        "v_caches": torch.randint(0, 256, rows + (HEAD_DIM * value_bits // 8,), dtype=torch.uint8, generator=g),
        "k_scales_zeros": torch.randn(rows + (key_fields,), generator=g).to(dtype),
        "v_scales_zeros": torch.randn(rows + (value_fields,), generator=g).to(dtype),
    }


def to_cache(module, t: dict):
    return module.KVCache(key_codes=t["k_caches"], key_meta=t["k_scales_zeros"], value_codes=t["v_caches"],
                          value_meta=t["v_scales_zeros"], head_dim=HEAD_DIM, layout="bshd")


@dataclass
class Step:
    """One forward step of LMDeploy's attention layer: `new[i]` tokens of sequence i after `history[i]`."""

    history: list[int]
    new: list[int]
    block_offsets: torch.Tensor
    padding: int = 2

    @property
    def kv_seq_length(self) -> torch.Tensor:
        return torch.tensor([h + n for h, n in zip(self.history, self.new)], dtype=torch.int32)

    @property
    def q_seq_length(self) -> torch.Tensor:
        return torch.tensor(self.new, dtype=torch.int32)

    @property
    def q_start_loc(self) -> torch.Tensor:
        return torch.tensor([sum(self.new[:i]) for i in range(len(self.new))], dtype=torch.int32)

    @property
    def num_tokens(self) -> int:
        return sum(self.new) + self.padding

    def slots(self) -> torch.Tensor:
        """Written out token by token, independently of kl.slot_mapping."""
        out = [-1] * self.num_tokens
        row = 0
        for i, (h, n) in enumerate(zip(self.history, self.new)):
            for j in range(n):
                p = h + j
                out[row + j] = int(self.block_offsets[i, p // BLOCK]) * BLOCK + p % BLOCK
            row += n
        return torch.tensor(out, dtype=torch.int64)

    def fill_args(self, k, v, t: dict, policy: int) -> dict:
        return dict(k_states=k, v_states=v, k_caches=t["k_caches"], v_caches=t["v_caches"],
                    q_start_loc=self.q_start_loc, q_seq_length=self.q_seq_length,
                    kv_seq_length=self.kv_seq_length, max_q_seq_length=max(self.new), block_offsets=self.block_offsets,
                    k_scales_zeros=t["k_scales_zeros"], v_scales_zeros=t["v_scales_zeros"], quant_policy=policy)


def scattered_blocks(lens: list[int], seed: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / BLOCK) for n in lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)  # a spare column nothing may read
    at = 0
    for i, k in enumerate(need):
        table[i, :k] = order[at : at + k]
        at += k
    return table, num_blocks


def states(n: int, seed: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, KV_HEADS, HEAD_DIM, generator=g) * 2).to(dtype), torch.randn(
        n, KV_HEADS, HEAD_DIM, generator=g).to(dtype)


FINAL = [9, 5, 3]  # sequence lengths after the three steps below


def run_steps(adapter: kl.Kernels, policy: int, dtype, seed: int):
    """Prefill, a chunked-prefill step over history (one sequence idle), then a decode step; after each step the
    adapter's cache must equal a twin filled by module.fill at the hand-computed slots."""
    table, num_blocks = scattered_blocks(FINAL, seed)
    engine = engine_cache(policy, num_blocks, dtype, seed)
    twin = {k: v.clone() for k, v in engine.items()}
    steps = [Step([0, 0, 0], [6, 2, 0], table), Step([6, 2, 0], [2, 2, 2], table, padding=0),
             Step([8, 4, 2], [1, 1, 1], table, padding=1)]
    for n, step in enumerate(steps):
        k, v = states(step.num_tokens, seed + n, dtype)
        adapter.fill_kv_cache(**step.fill_args(k, v, engine, policy))
        adapter.module.fill(to_cache(adapter.module, twin), k, v, step.slots())
        for name in engine:
            assert torch.equal(engine[name], twin[name]), f"step {n}: {name} differs from module.fill"
    return engine, table


# ---------------------------------------------------------------------------------------------------- conversion


def test_slot_mapping_by_hand():
    offsets = torch.tensor([[7, 2, 0], [5, 0, 0]], dtype=torch.int32)
    # sequence 0: 3 cached, 2 new (positions 3, 4); sequence 1: 3 new; one padding row at the end
    slots = kl.slot_mapping(6, torch.tensor([0, 2]), torch.tensor([2, 3]), torch.tensor([5, 3]), 3, offsets, 4)
    assert slots.tolist() == [7 * 4 + 3, 2 * 4 + 0, 20, 21, 22, -1]
    # a decode step: one token each; an empty sequence (kv_seq_length 0) writes nothing
    slots = kl.slot_mapping(2, torch.tensor([0, 1]), torch.tensor([1, 1]), torch.tensor([9, 0]), 1, offsets, 4)
    assert slots.tolist() == [0 * 4 + 0, -1]
    with pytest.raises(ValueError, match="block_offsets: sequence 1"):
        kl.slot_mapping(1, torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([0, 13]), 1, offsets, 4)


def test_cuda_graph_padding_writes_nothing():
    """LMDeploy's captured decode pads the batch to its graph's size with entries whose token is row 0, one token
    at position 0 and a block row of zeros: they must not take row 0 from sequence 0 nor write into block 0."""
    offsets = torch.tensor([[3, 5], [1, 2], [0, 0], [0, 0]], dtype=torch.int32)
    for seed in range(5):  # scatter order is not fixed: several draws of the same step
        torch.manual_seed(seed)
        slots = kl.slot_mapping(4, torch.tensor([0, 1, 0, 0]), torch.tensor([1, 1, 1, 1]), torch.tensor([6, 3, 1, 1]),
                                1, offsets, 4)
        assert slots.tolist() == [5 * 4 + 1, 1 * 4 + 2, -1, -1]


def test_slot_mapping_follows_the_first_claimant_rule():
    """Random entries, some overlapping, some out of range: each row goes to the first entry whose rows include it,
    and is written only where that entry's token has a position, a block column and a row inside the states."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch, width, block_size, num_tokens = 7, 3, 4, 12
        starts = torch.randint(-1, num_tokens, (batch,), generator=gen)
        q_lens = torch.randint(0, 4, (batch,), generator=gen)
        kv_lens = q_lens + torch.randint(-1, 10, (batch,), generator=gen)
        offsets = torch.randint(0, 50, (batch, width), generator=gen, dtype=torch.int32)
        want, claimed = [-1] * num_tokens, set()
        for i in range(batch):
            rows = [int(starts[i]) + t for t in range(int(q_lens[i]))]
            for t, row in enumerate(rows):
                position = int(kv_lens[i]) - int(q_lens[i]) + t
                if row in claimed or not 0 <= row < num_tokens or position < 0 or position // block_size >= width:
                    continue
                want[row] = int(offsets[i, position // block_size]) * block_size + position % block_size
            claimed.update(rows)
        got = kl._slots(num_tokens, starts, q_lens, kv_lens, 4, offsets, block_size)  # past slot_mapping's checks
        assert got.tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
def test_hadamard_rotate_is_lmdeploys_rotation(d, dtype):
    """What install() puts in place of LMDeploy's turbo_quant.hadamard_rotate(_inv): x @ H/sqrt(d) in x's dtype."""
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d)).to(dtype)
    want = (x.double() @ hadamard(d)).to(dtype)  # hadamard(d) is H/sqrt(d)
    got = kl.hadamard_rotate(x.to(DEVICE))
    assert got.shape == x.shape and got.dtype == dtype
    tol = ({"rtol": 2e-6, "atol": 2e-6} if dtype == torch.float32
           else {"rtol": 1e-3, "atol": 2e-3})  # the dtype's rounding
    torch.testing.assert_close(got.cpu(), want, **tol)
    torch.testing.assert_close(kl.hadamard_rotate(got).cpu().double(), x.double(), rtol=0,
                               atol=1e-5 if dtype == torch.float32 else 5e-3)


def test_decode_step_does_not_read_cu_seqlens_q():
    """LMDeploy's decode passes max_seqlen_q=1 and cu_seqlens_q; reading cu_seqlens_q would wait for the GPU, which
    CUDA-graph capture forbids, so offsets that do not even add up must go unread."""
    adapter = kl.kernels("turbo_k4v2", 42)
    engine, table = run_steps(adapter, 42, torch.float32, seed=5)
    lens = torch.tensor(FINAL, dtype=torch.int32)
    q = torch.randn(len(FINAL), Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    unread = torch.tensor([0, 7, 7, 100], dtype=torch.int32)
    out = adapter.flash_attn_with_kvcache(q, engine["k_caches"], engine["v_caches"], lens, table, cu_seqlens_q=unread,
                                          max_seqlen_q=1, k_scales_zeros=engine["k_scales_zeros"],
                                          v_scales_zeros=engine["v_scales_zeros"], quant_policy=42)
    want = adapter.module.decode(q, to_cache(adapter.module, engine), table, lens)
    assert torch.equal(out, want)


def test_signatures_are_lmdeploys():
    """Argument names and defaults of lmdeploy 0.18's functions, copied from its source by hand."""
    adapter = kl.kernels("turbo_k4v2", 42)
    want = {
        "fill_kv_cache": "k_states v_states k_caches v_caches q_start_loc q_seq_length kv_seq_length "
                         "max_q_seq_length block_offsets k_scales_zeros=None v_scales_zeros=None quant_policy=0 "
                         "kv_layout='bshd'",
        "flatten_kv_cache": "k_caches v_caches seqlens block_offsets start_loc=None out_size=None out_dtype=None "
                            "k_scales_zeros=None v_scales_zeros=None quant_policy=0 kv_layout='bshd' "
                            "flatten_kv_layout='hsd'",
        "flash_attn_with_kvcache": "q k_cache v_cache cache_seqlens page_table cu_seqlens_q=None max_seqlen_q=None "
                                   "softmax_scale=None causal=False window_size=None softcap=None "
                                   "scheduler_metadata=None alibi_slopes=None k_scales_zeros=None "
                                   "v_scales_zeros=None quant_policy=0 sinks=None kv_layout='bshd'",
    }
    for name, text in want.items():
        params = inspect.signature(getattr(adapter, name)).parameters.values()
        got = " ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in params)
        assert got == text, name


# ---------------------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("policy,name", CASES)
def test_fill_flatten_decode(policy, name):
    dtype = torch.float16
    adapter = kl.kernels(name, policy, allow_incompatible=True)
    engine, table = run_steps(adapter, policy, dtype, seed=policy)
    module, cache = adapter.module, to_cache(adapter.module, engine)
    lens = torch.tensor(FINAL, dtype=torch.int32)
    want_k, want_v = module.reference.flatten(cache, table, lens)  # float64, input basis
    if policy == 42:  # LMDeploy's flatten returns the rotated basis
        q = kl._rotation(HEAD_DIM, torch.device("cpu")).double()
        want_k, want_v = want_k @ q, want_v @ q

    # flatten at LMDeploy's start_loc / out_size, both output layouts; rows between sequences stay zero
    start_loc = torch.tensor([0, 12, 20])
    for layout in ("hsd", "shd"):
        k, v = adapter.flatten_kv_cache(engine["k_caches"], engine["v_caches"], lens, table, start_loc=start_loc,
                                        out_size=28, out_dtype=dtype, k_scales_zeros=engine["k_scales_zeros"],
                                        v_scales_zeros=engine["v_scales_zeros"], quant_policy=policy,
                                        flatten_kv_layout=layout)
        if layout == "hsd":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        assert k.shape == (28, KV_HEADS, HEAD_DIM) and k.dtype == dtype
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(start_loc.tolist(), FINAL)])
        assert rel_err(k[rows], want_k) < RTOL[dtype] and rel_err(v[rows], want_v) < RTOL[dtype]
        others = torch.ones(28, dtype=torch.bool)
        others[rows] = False
        assert not k[others].any() and not v[others].any()

    # paged attention: one query token per sequence -> the decode kernel
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(3, Q_HEADS, HEAD_DIM, generator=g) * 0.5).to(dtype)
    out = adapter.flash_attn_with_kvcache(q, engine["k_caches"], engine["v_caches"], cache_seqlens=lens,
                                          page_table=table, max_seqlen_q=1, softmax_scale=0.2,
                                          k_scales_zeros=engine["k_scales_zeros"],
                                          v_scales_zeros=engine["v_scales_zeros"], quant_policy=policy)
    want = module.reference.decode(q, cache, table, lens, scale=0.2)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, want) < RTOL[dtype]
    assert rel_err(module.reference.decode(q, cache, table, lens, scale=0.1), want) > 10 * RTOL[dtype]  # teeth


def test_a_steps_layers_share_one_slot_mapping(monkeypatch):
    """LMDeploy hands every layer of a step the same index tensors, so slots are mapped once a step. The next step
    refills those tensors in place: the first layer filled again maps them anew, and every layer writes what
    module.fill writes at the hand-computed slots."""
    adapter, dtype = kl.kernels("int4_token", 4, allow_incompatible=True), torch.float16
    table, num_blocks = scattered_blocks(FINAL, seed=7)
    layers = [engine_cache(4, num_blocks, dtype, seed=s) for s in (7, 8)]
    twins = [{name: t.clone() for name, t in layer.items()} for layer in layers]
    mapped = []
    slot_mapping = kl.slot_mapping
    monkeypatch.setattr(kl, "slot_mapping", lambda *a, **kw: mapped.append(a) or slot_mapping(*a, **kw))
    steps = [Step([0, 0, 0], [2, 2, 2], table, padding=0), Step([2, 2, 2], [2, 2, 2], table, padding=0)]
    index = {name: getattr(steps[0], name) for name in ("q_start_loc", "q_seq_length", "kv_seq_length")}
    for n, step in enumerate(steps):
        for name, t in index.items():
            t.copy_(getattr(step, name))
        for i, (layer, twin) in enumerate(zip(layers, twins)):
            k, v = states(step.num_tokens, 10 * n + i, dtype)
            adapter.fill_kv_cache(**{**step.fill_args(k, v, layer, 4), **index})
            adapter.module.fill(to_cache(adapter.module, twin), k, v, step.slots())
        assert len(mapped) == n + 1
    for layer, twin in zip(layers, twins):
        for name in layer:
            assert torch.equal(layer[name], twin[name]), name


def test_head_major_caches_take_the_same_calls():
    """kv_layout='bhsd' ([num_blocks, num_kv_heads, block_size, ...] tensors): fill writes the bytes it writes under
    'bshd' at the transposed places, and flatten and paged attention return the same."""
    adapter, dtype = kl.kernels("turbo_k4v2", 42), torch.float16
    token_major, table = run_steps(adapter, 42, dtype, seed=5)
    head_major = {k: t.transpose(1, 2).contiguous() for k, t in engine_cache(42, token_major["k_caches"].shape[0],
                                                                             dtype, seed=5).items()}
    steps = [Step([0, 0, 0], [6, 2, 0], table), Step([6, 2, 0], [2, 2, 2], table, padding=0),
             Step([8, 4, 2], [1, 1, 1], table, padding=1)]
    for n, step in enumerate(steps):  # run_steps' calls and states, now into head-major tensors
        k, v = states(step.num_tokens, 5 + n, dtype)
        adapter.fill_kv_cache(**step.fill_args(k, v, head_major, 42), kv_layout="bhsd")
    for name, t in token_major.items():
        assert torch.equal(head_major[name], t.transpose(1, 2)), name
    lens = torch.tensor(FINAL, dtype=torch.int32)
    outs = []
    for t, layout in ((token_major, "bshd"), (head_major, "bhsd")):
        meta = dict(k_scales_zeros=t["k_scales_zeros"], v_scales_zeros=t["v_scales_zeros"], quant_policy=42,
                    kv_layout=layout)
        q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(6)).to(dtype)
        outs.append((*adapter.flatten_kv_cache(t["k_caches"], t["v_caches"], lens, table, **meta),
                     adapter.flash_attn_with_kvcache(q, t["k_caches"], t["v_caches"], cache_seqlens=lens,
                                                     page_table=table, max_seqlen_q=1, **meta)))
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("causal", [True, False])
def test_several_query_tokens_per_sequence(causal):
    """Speculative / block-sparse decoding: 3 query tokens per sequence, causal from the end or over everything."""
    dtype = torch.float32
    adapter = kl.kernels("turbo_k4v2", 42)
    engine, table = run_steps(adapter, 42, dtype, seed=5)
    module, cache = adapter.module, to_cache(adapter.module, engine)
    lens = torch.tensor(FINAL, dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3 * 3, Q_HEADS, HEAD_DIM, generator=g).to(dtype)
    out = adapter.flash_attn_with_kvcache(q, engine["k_caches"], engine["v_caches"], lens, table, max_seqlen_q=3,
                                          causal=causal, k_scales_zeros=engine["k_scales_zeros"],
                                          v_scales_zeros=engine["v_scales_zeros"], quant_policy=42)
    key, value = module.reference.flatten(cache, table, lens)
    want = torch.zeros(9, Q_HEADS, HEAD_DIM, dtype=torch.float64)
    at = 0
    for i, n in enumerate(FINAL):
        k = key[at : at + n].repeat_interleave(2, dim=1)
        v = value[at : at + n].repeat_interleave(2, dim=1)
        for j in range(3):
            visible = n - 3 + j + 1 if causal else n
            s = torch.einsum("hd,nhd->hn", q[3 * i + j].double(), k[:visible]) / math.sqrt(HEAD_DIM)
            want[3 * i + j] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[:visible])
        at += n
    assert rel_err(out, want) < RTOL[dtype]


def test_uneven_query_tokens_follow_cu_seqlens_q():
    """Chunked prefill: 1, 3 and 2 new query tokens in one batch, told apart only by cu_seqlens_q."""
    dtype = torch.float32
    adapter = kl.kernels("turbo_k4v2", 42)
    engine, table = run_steps(adapter, 42, dtype, seed=7)
    module, cache = adapter.module, to_cache(adapter.module, engine)
    lens = torch.tensor(FINAL, dtype=torch.int32)
    q_lens = [1, 3, 2]
    cu = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    q = torch.randn(6, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = adapter.flash_attn_with_kvcache(q, engine["k_caches"], engine["v_caches"], lens, table, cu_seqlens_q=cu,
                                          max_seqlen_q=3, causal=True, k_scales_zeros=engine["k_scales_zeros"],
                                          v_scales_zeros=engine["v_scales_zeros"], quant_policy=42)
    key, value = module.reference.flatten(cache, table, lens)
    want = torch.zeros(6, Q_HEADS, HEAD_DIM, dtype=torch.float64)
    at = row = 0
    for n, m in zip(FINAL, q_lens):
        k, v = key[at : at + n].repeat_interleave(2, dim=1), value[at : at + n].repeat_interleave(2, dim=1)
        for j in range(m):
            visible = n - m + j + 1
            s = torch.einsum("hd,nhd->hn", q[row].double(), k[:visible]) / math.sqrt(HEAD_DIM)
            want[row] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[:visible])
            row += 1
        at += n
    assert rel_err(out, want) < RTOL[dtype]
    with pytest.raises(ValueError, match="cu_seqlens_q: expected 4 offsets"):
        adapter.flash_attn_with_kvcache(q, engine["k_caches"], engine["v_caches"], lens, table,
                                        cu_seqlens_q=cu[:3], k_scales_zeros=engine["k_scales_zeros"],
                                        v_scales_zeros=engine["v_scales_zeros"], quant_policy=42)


@pytest.mark.parametrize("name, match", [
    ("metal_uint2_q2_0", "groups of channels"),
    ("turbo_k4v2_d80_96", r"head_dim \[80, 96\]"),
    ("kivi_k2v2", "ring row per sequence"),
])
def test_refuses_layouts_lmdeploy_cannot_hold(name, match):
    with pytest.raises(ValueError, match=match):
        kl.kernels(name, 42, allow_incompatible=True)


# ---------------------------------------------------------------------------------------------------- LMDeploy's bytes

# lmdeploy/pytorch/kernels/cuda/turbo_quant.py (0.18): N(0, 1) tables, scaled by 1/sqrt(d) at run time.
LMD_K3 = [-2.1519456, -1.3439093, -0.7560052, -0.2450942, 0.2450942, 0.7560052, 1.3439093, 2.1519456]
LMD_K3_BOUNDS = [-1.7479274, -1.0499573, -0.5005497, 0.0, 0.5005497, 1.0499573, 1.7479274]
LMD_V2 = [-1.5104176, -0.4527808, 0.4527808, 1.5104176]
LMD_V2_BOUNDS = [-0.9815992, 0.0, 0.9815992]


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def lmdeploy_dequantize(codes_k, meta_k, codes_v, meta_v, d: int):
    """LMDeploy's flatten for quant_policy=42, from its kernel: rotated-basis K and V, float64.

    K byte j: low nibble coordinate j, high nibble coordinate j + d/2; nibble = idx3 | sign << 3;
    K = norm * (c3[idx3] + rms * (2 * sign - 1)). V byte j: 2-bit fields for coordinates j, j + d/4, j + d/2,
    j + 3d/4 at shifts 0, 2, 4, 6; V = norm * c2[idx2].
    """
    nib = torch.cat([codes_k & 15, codes_k >> 4], -1).long()
    c3 = torch.tensor(LMD_K3, dtype=torch.float64) / math.sqrt(d)
    sign = ((nib >> 3) & 1).double() * 2 - 1
    k = meta_k[..., :1].double() * (c3[nib & 7] + meta_k[..., 1:2].double() * sign)
    idx = torch.cat([(codes_v >> s) & 3 for s in (0, 2, 4, 6)], -1).long()
    v = meta_v[..., :1].double() * (torch.tensor(LMD_V2, dtype=torch.float64) / math.sqrt(d))[idx]
    return k, v


def lmdeploy_quantize(x: torch.Tensor, bits: int):
    """LMDeploy's fill for quant_policy=42 (float64 here): codes, metadata, and each coordinate's distance to its
    nearest decision boundary (where float32 arithmetic may legitimately decide the other way)."""
    d = x.shape[-1]
    y = x.double() @ hadamard(d).T
    norm = (y.pow(2).sum(-1) + 1e-8).sqrt()
    u = y / norm[..., None]
    c = torch.tensor(LMD_K3 if bits == 3 else LMD_V2, dtype=torch.float64) / math.sqrt(d)
    b = torch.tensor(LMD_K3_BOUNDS if bits == 3 else LMD_V2_BOUNDS, dtype=torch.float64) / math.sqrt(d)
    idx = (u[..., None] > b).sum(-1)
    margin = (u[..., None] - b).abs().min(-1).values
    if bits == 3:
        r = u - c[idx]
        nib = idx | (r >= 0).long() << 3
        codes = (nib[..., : d // 2] | nib[..., d // 2 :] << 4).to(torch.uint8)
        meta = torch.stack([norm, (r.pow(2).sum(-1) + 1e-8).sqrt() / math.sqrt(d)], -1)
        margin = torch.minimum(margin, r.abs())  # the residual sign flips at r = 0
        margin = torch.minimum(margin[..., : d // 2], margin[..., d // 2 :])  # per byte
    else:
        q = d // 4
        codes = (idx[..., :q] | idx[..., q : 2 * q] << 2 | idx[..., 2 * q : 3 * q] << 4 | idx[..., 3 * q :] << 6)
        codes = codes.to(torch.uint8)
        meta = norm[..., None]
        margin = torch.stack([margin[..., i * q : (i + 1) * q] for i in range(4)]).min(0).values
    return codes, meta, margin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cache_reads_back_through_lmdeploys_dequantization(dtype):
    adapter = kl.kernels("turbo_k4v2", 42)
    engine, table = run_steps(adapter, 42, dtype, seed=11)
    lens = torch.tensor(FINAL, dtype=torch.int32)
    k, v = adapter.flatten_kv_cache(engine["k_caches"], engine["v_caches"], lens, table, out_dtype=dtype,
                                    k_scales_zeros=engine["k_scales_zeros"], v_scales_zeros=engine["v_scales_zeros"],
                                    quant_policy=42, flatten_kv_layout="shd")
    slots = torch.cat([table[i, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
                       for i, n in enumerate(FINAL)])
    flat = {name: t.view(-1, KV_HEADS, t.shape[-1])[slots] for name, t in engine.items()}
    want_k, want_v = lmdeploy_dequantize(flat["k_caches"], flat["k_scales_zeros"], flat["v_caches"],
                                         flat["v_scales_zeros"], HEAD_DIM)
    total = sum(FINAL)
    assert rel_err(k[:total], want_k) < RTOL[dtype] and rel_err(v[:total], want_v) < RTOL[dtype]


def test_fill_writes_lmdeploys_bytes():
    """float32 model dtype (no rounding of the rotated vector): codes equal LMDeploy's away from boundaries."""
    adapter = kl.kernels("turbo_k4v2", 42)
    table, num_blocks = scattered_blocks([13, 7], 3)
    engine = engine_cache(42, num_blocks, torch.float32, 3)
    step = Step([0, 0], [13, 7], table, padding=1)
    k, v = states(step.num_tokens, 3, torch.float32)
    adapter.fill_kv_cache(**step.fill_args(k, v, engine, 42))
    slots = step.slots()
    kept = slots >= 0
    got = {name: t.view(-1, KV_HEADS, t.shape[-1])[slots[kept]] for name, t in engine.items()}
    for x, codes, meta, bits in ((k, "k_caches", "k_scales_zeros", 3), (v, "v_caches", "v_scales_zeros", 2)):
        want_codes, want_meta, margin = lmdeploy_quantize(x[kept], bits)
        clear = margin > 1e-5
        assert clear.float().mean() > 0.99
        assert torch.equal(got[codes][clear], want_codes[clear]), codes
        rows = clear.all(-1)
        torch.testing.assert_close(got[meta][rows].double(), want_meta[rows], rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------------- refusals


def test_refusals():
    with pytest.raises(ValueError, match="allow_incompatible=True"):
        kl.kernels("int8_token", 8)
    with pytest.raises(ValueError, match="use turbo_k4v2"):
        kl.kernels("turbo_k4mse_v2", 42)  # one key metadata field where LMDeploy allocates two
    with pytest.raises(ValueError, match="quant_policy: kvqc maps"):
        kl.kernels("turbo_k4v2", 16)
    adapter = kl.kernels("turbo_k4v2", 42)
    table, num_blocks = scattered_blocks([4], 0)
    engine = engine_cache(42, num_blocks, torch.float16, 0)
    step = Step([0], [4], table, padding=0)
    k, v = states(4, 0, torch.float16)
    with pytest.raises(ValueError, match="start LMDeploy with quant_policy=42"):
        adapter.fill_kv_cache(**{**step.fill_args(k, v, engine, 42), "quant_policy": 0})
    with pytest.raises(ValueError, match="kv_layout: kvqc reads 'bshd' or 'bhsd' caches, got 'hsd'"):
        adapter.fill_kv_cache(**step.fill_args(k, v, engine, 42), kv_layout="hsd")
    strided = {name: torch.cat([t, t], 0)[::2] for name, t in engine.items()}  # a packed pool's view
    with pytest.raises(ValueError, match="k_cache: a strided view"):
        adapter.fill_kv_cache(**step.fill_args(k, v, strided, 42))
    q = torch.randn(1, Q_HEADS, HEAD_DIM).to(torch.float16)
    with pytest.raises(NotImplementedError, match="window_size"):
        adapter.flash_attn_with_kvcache(q, engine["k_caches"], engine["v_caches"], torch.tensor([4]), table,
                                        window_size=(8, 8), k_scales_zeros=engine["k_scales_zeros"],
                                        v_scales_zeros=engine["v_scales_zeros"], quant_policy=42)


# ---------------------------------------------------------------------------------------------------- install


def fake_lmdeploy(monkeypatch) -> types.SimpleNamespace:
    """Just enough of lmdeploy 0.18's module tree for install() to find what it patches."""

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    def fill_kv_cache(*args, **kwargs): ...
    def flatten_kv_cache(*args, **kwargs): ...
    def flash_attn_with_kvcache(*args, **kwargs): ...
    def unrelated(*args, **kwargs): ...

    class DefaultCacheBackend:
        @classmethod
        def build_block_layout(cls, tensor_specs, num_layers):
            return "packed"

    class ContiguousBlockCacheLayout:
        def __init__(self, tensor_specs, num_layers):
            self.tensor_specs, self.num_layers = tensor_specs, num_layers

    kernels = dict(fill_kv_cache=fill_kv_cache, flatten_kv_cache=flatten_kv_cache,
                   flash_attn_with_kvcache=flash_attn_with_kvcache)
    module("lmdeploy", __version__="0.18.0")
    cuda = module("lmdeploy.pytorch.kernels.cuda", **kernels)
    defining = module("lmdeploy.pytorch.kernels.cuda.pagedattention", flash_attn_with_kvcache=flash_attn_with_kvcache)
    user = module("lmdeploy.pytorch.backends.cuda.attention.default", fill_kv_cache=fill_kv_cache)
    other = module("lmdeploy.pytorch.kernels.dlinfer", fill_kv_cache=unrelated)  # another backend's kernel
    module("lmdeploy.pytorch.backends.default.cache", DefaultCacheBackend=DefaultCacheBackend)
    module("lmdeploy.pytorch.engine.cache_engine.layout", ContiguousBlockCacheLayout=ContiguousBlockCacheLayout)
    return types.SimpleNamespace(cuda=cuda, defining=defining, user=user, other=other, kernels=kernels,
                                 unrelated=unrelated, backend=DefaultCacheBackend,
                                 contiguous=ContiguousBlockCacheLayout)


def test_install_swaps_and_restores(monkeypatch):
    fake = fake_lmdeploy(monkeypatch)
    uninstall = kl.install("turbo_k4v2", 42)
    for name in fake.kernels:
        swapped = getattr(fake.cuda, name)
        assert isinstance(swapped.__self__, kl.Kernels) and swapped.__name__ == name
    assert fake.defining.flash_attn_with_kvcache.__self__.quant_policy == 42
    assert fake.user.fill_kv_cache.__func__ is kl.Kernels.fill_kv_cache
    assert fake.other.fill_kv_cache is fake.unrelated  # not LMDeploy's CUDA kernel: untouched
    layout = fake.backend.build_block_layout(["k", "v"], num_layers=3)
    assert isinstance(layout, fake.contiguous) and layout.num_layers == 3
    uninstall()
    for name, original in fake.kernels.items():
        assert getattr(fake.cuda, name) is original
    assert fake.user.fill_kv_cache is fake.kernels["fill_kv_cache"]
    assert fake.backend.build_block_layout(["k"], num_layers=1) == "packed"


def test_install_without_lmdeploy(monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdeploy", None)  # makes `import lmdeploy...` fail
    with pytest.raises(ImportError, match=r"pip install 'lmdeploy==0\.18\.\*'"):
        kl.install("turbo_k4v2", 42)




def _engine_benchmark():
    """benchmarks/lmdeploy_engine.py as a module (it imports neither torch nor LMDeploy at the top)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lmdeploy_engine.py"
    spec = importlib.util.spec_from_file_location("kvqc_lmdeploy_engine_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_benchmark_kernel_categories():
    """Every @triton.jit kernel of the generated modules and the adapter falls in a kvqc category of --profile."""
    bench = _engine_benchmark()
    root = Path(__file__).resolve().parents[1]
    names = set()
    for path in [*sorted((root / "generated").glob("*.py")), root / "kvqc" / "engines" / "lmdeploy.py"]:
        names |= set(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)", path.read_text()))
    kernels = {n for n in names if n.endswith("_kernel") or "_kernel_" in n}
    assert {"_decode_kernel", "_fill_kernel", "_slot_mapping_kernel", "_hadamard_kernel"} <= kernels
    assert {n: bench.kernel_category(n) for n in kernels if not bench.kernel_category(n).startswith("kvqc")} == {}
    assert bench.kernel_category("_fill_kv_cache_kernel") == "lmdeploy attention"
    assert bench.kernel_category("nvjet_sm90_hsh_128x32_64x10_2x1_v_bz_TNT") == "gemm"
    assert bench.kernel_category("add_rms_norm_kernel") == "other"
    assert bench.parse_args(["--out", "x"]).profile == 0


def test_engine_benchmark_merges_repeats_apart():
    """--repeats N runs each cache N times; --merge replaces a run by the one of the same cache, mode, batch, prompt
    and repeat, and keeps the other repeats."""
    bench = _engine_benchmark()
    assert bench.parse_args(["--out", "x"]).repeats == 1
    run = lambda cache, repeat, tok_s: dict(cache=cache, mode="eager", batch=32, prompt=4096, repeat=repeat,
                                            decode_tok_s=tok_s)
    old = dict(model={"layers": 8}, commands=["a"], runs=[run("lmdeploy-fp16", 0, 1.0), run("lmdeploy-fp16", 1, 2.0),
                                                           run("kvqc-int4_token", 0, 3.0)])
    new = dict(model={"layers": 8}, commands=["b"], runs=[run("lmdeploy-fp16", 1, 5.0), run("kvqc-int4_token", 1, 6.0)])
    merged = bench.merge(old, new)
    assert [(r["cache"], r["repeat"], r["decode_tok_s"]) for r in merged["runs"]] == [
        ("lmdeploy-fp16", 0, 1.0), ("kvqc-int4_token", 0, 3.0), ("lmdeploy-fp16", 1, 5.0), ("kvqc-int4_token", 1, 6.0)]
    assert merged["commands"] == ["a", "b"]


def test_engine_benchmark_host_times():
    """--host-times wraps a callable in place and sums the calls that start inside the decode window, per step and
    per call."""
    bench = _engine_benchmark()
    owner = types.SimpleNamespace(fill_kv_cache=lambda x: x + 1)
    timer = bench.HostTimes()
    timer.wrap(owner, "fill_kv_cache")
    assert owner.fill_kv_cache(1) == 2 and len(timer.calls) == 1
    # two layers: a step is two fill calls; calls before the window do not count
    timer.calls[:] = [("fill_kv_cache", 0.5, 0.6), ("fill_kv_cache", 1.0, 1.002), ("fill_kv_cache", 1.5, 1.504),
                      ("flash_attn_with_kvcache", 1.2, 1.203), ("fill_kv_cache", 1.6, 1.603),
                      ("fill_kv_cache", 1.9, 1.901), ("slot_mapping", 1.01, 1.011), ("fill_kv_cache", 3.0, 3.1)]
    summary = timer.summary(1.0, 2.0, layers=2)
    assert summary["fill_kv_cache"] == pytest.approx(
        {"calls": 4, "us_per_call": 2500.0, "calls_per_step": 2.0, "ms_per_step": 5.0})
    assert summary["flash_attn_with_kvcache"] == pytest.approx(
        {"calls": 1, "us_per_call": 3000.0, "calls_per_step": 0.5, "ms_per_step": 1.5})
    assert summary["slot_mapping"]["calls_per_step"] == pytest.approx(0.5)
    assert bench.parse_args(["--out", "x", "--host-times"]).host_times
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--repeats", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--agreement", "--repeats", "2"])


def test_engine_benchmark_step_profile():
    """Steps split at the decode graph's replays: kernels by category, period, span and idle share per step."""
    bench = _engine_benchmark()
    events, t = [], 0.0
    for step in range(6):
        corr = 100 + step
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t, "dur": 5.0,
                       "args": {"correlation": corr}})
        for name, dur in [("_decode_kernel", 300.0), ("nvjet_sm90_hsh_64x32", 100.0), ("add_rms_norm_kernel", 10.0)]:
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t + 10, "dur": dur,
                           "args": {"correlation": corr}})
            t += dur + 10  # 10 us idle before each kernel
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": t - 8, "dur": 5.0,
                       "args": {"correlation": 900 + step}})  # within the last kernel, on another stream
        t += 40
    profile = bench.step_profile(events, steps=3)
    # the first replay is skipped (PROFILE_WARM_STEPS); a step is 410 us of kernels, 30 us of gaps between them
    # and 40 us after them (480 us, first kernel to the next replay's); the copy adds time, not busy time
    assert profile["graph_kernels_traced"] and profile["steps"] == 3 and profile["graph_kernels"] == 3
    assert profile["period_ms"] == pytest.approx(0.480) and profile["busy_ms"] == pytest.approx(0.410)
    assert profile["span_ms"] == pytest.approx(0.430)
    assert profile["ms"] == pytest.approx({"kvqc attention": 0.3, "kvqc fill": 0.0, "lmdeploy attention": 0.0,
                                          "gemm": 0.1, "other": 0.015})
    assert profile["idle_share"] == pytest.approx(70 / 480)
    no_graph = [e for e in events if e["cat"] != "kernel"]
    assert bench.step_profile(no_graph, steps=3) == {"graph_launches": 6, "graph_kernels_traced": False}
