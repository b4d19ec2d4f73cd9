"""What a module's tensors may be (dtypes, cache layouts) and what every KVCache reads off its tensors.

Every generated module carries this text (see kvqc/compiler/runtime/__init__.py), before its KVCache dataclass,
which subclasses _PagedCache with the scheme's own tensor fields.
"""

from typing import TYPE_CHECKING

import torch
import triton.language as tl

if TYPE_CHECKING:
    from kvqc.compiler.runtime.environment import _INTERPRET

# ---- generated modules carry the rest of this file verbatim ----


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Decode's dot products take the model's precision; float32 models get float32-accurate products. The
# interpreter computes bfloat16 dots wrongly (numpy has no bfloat16), so it gets float32 throughout.
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
if _INTERPRET:
    _DOT_DTYPES = dict.fromkeys(_DOT_DTYPES, tl.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
# The cache layouts the kernels read: head-major blocks [num_blocks, num_kv_heads, block_size, ...] (each KV head's
# tokens of a block contiguous: one program reads one run of memory; allocate_cache's) or token-major blocks
# [num_blocks, block_size, num_kv_heads, ...] (LMDeploy's and vLLM's default, so an engine's own tensors can be used).
LAYOUTS = ("bhsd", "bshd")


class _PagedCache:
    """What KVCache reads off its tensors: one layer's paged cache, its first three dims [num_blocks, num_kv_heads,
    block_size] ('bhsd') or [num_blocks, block_size, num_kv_heads] ('bshd')."""

    @property
    def num_blocks(self) -> int:
        return self.key_codes.shape[0]

    @property
    def block_size(self) -> int:
        return self.key_codes.shape[2 if self.layout == "bhsd" else 1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_codes.shape[1 if self.layout == "bhsd" else 2]

    @property
    def dtype(self) -> torch.dtype:
        return self.key_meta.dtype

    @property
    def device(self) -> torch.device:
        return self.key_codes.device
