"""What only schemes that quantize outlier channels apart carry: each KV head's channel order, the permutations
into and out of it, and the check of an order an engine or calibrate set.

The modules of channel-split schemes carry this text (see kvqc/compiler/runtime/__init__.py).
"""

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from kvqc.compiler.runtime.cache_check import _check_memory
    from kvqc.compiler.runtime.launch import _cdiv, _launch, _pow2
    from kvqc.compiler.runtime.scope import SCHEME, KVCache

# ---- generated modules carry the rest of this file verbatim ----


def _outliers_first(chosen: torch.Tensor) -> torch.Tensor:
    """The channel order with the chosen channels [..., head_dim] first, each group in ascending order (a stable
    sort on "not chosen")."""
    return torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)


def _channels(cache: KVCache, base: str) -> torch.Tensor:
    order = getattr(cache, f"{base}_channels")
    if order is None:
        raise ValueError(
            f"cache.{base}_channels: {SCHEME['name']} quantizes outlier channels "
            "apart; call calibrate(cache, key, value) with sample K/V first"
        )
    return order


def _permute(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] in each head's channel order (outliers first)."""
    return _take(x, order)


def _unpermute(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x in each head's channel order back in channel order: channel c is at its place in the order."""
    places = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return _take(x, torch.empty_like(order).scatter_(1, order, places))


_TAKE_BLOCK_T = 32  # tokens a program permutes


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """y[t, h, j] = x[t, h, index[h, j]], contiguous: _take_kernel, at about a copy's speed (H200, 65,536 tokens x 8
    heads x 128 in fp16: 74 us, a copy 68, torch's index_select over each token's heads * head_dim values 195)."""
    tokens, heads, head_dim = x.shape
    y = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens:
        _launch(
            _take_kernel, (_cdiv(tokens, _TAKE_BLOCK_T), heads),
            x, index, y, tokens, x.stride(0), x.stride(1), x.stride(2), y.stride(0),
            HEAD_DIM=head_dim, DIM_PAD=_pow2(head_dim), BLOCK_T=_TAKE_BLOCK_T,
        )
    return y


@triton.jit
def _channel(order_ptr, mask, HEAD_DIM: tl.constexpr):
    """Channels of a KV head's order, held inside the row: the wrappers check the order on eager calls, and one
    changed while a CUDA graph replays must not read or write past the row."""
    return tl.minimum(tl.maximum(tl.load(order_ptr, mask=mask, other=0), 0), HEAD_DIM - 1)


@triton.jit
def _take_kernel(
    x_ptr, index_ptr, y_ptr, tokens, stride_token, stride_head, stride_dim, stride_out_token,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """BLOCK_T tokens of one head: rows loaded whole, permuted in registers (tl.gather; columns gathered from
    memory ran at half a copy's speed), stored whole. An index outside the row (an order spoiled under a graph,
    where no wrapper checks it) reads a column of the same row."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    column = tl.arange(0, DIM_PAD)
    inside = column < HEAD_DIM
    index = _channel(index_ptr + head * HEAD_DIM + column, inside, HEAD_DIM).to(tl.int32)
    mask = (token < tokens)[:, None] & inside[None, :]
    x = tl.load(x_ptr + token[:, None].to(tl.int64) * stride_token + head * stride_head + column[None, :] * stride_dim,
                mask=mask, other=0.0)
    y = tl.gather(x, tl.broadcast_to(index[None, :], [BLOCK_T, DIM_PAD]), axis=1)
    tl.store(y_ptr + token[:, None].to(tl.int64) * stride_out_token + head * HEAD_DIM + column[None, :], y, mask=mask)


def _check_channels(cache: KVCache, name: str) -> bool:
    """A channel order the wrappers gather and scatter with: each KV head's row a permutation of 0..head_dim-1
    (a repeated channel leaves flatten's output partly unwritten; one out of range fails inside torch)."""
    order = getattr(cache, name)
    if order is None:
        return True
    want = (cache.num_kv_heads, cache.head_dim)
    if (
        not isinstance(order, torch.Tensor) or order.dtype != torch.int64 or tuple(order.shape) != want
        or order.device != cache.device or order.layout != torch.strided
    ):
        raise ValueError(
            f"cache.{name}: expected an int64 tensor [{want[0]}, {want[1]}] "
            f"on {cache.device} (from calibrate), got {order!r:.60}"
        )
    _check_memory(name, order)
    if order.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # reading the values back would end the capture: checked on a later call
    ranked = order.sort(dim=-1).values
    bad = (ranked != torch.arange(cache.head_dim, device=order.device)).any(dim=-1)
    if bool(bad.any()):
        head = int(bad.nonzero()[0])
        raise ValueError(
            f"cache.{name}: row {head} is not a permutation of 0..{cache.head_dim - 1} "
            "(a channel repeated or out of range); take the order calibrate chooses"
        )
    return True
