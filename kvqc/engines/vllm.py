"""A vLLM attention backend on a kvqc generated module, registered as AttentionBackendEnum.CUSTOM.

    pip install -e . 'vllm==0.13.*'          # kvqc's entry point: vllm.general_plugins -> kvqc.engines.vllm:register
    KVQC_VLLM_SCHEME=turbo_k4v2 vllm serve MODEL --attention-backend CUSTOM

Written against vLLM 0.13 (V1 engine): `vllm.attention.backends.registry.register_backend`,
`vllm.attention.backends.abstract.AttentionBackend / AttentionImpl`, `vllm.v1.attention.backends.utils.
AttentionMetadataBuilder / CommonAttentionMetadata`, `vllm.v1.kv_cache_interface.FullAttentionSpec`. Later vLLM
releases moved these (0.33 has `vllm.v1.attention.backend` and per-layout cache specs) and are not supported.
Nothing is imported from vllm until `register()` or one of the backend classes is asked for; the tensor work
below (`carve`, `Metadata`, `forward`) is plain torch and tested without vLLM. The classes vLLM pickles or looks up
by name (the spec, builder, impl, backend) are attributes `kvqc.engines.vllm.<Name>` of this module, defined on first
use in each process. `register()` never raises: vLLM does not catch what a plugin raises, so a missing or other vLLM
must not stop it from starting.

The cache: vLLM gives each layer one raw byte tensor of num_blocks pages, viewed through the backend's
get_kv_cache_shape [num_blocks, num_kv_heads, block_size, bytes_per_token] (uint8). kvqc's kernels need each of
key_codes / key_meta / value_codes / value_meta contiguous, so the bytes are not interleaved per slot: `carve`
lays them out as four regions, all blocks' key codes, then all key metadata, then value codes, then value
metadata, each viewed as [num_blocks, num_kv_heads, block_size, ...] (metadata in the model dtype): kvqc's
head-major 'bhsd' layout, in which a KV head's tokens of a block are one run of memory. A page is
block_size * num_kv_heads * bytes_per_token bytes, which the KVQCAttentionSpec tells vLLM's allocator; the
Attention layers return that spec when they run on this backend (register() wraps get_kv_cache_spec).

Forward: the new tokens' K/V go through `fill` at vLLM's slot_mapping (-1 = padding, skipped); requests with one
query token run the module's paged `decode`; longer ones (prefill, chunked prefill, speculative verification)
attend causally over `flatten`'s dequantized K/V. Not supported: sliding window, ALiBi, logit soft-capping,
attention sinks, encoder / cross attention, KV connectors and offloading, FP8 kv_cache_dtype. CUDA graphs: the
builder declares UNIFORM_SINGLE_TOKEN_DECODE, so vLLM captures decode-only batches in full graphs and runs the
others outside them.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from dataclasses import dataclass, replace
from types import ModuleType

import torch

from kvqc.engines import paged
from kvqc.modules import meta_width

VLLM_VERSION = "0.13"
SCHEME_ENV = "KVQC_VLLM_SCHEME"  # read in every vLLM process, so an environment variable rather than an argument
DEFAULT_SCHEME = "turbo_k4v2"
_REGIONS = ("key_codes", "key_meta", "value_codes", "value_meta")


# ---------------------------------------------------------------------------------------------------- the cache


def region_bytes(module: ModuleType, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes per token and KV head of each region (they add up to module.bytes_per_token)."""
    item = torch.empty((), dtype=dtype).element_size()
    return {
        "key_codes": head_dim * module.KEY_CODE_BITS // 8,
        "key_meta": meta_width(module, "key", head_dim) * item,  # fields times scale groups
        "value_codes": head_dim * module.VALUE_CODE_BITS // 8,
        "value_meta": meta_width(module, "value", head_dim) * item,
    }


def carve(module: ModuleType, raw: torch.Tensor, head_dim: int, dtype: torch.dtype):
    """The module's KVCache over one layer's raw uint8 cache [num_blocks, num_kv_heads, block_size, bytes_per_token],
    as four contiguous regions (views, no copy) in the 'bhsd' layout."""
    if raw.dtype != torch.uint8 or raw.dim() != 4 or not raw.is_contiguous():
        raise ValueError(f"kv_cache: expected a contiguous uint8 [blocks, heads, block_size, bytes] tensor, got "
                         f"{raw.dtype} {list(raw.shape)}")
    sizes = region_bytes(module, head_dim, dtype)
    if raw.shape[-1] != sum(sizes.values()):
        raise ValueError(f"kv_cache: {raw.shape[-1]} bytes per token and head, {module.SCHEME['name']} at "
                         f"head_dim {head_dim} / {dtype} needs {sum(sizes.values())}")
    rows = tuple(raw.shape[:3])
    count = rows[0] * rows[1] * rows[2]
    flat = raw.view(-1)
    item = torch.empty((), dtype=dtype).element_size()
    views, at = {}, 0
    for name in _REGIONS:
        size = count * sizes[name]
        part = flat[at : at + size]
        if name.endswith("meta"):
            if (raw.data_ptr() + at) % item:  # .view(dtype) needs the region aligned to the metadata dtype
                raise ValueError(f"kv_cache: the {name} region starts at byte {at}, not aligned to {dtype}")
            part = part.view(dtype)
        views[name] = part.view(*rows, -1)
        at += size
    return module.KVCache(head_dim=head_dim, layout="bhsd", **views)


# ---------------------------------------------------------------------------------------------------- a step


@dataclass
class Metadata:
    """What forward needs from vLLM's CommonAttentionMetadata for one step (all requests of the batch)."""

    num_reqs: int  # rows of query_start_loc - 1: with full CUDA graphs, padded requests at the end (no tokens)
    num_actual_tokens: int  # with full CUDA graphs, the padded token count (padding slots are -1)
    max_query_len: int  # on the host: picks the decode-only path without reading a tensor
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    query_start_loc_cpu: torch.Tensor  # the same on the host: query lengths without a device sync
    seq_lens: torch.Tensor  # [num_reqs] tokens per request after this step (cached + new; 0 for padding)
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32 (-1 rows for padding)
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    decode_plan: object = None  # the module's DecodePlan, made by the step's first layer and shared by the others


def forward(
    module: ModuleType,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    metadata: Metadata,
    scale: float,
    output: torch.Tensor | None = None,
    cache: object | None = None,
) -> torch.Tensor:
    """One attention layer's step: store the new tokens' K/V, then attend. query [num_tokens, num_heads, head_dim],
    key / value [num_tokens, num_kv_heads, head_dim] or None (a layer sharing another's cache); returns output
    [num_tokens, num_heads, head_dim] (rows past num_actual_tokens, vLLM's padding, are left as they are).
    `cache`: carve(module, kv_cache, ...) done once by the caller, else carved here.

    A decode-only step (every request one query token) reads only host ints and launches fill and decode: no
    device sync and no data-dependent shape, so vLLM can capture it in a full CUDA graph. Steps with a longer
    query read the query lengths on the host and sync on the device (they run outside graphs)."""
    head_dim = query.shape[-1]
    if output is None:
        output = torch.zeros_like(query)
    if cache is None:
        cache = carve(module, kv_cache, head_dim, query.dtype)
    n = metadata.num_actual_tokens
    if key is not None and value is not None and n:
        module.fill(cache, key[:n], value[:n], metadata.slot_mapping[:n])
    reqs = metadata.num_reqs
    if reqs == 0:
        return output
    block_table, seq_lens = metadata.block_table[:reqs], metadata.seq_lens[:reqs]
    if metadata.max_query_len <= 1 and n == reqs:
        # Request i's token is row i. Under a full CUDA graph the trailing requests are padding (no query token,
        # seq_len 0, block table row -1): decode reads no block for them and their rows are discarded.
        # The step's layers share one plan (piecewise CUDA graphs run attention eagerly, once per layer).
        plan = paged.step_plan(module, metadata.decode_plan, query[:reqs], cache, block_table, seq_lens)
        metadata.decode_plan = plan or metadata.decode_plan
        if plan is not None:
            block_table, seq_lens = plan.block_tables, plan.seq_lens  # the tensors the plan was made with
        module.decode(query[:reqs], cache, block_table, seq_lens, scale=scale, plan=plan, out=output[:reqs])
        return output
    starts = metadata.query_start_loc_cpu[: reqs + 1].tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    device = query.device
    decodes = [i for i, q in enumerate(q_lens) if q == 1]
    longer = [i for i, q in enumerate(q_lens) if q > 1]
    if decodes:
        at = torch.tensor(decodes, device=device)
        rows = torch.tensor([starts[i] for i in decodes], device=device)
        output[rows] = module.decode(query[rows], cache, block_table[at], seq_lens[at].contiguous(), scale=scale)
    if longer:
        at = torch.tensor(longer, device=device)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in longer])
        lens = seq_lens[at].contiguous()
        k, v = module.flatten(cache, block_table[at], lens)
        output[rows] = paged.attend(query[rows], k, v, [q_lens[i] for i in longer], lens.tolist(), scale)
    return output


# ---------------------------------------------------------------------------------------------------- vLLM


def scheme_module() -> ModuleType:
    """The generated module named by $KVQC_VLLM_SCHEME (a scheme name, .py or .yaml path; default turbo_k4v2)."""
    module = paged.load_module(os.environ.get(SCHEME_ENV) or DEFAULT_SCHEME)
    if hasattr(module, "WINDOW"):
        raise ValueError(
            f"{SCHEME_ENV}: {module.SCHEME['name']} keeps each sequence's last {module.WINDOW} tokens in a ring row "
            "per sequence, which this backend does not allocate yet (use a scheme without window)"
        )
    if hasattr(module, "calibrate"):
        raise ValueError(
            f"{SCHEME_ENV}: {module.SCHEME['name']} splits off outlier channels, whose cache tensors and per-layer "
            "channel order this backend does not carve yet (use a scheme without outliers)"
        )
    return module


@functools.lru_cache(maxsize=None)
def backend_module() -> ModuleType:
    """scheme_module(), loaded once per process when the backend is first used (never by register())."""
    return scheme_module()


_BYTES_PER_TOKEN: dict[int, int] = {}  # head_size -> bytes per token and head, recorded when the spec is built
CLASS_NAMES = ("KVQCAttentionSpec", "KVQCMetadataBuilder", "KVQCAttentionImpl", "KVQCAttentionBackend")
_DEFINE_LOCK = threading.Lock()


def _vllm_classes() -> dict[str, type]:
    """The spec, metadata builder, impl and backend classes, subclasses of vLLM's (imports vllm on first call).

    They are defined once per process and stored as this module's attributes under their own names, with
    __module__ 'kvqc.engines.vllm' and __qualname__ their name: pickle (specs sent between vLLM's processes) and vLLM's
    class_path resolve them by that qualified name, and in a process that has not defined them yet the module
    __getattr__ below defines them. The lock keeps two threads from defining two different classes of one name,
    which would make pickling instances of the first fail."""
    namespace = globals()
    if all(name in namespace for name in CLASS_NAMES):
        return {name: namespace[name] for name in CLASS_NAMES}
    with _DEFINE_LOCK:
        if not all(name in namespace for name in CLASS_NAMES):
            _require_vllm()
            classes = _define_vllm_classes()
            for cls in classes.values():
                cls.__module__, cls.__qualname__ = __name__, cls.__name__
            namespace.update(classes)
    return {name: namespace[name] for name in CLASS_NAMES}


def _define_vllm_classes() -> dict[str, type]:
    from vllm.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionType
    from vllm.v1.attention.backends.utils import AttentionCGSupport, AttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    @dataclass(frozen=True)
    class KVQCAttentionSpec(FullAttentionSpec):
        """Pages of block_size * num_kv_heads * kvqc_bytes_per_token bytes; dtype is uint8 (the raw view).

        A frozen dataclass like vLLM's: equality and hash cover every field, this one included, so vLLM's
        grouping of layers by equal specs keeps layers of different byte counts apart."""

        kvqc_bytes_per_token: int = 0

        @property
        def page_size_bytes(self) -> int:
            return self.block_size * self.num_kv_heads * self.kvqc_bytes_per_token

        @classmethod
        def merge(cls, specs):
            # FullAttentionSpec.merge checks the shared fields and builds cls(...) without ours: put it back.
            if len({getattr(s, "kvqc_bytes_per_token", None) for s in specs}) != 1:
                raise ValueError("kvqc: layers of one KV cache group need the same kvqc_bytes_per_token")
            return replace(super().merge(specs), kvqc_bytes_per_token=specs[0].kvqc_bytes_per_token)

    class KVQCMetadataBuilder(AttentionMetadataBuilder):
        # A decode-only batch (one query token per request) runs fill + decode: no host sync, fixed shapes for a
        # fixed padded batch, padded requests harmless (see forward). Longer queries sync on the host (flatten +
        # torch attention), so neither mixed batches (ALWAYS) nor uniform multi-token ones (UNIFORM_BATCH, spec
        # decoding) may be captured; vLLM then runs those outside the graphs (FULL_AND_PIECEWISE) or eagerly.
        _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            m = common_attn_metadata
            return Metadata(
                num_reqs=m.num_reqs, num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                query_start_loc=m.query_start_loc, query_start_loc_cpu=m.query_start_loc_cpu, seq_lens=m.seq_lens,
                block_table=m.block_table_tensor, slot_mapping=m.slot_mapping,
            )

    class KVQCAttentionImpl(AttentionImpl):
        def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                     kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                     kv_sharing_target_layer_name=None, **kwargs):
            for name, got in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                              ("logits_soft_cap", logits_soft_cap), ("sinks", kwargs.get("sinks"))):
                if got is not None:
                    raise NotImplementedError(f"{name}: not supported by the kvqc backend")
            if attn_type != AttentionType.DECODER or kv_cache_dtype != "auto":
                raise NotImplementedError(f"kvqc backend: decoder attention with kv_cache_dtype 'auto' only, got "
                                          f"{attn_type} / {kv_cache_dtype!r}")
            self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
            self.num_kv_heads = num_kv_heads or num_heads
            self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
            self.module = backend_module()
            self._carved = None  # (raw tensor, dtype, KVCache): vLLM passes the layer the same tensor every step

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                    output_block_scale=None):
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("output_scale: fused output quantization is not supported by kvqc")
            if attn_metadata is None:  # vLLM's profiling run
                return output.fill_(0) if output is not None else torch.zeros_like(query)
            if self.kv_sharing_target_layer_name is not None:
                key = value = None  # the target layer stored them
            carved = self._carved
            if carved is None or carved[0] is not kv_cache or carved[1] != query.dtype:
                carved = self._carved = (kv_cache, query.dtype,
                                         carve(self.module, kv_cache, query.shape[-1], query.dtype))
            return forward(self.module, query, key, value, kv_cache, attn_metadata, self.scale, output,
                           cache=carved[2])

    class KVQCAttentionBackend(AttentionBackend):
        accept_output_buffer = True
        supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
        supported_kv_cache_dtypes = ["auto"]

        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return KVQCAttentionImpl

        @staticmethod
        def get_builder_cls():
            return KVQCMetadataBuilder

        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            if head_size not in _BYTES_PER_TOKEN:
                raise RuntimeError(f"kvqc: no KV cache spec was built for head_size {head_size} in this process")
            return (num_blocks, num_kv_heads, block_size, _BYTES_PER_TOKEN[head_size])

        @classmethod
        def get_supported_head_sizes(cls) -> list[int]:
            return list(backend_module().HEAD_DIMS)

    return {c.__name__: c for c in (KVQCAttentionSpec, KVQCMetadataBuilder, KVQCAttentionImpl, KVQCAttentionBackend)}


def __getattr__(name: str):
    # Only reached while the classes are not defined in this process yet (e.g. unpickling a spec in a process
    # that has not used the backend): afterwards they are ordinary module attributes.
    if name in CLASS_NAMES:
        return _vllm_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kv_cache_spec(layer, vllm_config, original):
    """The layer's spec: kvqc's when the layer runs on this backend, vLLM's own otherwise."""
    classes = _vllm_classes()
    if getattr(layer, "attn_backend", None) is not classes["KVQCAttentionBackend"]:
        return original(layer, vllm_config)
    if getattr(layer, "sliding_window", None) is not None:
        raise NotImplementedError("sliding_window: the kvqc backend supports full-attention layers only")
    dtype = vllm_config.model_config.dtype
    per_token = backend_module().bytes_per_token(layer.head_size, dtype)
    _BYTES_PER_TOKEN[layer.head_size] = per_token
    return classes["KVQCAttentionSpec"](block_size=vllm_config.cache_config.block_size,
                                        num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                                        dtype=torch.uint8, kvqc_bytes_per_token=per_token)


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ImportError(f"kvqc.engines.vllm's backend needs vLLM: pip install 'vllm=={VLLM_VERSION}.*'") from None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def register() -> None:
    """The vllm.general_plugins entry point: make `--attention-backend CUSTOM` the kvqc backend (every process).

    vLLM calls every general plugin in each of its processes without catching what it raises, so this never
    raises: without vLLM, on a vLLM other than 0.13.x or when one of the names it uses is missing, it warns once
    and leaves vLLM as it was."""
    try:
        _register()
    except Exception as error:  # noqa: BLE001 - the plugin must never stop vLLM from starting
        _warn_once("kvqc.engines.vllm: the kvqc attention backend is not registered "
                   f"({type(error).__name__}: {error}); it needs vllm=={VLLM_VERSION}.*")


def _register() -> None:
    import vllm

    version = str(getattr(vllm, "__version__", ""))
    if not version.startswith(VLLM_VERSION + "."):
        _warn_once(f"kvqc.engines.vllm: the kvqc attention backend is not registered: it follows vLLM {VLLM_VERSION}.x "
                   f"and found vllm {version or '(no version)'}; pip install 'vllm=={VLLM_VERSION}.*'")
        return
    from vllm.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.attention.layer import Attention
    from vllm.v1.core.single_type_kv_cache_manager import spec_manager_map
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    # Everything is looked up before anything of vLLM's is changed, so a missing name leaves vLLM untouched.
    classes = _vllm_classes()
    custom = AttentionBackendEnum.CUSTOM
    manager = spec_manager_map[FullAttentionSpec]
    original = Attention.get_kv_cache_spec
    register_backend(custom, class_path=f"{__name__}.KVQCAttentionBackend")
    # The KV cache manager is looked up by the spec's exact type.
    spec_manager_map[classes["KVQCAttentionSpec"]] = manager
    if not getattr(original, "_kvqc", False):

        def get_kv_cache_spec(self, vllm_config):
            return kv_cache_spec(self, vllm_config, original)

        get_kv_cache_spec._kvqc = True
        Attention.get_kv_cache_spec = get_kv_cache_spec
