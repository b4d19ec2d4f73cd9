"""kvqc.engines.vllm on CPU, with synthetic inputs in vLLM 0.13's layout (vLLM itself is not installed).

One raw uint8 tensor per layer, as vLLM allocates it, carved into four contiguous regions; batches described as
vLLM describes them (query_start_loc, seq_lens, block_table, slot_mapping with -1 padding, padded token rows),
mixing decode requests with prefill and chunked-prefill requests, GQA. Checks: the regions tile the tensor; fill
lands exactly where module.fill puts it; outputs agree with float64 attention over the reference's dequantized
cache. The vLLM classes are exercised against a stand-in of the few vLLM 0.13 names they use, written to disk as a
package so that a fresh interpreter can unpickle a spec; register() is checked never to raise.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

import kvqc.engines.vllm as kv

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
    with pytest.raises(ValueError,
                       match="54 bytes per token and head, turbo_k4v2 at head_dim 64 / torch.float32 needs 60"):
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
        return kv.Metadata(num_reqs=len(self.new), num_actual_tokens=starts[-1], max_query_len=max(self.new),
                           query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
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


def test_decode_step_reads_no_tensor_on_the_host(monkeypatch):
    """The decode-only path is what vLLM captures in a full CUDA graph: it must not read a tensor's value on the
    host (item / int / bool / tolist, nonzero) nor touch query_start_loc_cpu. The generated wrappers check indices
    on CPU (with syncs), as they do on a GPU only under KVQC_DEBUG; that is switched off here as on a GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    module = kv.paged.load_module("turbo_k4v2")
    monkeypatch.setattr(module, "_checking", lambda device: False)
    table = torch.tensor([[3, 1], [0, 2], [4, 5]], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    raw = torch.zeros(6, KV_HEADS, BLOCK, module.bytes_per_token(64, torch.float16), dtype=torch.uint8)
    cache = kv.carve(module, raw, 64, torch.float16)
    prefill = Batch([0, 0, 0], [5, 2, 6], table, padding=0).metadata()
    q = torch.randn(13, Q_HEADS, 64, generator=g).half()
    k, v = torch.randn(13, KV_HEADS, 64, generator=g).half(), torch.randn(13, KV_HEADS, 64, generator=g).half()
    kv.forward(module, q, k, v, raw, prefill, 0.125, cache=cache)
    batch = Batch([5, 2, 6], [1, 1, 1], table, padding=0)
    meta = batch.metadata()

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"query_start_loc_cpu.{name} read on the decode-only path")

    meta.query_start_loc_cpu = Untouchable()
    host_reads = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    q = torch.randn(3, Q_HEADS, 64, generator=g).half()
    k, v = torch.randn(3, KV_HEADS, 64, generator=g).half(), torch.randn(3, KV_HEADS, 64, generator=g).half()
    with Watch():
        out = kv.forward(module, q, k, v, raw, meta, 0.125, torch.empty_like(q), cache=cache)
    assert seen, "the dispatch mode saw no operator"
    assert not host_reads & set(seen), sorted(host_reads & set(seen))
    meta.query_start_loc_cpu = meta.query_start_loc.clone()
    assert rel_err(out, expected(module, cache, batch, q, 0.125)) < 3e-3


def test_padded_decode_batch_as_a_full_cuda_graph_replays_it():
    """vLLM 0.13 pads a full-graph decode batch: the trailing requests have no query token (query_start_loc repeats
    its last value), seq_len 0 and block table rows of -1, num_actual_tokens is the padded count and the padding
    tokens' slots are -1. The real requests' rows are right and nothing outside the table is read."""
    module = kv.paged.load_module("int4_token")
    table = torch.tensor([[2, 0], [1, 3], [-1, -1], [-1, -1]], dtype=torch.int32)
    raw = raw_cache(module, 4, 64, torch.float16, seed=5)
    prefill = Batch([0, 0], [6, 3], table[:2], padding=0)
    g = torch.Generator().manual_seed(4)
    meta = prefill.metadata()
    q = torch.randn(9, Q_HEADS, 64, generator=g).half()
    k, v = torch.randn(9, KV_HEADS, 64, generator=g).half(), torch.randn(9, KV_HEADS, 64, generator=g).half()
    kv.forward(module, q, k, v, raw, meta, 0.125, torch.empty_like(q))

    real = Batch([6, 3], [1, 1], table[:2], padding=0).metadata()
    qsl = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)
    padded = kv.Metadata(num_reqs=4, num_actual_tokens=4, max_query_len=1, query_start_loc=qsl,
                         query_start_loc_cpu=qsl.clone(), seq_lens=torch.tensor([7, 4, 0, 0], dtype=torch.int32),
                         block_table=table, slot_mapping=torch.cat([real.slot_mapping, torch.tensor([-1, -1])]))
    q = torch.randn(4, Q_HEADS, 64, generator=g).half()
    k, v = torch.randn(4, KV_HEADS, 64, generator=g).half(), torch.randn(4, KV_HEADS, 64, generator=g).half()
    twin = raw.clone()
    out = kv.forward(module, q, k, v, raw, padded, 0.125, torch.full_like(q, 7.0))
    module.fill(kv.carve(module, twin, 64, torch.float16), k[:2], v[:2], real.slot_mapping)
    assert torch.equal(raw, twin)  # padding slots (-1) stored nothing
    cache = kv.carve(module, raw, 64, torch.float16)
    assert rel_err(out[:2], expected(module, cache, Batch([6, 3], [1, 1], table[:2], 0), q[:2], 0.125)) < 3e-3


def test_entry_point_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["vllm.general_plugins"] == {"kvqc": "kvqc.engines.vllm:register"}
    assert callable(kv.register)
    assert not any("vllm" in dep for deps in project["project"].get("optional-dependencies", {}).values()
                   for dep in deps)  # never on an install path


# ---------------------------------------------------------------------------------------------------- the vLLM glue

# A stand-in of the vLLM 0.13 names kvqc.engines.vllm uses, with their behaviour where kvqc relies on it (the spec
# classes' merge and page size, the builder's cudagraph support, the registry's overrides), copied from vLLM 0.13's
# source.
FAKE_VLLM = {
    "__init__.py": "__version__ = '0.13.0'\n",
    "attention/__init__.py": "",
    "attention/backends/__init__.py": "",
    "attention/backends/abstract.py": """
        class AttentionType:
            DECODER = "decoder"
            ENCODER = "encoder"

        class AttentionBackend:
            accept_output_buffer = False

            @classmethod
            def full_cls_name(cls):
                return (cls.__module__, cls.__qualname__)

        class AttentionImpl:
            pass
        """,
    "attention/backends/registry.py": """
        import enum

        class AttentionBackendEnum(enum.Enum):
            FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
            CUSTOM = ""

        _ATTN_OVERRIDES = {}

        def register_backend(backend, is_mamba=False, class_path=None):
            _ATTN_OVERRIDES[backend] = class_path
        """,
    "attention/layer.py": """
        class Attention:
            def get_kv_cache_spec(self, vllm_config):
                return "vllm's own spec"
        """,
    "v1/__init__.py": "",
    "v1/attention/__init__.py": "",
    "v1/attention/backends/__init__.py": "",
    "v1/attention/backends/utils.py": """
        import enum

        class AttentionCGSupport(enum.Enum):
            ALWAYS = 3
            UNIFORM_BATCH = 2
            UNIFORM_SINGLE_TOKEN_DECODE = 1
            NEVER = 0

        class AttentionMetadataBuilder:
            _cudagraph_support = AttentionCGSupport.NEVER
            reorder_batch_threshold = None

            def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
                self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (
                    kv_cache_spec, layer_names, vllm_config, device)

            @classmethod
            def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
                return cls._cudagraph_support
        """,
    "v1/kv_cache_interface.py": """
        import copy
        from dataclasses import dataclass, fields

        import torch

        @dataclass(frozen=True)
        class KVCacheSpec:
            block_size: int

            @classmethod
            def merge(cls, specs):
                assert all(spec == specs[0] for spec in specs[1:])
                return copy.deepcopy(specs[0])

        @dataclass(frozen=True)
        class AttentionSpec(KVCacheSpec):
            num_kv_heads: int
            head_size: int
            dtype: torch.dtype

            @property
            def page_size_bytes(self):
                return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

        @dataclass(frozen=True)
        class FullAttentionSpec(AttentionSpec):
            sliding_window: int | None = None
            attention_chunk_size: int | None = None

            @classmethod
            def merge(cls, specs):
                assert all(isinstance(spec, FullAttentionSpec) for spec in specs)
                merged = cls(block_size=specs[0].block_size, num_kv_heads=specs[0].num_kv_heads,
                             head_size=specs[0].head_size, dtype=specs[0].dtype)
                for spec in specs:
                    for f in fields(AttentionSpec):
                        assert getattr(spec, f.name) == getattr(merged, f.name)
                return merged
        """,
    "v1/core/__init__.py": "",
    "v1/core/single_type_kv_cache_manager.py": """
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        class FullAttentionManager:
            pass

        spec_manager_map = {FullAttentionSpec: FullAttentionManager}
        """,
}


def write_fake_vllm(root: Path, version: str = "0.13.0", edit: tuple[str, str, str] | None = None) -> None:
    """The stand-in under root/vllm; `edit` = (file, old, new) changes one file (a name renamed away)."""
    for name, text in FAKE_VLLM.items():
        text = textwrap.dedent(text)
        if name == "__init__.py":
            text = f"__version__ = {version!r}\n"
        if edit and edit[0] == name:
            assert edit[1] in text
            text = text.replace(edit[1], edit[2])
        path = root / "vllm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _forget_vllm() -> None:
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    for name in kv.CLASS_NAMES:
        vars(kv).pop(name, None)
    kv._BYTES_PER_TOKEN.clear()
    kv._warned.clear()
    kv.backend_module.cache_clear()


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """Import path with the stand-in vLLM package; kvqc.engines.vllm's classes and state forgotten before and after."""

    def install(**changes) -> Path:
        root = tmp_path / f"site{len(list(tmp_path.iterdir()))}"
        write_fake_vllm(root, **changes)
        _forget_vllm()
        monkeypatch.syspath_prepend(str(root))
        return root

    monkeypatch.setenv(kv.SCHEME_ENV, "turbo_k4v2")
    _forget_vllm()
    yield install
    _forget_vllm()


def test_register_and_run_through_the_classes(fake_vllm):
    fake_vllm()
    kv.register()
    import vllm.attention.backends.registry as registry
    from vllm.attention.layer import Attention
    from vllm.v1.core.single_type_kv_cache_manager import spec_manager_map

    assert registry._ATTN_OVERRIDES == {registry.AttentionBackendEnum.CUSTOM: "kvqc.engines.vllm.KVQCAttentionBackend"}
    backend = kv.KVQCAttentionBackend
    spec_cls = kv.KVQCAttentionSpec
    assert spec_manager_map[spec_cls].__name__ == "FullAttentionManager"
    kv.register()  # vLLM may load plugins again: nothing is wrapped twice
    assert Attention.get_kv_cache_spec.__closure__[0].cell_contents.__qualname__ == "Attention.get_kv_cache_spec"

    config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float16),
                                   cache_config=types.SimpleNamespace(block_size=BLOCK))
    other = Attention()
    assert Attention.get_kv_cache_spec(other, config) == "vllm's own spec"  # not on this backend
    layer = Attention()
    layer.attn_backend, layer.head_size, layer.num_kv_heads, layer.sliding_window = backend, 64, KV_HEADS, None
    spec = Attention.get_kv_cache_spec(layer, config)
    assert isinstance(spec, spec_cls) and spec.dtype == torch.uint8
    assert spec.page_size_bytes == BLOCK * KV_HEADS * 54  # turbo_k4v2, d=64, fp16 metadata: 54 bytes
    shape = backend.get_kv_cache_shape(5, BLOCK, KV_HEADS, 64)
    assert shape == (5, KV_HEADS, BLOCK, 54)
    assert backend.get_supported_head_sizes() == list(kv.backend_module().HEAD_DIMS)

    impl = backend.get_impl_cls()(Q_HEADS, 64, 0.125, KV_HEADS)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        backend.get_impl_cls()(Q_HEADS, 64, 0.125, KV_HEADS, None, 128)
    builder = backend.get_builder_cls()(spec, ["layer.0"], config, torch.device("cpu"))
    batch = Batch([0, 0], [3, 2], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), padding=1)
    m = batch.metadata()
    common = types.SimpleNamespace(num_reqs=2, num_actual_tokens=m.num_actual_tokens, max_query_len=3,
                                   query_start_loc=m.query_start_loc, query_start_loc_cpu=m.query_start_loc_cpu,
                                   seq_lens=m.seq_lens, block_table_tensor=m.block_table, slot_mapping=m.slot_mapping)
    meta = builder.build(0, common)
    raw = torch.zeros(shape, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, Q_HEADS, 64, generator=g).half()
    k, v = torch.randn(6, KV_HEADS, 64, generator=g).half(), torch.randn(6, KV_HEADS, 64, generator=g).half()
    out = impl.forward(None, q, k, v, raw, meta, output=torch.empty_like(q))
    module = kv.backend_module()
    want = expected(module, kv.carve(module, raw, 64, torch.float16), batch, q, 0.125)
    assert rel_err(out[:5], want) < 3e-3
    carved = impl._carved[2]
    impl.forward(None, q, k, v, raw, meta, output=torch.empty_like(q))
    assert impl._carved[2] is carved  # the same tensor next step: carved once
    assert not impl.forward(None, q, k, v, raw, None, output=torch.ones_like(q)).any()  # profiling run


def test_spec_keeps_vllms_equality_hash_and_merge(fake_vllm):
    fake_vllm()
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec_cls = kv.KVQCAttentionSpec
    a = spec_cls(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.uint8, kvqc_bytes_per_token=102)
    b = spec_cls(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.uint8, kvqc_bytes_per_token=102)
    c = dataclasses.replace(a, kvqc_bytes_per_token=70)
    assert a == b and hash(a) == hash(b) and len({a, b, c}) == 2 and a != c
    assert issubclass(spec_cls, FullAttentionSpec) and dataclasses.is_dataclass(spec_cls)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.block_size = 32
    assert a.page_size_bytes == 16 * 2 * 102
    merged = spec_cls.merge([a, b])
    assert type(merged) is spec_cls and merged == a and merged.page_size_bytes == a.page_size_bytes
    with pytest.raises(ValueError, match="kvqc_bytes_per_token"):
        spec_cls.merge([a, c])
    wider = a.__class__.merge([dataclasses.replace(a, block_size=32)])  # vLLM's copy_with_new_block_size path
    assert wider.page_size_bytes == 2 * a.page_size_bytes


def test_classes_pickle_by_qualified_name_into_a_fresh_process(fake_vllm):
    """vLLM sends specs between processes (tensor parallel workers, the engine core) with pickle; the receiving
    process has not used the backend yet, so unpickling alone must define the class there."""
    root = fake_vllm()
    spec = kv.KVQCAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                                kvqc_bytes_per_token=54)
    for name in kv.CLASS_NAMES:
        cls = getattr(kv, name)
        assert (cls.__module__, cls.__qualname__) == ("kvqc.engines.vllm", name) and vars(kv)[name] is cls
        assert pickle.loads(pickle.dumps(cls)) is cls
    assert kv.KVQCAttentionBackend.full_cls_name() == ("kvqc.engines.vllm", "KVQCAttentionBackend")
    assert pickle.loads(pickle.dumps(spec)) == spec
    script = (
        "import pickle, sys\n"
        "spec = pickle.loads(sys.stdin.buffer.read())\n"
        "import kvqc.engines.vllm\n"
        "assert type(spec) is kvqc.engines.vllm.KVQCAttentionSpec, type(spec)\n"
        "from vllm.v1.kv_cache_interface import FullAttentionSpec\n"
        "assert isinstance(spec, FullAttentionSpec)\n"
        "print(type(spec).__qualname__, spec.page_size_bytes, spec.kvqc_bytes_per_token, hash(spec) == hash(\n"
        "    kvqc.engines.vllm.KVQCAttentionSpec(16, 2, 64, spec.dtype, kvqc_bytes_per_token=54)))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(Path(kv.__file__).parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(spec), capture_output=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["KVQCAttentionSpec", str(16 * 2 * 54), "54", "True"]


def test_builder_declares_cuda_graphs_for_single_token_decode(fake_vllm):
    fake_vllm()
    from vllm.v1.attention.backends.utils import AttentionCGSupport

    builder = kv.KVQCAttentionBackend.get_builder_cls()
    assert builder.get_cudagraph_support(None, None) is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


@pytest.mark.parametrize("change,reason", [
    ({"version": "0.12.1"}, "found vllm 0.12.1"),
    ({"version": "0.14.0"}, "found vllm 0.14.0"),
    ({"edit": ("attention/backends/registry.py", "def register_backend", "def _register_backend")}, "ImportError"),
    ({"edit": ("v1/attention/backends/utils.py", "AttentionCGSupport", "CGSupport")}, "ImportError"),
    ({"edit": ("attention/backends/registry.py", 'CUSTOM = ""', 'OTHER = ""')}, "AttributeError: CUSTOM"),
    ({"edit": ("v1/core/single_type_kv_cache_manager.py", "{FullAttentionSpec: FullAttentionManager}", "{}")},
     "KeyError"),
])
def test_register_never_raises(fake_vllm, change, reason):
    """vLLM calls plugins in every process without catching: on another vLLM it warns once and changes nothing."""
    fake_vllm(**change)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kv.register()
        kv.register()
    assert len(caught) == 1 and reason in str(caught[0].message), [str(w.message) for w in caught]
    assert "vllm==0.13.*" in str(caught[0].message)
    from vllm.attention.layer import Attention

    assert not getattr(Attention.get_kv_cache_spec, "_kvqc", False)  # vLLM left as it was
    registry = sys.modules.get("vllm.attention.backends.registry")
    assert registry is None or registry._ATTN_OVERRIDES == {}


def test_register_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(kv, "_warned", set())
    for name in kv.CLASS_NAMES:
        assert name not in vars(kv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kv.register()
    message = str(caught[0].message) if len(caught) == 1 else caught
    assert "not registered (ModuleNotFoundError" in message and "vllm==0.13.*" in message
    with pytest.raises(ImportError, match=r"pip install 'vllm==0\.13\.\*'"):
        kv.KVQCAttentionBackend


def test_window_schemes_are_refused(monkeypatch):
    monkeypatch.setenv(kv.SCHEME_ENV, "sign1_window")
    with pytest.raises(ValueError, match="^KVQC_VLLM_SCHEME: sign1_window keeps"):
        kv.scheme_module()
