"""What only window schemes carry: the check of the ring rows that flatten, plan_decode and decode take.

The modules of window schemes carry this text (see kvqc/compiler/runtime/__init__.py).
"""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvqc.compiler.runtime.cache import _INDEX_DTYPES
    from kvqc.compiler.runtime.checks import _check_tensor, _checking
    from kvqc.compiler.runtime.scope import KVCache

# ---- generated modules carry the rest of this file verbatim ----


def _check_window_index(cache: KVCache, window_index: torch.Tensor, batch: int) -> None:
    _check_tensor("window_index", window_index, cache.device, _INDEX_DTYPES, (batch,))
    if _checking(cache.device) and batch:
        bad = (window_index < 0) | (window_index >= cache.max_seqs)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"window_index: entry {i} is {int(window_index[i])}, "
                f"expected a ring row 0..{cache.max_seqs - 1} (max_seqs)"
            )
