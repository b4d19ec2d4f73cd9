"""The check of flatten's out=(key, value), an engine's buffers with any row and head strides.

The modules whose flatten writes into an engine's buffers (every scheme but channel-split ones) carry this text
(see kvqc/compiler/runtime/__init__.py).
"""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvqc.compiler.runtime.cache import _FLOAT_DTYPES
    from kvqc.compiler.runtime.checks import _check_tensor
    from kvqc.compiler.runtime.scope import KVCache

# ---- generated modules carry the rest of this file verbatim ----


def _check_flatten_out(cache: KVCache, out) -> "tuple[torch.Tensor, torch.Tensor]":
    """flatten's out=(key, value): two float tensors [rows, num_kv_heads, head_dim] on the cache's device with the
    same shape and strides (one pair of strides reaches both), the last dim contiguous, no two rows overlapping."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"out: expected a (key, value) pair of tensors, got {type(out).__name__}")
    key, value = out
    for name, t in (("out[0]", key), ("out[1]", value)):
        _check_tensor(name, t, cache.device, _FLOAT_DTYPES, ("rows", cache.num_kv_heads, cache.head_dim))
    if value.shape != key.shape or value.stride() != key.stride():
        raise ValueError(f"out[1]: expected key's shape {list(key.shape)} and strides {key.stride()}, got "
                         f"{list(value.shape)} and {value.stride()}")
    # Rows of head_dim values must not alias: the smaller stride spans a row, the larger one the other dim's extent.
    spans = sorted((stride, extent) for stride, extent in zip(key.stride()[:2], key.shape[:2]) if extent > 1)
    inner = cache.head_dim
    for stride, extent in spans:
        if stride < inner:
            raise ValueError(
                f"out: rows overlap (strides {key.stride()}); pass buffers whose rows and heads do not alias"
            )
        inner = stride * extent
    return key, value
