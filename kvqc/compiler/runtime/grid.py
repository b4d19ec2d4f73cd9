"""Launch shapes: decode's launch settings at a head_dim, how many programs fill the device, and the row strides a
cache layout gives the kernels.

Every generated module carries this text (see kvqc/compiler/runtime/__init__.py).
"""

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvqc.compiler.runtime.scope import _DECODE_CONFIGS, _DECODE_DEFAULT, KVCache

# ---- generated modules carry the rest of this file verbatim ----


# CUDA launches at most this many programs along a grid's axes 1 and 2.
_MAX_GRID_YZ = 65535


def _row_strides(cache: KVCache) -> dict:
    """Rows (token, head pairs) between a block's KV heads and between its consecutive tokens, for the kernels'
    row = block * block_size * num_kv_heads + offset * TOKEN_STRIDE + head * HEAD_STRIDE."""
    if cache.layout == "bhsd":
        return {"HEAD_STRIDE": cache.block_size, "TOKEN_STRIDE": 1}
    return {"HEAD_STRIDE": 1, "TOKEN_STRIDE": cache.num_kv_heads}


def _heads_fastest(cache: KVCache) -> bool:
    """Whether a grid over (sequence or token tile, KV head) puts a sequence's or tile's KV heads side by side on
    axis 0 (the kernels' HEADS_FASTEST). On token-major blocks a token's KV heads are adjacent rows, so the programs
    that run together then read and write the same tokens' rows, not one head's rows of many sequences. Head-major
    blocks keep sequences (or tiles) fastest, the order their decode was tuned in."""
    return cache.layout == "bshd"


def _decode_config(head_dim: int) -> tuple:
    """(BLOCK_N, num_warps, num_stages, splits per SM, most splits[, registers per thread]) for decode at this
    head_dim: the table's (codegen lists every head_dim outside 65..128), else the default."""
    return _DECODE_CONFIGS.get(head_dim, _DECODE_DEFAULT)


def _target_programs(device: torch.device, per_sm: int) -> int:
    """Enough programs to fill the GPU (decode's splits, a looping fill's programs); two on the interpreter, so
    tests still cross a split and a looping fill takes several tiles a program."""
    if device.type == "cuda":
        return per_sm * _sm_count(device)
    return 2


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
