"""A vLLM attention backend on a kvqc generated module, registered as AttentionBackendEnum.CUSTOM.

    pip install -e . 'vllm==0.13.*'          # kvqc's entry point: vllm.general_plugins -> kvqc.vllm:register
    KVQC_VLLM_SCHEME=turbo_k4v2 vllm serve MODEL --attention-backend CUSTOM

Written against vLLM 0.13 (V1 engine): `vllm.attention.backends.registry.register_backend`,
`vllm.attention.backends.abstract.AttentionBackend / AttentionImpl`, `vllm.v1.attention.backends.utils.
AttentionMetadataBuilder / CommonAttentionMetadata`, `vllm.v1.kv_cache_interface.FullAttentionSpec`. Later vLLM
releases moved these (0.33 has `vllm.v1.attention.backend` and per-layout cache specs) and are not supported.
Nothing is imported from vllm until `register()` or one of the backend classes is asked for; the tensor work
below (`carve`, `Metadata`, `forward`) is plain torch and tested without vLLM.

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
attention sinks, encoder / cross attention, KV connectors and offloading, FP8 kv_cache_dtype, full CUDA graphs.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from . import paged
from .modules import meta_width

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

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    query_start_loc_cpu: torch.Tensor  # the same on the host: query lengths without a sync
    seq_lens: torch.Tensor  # [num_reqs] tokens per request after this step (cached + new)
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding

    @property
    def num_reqs(self) -> int:
        return self.query_start_loc_cpu.shape[0] - 1


def forward(
    module: ModuleType,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    metadata: Metadata,
    scale: float,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """One attention layer's step: store the new tokens' K/V, then attend. query [num_tokens, num_heads, head_dim],
    key / value [num_tokens, num_kv_heads, head_dim] or None (a layer sharing another's cache); returns output
    [num_tokens, num_heads, head_dim] (rows past num_actual_tokens, vLLM's padding, are left as they are)."""
    head_dim = query.shape[-1]
    if output is None:
        output = torch.zeros_like(query)
    cache = carve(module, kv_cache, head_dim, query.dtype)
    n = metadata.num_actual_tokens
    if key is not None and value is not None and n:
        module.fill(cache, key[:n], value[:n], metadata.slot_mapping[:n])
    starts = metadata.query_start_loc_cpu.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    reqs = len(q_lens)
    if reqs == 0:
        return output
    block_table, seq_lens = metadata.block_table[:reqs], metadata.seq_lens[:reqs]
    if all(q == 1 for q in q_lens):  # the decode-only step: no gathers
        output[:reqs] = module.decode(query[:reqs], cache, block_table, seq_lens, scale=scale)
        return output
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
            f"{SCHEME_ENV}: {module.SCHEME['name']} keeps each sequence's last {module.WINDOW} tokens in a ring row per "
            "sequence, which this backend does not allocate yet (use a scheme without window)"
        )
    if hasattr(module, "calibrate"):
        raise ValueError(
            f"{SCHEME_ENV}: {module.SCHEME['name']} splits off outlier channels, whose cache tensors and per-layer "
            "channel order this backend does not carve yet (use a scheme without outliers)"
        )
    return module


_BYTES_PER_TOKEN: dict[int, int] = {}  # head_size -> bytes per token and head, recorded when the spec is built


@functools.lru_cache(maxsize=None)
def _vllm_classes() -> dict[str, type]:
    """vLLM's side: the spec, metadata builder, impl and backend classes (imports vllm)."""
    from dataclasses import replace

    _require_vllm()
    from vllm.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionType
    from vllm.v1.attention.backends.utils import AttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    module = scheme_module()

    @dataclass(frozen=True)
    class KVQCAttentionSpec(FullAttentionSpec):
        """Pages of block_size * num_kv_heads * kvqc_bytes_per_token bytes; dtype is uint8 (the raw view)."""

        kvqc_bytes_per_token: int = 0

        @property
        def page_size_bytes(self) -> int:
            return self.block_size * self.num_kv_heads * self.kvqc_bytes_per_token

        @classmethod
        def merge(cls, specs):
            merged = super().merge(specs)  # FullAttentionSpec.merge rebuilds without our field
            if len({s.kvqc_bytes_per_token for s in specs}) != 1:
                raise ValueError("kvqc: layers of one KV cache group need the same bytes per token")
            return replace(merged, kvqc_bytes_per_token=specs[0].kvqc_bytes_per_token)

    class KVQCMetadataBuilder(AttentionMetadataBuilder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            m = common_attn_metadata
            return Metadata(
                num_actual_tokens=m.num_actual_tokens, query_start_loc=m.query_start_loc,
                query_start_loc_cpu=m.query_start_loc_cpu, seq_lens=m.seq_lens,
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

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                    output_block_scale=None):
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("output_scale: fused output quantization is not supported by kvqc")
            if attn_metadata is None:  # vLLM's profiling run
                return output.fill_(0) if output is not None else torch.zeros_like(query)
            if self.kv_sharing_target_layer_name is not None:
                key = value = None  # the target layer stored them
            return forward(module, query, key, value, kv_cache, attn_metadata, self.scale, output)

    class KVQCAttentionBackend(AttentionBackend):
        accept_output_buffer = True
        supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
        supported_kv_cache_dtypes = ["auto"]
        kvqc_module = module

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
            return list(module.HEAD_DIMS)

    return {c.__name__: c for c in (KVQCAttentionSpec, KVQCMetadataBuilder, KVQCAttentionImpl, KVQCAttentionBackend)}


def __getattr__(name: str):
    # vLLM resolves the backend by its qualified name and pickles specs between processes: both find the classes
    # here, built on first use.
    if name in ("KVQCAttentionSpec", "KVQCMetadataBuilder", "KVQCAttentionImpl", "KVQCAttentionBackend"):
        return _vllm_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kv_cache_spec(layer, vllm_config, original):
    """The layer's spec: kvqc's when the layer runs on this backend, vLLM's own otherwise."""
    classes = _vllm_classes()
    if getattr(layer, "attn_backend", None) is not classes["KVQCAttentionBackend"]:
        return original(layer, vllm_config)
    if getattr(layer, "sliding_window", None) is not None:
        raise NotImplementedError("sliding_window: the kvqc backend supports full-attention layers only")
    module = classes["KVQCAttentionBackend"].kvqc_module
    dtype = vllm_config.model_config.dtype
    per_token = module.bytes_per_token(layer.head_size, dtype)
    _BYTES_PER_TOKEN[layer.head_size] = per_token
    return classes["KVQCAttentionSpec"](block_size=vllm_config.cache_config.block_size,
                                        num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                                        dtype=torch.uint8, kvqc_bytes_per_token=per_token)


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ImportError(f"kvqc.vllm's backend needs vLLM: pip install 'vllm=={VLLM_VERSION}.*'") from None


def register() -> None:
    """The vllm.general_plugins entry point: make `--attention-backend CUSTOM` the kvqc backend (every process)."""
    _require_vllm()
    import vllm
    from vllm.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.attention.layer import Attention
    from vllm.v1.core.single_type_kv_cache_manager import spec_manager_map
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not str(getattr(vllm, "__version__", "")).startswith(VLLM_VERSION + "."):
        warnings.warn(f"kvqc.vllm follows vLLM {VLLM_VERSION}.x; found {vllm.__version__}", stacklevel=2)
    classes = _vllm_classes()
    register_backend(AttentionBackendEnum.CUSTOM, class_path=f"{__name__}.KVQCAttentionBackend")
    # The KV cache manager is looked up by the spec's exact type.
    spec_manager_map[classes["KVQCAttentionSpec"]] = spec_manager_map[FullAttentionSpec]
    if not getattr(Attention.get_kv_cache_spec, "_kvqc", False):
        original = Attention.get_kv_cache_spec

        def get_kv_cache_spec(self, vllm_config):
            return kv_cache_spec(self, vllm_config, original)

        get_kv_cache_spec._kvqc = True
        Attention.get_kv_cache_spec = get_kv_cache_spec
