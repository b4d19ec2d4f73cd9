"""kvqc.vllm on CPU, with synthetic inputs in vLLM 0.13's layout (vLLM itself is not installed).

One raw uint8 tensor per layer, as vLLM allocates it, carved into four contiguous regions; batches described as
vLLM describes them (query_start_loc, seq_lens, block_table, slot_mapping with -1 padding, padded token rows),
mixing decode requests with prefill and chunked-prefill requests, GQA. Checks: the regions tile the tensor; fill
lands exactly where module.fill puts it; outputs agree with float64 attention over the reference's dequantized
cache. The vLLM classes are exercised against a stand-in of the few vLLM names they use.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

import kvqc.vllm as kv

BLOCK = 4
KV_HEADS = 2
Q_HEADS = 4
SCHEMES = [("turbo_k4v2", 64), ("int8_token", 64), ("int4_token", 64), ("turbo_k4mse_v2", 64),
           ("turbo_qjl_k3v3", 128), ("metal_uint2_q2_0", 128), ("fp8_e4m3", 64), ("turbo_k4v2_d80_96", 80)]
pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU (interpreter) tests")


def raw_cache(module, num_blocks: int, head_dim: int, dtype, seed: int) -> torch.Tensor:
    per_token = module.bytes_per_token(head_dim, dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, KV_HEADS, BLOCK, per_token), dtype=torch.uint8, generator=g)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.cpu().double(), want.cpu().double()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def test_regions_tile_the_raw_tensor():
    module = kv.paged.load_module("turbo_k4v2")
    raw = torch.zeros(3, KV_HEADS, BLOCK, module.bytes_per_token(64, torch.float16), dtype=torch.uint8)
    cache = kv.carve(module, raw, 64, torch.float16)
    n = 3 * BLOCK * KV_HEADS
    sizes = kv.region_bytes(module, 64, torch.float16)
    assert sizes == {"key_codes": 32, "key_meta": 4, "value_codes": 16, "value_meta": 2}
    at = 0
    for i, name in enumerate(kv._REGIONS):
        t = getattr(cache, name)
        assert t.is_contiguous() and t.shape[:3] == (3, KV_HEADS, BLOCK)
        assert cache.block_size == BLOCK and cache.num_kv_heads == KV_HEADS
        assert t.data_ptr() == raw.data_ptr() + at  # region i starts where region i - 1 ends
        t.view(torch.uint8).fill_(i + 1)
        at += n * sizes[name]
    assert at == raw.numel()
    assert torch.equal(raw.view(-1), torch.repeat_interleave(torch.arange(1, 5, dtype=torch.uint8),
                                                             torch.tensor([n * sizes[r] for r in kv._REGIONS])))
    assert cache.key_meta.dtype == torch.float16
    with pytest.raises(ValueError, match="54 bytes per token and head, turbo_k4v2 at head_dim 64 / torch.float32 needs 60"):
        kv.carve(module, raw, 64, torch.float32)


class Batch:
    """vLLM's view of requests: request i has `cached[i]` tokens stored and `new[i]` scheduled now."""

    def __init__(self, cached, new, table, padding):
        self.cached, self.new, self.table, self.padding = cached, new, table, padding

    def metadata(self) -> kv.Metadata:
        starts = [0]
        for n in self.new:
            starts.append(starts[-1] + n)
        slots = []
        for i, (c, n) in enumerate(zip(self.cached, self.new)):
            for p in range(c, c + n):
                slots.append(int(self.table[i, p // BLOCK]) * BLOCK + p % BLOCK)
        slots += [-1] * self.padding  # vLLM pads the token count (CUDA graphs); those slots are -1
        qsl = torch.tensor(starts, dtype=torch.int32)
        return kv.Metadata(num_actual_tokens=starts[-1], query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
                           seq_lens=torch.tensor([c + n for c, n in zip(self.cached, self.new)], dtype=torch.int32),
                           block_table=self.table, slot_mapping=torch.tensor(slots, dtype=torch.int64))


def expected(module, cache, batch: Batch, query, scale) -> torch.Tensor:
    """float64 causal attention over the reference's dequantization of what the cache holds."""
    seq_lens = torch.tensor([c + n for c, n in zip(batch.cached, batch.new)], dtype=torch.int32)
    key, value = module.reference.flatten(cache, batch.table, seq_lens)
    out = torch.zeros(sum(batch.new), Q_HEADS, query.shape[-1], dtype=torch.float64)
    kv_at = q_at = 0
    for c, n in zip(batch.cached, batch.new):
        k = key[kv_at : kv_at + c + n].repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
        v = value[kv_at : kv_at + c + n].repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
        for j in range(n):
            s = torch.einsum("hd,nhd->hn", query[q_at + j].double(), k[: c + j + 1]) * scale
            out[q_at + j] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[: c + j + 1])
        kv_at += c + n
        q_at += n
    return out


@pytest.mark.parametrize("name,head_dim", SCHEMES)
def test_forward_over_steps(name, head_dim):
    dtype = torch.float16
    module = kv.paged.load_module(name)
    g = torch.Generator().manual_seed(len(name))
    num_blocks = 9
    table = torch.randperm(num_blocks, generator=g)[:6].view(3, 2).to(torch.int32).contiguous()  # scattered
    raw = raw_cache(module, num_blocks, head_dim, dtype, seed=1)
    twin = raw.clone()
    scale = 1 / math.sqrt(head_dim)
    steps = [
        Batch([0, 0, 0], [5, 3, 0], table, padding=2),  # prefill; request 2 not scheduled yet (0 tokens)
        Batch([5, 3, 0], [2, 1, 3], table, padding=1),  # a chunked-prefill chunk, a decode, a new prefill
        Batch([7, 4, 3], [1, 1, 1], table, padding=0),  # decode only: the no-gather path
    ]
    for n, batch in enumerate(steps):
        meta = batch.metadata()
        tokens = meta.slot_mapping.shape[0]
        query = torch.randn(tokens, Q_HEADS, head_dim, generator=g).to(dtype)
        key = (torch.randn(tokens, KV_HEADS, head_dim, generator=g) * 2).to(dtype)
        value = torch.randn(tokens, KV_HEADS, head_dim, generator=g).to(dtype)
        output = torch.full_like(query, 7.0)
        out = kv.forward(module, query, key, value, raw, meta, scale, output)
        assert out is output
        module.fill(kv.carve(module, twin, head_dim, dtype), key[: meta.num_actual_tokens],
                    value[: meta.num_actual_tokens], meta.slot_mapping[: meta.num_actual_tokens])
        assert torch.equal(raw, twin), f"step {n}: the cache differs from module.fill at vLLM's slots"
        cache = kv.carve(module, raw, head_dim, dtype)
        want = expected(module, cache, batch, query, scale)
        assert rel_err(out[: meta.num_actual_tokens], want) < 3e-3, f"step {n}"
        assert (out[meta.num_actual_tokens :] == 7).all()  # padding rows untouched
        wrong = expected(module, cache, batch, query, scale * 0.5)
        assert rel_err(out[: meta.num_actual_tokens], wrong) > 1e-2  # the check has teeth


def test_backend_without_vllm(monkeypatch):
    """kvqc.vllm imported above without vLLM; its classes and register() say what to install."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    kv._vllm_classes.cache_clear()
    with pytest.raises(ImportError, match=r"pip install 'vllm==0\.13\.\*'"):
        kv.KVQCAttentionBackend
    with pytest.raises(ImportError, match="needs vLLM"):
        kv.register()


def test_entry_point_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["vllm.general_plugins"] == {"kvqc": "kvqc.vllm:register"}
    assert callable(kv.register)
    assert not any("vllm" in dep for deps in project["project"].get("optional-dependencies", {}).values()
                   for dep in deps)  # never on an install path


# ---------------------------------------------------------------------------------------------------- the vLLM glue


@pytest.fixture
def fake_vllm(monkeypatch):
    """The handful of vLLM 0.13 names kvqc.vllm uses, with their behaviour where kvqc relies on it."""

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    @dataclasses.dataclass(frozen=True)
    class FullAttentionSpec:
        block_size: int
        num_kv_heads: int
        head_size: int
        dtype: torch.dtype
        sliding_window: int | None = None
        attention_chunk_size: int | None = None

        @property
        def page_size_bytes(self):
            return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

        @classmethod
        def merge(cls, specs):
            s = specs[0]
            return cls(block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size, dtype=s.dtype)

    class Enum:
        CUSTOM = "CUSTOM"

    overrides = {}

    def register_backend(backend, is_mamba=False, class_path=None):
        overrides[backend] = class_path

    class Attention:
        def get_kv_cache_spec(self, vllm_config):
            return "vllm's own spec"

    class AttentionMetadataBuilder:
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            self.kv_cache_spec = kv_cache_spec

    module("vllm", __version__="0.13.0", __path__=[])
    module("vllm.attention.backends.abstract", AttentionBackend=object, AttentionImpl=object,
           AttentionType=types.SimpleNamespace(DECODER="decoder"))
    module("vllm.attention.backends.registry", AttentionBackendEnum=Enum, register_backend=register_backend)
    module("vllm.attention.layer", Attention=Attention)
    module("vllm.v1.attention.backends.utils", AttentionMetadataBuilder=AttentionMetadataBuilder)
    module("vllm.v1.kv_cache_interface", FullAttentionSpec=FullAttentionSpec)
    managers = module("vllm.v1.core.single_type_kv_cache_manager", FullAttentionSpec=FullAttentionSpec,
                      spec_manager_map={FullAttentionSpec: "FullAttentionManager"})
    monkeypatch.setenv(kv.SCHEME_ENV, "turbo_k4v2")
    kv._vllm_classes.cache_clear()
    yield types.SimpleNamespace(overrides=overrides, Attention=Attention, managers=managers)
    kv._vllm_classes.cache_clear()
    kv._BYTES_PER_TOKEN.clear()


def test_register_and_run_through_the_classes(fake_vllm):
    kv.register()
    assert fake_vllm.overrides == {"CUSTOM": "kvqc.vllm.KVQCAttentionBackend"}
    backend = kv.KVQCAttentionBackend
    spec_cls = kv.KVQCAttentionSpec
    assert fake_vllm.managers.spec_manager_map[spec_cls] == "FullAttentionManager"

    config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float16),
                                   cache_config=types.SimpleNamespace(block_size=BLOCK))
    other = fake_vllm.Attention()
    assert fake_vllm.Attention.get_kv_cache_spec(other, config) == "vllm's own spec"  # not on this backend
    layer = fake_vllm.Attention()
    layer.attn_backend, layer.head_size, layer.num_kv_heads, layer.sliding_window = backend, 64, KV_HEADS, None
    spec = fake_vllm.Attention.get_kv_cache_spec(layer, config)
    assert isinstance(spec, spec_cls) and spec.dtype == torch.uint8
    assert spec.page_size_bytes == BLOCK * KV_HEADS * 54  # turbo_k4v2, d=64, fp16 metadata: 54 bytes
    assert spec_cls.merge([spec, spec]).page_size_bytes == spec.page_size_bytes
    shape = backend.get_kv_cache_shape(5, BLOCK, KV_HEADS, 64)
    assert shape == (5, KV_HEADS, BLOCK, 54)

    impl = backend.get_impl_cls()(Q_HEADS, 64, 0.125, KV_HEADS)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        backend.get_impl_cls()(Q_HEADS, 64, 0.125, KV_HEADS, None, 128)
    builder = backend.get_builder_cls()(spec, ["layer.0"], config, torch.device("cpu"))
    batch = Batch([0, 0], [3, 2], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), padding=1)
    m = batch.metadata()
    common = types.SimpleNamespace(num_actual_tokens=m.num_actual_tokens, query_start_loc=m.query_start_loc,
                                   query_start_loc_cpu=m.query_start_loc_cpu, seq_lens=m.seq_lens,
                                   block_table_tensor=m.block_table, slot_mapping=m.slot_mapping)
    meta = builder.build(0, common)
    raw = torch.zeros(shape, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, Q_HEADS, 64, generator=g).half()
    k, v = torch.randn(6, KV_HEADS, 64, generator=g).half(), torch.randn(6, KV_HEADS, 64, generator=g).half()
    out = impl.forward(None, q, k, v, raw, meta, output=torch.empty_like(q))
    want = expected(backend.kvqc_module, kv.carve(backend.kvqc_module, raw, 64, torch.float16), batch, q, 0.125)
    assert rel_err(out[:5], want) < 3e-3
    assert not impl.forward(None, q, k, v, raw, None, output=torch.ones_like(q)).any()  # profiling run


def test_window_schemes_are_refused(monkeypatch):
    monkeypatch.setenv(kv.SCHEME_ENV, "sign1_window")
    with pytest.raises(ValueError, match="^KVQC_VLLM_SCHEME: sign1_window keeps"):
        kv.scheme_module()
