"""LMDeploy's PyTorch-engine KV-cache kernels, backed by a kvqc generated module.

    import kvqc.engines.lmdeploy
    uninstall = kvqc.engines.lmdeploy.install("turbo_k4v2", quant_policy=42)   # before the pipeline is built
    pipe = lmdeploy.pipeline(model, backend_config=PytorchEngineConfig(quant_policy=42))
    ...
    uninstall()

Written against lmdeploy 0.18 (`lmdeploy.pytorch.kernels.cuda`): `fill_kv_cache`, `flatten_kv_cache` and
`flash_attn_with_kvcache` here take that release's arguments (block_offsets, q_start_loc, q_seq_length,
kv_seq_length, max_q_seq_length, k_scales_zeros, v_scales_zeros, quant_policy, kv_layout) and write or return
what LMDeploy's do. Nothing is imported from lmdeploy until `install()` runs.

Caches: LMDeploy allocates, per layer, k_cache [num_blocks, block_size, num_kv_heads, ...] uint8 (kv_layout 'bshd';
[num_blocks, num_kv_heads, block_size, ...] under 'bhsd', which kvqc also reads), v_cache likewise,
and k_scales_zeros / v_scales_zeros [..., fields] in the model dtype. For the policies below those are exactly a
kvqc KVCache(key_codes=k_cache, key_meta=k_scales_zeros, value_codes=v_cache, value_meta=v_scales_zeros), so the
adapter wraps the engine's own tensors (no copies):

    quant_policy  LMDeploy allocates per token and head        kvqc scheme   same bytes as LMDeploy?
    42            K d/2 + 2 meta, V d/4 + 1 meta               turbo_k4v2    yes (tests/test_lmdeploy.py)
    4             K d/2 + 2 meta, V d/2 + 2 meta               int4_token    no: kvqc stores zero = row minimum
    8             K d + 2 meta,   V d + 2 meta                 int8_token    no: kvqc stores zero = row minimum

(LMDeploy stores zero = -min / scale.) A scheme that only shares the layout is refused unless
`allow_incompatible=True`: then every reader of the cache must be kvqc's, since LMDeploy's own kernels would
misread it. Other schemes (other bit widths or metadata) do not fit LMDeploy's allocation and are refused.

LMDeploy 0.18 packs every layer's four cache tensors of a block into one pool, so each tensor is a strided view;
kvqc's kernels need contiguous tensors, so `install(contiguous_cache=True)` (the default) also switches LMDeploy's
cache allocation to its own ContiguousBlockCacheLayout (the layout its dlinfer backend uses).

flatten_kv_cache under quant_policy=42 returns K/V in the Hadamard-rotated basis, as LMDeploy's does (its prefill
rotates the query and un-rotates the output around it); kvqc's flatten works in the input basis, so the adapter
rotates its output once more. flash_attn_with_kvcache with one query token per sequence runs the scheme's decode
kernel; with several (speculative or block-sparse decoding) it flattens and attends in torch, causally from the
end when causal=True, over the whole cache otherwise (what LMDeploy's kernel does).
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch
import triton
import triton.language as tl

from kvqc.engines import paged
from kvqc.numerics import rotation

LMDEPLOY_VERSION = "0.18"
# quant_policy -> (key code bits, key metadata fields, value code bits, value metadata fields, kvqc scheme)
POLICIES = {
    42: (4, 2, 2, 1, "turbo_k4v2"),
    4: (4, 2, 4, 2, "int4_token"),
    8: (8, 2, 8, 2, "int8_token"),
}
BYTE_COMPATIBLE = {42: "turbo_k4v2"}  # tested against a re-implementation of LMDeploy's algorithm
_KERNELS = ("fill_kv_cache", "flatten_kv_cache", "flash_attn_with_kvcache")


def slot_mapping(
    num_tokens: int,
    q_start_loc: torch.Tensor,
    q_seq_length: torch.Tensor,
    kv_seq_length: torch.Tensor,
    max_q_seq_length: int,
    block_offsets: torch.Tensor,
    block_size: int,
    launch=None,
) -> torch.Tensor:
    """kvqc's slot_mapping [num_tokens] (int64, -1 = skip) from LMDeploy's fill arguments, without a host sync.

    Sequence i's new tokens are rows q_start_loc[i] .. + q_seq_length[i] - 1 of the states and positions
    kv_seq_length[i] - q_seq_length[i] .. kv_seq_length[i] - 1 of the sequence; position p lives in block
    block_offsets[i, p // block_size] at offset p % block_size. Rows no sequence claims get -1, and a row several
    entries claim belongs to the first of them: LMDeploy pads a CUDA-graph batch with entries whose token is row 0
    and whose blocks are all block 0, and those must write nothing. One kernel after the -1 fill, once a step: the
    adapter's fill_kv_cache maps a step's index tensors for its first layer and reuses the slots for the others.
    """
    device = block_offsets.device
    batch, width = block_offsets.shape
    if paged.checking(device) and batch:
        q_len = q_seq_length.to(torch.int64)
        position = kv_seq_length.to(torch.int64) - 1  # each sequence's last new token reaches furthest
        past = (q_len > 0) & (position >= 0) & (torch.div(position, block_size, rounding_mode="floor") >= width)
        if bool(past.any()):
            seq = int(past.nonzero()[0])
            raise ValueError(f"block_offsets: sequence {seq} reaches past its {width} columns "
                             "(kv_seq_length too large?)")
        start = q_start_loc.to(torch.int64)
        if bool(((q_len > 0) & ((start < 0) | (start + q_len > num_tokens))).any()):
            raise ValueError(f"q_start_loc: a sequence's tokens fall outside the {num_tokens} rows of k_states")
    return _slots(num_tokens, q_start_loc, q_seq_length, kv_seq_length, max_q_seq_length, block_offsets, block_size,
                  launch)


def _slots(num_tokens: int, q_start_loc, q_seq_length, kv_seq_length, max_q_seq_length: int, block_offsets,
           block_size: int, launch=None) -> torch.Tensor:
    """slot_mapping's kernel launch, for arguments already checked (or out of range on purpose: it masks them);
    `launch(kernel, grid, *args, **constexprs)` launches it (default: Triton's own path)."""
    batch, width = block_offsets.shape
    launch = launch or (lambda kernel, grid, *args, **constexprs: kernel[grid](*args, **constexprs))
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=block_offsets.device)
    if batch and num_tokens:
        tokens = min(128, max(16, 1 << (max(int(max_q_seq_length), 1) - 1).bit_length()))
        # A generated module's _launch calls the compiled kernel directly after its first launch: Triton's own
        # launch path costs more host time than the kernel takes, once per step of an eager engine.
        launch(_slot_mapping_kernel, (batch,), slots, q_start_loc, q_seq_length, kv_seq_length, block_offsets,
               num_tokens, width, block_offsets.stride(0), BLOCK_SIZE=block_size, TOKENS=tokens, ENTRIES=64)
    return slots


@triton.jit
def _slot_mapping_kernel(slots_ptr, q_start_ptr, q_len_ptr, kv_len_ptr, block_offsets_ptr, num_tokens, width,
                         stride_block_offsets, BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr,
                         ENTRIES: tl.constexpr):
    """Entry i's slots, TOKENS rows at a time; a row an earlier entry (ENTRIES at a time) also claims is skipped."""
    i = tl.program_id(0)
    start = tl.load(q_start_ptr + i).to(tl.int64)
    q_len = tl.load(q_len_ptr + i).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + i).to(tl.int64)
    for first in range(0, q_len, TOKENS):
        t = first + tl.arange(0, TOKENS)
        row = start + t
        position = kv_len - q_len + t
        column = position // BLOCK_SIZE
        ok = (t < q_len) & (position >= 0) & (column < width) & (row >= 0) & (row < num_tokens)
        taken = tl.zeros([TOKENS], dtype=tl.int32)
        for j0 in range(0, i, ENTRIES):
            j = j0 + tl.arange(0, ENTRIES)
            earlier = j < i
            other_start = tl.load(q_start_ptr + j, mask=earlier, other=0).to(tl.int64)
            other_len = tl.load(q_len_ptr + j, mask=earlier, other=0).to(tl.int64)
            end = (other_start + other_len)[None, :]
            hit = earlier[None, :] & (other_start[None, :] <= row[:, None]) & (row[:, None] < end)
            taken = tl.maximum(taken, tl.max(hit.to(tl.int32), axis=1))
        ok = ok & (taken == 0)
        block = tl.load(block_offsets_ptr + i * stride_block_offsets + column, mask=ok, other=0).to(tl.int64)
        tl.store(slots_ptr + row, block * BLOCK_SIZE + position % BLOCK_SIZE, mask=ok)


@functools.lru_cache(maxsize=None)
def _rotation(head_dim: int, device: torch.device) -> torch.Tensor:
    """LMDeploy's TurboQuant rotation Q = H / sqrt(d), Sylvester's H (symmetric, so Q = Q^T)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim: LMDeploy's rotation needs a power of two, got {head_dim}")
    h = torch.tensor(rotation.hadamard_matrix(head_dim), dtype=torch.float32)  # Sylvester's for powers of two
    return (h / math.sqrt(head_dim)).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """LMDeploy's TurboQuant rotation y = x @ H/sqrt(d) over the last dim (H symmetric, so it is also its inverse),
    which its prefill applies to the query and to the output: one kernel on the tensor cores, where LMDeploy without
    fast_hadamard_transform casts to float32 and multiplies by a d x d matrix. The +-1 products of fp16 and bf16
    inputs accumulate exactly in float32; float32 inputs take IEEE products."""
    d = x.shape[-1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"x: the Hadamard rotation needs a power-of-two last dim of at least 16, got {d}")
    rows = x.reshape(-1, d).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = 32 if d > 128 else 64
        _hadamard_kernel[(triton.cdiv(rows.shape[0], block),)](
            rows, out, rows.shape[0], HEAD_DIM=d, ROWS=block, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )
    return out.view(x.shape)


@triton.jit
def _hadamard_kernel(x_ptr, out_ptr, num_rows, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    dim = tl.arange(0, HEAD_DIM)
    at = row[:, None].to(tl.int64) * HEAD_DIM + dim[None, :]
    x = tl.load(x_ptr + at, mask=row[:, None] < num_rows, other=0.0)
    # Sylvester's H: entry (i, j) is -1 where i & j has odd parity.
    parity = dim[:, None] & dim[None, :]
    parity = parity ^ (parity >> 8)
    parity = parity ^ (parity >> 4)
    parity = parity ^ (parity >> 2)
    parity = parity ^ (parity >> 1)
    h = (1 - 2 * (parity & 1)).to(x.dtype)
    y = tl.dot(x, h, input_precision=PRECISION) * (1.0 / HEAD_DIM ** 0.5)
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=row[:, None] < num_rows)


class Kernels:
    """fill_kv_cache / flatten_kv_cache / flash_attn_with_kvcache bound to one generated module and quant_policy."""

    def __init__(self, module: ModuleType, quant_policy: int, allow_incompatible: bool = False):
        quant_policy = int(quant_policy)
        if quant_policy not in POLICIES:
            raise ValueError(
                f"quant_policy: kvqc maps LMDeploy's {sorted(POLICIES)} onto its caches, got {quant_policy} "
                "(start LMDeploy with one of those)"
            )
        key_bits, key_fields, value_bits, value_fields, twin = POLICIES[quant_policy]
        name = module.SCHEME["name"]
        if hasattr(module, "WINDOW"):
            raise ValueError(
                f"module: {name} keeps each sequence's last {module.WINDOW} tokens in a ring row per sequence, which "
                "LMDeploy's fill/flatten/attention calls do not pass (use a scheme without window)"
            )
        if hasattr(module, "calibrate"):
            raise ValueError(
                f"module: {name} splits off outlier channels, which LMDeploy's four cache tensors per layer cannot "
                "hold (use a scheme without outliers)"
            )
        grouped = [side for side in ("KEY", "VALUE") if getattr(module, f"{side}_GROUP_SIZE", None)]
        if grouped:
            raise ValueError(
                f"module: {name} shares its {grouped[0].lower()} scales along groups of channels, and LMDeploy's "
                f"caches hold per-token metadata only (use a scheme without scale.group_size)"
            )
        odd = [d for d in module.HEAD_DIMS if d & (d - 1)]
        if odd:
            raise ValueError(
                f"module: {name} is built for head_dim {odd}, which LMDeploy's quantized caches (Sylvester "
                "Hadamard, power-of-two head_dim) do not have (use a scheme for powers of two)"
            )
        layout = (module.KEY_CODE_BITS, len(module.KEY_METADATA), module.VALUE_CODE_BITS, len(module.VALUE_METADATA))
        if layout != (key_bits, key_fields, value_bits, value_fields):
            raise ValueError(
                f"module: {name} stores K {layout[0]} bits + {layout[1]} fields, V {layout[2]} bits + {layout[3]} "
                f"fields; LMDeploy's quant_policy={quant_policy} cache has K {key_bits} + {key_fields}, V "
                f"{value_bits} + {value_fields} (use {twin} or another quant_policy)"
            )
        if not (allow_incompatible or _same_scheme(module, BYTE_COMPATIBLE.get(quant_policy))):
            raise ValueError(
                f"module: {name} fits LMDeploy's quant_policy={quant_policy} cache shapes but not its bytes "
                "(LMDeploy's own kernels would misread it); pass allow_incompatible=True if only kvqc reads the cache"
            )
        self.module, self.quant_policy = module, quant_policy
        self._caches: dict[tuple, tuple] = {}  # ids of LMDeploy's four tensors, head_dim, layout -> (tensors, KVCache)
        self._same_rotation: dict[int, bool] = {}
        self._last_plan = None  # the last decode step's plan (module.DecodePlan)
        self._last_slots = None  # (index tensors, sizes, slots, ids of the caches filled with them)

    # -- LMDeploy's signatures (lmdeploy 0.18, lmdeploy/pytorch/kernels/cuda/{fill_kv_cache,flatten_kv_cache,
    #    pagedattention}.py)

    def fill_kv_cache(self, k_states, v_states, k_caches, v_caches, q_start_loc, q_seq_length, kv_seq_length,
                      max_q_seq_length, block_offsets, k_scales_zeros=None, v_scales_zeros=None, quant_policy=0,
                      kv_layout="bshd"):
        """Quantize the new tokens' K/V into the cache in place."""
        self._check_call(quant_policy, kv_layout)
        if v_states is None or v_caches is None:
            raise NotImplementedError("v_states: kvqc caches hold K and V; shared-KV (MLA) layers are not supported")
        cache = self._cache(k_caches, k_scales_zeros, v_caches, v_scales_zeros, k_states.shape[-1], kv_layout)
        slots = self._step_slots(cache, k_states.shape[0], q_start_loc, q_seq_length, kv_seq_length,
                                 max_q_seq_length, block_offsets)
        self.module.fill(cache, k_states, v_states, slots)

    def flatten_kv_cache(self, k_caches, v_caches, seqlens, block_offsets, start_loc=None, out_size=None,
                         out_dtype=None, k_scales_zeros=None, v_scales_zeros=None, quant_policy=0, kv_layout="bshd",
                         flatten_kv_layout="hsd"):
        """Dequantized K, V: [num_kv_heads, out_size, head_dim] ('hsd') or [out_size, num_kv_heads, head_dim]
        ('shd'); sequence i at rows start_loc[i] ..; rows no sequence covers are zero (LMDeploy zero-fills the padded
        tail after the last sequence, which its attention may touch). Nothing is read on the host."""
        self._check_call(quant_policy, kv_layout)
        if flatten_kv_layout not in ("hsd", "shd"):
            raise ValueError(f"flatten_kv_layout: expected 'hsd' or 'shd', got {flatten_kv_layout!r}")
        head_dim = k_caches.shape[-1] * 8 // self.module.KEY_CODE_BITS
        cache = self._cache(k_caches, k_scales_zeros, v_caches, v_scales_zeros, head_dim, kv_layout)
        if out_size is None or out_size <= 0:
            out_size = cache.num_blocks * cache.block_size
        out_dtype = out_dtype or (torch.float16 if self.quant_policy == 42 else cache.dtype)
        heads, device = cache.num_kv_heads, k_caches.device
        shape = (heads, out_size, head_dim) if flatten_kv_layout == "hsd" else (out_size, heads, head_dim)
        key, value = (torch.zeros(shape, dtype=out_dtype, device=device) for _ in range(2))
        rows = (lambda t: t.transpose(0, 1)) if flatten_kv_layout == "hsd" else (lambda t: t)
        if start_loc is not None:
            start_loc = start_loc.to(device)
        # quant_policy 42's prefill rotates the query by H/sqrt(d) and the output back around this call, so K and V
        # are wanted in that basis: the codes' own basis when the module's rotation is LMDeploy's.
        basis = {"rotated": True} if self.quant_policy == 42 and self._rotation_is_lmdeploys(head_dim) else {}
        self.module.flatten(cache, block_offsets, seqlens.to(device), out=(rows(key), rows(value)),
                            start_loc=start_loc, **basis)
        if self.quant_policy == 42 and not basis:
            key, value = hadamard_rotate(key), hadamard_rotate(value)
        return key, value

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q=None,
                                max_seqlen_q=None, softmax_scale=None, causal=False, window_size=None, softcap=None,
                                scheduler_metadata=None, alibi_slopes=None, k_scales_zeros=None, v_scales_zeros=None,
                                quant_policy=0, sinks=None, kv_layout="bshd"):
        """Attention of q [batch * seq_len, num_heads, head_dim] over the cache; returns q's shape and dtype."""
        self._check_call(quant_policy, kv_layout)
        window = window_size[0] if isinstance(window_size, Sequence) else window_size
        if window is not None and window > 0:
            raise NotImplementedError("window_size: kvqc attends over whole sequences (no sliding window)")
        if softcap is not None and softcap > 0:
            raise NotImplementedError("softcap: kvqc's decode has no logit soft-capping")
        if alibi_slopes is not None or sinks is not None:
            raise NotImplementedError("alibi_slopes / sinks: not supported by kvqc's decode")
        cache = self._cache(k_cache, k_scales_zeros, v_cache, v_scales_zeros, q.shape[-1], kv_layout)
        batch, num_tokens = cache_seqlens.shape[0], q.shape[0]
        if num_tokens == batch and (max_seqlen_q == 1 or (max_seqlen_q is None and cu_seqlens_q is None)):
            # One query token per sequence, known without reading cu_seqlens_q: LMDeploy's decode step (it passes
            # max_seqlen_q=1) runs inside CUDA graphs, where nothing may wait for the GPU.
            # LMDeploy hands every layer of a step the same block_offsets and kv_seqlens tensors: the first layer
            # plans, the others reuse it (an eager step's host time).
            last = self._last_plan
            same_step = last is not None and last.block_tables is page_table and last.seq_lens is cache_seqlens
            plan = paged.step_plan(self.module, last if same_step else None, q, cache, page_table, cache_seqlens)
            self._last_plan = plan or last
            return self.module.decode(q, cache, page_table, cache_seqlens, scale=softmax_scale, plan=plan)
        if cu_seqlens_q is not None:  # query tokens per sequence, possibly uneven (chunked prefill)
            if cu_seqlens_q.shape[0] != batch + 1 or int(cu_seqlens_q[-1]) != num_tokens:
                raise ValueError(
                    f"cu_seqlens_q: expected {batch + 1} offsets ending at q's {num_tokens} tokens, got "
                    f"{cu_seqlens_q.tolist()}"
                )
            q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        else:
            if batch == 0 or num_tokens % batch:
                raise ValueError(
                    f"q: {num_tokens} tokens do not split evenly over {batch} sequences (pass cu_seqlens_q)"
                )
            q_lens = [num_tokens // batch] * batch
        if max_seqlen_q is not None and max_seqlen_q < max(q_lens, default=0):
            raise ValueError(f"max_seqlen_q: {max_seqlen_q}, but a sequence has {max(q_lens)} query tokens")
        if batch and all(n == 1 for n in q_lens):
            return self.module.decode(q, cache, page_table, cache_seqlens, scale=softmax_scale)
        key, value = self.module.flatten(cache, page_table, cache_seqlens)
        return paged.attend(q, key, value, q_lens, cache_seqlens.tolist(), softmax_scale, causal)

    # -- helpers

    def _step_slots(self, cache, num_tokens: int, q_start_loc, q_seq_length, kv_seq_length, max_q_seq_length,
                    block_offsets) -> torch.Tensor:
        """The slot_mapping of a layer's fill. LMDeploy hands every layer of a step the same index tensors, so the
        step's first layer maps them and the others reuse its slots (an eager step's host time); a cache filled again
        starts the next step, whose tensors may be the same ones refilled in place, and maps anew, as does a call on
        the other side of a CUDA-graph capture. What this assumes of the engine: the index tensors change only
        between steps, and a step fills each layer's cache once."""
        index = (q_start_loc, q_seq_length, kv_seq_length, block_offsets)
        # A graph must map inside its capture, and an eager call must not read slots that live in a graph's pool.
        capturing = block_offsets.is_cuda and torch.cuda.is_current_stream_capturing()
        sizes = (num_tokens, int(max_q_seq_length), cache.block_size, capturing)
        last = self._last_slots
        if (last is not None and all(a is b for a, b in zip(last[0], index)) and last[1] == sizes
                and id(cache) not in last[3]):
            last[3].add(id(cache))
            return last[2]
        slots = slot_mapping(num_tokens, q_start_loc, q_seq_length, kv_seq_length, max_q_seq_length, block_offsets,
                             cache.block_size, launch=self.module._launch)
        self._last_slots = (index, sizes, slots, {id(cache)})
        return slots

    def _check_call(self, quant_policy, kv_layout) -> None:
        if int(quant_policy) != self.quant_policy:
            raise ValueError(
                f"quant_policy: kvqc was installed for {self.quant_policy}, LMDeploy passed {int(quant_policy)} "
                f"(start LMDeploy with quant_policy={self.quant_policy})"
            )
        if kv_layout not in ("bshd", "bhsd"):
            raise ValueError(f"kv_layout: kvqc reads 'bshd' or 'bhsd' caches, got {kv_layout!r}")

    def _rotation_is_lmdeploys(self, head_dim: int) -> bool:
        """Whether the module's K and V rotations are LMDeploy's H/sqrt(d), so flatten's rotated basis is its."""
        if head_dim not in self._same_rotation:
            offered = getattr(self.module, "rotation", None)
            self._same_rotation[head_dim] = offered is not None and all(
                torch.allclose(offered(side, head_dim), _rotation(head_dim, torch.device("cpu")), atol=1e-6)
                for side in ("key", "value")
            )
        return self._same_rotation[head_dim]

    def _cache(self, key_codes, key_meta, value_codes, value_meta, head_dim: int, kv_layout: str):
        """The module's KVCache over LMDeploy's tensors: one object per layer's tensors, built once, so the module's
        checks of it run once too."""
        tensors = (key_codes, key_meta, value_codes, value_meta)
        key = (*map(id, tensors), head_dim, kv_layout)
        known = self._caches.get(key)
        if known is not None and all(a is b for a, b in zip(known[0], tensors)):
            return known[1]
        cache = self._new_cache(key_codes, key_meta, value_codes, value_meta, head_dim, kv_layout)
        self._caches[key] = (tensors, cache)
        return cache

    def _new_cache(self, key_codes, key_meta, value_codes, value_meta, head_dim: int, kv_layout: str):
        if key_meta is None or value_meta is None:
            raise ValueError("k_scales_zeros: kvqc needs LMDeploy's per-token metadata tensors (a quantized cache)")
        for name, t in (("k_cache", key_codes), ("v_cache", value_codes), ("k_scales_zeros", key_meta),
                        ("v_scales_zeros", value_meta)):
            if t.dim() == 4 and not t.is_contiguous():
                raise ValueError(
                    f"{name}: a strided view (strides {t.stride()}); kvqc's kernels need contiguous caches, so let "
                    "install(contiguous_cache=True) switch LMDeploy to contiguous allocation"
                )
        return self.module.KVCache(key_codes=key_codes, key_meta=key_meta, value_codes=value_codes,
                                   value_meta=value_meta, head_dim=head_dim, layout=kv_layout)


def _same_scheme(module: ModuleType, name: str | None) -> bool:
    """Whether the module quantizes exactly as the named shipped scheme (its key and value definitions)."""
    if name is None:
        return False
    twin = paged.load_module(name)
    return module.SCHEME["key"] == twin.SCHEME["key"] and module.SCHEME["value"] == twin.SCHEME["value"]


def kernels(module_or_name: ModuleType | str | Path = "turbo_k4v2", quant_policy: int = 42, *,
            allow_incompatible: bool = False) -> Kernels:
    """The three LMDeploy kernels bound to a generated module (a module, scheme name, .py or .yaml path)."""
    return Kernels(paged.load_module(module_or_name), quant_policy, allow_incompatible)


def install(module_or_name: ModuleType | str | Path = "turbo_k4v2", quant_policy: int = 42, *,
            allow_incompatible: bool = False, contiguous_cache: bool = True) -> Callable[[], None]:
    """Swap LMDeploy's fill / flatten / paged-attention kernels for kvqc's; returns a function that undoes it.

    Call it in the process that runs the model, before the engine is built: LMDeploy's attention layers look the
    kernels up when they are constructed. Every lmdeploy module holding one of the three functions by name gets
    the replacement (the kernels package, the modules defining them, and any module that imported them).
    """
    bound = kernels(module_or_name, quant_policy, allow_incompatible=allow_incompatible)
    try:
        package = importlib.import_module("lmdeploy.pytorch.kernels.cuda")
    except ImportError:
        raise ImportError(
            "kvqc.engines.lmdeploy.install needs LMDeploy's PyTorch engine: "
            f"pip install 'lmdeploy=={LMDEPLOY_VERSION}.*'"
        ) from None
    version = getattr(sys.modules.get("lmdeploy"), "__version__", "unknown")
    if not str(version).startswith(LMDEPLOY_VERSION + "."):
        warnings.warn(f"kvqc.engines.lmdeploy follows lmdeploy {LMDEPLOY_VERSION}.x; found {version}", stacklevel=2)
    undo: list[tuple[object, str, object]] = []  # (owner, attribute, previous value)
    originals = {name: getattr(package, name) for name in _KERNELS}
    for mod in [m for n, m in list(sys.modules.items()) if n == "lmdeploy" or n.startswith("lmdeploy.")]:
        for name, original in originals.items():
            if mod is not None and getattr(mod, name, None) is original:
                undo.append((mod, name, original))
                setattr(mod, name, getattr(bound, name))
    if quant_policy == 42:
        undo += _fast_rotation()
    if contiguous_cache:
        undo.append(_contiguous_cache_layout())

    def uninstall() -> None:
        while undo:
            owner, name, previous = undo.pop()
            setattr(owner, name, previous)

    return uninstall


def _fast_rotation() -> list[tuple[object, str, object]]:
    """quant_policy 42's prefill rotates the query and the output around attention with LMDeploy's
    turbo_quant.hadamard_rotate / hadamard_rotate_inv, looked up at each call: kvqc's kernel computes the same."""
    try:
        turbo = importlib.import_module("lmdeploy.pytorch.kernels.cuda.turbo_quant")
    except ImportError:
        return []  # an LMDeploy without it keeps its own rotation
    undo = []
    for name in ("hadamard_rotate", "hadamard_rotate_inv"):
        if callable(getattr(turbo, name, None)):
            undo.append((turbo, name, getattr(turbo, name)))
            setattr(turbo, name, hadamard_rotate)
    return undo


def _contiguous_cache_layout() -> tuple[object, str, object]:
    """Make LMDeploy 0.18 give each layer's cache tensors their own contiguous storage."""
    try:
        backend = importlib.import_module("lmdeploy.pytorch.backends.default.cache").DefaultCacheBackend
        contiguous = importlib.import_module("lmdeploy.pytorch.engine.cache_engine.layout").ContiguousBlockCacheLayout
    except (ImportError, AttributeError):
        raise ImportError(
            f"contiguous_cache: lmdeploy {LMDEPLOY_VERSION}'s cache layout classes were not found; pass "
            "contiguous_cache=False if this lmdeploy already allocates contiguous per-layer caches"
        ) from None
    previous = backend.__dict__["build_block_layout"]

    def build_block_layout(cls, tensor_specs, num_layers: int):
        return contiguous(tuple(tensor_specs), num_layers=num_layers)

    backend.build_block_layout = classmethod(build_block_layout)
    return backend, "build_block_layout", previous
