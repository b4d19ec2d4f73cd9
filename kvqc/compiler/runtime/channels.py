"""What only schemes that quantize outlier channels apart carry: each KV head's channel order, the permutations
into and out of it, and the check of an order an engine or calibrate set.

The modules of channel-split schemes carry this text (see kvqc/compiler/runtime/__init__.py).
"""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvqc.compiler.runtime.cache_check import _check_memory
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


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """y[t, h, j] = x[t, h, index[h, j]]: one index_select over each token's heads * head_dim values, whose index
    is that small (torch.gather would read an index the size of x, four times its bytes in int64)."""
    tokens, heads, head_dim = x.shape
    flat = (index + torch.arange(heads, device=index.device)[:, None] * head_dim).view(-1)
    return x.reshape(tokens, heads * head_dim).index_select(1, flat).view(tokens, heads, head_dim)


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
