"""Argument checks every public function of a module runs: sizes, head_dim, dtypes, softmax scale, tensors, paging.

Every generated module carries this text (see kvqc/compiler/runtime/__init__.py). Errors name the argument, what
was expected and what came, in one line.
"""

import math
import numbers
import operator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvqc.compiler.runtime.cache import _FLOAT_DTYPES, _INDEX_DTYPES
    from kvqc.compiler.runtime.environment import DEBUG
    from kvqc.compiler.runtime.scope import HEAD_DIMS, SCHEME, KVCache

# ---- generated modules carry the rest of this file verbatim ----


def _checking(device: torch.device) -> bool:
    return DEBUG or device.type == "cpu"


def _as_int(value):
    """value as an int where it is an integer of another type (numpy's, a one-element integer tensor); anything else
    (bool, float) unchanged, for the caller to refuse."""
    if type(value) is int or isinstance(value, (bool, float)):
        return value
    try:
        return operator.index(value)
    except (TypeError, ValueError, RuntimeError):
        return value


def _check_head_dim(head_dim, name: str) -> int:
    """head_dim as an int; a float (hidden_size / num_heads) would turn off every comparison with tensor sizes."""
    head_dim = _as_int(head_dim)
    if type(head_dim) is not int or head_dim not in HEAD_DIMS:
        hint = " (an int: use //)" if isinstance(head_dim, float) else ""
        raise ValueError(f"{name}: {SCHEME['name']} is built for head_dim in {HEAD_DIMS}{hint}, got {head_dim!r:.60}")
    return head_dim


def _check_size(value, name: str) -> int:
    """A count of blocks, slots, heads or sequences as an int from 1 to 2**31 - 1 (what an int32 index tensor
    addresses; slot numbers, block * block_size + offset, then stay within int64)."""
    value = _as_int(value)
    if type(value) is not int or not 1 <= value < 1 << 31:
        raise ValueError(f"{name}: expected an int from 1 to 2**31 - 1, got {value!r:.60}")
    return value


def _check_dtype(dtype) -> torch.dtype:
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {_FLOAT_DTYPES}, got {dtype!r:.60}")
    return dtype


# float32 holds scale * log2(e), the kernels' exponent factor, below this.
_MAX_SCALE = torch.finfo(torch.float32).max / 1.4426950408889634


def _check_scale(scale, head_dim: int) -> float:
    """decode's and attend's softmax scale as a float: a finite positive real number, 1 / sqrt(head_dim) if None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = None
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        try:
            value = float(scale)
        except (OverflowError, ValueError, TypeError):
            pass
    if value is None or not 0 < value <= _MAX_SCALE:  # NaN fails both comparisons
        raise ValueError(f"scale: expected a finite positive number (default 1 / sqrt(head_dim)), got {scale!r:.60}")
    return value


def _check_tensor(name: str, t: torch.Tensor, device: torch.device, dtypes: tuple, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(isinstance(want, int) and got != want for got, want in zip(t.shape, shape)):
        want = "[" + ", ".join(str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the cache's device), got {t.device}")
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")
    if t.dim() > 1 and (t.stride(0) < 0 or t.stride(1) < 0):
        raise ValueError(f"{name}: negative strides are not supported, got {t.stride()}")


def _check_paging(
    cache: KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_lens_device: "torch.device | None" = None
) -> None:
    _check_tensor("block_tables", block_tables, cache.device, _INDEX_DTYPES, ("batch", "max_blocks_per_seq"))
    _check_tensor("seq_lens", seq_lens, seq_lens_device or cache.device, _INDEX_DTYPES, (block_tables.shape[0],))
    if seq_lens.dim() == 1 and seq_lens.stride(0) != 1 and seq_lens.shape[0] > 1:
        raise ValueError(f"seq_lens: expected a contiguous tensor, got stride {seq_lens.stride(0)}")


def _check_block_ids(cache: KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Every block a sequence reaches must lie in the cache (entries past a sequence's end are not read)."""
    if block_tables.numel() == 0:
        return
    needed = (seq_lens.to(torch.int64) + cache.block_size - 1) // cache.block_size
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < needed[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= cache.num_blocks))
    if bool(bad.any()):
        seq, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_tables: entry [{seq}, {col}] = {int(block_tables[seq, col])} is outside the cache's "
            f"{cache.num_blocks} blocks"
        )
