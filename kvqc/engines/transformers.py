"""Run a Hugging Face transformers model (5.x) on a kvqc quantized KV cache.

    import kvqc.engines.transformers as kq                      # registers the "kvqc" attention on import
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=kq.ATTENTION)   # or set_attn_implementation
    kq.check_model(model)                               # unsupported features fail here, in one line
    past = kq.cache("turbo_k4v2", model.config, backend="reference")                      # or "triton", "interpreter"
    out = model.generate(**inputs, cache=past, max_new_tokens=32, do_sample=False)

transformers 5.24 takes the cache as `cache=` (generate and every forward) and deprecates `past_key_values=`;
earlier 5.x releases take only `past_key_values=`. `cache_argument(model)` says which one the installed release
wants (read off the model's forward signature): `model(ids, **{kq.cache_argument(model): past})`.

Each decoder layer owns one paged cache from the generated module's `allocate_cache`, one sequence per batch row.
New tokens are quantized into it by `fill`; tokens the attention mask marks as padding get slot -1, so they take no
space and never count in `seq_lens`. Prefill (more than one query token) attends over `flatten`'s dequantized K/V,
i.e. exactly what the cache holds, with causal masking; decode (one query token) calls the module's paged `decode`
kernel with the model's softmax scale (grouped-query attention is handled by the kernel). The cache is append-only:
nothing already stored is ever quantized again.

Backends (no fallback from one to another: the cache's `backend` attribute says which one ran):

    triton       the compiled kernels; needs CUDA and TRITON_INTERPRET unset
    interpreter  the same kernels under Triton's interpreter on CPU; TRITON_INTERPRET=1 must be set before the
                 generated module is imported (checked, with a clear error)
    reference    kvqc's float64 torch oracle (`module.reference`) on the same cache tensors and layout

`layer_schemes` maps a layer index (negative counts from the end) to another scheme for that layer, e.g.
`{0: "int8_token", 1: "int8_token", -2: "int8_token", -1: "int8_token"}`; the scheme "none" keeps that layer's K/V
unquantized in the model dtype (same append-only, padding-free layout, plain torch attention).

Sliding-window layers (config.layer_types "sliding_attention", e.g. five of every six layers of Gemma 3; or every
layer of a config with `sliding_window` and no `layer_types`) are kept unquantized, whatever the scheme: each row
holds at most its last `sliding_window` tokens there (older ones are dropped, as transformers' own sliding layers
do), so their memory does not grow with the context and quantizing them would save little; attention in them
covers the last `sliding_window` stored tokens, the query's own included. `layer_schemes` may map them to "none"
only. A model whose every layer slides would have nothing quantized and is refused.

How the pieces meet: transformers calls the cache's `update` before the attention function and does not pass it the
attention mask, so `update` only stages the new K/V and tags the returned key tensor with its layer; the "kvqc"
attention function (which receives the padding mask built by the matching "kvqc" mask function) stores them and
attends. The model must therefore run with attn_implementation="kvqc" and a cache from `cache()`; either one alone
raises a clear error rather than attending over the wrong tokens. Supported: decoder-only causal models whose
attention modules call the cache's `update` and then the AttentionInterface function (Llama, Mistral, Qwen2/3,
Gemma 3 and the like). Not supported, refused by `check_model` before any real work: encoder-decoder and
bidirectional models, ALiBi, attention-logit soft-capping, mask overlays (chunked attention, image-token blocks),
layer types other than full and sliding attention. Beam search and cache cropping raise NotImplementedError.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from kvqc import modules

ATTENTION = "kvqc"
BACKENDS = ("triton", "interpreter", "reference")
NONE = "none"  # the scheme name for an unquantized layer
FULL, SLIDING = "full_attention", "sliding_attention"  # the layer types kvqc caches take

_LAYER_ATTR = "_kvqc_layer"
_INITIAL_BLOCKS_PER_SEQ = 4


# ---------------------------------------------------------------------------------------------------- backends


class _Kernels:
    """fill / flatten / decode of a generated module, compiled or interpreted. positions and the ring rows are
    passed always: a scheme with a recent-token window needs them, the others ignore them."""

    def __init__(self, module: ModuleType):
        self.module = module

    def fill(self, cache, key, value, slots, positions, rows):
        self.module.fill(cache, key, value, slots, positions=positions, window_index=rows)

    def calibrate(self, cache, key, value):
        self.module.calibrate(cache, key, value)

    def flatten(self, cache, block_tables, seq_lens, rows):
        return self.module.flatten(cache, block_tables, seq_lens, window_index=rows)

    def decode(self, query, cache, block_tables, seq_lens, scale, rows):
        return self.module.decode(query, cache, block_tables, seq_lens, window_index=rows, scale=scale)


class _Reference:
    """The same surface through the module's float64 oracle; outputs come back in the cache's dtype and device."""

    def __init__(self, module: ModuleType):
        self.module = module
        self.oracle = module.reference  # a kvqc.oracle.reference.Reference bound to the module's embedded scheme

    def fill(self, cache, key, value, slots, positions, rows):
        self.oracle.fill(cache, key, value, slots, positions=positions, window_index=rows)

    def calibrate(self, cache, key, value):
        self.oracle.calibrate(cache, key, value)

    def flatten(self, cache, block_tables, seq_lens, rows):
        k, v = self.oracle.flatten(cache, block_tables, seq_lens, window_index=rows)
        return k.to(device=cache.device, dtype=cache.dtype), v.to(device=cache.device, dtype=cache.dtype)

    def decode(self, query, cache, block_tables, seq_lens, scale, rows):
        out = self.oracle.decode(query, cache, block_tables, seq_lens, scale=scale, window_index=rows)
        return out.to(device=query.device, dtype=query.dtype)


def _check_backend(backend: str, device: torch.device | None) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "triton":
        if modules.interpreting() or modules.triton_library_interpreted():
            raise RuntimeError(
                "backend 'triton': TRITON_INTERPRET=1 is set (or was when triton was imported), so the kernels would "
                "be interpreted, not compiled; "
                "use backend='interpreter' or unset TRITON_INTERPRET"
            )
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'triton' needs a CUDA GPU; on CPU use backend='reference' or 'interpreter'")
        if device is not None and device.type != "cuda":
            raise ValueError(f"backend 'triton' runs on CUDA tensors, got device {device}")
    elif backend == "interpreter":
        if not modules.interpreting() or modules.triton_library_interpreted() is False:
            raise RuntimeError(
                "backend 'interpreter' needs TRITON_INTERPRET=1 in the environment before triton is first imported "
                "(transformers imports it; Triton decides when it decorates kernels): run with "
                "`TRITON_INTERPRET=1 python ...`, or set os.environ['TRITON_INTERPRET'] = '1' before any import of "
                "transformers or triton"
            )
        if device is not None and device.type != "cpu":
            raise ValueError(f"backend 'interpreter' runs on CPU tensors, got device {device}")


@functools.lru_cache(maxsize=None)
def _bind(module: ModuleType, backend: str):
    """One backend object per module and backend, shared by the layers (the oracle builds its tables once)."""
    if backend == "reference":
        return _Reference(module)
    want = backend == "interpreter"
    if bool(getattr(module, "_INTERPRET", want)) != want:
        raise RuntimeError(
            f"{module.__file__}: imported with TRITON_INTERPRET={'1' if module._INTERPRET else 'unset'}, "
            f"which does not match backend {backend!r}"
        )
    return _Kernels(module)


# ---------------------------------------------------------------------------------------------------- layers


class _Layer(CacheLayerMixin):
    """Common bookkeeping: transformers' position count, per-row token counts and the staged update."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    window: int | None = None  # tokens a query attends to (its own included) in a sliding-window layer
    # decode_time: a pass of several tokens reads, for each of them, the scheme's last `exact_recent` tokens as
    # given, as a decoded token reads its ring (0: every token reads the cache as the whole pass left it).
    exact_recent: int = 0

    def __init__(self, layer_idx: int, scheme: str, num_kv_heads: int, head_dim: int, *, device, dtype,
                 max_cache_len: int | None):
        super().__init__()
        self.layer_idx, self.scheme = layer_idx, scheme
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.want_device, self.want_dtype = device, dtype
        self.max_cache_len = max_cache_len
        self.cumulative_length = 0  # positions transformers has fed, padding included (what masks are sized by)
        self.seq_lens: list[int] = []  # tokens stored per row, padding excluded
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def __repr__(self):
        return f"{type(self).__name__}(layer={self.layer_idx}, scheme={self.scheme!r}, seq_lens={self.seq_lens})"

    # -- the transformers cache-layer interface

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if heads != self.num_kv_heads or dim != self.head_dim:
            raise ValueError(
                f"layer {self.layer_idx}: got K/V with {heads} heads of {dim}, the config says "
                f"{self.num_kv_heads} KV heads of {self.head_dim}"
            )
        self.device = torch.device(self.want_device) if self.want_device is not None else key_states.device
        if self.device != key_states.device:
            raise ValueError(f"layer {self.layer_idx}: cache device {self.device}, K/V on {key_states.device}")
        self.dtype = self.want_dtype or key_states.dtype
        self.batch = batch
        self.seq_lens = [0] * batch
        self._allocate(batch)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._pending is not None:
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous update was never stored; the model must run with "
                f"attn_implementation={ATTENTION!r} (model.set_attn_implementation({ATTENTION!r})) to use a kvqc cache"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch:
            raise ValueError(f"layer {self.layer_idx}: batch {key_states.shape[0]}, the cache holds {self.batch} rows")
        self.cumulative_length += key_states.shape[-2]
        self._pending = (key_states, value_states)
        setattr(key_states, _LAYER_ATTR, self)  # the attention function finds its layer through the key tensor
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len if self.max_cache_len is not None else -1

    def reset(self) -> None:
        self.cumulative_length = 0
        self.seq_lens = []
        self._pending = None
        self.is_initialized = False
        self._release()

    def offload(self):
        pass  # kvqc caches stay where they were allocated

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("kvqc caches do not support beam search (rows would share append-only blocks)")

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("kvqc caches are append-only and cannot be cropped (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("kvqc caches cannot be expanded after prefill (num_return_sequences, beams)")

    def batch_select_indices(self, indices):
        raise NotImplementedError("kvqc caches cannot select rows after prefill")

    # -- storing and attending, called by the attention function

    def commit(self, keep: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
        """Store the staged K/V; keep [batch, new tokens] bool (None: all real). Returns tokens stored before, keep."""
        if self._pending is None:
            raise RuntimeError(f"layer {self.layer_idx}: attention ran without a cache update")
        key, value = self._pending
        self._pending = None
        batch, _, tokens, _ = key.shape
        keep = torch.ones(batch, tokens, dtype=torch.bool) if keep is None else keep.detach().to("cpu", torch.bool)
        self._forget()
        before = list(self.seq_lens)
        counts = keep.sum(dim=1).tolist()
        after = [n + c for n, c in zip(before, counts)]
        if self.max_cache_len is not None and max(after) > self.max_cache_len:
            raise ValueError(f"layer {self.layer_idx}: {max(after)} tokens exceed max_cache_len {self.max_cache_len}")
        self._store(key, value, keep, before, after)
        self.seq_lens = after
        return before, keep

    def sequences(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per row, the stored K and V as the model sees them: [seq_len, num_kv_heads, head_dim] each."""
        raise NotImplementedError

    def decode(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """query [batch, num_q_heads, head_dim] -> attention over each row's stored tokens, same shape."""
        raise NotImplementedError

    def _allocate(self, batch: int) -> None:
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop stored tokens no future query can attend to (sliding-window layers); before each store."""

    def _release(self) -> None:
        raise NotImplementedError

    def _store(self, key, value, keep, before, after) -> None:
        raise NotImplementedError


class QuantizedLayer(_Layer):
    """One layer's paged kvqc cache: `cache` (the module's KVCache), `block_tables`, `seq_lens`."""

    def __init__(self, layer_idx: int, scheme: str, module: ModuleType, backend: str, num_kv_heads: int, head_dim: int,
                 *, device, dtype, block_size: int, max_cache_len: int | None):
        super().__init__(layer_idx, scheme, num_kv_heads, head_dim, device=device, dtype=dtype,
                         max_cache_len=max_cache_len)
        self.module, self.backend, self.block_size = module, backend, block_size
        self.calibration: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V [tokens, heads, dim] for calibrate
        self.ops = _bind(module, backend)
        self.cache = None
        self._tables: torch.Tensor | None = None  # int64 [batch, blocks per row], on the CPU
        self._owned: list[int] = []  # blocks assigned per row
        self._next_block = 0
        self._device_tables: torch.Tensor | None = None

    def _allocate(self, batch: int) -> None:
        if self.max_cache_len is not None:
            per_row = max(1, -(-self.max_cache_len // self.block_size))
            num_blocks = batch * per_row
            self._tables = torch.arange(num_blocks, dtype=torch.int64).view(batch, per_row)
            self._owned = [per_row] * batch
            self._next_block = num_blocks
        else:
            num_blocks = batch * _INITIAL_BLOCKS_PER_SEQ
            self._tables = torch.zeros(batch, _INITIAL_BLOCKS_PER_SEQ, dtype=torch.int64)
            self._owned = [0] * batch
            self._next_block = 0
        self.cache = self._new_cache(num_blocks)
        self._device_tables = None

    def _new_cache(self, num_blocks: int):
        # A scheme with a recent-token window keeps one ring row per batch row (window_index = the row).
        rows = {"max_seqs": len(self._owned)} if hasattr(self.module, "WINDOW") else {}
        return self.module.allocate_cache(num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                                          device=self.device, dtype=self.dtype, **rows)

    def _rows(self) -> torch.Tensor:
        return torch.arange(len(self._owned), dtype=torch.int64, device=self.device)

    def _release(self) -> None:
        self.cache = self._tables = self._device_tables = None
        self._owned, self._next_block = [], 0

    def _grow(self, after: list[int]) -> None:
        """Give every row enough blocks for `after` tokens, growing the pool (doubling) and the tables."""
        need = [-(-n // self.block_size) for n in after]
        extra = sum(max(0, n - o) for n, o in zip(need, self._owned))
        if not extra:
            return
        if self._next_block + extra > self.cache.num_blocks:
            num_blocks = max(self._next_block + extra, 2 * self.cache.num_blocks)
            grown = self._new_cache(num_blocks)
            for field in (f.name for f in dataclasses.fields(grown) if f.name.endswith(("_codes", "_meta"))):
                getattr(grown, field)[: self.cache.num_blocks].copy_(getattr(self.cache, field))
            for field in ("key_channels", "value_channels", "key_mean"):  # as calibrate chose them
                if getattr(self.cache, field, None) is not None:
                    setattr(grown, field, getattr(self.cache, field))
            for field in ("key_window", "value_window"):
                if hasattr(grown, field):
                    getattr(grown, field).copy_(getattr(self.cache, field))
            self.cache = grown
        if max(need) > self._tables.shape[1]:
            columns = max(max(need), 2 * self._tables.shape[1])
            self._tables = F.pad(self._tables, (0, columns - self._tables.shape[1]))
        for row, (n, owned) in enumerate(zip(need, self._owned)):
            for column in range(owned, n):
                self._tables[row, column] = self._next_block
                self._next_block += 1
            self._owned[row] = max(owned, n)
        self._device_tables = None

    @property
    def block_tables(self) -> torch.Tensor:
        """int32 [batch, blocks per row] on the cache's device (entries past a row's blocks are 0 and never read)."""
        if self._device_tables is None:
            self._device_tables = self._tables.to(device=self.device, dtype=torch.int32)
        return self._device_tables

    def seq_lens_tensor(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=self.device)

    def _store(self, key, value, keep, before, after) -> None:
        self._grow(after)
        batch, heads, tokens, dim = key.shape
        position = torch.tensor(before, dtype=torch.int64)[:, None] + keep.cumsum(dim=1) - 1
        position = position.clamp_min(0)
        block = self._tables.gather(1, position // self.block_size)
        slots = torch.where(keep, block * self.block_size + position % self.block_size, torch.full_like(block, -1))
        k = key.transpose(1, 2).reshape(batch * tokens, heads, dim).contiguous()
        v = value.transpose(1, 2).reshape(batch * tokens, heads, dim).contiguous()
        positions = position.view(-1).to(self.device)
        rows = self._rows().repeat_interleave(tokens)
        chosen = [getattr(self.cache, f) for f in ("key_channels", "value_channels", "key_mean")
                  if hasattr(self.cache, f)]
        if any(c is None for c in chosen):
            # A channel split's outlier channels and a centered key's mean are set once per layer: from the
            # calibration samples given, else from the first tokens stored (the prompt's), padding excluded.
            if self.calibration is not None:
                self.ops.calibrate(self.cache, *(x.to(self.device) for x in self.calibration))
            else:
                kept = keep.reshape(-1).to(self.device)
                self.ops.calibrate(self.cache, k[kept], v[kept])
        self.ops.fill(self.cache, k, v, slots.view(-1).to(self.device), positions, rows)

    def flatten(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's dequantized K and V one after another: [sum(seq_lens), num_kv_heads, head_dim] each."""
        return self.ops.flatten(self.cache, self.block_tables, self.seq_lens_tensor(), self._rows())

    def sequences(self):
        k, v = self.flatten()
        return list(zip(k.split(self.seq_lens), v.split(self.seq_lens)))

    def decode(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        return self.ops.decode(query.contiguous(), self.cache, self.block_tables, self.seq_lens_tensor(), scale,
                               self._rows())


class FullPrecisionLayer(_Layer):
    """The scheme "none": K/V kept unquantized in the cache dtype, rows padding-free like the quantized layers."""

    backend = "torch"

    def _allocate(self, batch: int) -> None:
        capacity = self.max_cache_len or 64
        shape = (batch, self.num_kv_heads, capacity, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)

    def _release(self) -> None:
        self.keys = self.values = None

    def _store(self, key, value, keep, before, after) -> None:
        if max(after) > self.keys.shape[2]:
            grow = max(max(after), 2 * self.keys.shape[2]) - self.keys.shape[2]
            self.keys = F.pad(self.keys, (0, 0, 0, grow))
            self.values = F.pad(self.values, (0, 0, 0, grow))
        for row, start in enumerate(before):
            index = keep[row].nonzero().view(-1).to(key.device)
            n = index.numel()
            if n:
                self.keys[row, :, start : start + n] = key[row].index_select(1, index).to(self.dtype)
                self.values[row, :, start : start + n] = value[row].index_select(1, index).to(self.dtype)

    def sequences(self):
        return [
            (self.keys[row, :, :n].transpose(0, 1), self.values[row, :, :n].transpose(0, 1))
            for row, n in enumerate(self.seq_lens)
        ]

    def decode(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        batch, q_heads, dim = query.shape
        longest = max(self.seq_lens) if self.seq_lens else 0
        out = torch.zeros(batch, q_heads, dim, dtype=query.dtype, device=query.device)
        if longest == 0:
            return out
        group = q_heads // self.num_kv_heads
        compute = torch.promote_types(query.dtype, torch.float32)
        k = self.keys[:, :, :longest].to(compute).repeat_interleave(group, dim=1)
        v = self.values[:, :, :longest].to(compute).repeat_interleave(group, dim=1)
        lens = torch.tensor(self.seq_lens, device=query.device)
        valid = torch.arange(longest, device=query.device)[None, :] < lens[:, None]  # [batch, longest]
        o = F.scaled_dot_product_attention(
            query.to(compute)[:, :, None], k, v, attn_mask=valid[:, None, None, :], scale=scale
        )[:, :, 0]
        return torch.where((lens > 0)[:, None, None], o, torch.zeros_like(o)).to(query.dtype)


class SlidingWindowLayer(FullPrecisionLayer):
    """A sliding-window layer: unquantized, each row keeps its last `window - 1` tokens before storing new ones, so a
    query attends to at most `window` tokens (its own included), as transformers' sliding masks allow."""

    is_sliding = True

    def __init__(self, layer_idx: int, window: int, num_kv_heads: int, head_dim: int, *, device, dtype,
                 max_cache_len: int | None):
        super().__init__(layer_idx, NONE, num_kv_heads, head_dim, device=device, dtype=dtype,
                         max_cache_len=max_cache_len)
        self.window = window

    def __repr__(self):
        return f"{type(self).__name__}(layer={self.layer_idx}, window={self.window}, seq_lens={self.seq_lens})"

    def get_max_length(self) -> int:
        return self.window

    def _allocate(self, batch: int) -> None:
        # A row holds at most window - 1 tokens plus one forward's new ones: no need to reserve max_cache_len.
        capacity = min(self.max_cache_len or 64, self.window)
        shape = (batch, self.num_kv_heads, capacity, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)

    def _forget(self) -> None:
        keep = self.window - 1
        for row, n in enumerate(self.seq_lens):
            if n > keep:
                if keep:
                    self.keys[row, :, :keep] = self.keys[row, :, n - keep : n].clone()
                    self.values[row, :, :keep] = self.values[row, :, n - keep : n].clone()
                self.seq_lens[row] = keep


# ---------------------------------------------------------------------------------------------------- the cache


class KVQCCache(Cache):
    """A transformers Cache of kvqc layers. `backend`, `schemes` (per layer) and `describe()` say what runs."""

    def __init__(self, layers: list[_Layer], backend: str):
        super().__init__(layers=layers)
        self.backend = backend

    @property
    def schemes(self) -> list[str]:
        return [layer.scheme for layer in self.layers]

    def describe(self) -> dict[str, Any]:
        quantized = [layer for layer in self.layers if isinstance(layer, QuantizedLayer)]
        sliding = [layer for layer in self.layers if layer.window is not None]
        return {
            "backend": self.backend if quantized else "torch (no quantized layer)",
            "layer_schemes": self.schemes,
            "quantized_layers": len(quantized),
            "block_size": quantized[0].block_size if quantized else None,
            "sliding_window_layers": [layer.layer_idx for layer in sliding],
            "sliding_window": sliding[0].window if sliding else None,
        }


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _scheme_label(scheme: str | Path) -> str:
    text = str(scheme)
    return text if text == NONE else (Path(text).stem if text.endswith((".py", ".yaml", ".yml")) else text)


def model_name(config) -> str:
    """What error messages call the model: the path or hub id it was loaded from, else its model type."""
    return (getattr(config, "_name_or_path", None) or getattr(_text_config(config), "model_type", None)
            or type(config).__name__)


def layer_types(config) -> list[str]:
    """Each layer's attention type: config.layer_types where the config has it, else every layer "sliding_attention"
    when the config sets `sliding_window` (Mistral-style: the model applies it to every layer) or "full_attention"."""
    text = _text_config(config)
    types = getattr(text, "layer_types", None)
    if types:
        return list(types)
    return [SLIDING if getattr(text, "sliding_window", None) is not None else FULL] * text.num_hidden_layers


def full_layers(config) -> list[int]:
    """Indices of the full-attention layers: those a quantized scheme applies to."""
    return [i for i, t in enumerate(layer_types(config)) if t == FULL]


def format_layers(indices: list[int]) -> str:
    """[0, 1, 2, 4, 6, 7] -> '0-2, 4, 6-7'."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "none"


def _config_problem(config, types: list[str]) -> str | None:
    """What the config shows kvqc cannot run, as 'feature; what to do', or None."""
    text = _text_config(config)
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        return "encoder-decoder (cross-attention) layers are not supported; use a decoder-only causal model"
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        return "bidirectional attention is not supported; kvqc caches serve causal decoder-only models"
    attn_config = getattr(text, "attn_config", None)
    if (getattr(text, "model_type", None) == "bloom" or getattr(text, "alibi", False)
            or getattr(attn_config, "alibi", False) or getattr(text, "position_embedding_type", None) == "alibi"):
        return "ALiBi position biases are not supported (the kvqc attention adds no bias); use a rotary-embedding model"
    other = [i for i, t in enumerate(types) if t not in (FULL, SLIDING)]
    if other:
        kinds = ", ".join(sorted({types[i] for i in other}))
        return (f"layer type {kinds} (layers {format_layers(other)}) is not supported; kvqc caches take "
                f"'{FULL}' and '{SLIDING}' layers only")
    if SLIDING in types and getattr(text, "sliding_window", None) is None:
        return f"'{SLIDING}' layers without config.sliding_window; set the window the model was trained with"
    if FULL not in types:
        return ("every layer uses a sliding window, which kvqc keeps unquantized, so nothing would be quantized; "
                "use a model with full-attention layers")
    return None


@functools.lru_cache(maxsize=None)
def _forward_takes_cache(model_class: type) -> bool:
    return "cache" in inspect.signature(model_class.forward).parameters


def cache_argument(model) -> str:
    """The keyword the model's forward (and generate) take a cache by: "cache" from transformers 5.24 on, where
    `past_key_values` is deprecated, else "past_key_values". Read off the forward's signature, not the version."""
    return "cache" if _forward_takes_cache(type(model)) else "past_key_values"


def check_model(model, *, probe: bool = True) -> None:
    """Raise NotImplementedError (one line: the model, the feature, what to do) if the kvqc attention cannot run
    `model`. probe: also run a 3-token forward (prefill of 2, decode of 1) through an unquantized kvqc cache, which
    finds what only the model's code shows (soft-capping, mask overlays, attention modules that bypass the cache)."""
    name = model_name(model.config)
    problem = _config_problem(model.config, layer_types(model.config))
    if problem is not None:
        raise NotImplementedError(f"model {name}: {problem}")
    if not probe:
        return
    previous = model.config._attn_implementation
    past = cache(NONE, model.config, backend="reference")
    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)  # any token id; only the code path matters
    argument = {cache_argument(model): past}
    try:
        model.set_attn_implementation(ATTENTION)
    except (ValueError, ImportError) as exc:
        raise NotImplementedError(
            f"model {name}: does not take a custom attention function ({exc}); kvqc needs attn_implementation="
            f"{ATTENTION!r}"
        ) from None
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **argument)
            model(input_ids=ids[:, :1], use_cache=True, **argument)
    except (NotImplementedError, RuntimeError, ValueError) as exc:
        raise NotImplementedError(f"model {name}: {exc}") from None
    finally:
        model.set_attn_implementation(previous)
    missed = [layer.layer_idx for layer in past.layers if layer.cumulative_length != 3 or layer._pending is not None]
    if missed:
        raise NotImplementedError(
            f"model {name}: layers {format_layers(missed)} did not store their K/V through the kvqc attention (their "
            "attention modules must call the cache's update, then the AttentionInterface function); kvqc supports "
            "Llama-style attention modules"
        )


def _fitting_block_size(module: ModuleType, block_size: int) -> int:
    """block_size, or its least multiple a scheme with per-channel scales takes: their scale groups of tokens may not
    straddle blocks (KIVI's keys: 32 tokens)."""
    for side in ("key", "value"):
        scale = module.SCHEME[side]["scale"]
        if scale.get("axis") == "channel":
            block_size = math.lcm(block_size, scale["group_size"])
    return block_size


def cache(
    scheme: str | Path,
    config,
    *,
    backend: str,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    block_size: int = 16,
    max_cache_len: int | None = None,
    layer_schemes: dict[int, str | Path] | None = None,
    decode_time: bool = False,
    calibration: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> KVQCCache:
    """A kvqc cache for a model with `config`: pass it as `cache=` (`past_key_values=` before transformers 5.24;
    `cache_argument(model)` says which) with attn_implementation="kvqc". Sliding-window layers are kept unquantized.

    scheme: a scheme name, a generated .py, a scheme .yaml, or "none" (unquantized). backend: "triton",
    "interpreter" or "reference". device / dtype: of the cache tensors (default: those of the first K/V stored);
    dtype is the metadata dtype of quantized layers and the storage dtype of "none" layers. block_size: tokens
    per cache block (a scheme with per-channel scales takes its least multiple of their token group).
    max_cache_len: allocate every row's blocks up front for this many tokens (default: blocks on demand).
    layer_schemes: {layer index: scheme} overrides, negative indices counting from the last layer.
    decode_time: a pass of several tokens attends as decoding them one at a time would, for schemes with a
    recent-token window: token i reads tokens i - WINDOW + 1 .. i as given and older ones from the cache (without
    it every token of the pass reads the cache as the whole pass left it, its ring holding the pass's last tokens);
    what `kvqc eval --decode-time` measures perplexity with. calibration: {layer index: (key, value) [tokens,
    num_kv_heads, head_dim]}, the samples a scheme that calibrates (a channel split, a centered key) takes its
    choice from in that layer, e.g. K/V of a calibration text (`calibration_samples`); a layer without them
    calibrates on the first tokens it stores.
    """
    device = torch.device(device) if device is not None else None
    _check_backend(backend, device)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                      or max_cache_len < 1):
        raise ValueError(f"max_cache_len: expected a positive int or None, got {max_cache_len!r}")
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")

    text = _text_config(config)
    num_layers = text.num_hidden_layers
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    types = layer_types(config)
    problem = _config_problem(config, types)
    if problem is not None:
        raise NotImplementedError(f"model {model_name(config)}: {problem}")
    window = getattr(text, "sliding_window", None)

    chosen: list[str | Path] = [scheme] * num_layers
    for index, other in (layer_schemes or {}).items():
        if isinstance(index, bool) or not isinstance(index, int) or not -num_layers <= index < num_layers:
            raise ValueError(f"layer_schemes: layer {index!r} is not in 0..{num_layers - 1} (or -1..-{num_layers})")
        if types[index % num_layers] == SLIDING and str(other) != NONE:
            raise ValueError(
                f"layer_schemes: layer {index} uses a {window}-token sliding window, which kvqc keeps unquantized; "
                f"map it to 'none' or leave it out (full-attention layers: {format_layers(full_layers(config))})"
            )
        chosen[index % num_layers] = other

    loaded: dict[str, ModuleType] = {}
    layers: list[_Layer] = []
    for index, name in enumerate(chosen):
        label = _scheme_label(name)
        common = dict(device=device, dtype=dtype, max_cache_len=max_cache_len)
        if types[index] == SLIDING:
            layers.append(SlidingWindowLayer(index, window, num_kv_heads, head_dim, **common))
            continue
        if str(name) == NONE:
            layers.append(FullPrecisionLayer(index, NONE, num_kv_heads, head_dim, **common))
            continue
        key = str(name)
        if key not in loaded:
            module = modules.load(name)
            if head_dim not in module.HEAD_DIMS:
                raise ValueError(
                    f"{label}: the model's head_dim is {head_dim}; the scheme is built for head_dims "
                    f"{list(module.HEAD_DIMS)} (add it to the scheme's head_dims and rebuild)"
                )
            loaded[key] = module
        layers.append(QuantizedLayer(index, label, loaded[key], backend, num_kv_heads, head_dim,
                                     block_size=_fitting_block_size(loaded[key], block_size), **common))
        if decode_time:
            layers[-1].exact_recent = getattr(loaded[key], "WINDOW", 0)
        layers[-1].calibration = (calibration or {}).get(index)
    return KVQCCache(layers, backend)


def calibration_samples(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer index: (key, value) [tokens, num_kv_heads, head_dim]}: the K/V each full-attention layer of `model`
    computes over the token ids [1, tokens] (a calibration text), for `cache(..., calibration=...)`."""
    past = cache(NONE, model.config, backend="reference")
    with torch.no_grad():
        model(ids, **{cache_argument(model): past, "use_cache": True})
    return {layer.layer_idx: layer.sequences()[0] for layer in past.layers if layer.window is None}


# ---------------------------------------------------------------------------------------------------- attention


def _padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The "kvqc" mask: the 2D padding mask [batch, kv_length] (True = real token), or None when nothing is padded.

    Causality and a layer's sliding window are applied by the attention function itself, over each row's stored
    (padding-free) tokens.
    """
    # A plain causal mask, or transformers' sliding-window one (it alone passes local_size); any overlay (chunked
    # attention, image-token blocks, packed sequences) switches to vmap or forbids the causal skip.
    plain = mask_function is causal_mask_function or kwargs.get("local_size") is not None
    if not plain or kwargs.get("use_vmap", False) or not kwargs.get("allow_is_causal_skip", True):
        raise NotImplementedError(
            "mask overlays (chunked attention, bidirectional or image-token blocks, packed sequences) are not "
            "supported by the kvqc attention; run text-only input, one sequence per row"
        )
    if attention_mask is None:
        return None
    mask = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if mask.shape[-1] != kv_length:
        raise ValueError(f"attention_mask: covers {mask.shape[-1]} positions, expected {kv_length} (past + new tokens)")
    return None if bool(mask.all()) else mask


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "kvqc" attention function: store the new K/V in the layer's kvqc cache, then attend over the cache."""
    layer: _Layer | None = getattr(key, _LAYER_ATTR, None)
    if layer is None:
        raise RuntimeError(
            f"attn_implementation={ATTENTION!r} needs a kvqc.engines.transformers.cache(...) passed as cache= "
            "(past_key_values= before transformers 5.24) and use_cache=True"
        )
    delattr(key, _LAYER_ATTR)
    if kwargs.get("softcap") is not None:
        layer._pending = None
        raise NotImplementedError(
            f"attention logit soft-capping (softcap={kwargs['softcap']}) is not supported by the kvqc attention; "
            "use a model without it"
        )
    window = kwargs.get("sliding_window")
    if window != layer.window:
        layer._pending = None
        raise ValueError(
            f"layer {layer.layer_idx}: the model attends over "
            f"{'a ' + str(window) + '-token sliding window' if window else 'all tokens'}, the cache layer over "
            f"{'a ' + str(layer.window) + '-token window' if layer.window else 'all tokens'}; build the cache from "
            "this model's config"
        )
    batch, q_heads, tokens, dim = query.shape
    if q_heads % layer.num_kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {layer.num_kv_heads} KV heads")
    scale = dim**-0.5 if scaling is None else float(scaling)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError("the kvqc attention takes 2D padding masks only (got a prepared 4D mask)")
    keep = None if attention_mask is None else attention_mask[:, -tokens:]
    before, keep = layer.commit(keep)

    if tokens == 1:
        out = layer.decode(query[:, :, 0, :], scale)  # [batch, q_heads, dim]
        if not bool(keep.all()):
            out = out * keep.to(out.device)[:, :, None].to(out.dtype)
        return out[:, None].contiguous(), None

    group = q_heads // layer.num_kv_heads
    compute = torch.promote_types(query.dtype, torch.float32)
    out = torch.zeros(batch, tokens, q_heads, dim, dtype=query.dtype, device=query.device)
    for row, (k, v) in enumerate(layer.sequences()):
        index = keep[row].nonzero().view(-1)
        m = index.numel()
        if m == 0:
            continue
        index = index.to(query.device)
        q = query[row].index_select(1, index).to(compute)  # [q_heads, m, dim]
        k = k.to(device=query.device, dtype=compute).transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.to(device=query.device, dtype=compute).transpose(0, 1).repeat_interleave(group, dim=0)
        n = k.shape[1]
        stored = torch.arange(n, device=query.device)[None, :]
        last = before[row] + torch.arange(m, device=query.device)[:, None]  # each query's own stored index
        allowed = stored <= last
        if layer.window is not None:
            allowed &= stored > last - layer.window
        if layer.exact_recent:
            # This pass's tokens as given, where the cache holds them quantized: each query reads its own last
            # exact_recent tokens from these, as a decoded token reads its ring.
            given = before[row] + torch.arange(m, device=query.device)
            k_given, v_given = k.clone(), v.clone()
            k_given[:, given] = key[row].index_select(1, index).to(compute).repeat_interleave(group, dim=0)
            v_given[:, given] = value[row].index_select(1, index).to(compute).repeat_interleave(group, dim=0)
            recent = allowed & (stored > last - layer.exact_recent)
            scores = torch.where(recent, q @ k_given.transpose(1, 2), q @ k.transpose(1, 2)) * scale
            p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            o = (p * recent) @ v_given + (p * ~recent) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)  # [q_heads, m, dim]
        out[row, index] = o.transpose(0, 1).to(query.dtype)
    return out, None


AttentionInterface.register(ATTENTION, attention)
AttentionMaskInterface.register(ATTENTION, _padding_mask)

