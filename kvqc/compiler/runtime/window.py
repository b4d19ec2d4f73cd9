"""What only window schemes carry: the keywords their calls require, and the checks of the ring rows and of the
tokens one fill takes.

The modules of window schemes carry this text (see kvqc/compiler/runtime/__init__.py).
"""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvqc.compiler.runtime.cache import _INDEX_DTYPES
    from kvqc.compiler.runtime.checks import _check_tensor, _checking
    from kvqc.compiler.runtime.scope import SCHEME, WINDOW, KVCache

# ---- generated modules carry the rest of this file verbatim ----


def _require(call: str, **arguments) -> None:
    """A window scheme's fill, flatten, plan_decode, decode and attend need to know each token's ring row."""
    for name, value in arguments.items():
        if value is None:
            raise ValueError(
                f"{call}: {SCHEME['name']} keeps each sequence's last "
                f"{WINDOW} tokens in a ring: pass the {name} keyword"
            )


def _check_window_tokens(
    cache: KVCache,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    window_index: torch.Tensor,
) -> None:
    """What the kernels assume of the tokens of a window scheme's fill (checked on CPU tensors and with KVQC_DEBUG)."""
    kept = slot_mapping >= 0
    bad = kept & ((window_index < 0) | (window_index >= cache.max_seqs))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"window_index: entry {i} is {int(window_index[i])}, expected a ring row 0..{cache.max_seqs - 1} (max_seqs)"
        )
    bad = kept & (positions < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"positions: entry {i} is {int(positions[i])}, expected positions >= 0 for every token with a slot"
        )
    bad = kept & (slot_mapping % cache.block_size != positions % cache.block_size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"slot_mapping: entry {i} is slot {int(slot_mapping[i])} "
            f"for position {int(positions[i])}; a token's offset in "
            f"its block must be its position % block_size ({cache.block_size})"
        )
    # Skipped tokens belong to no sequence: each is a run of its own.
    owner = torch.where(kept, window_index.to(torch.int64), -1 - torch.arange(len(kept), device=kept.device))
    same = owner[1:] == owner[:-1]
    if bool((same & (positions[1:] != positions[:-1] + 1)).any()):
        raise ValueError("positions: a sequence's tokens in one call must be consecutive and in position order")
    runs = torch.cat([owner[:1], owner[1:][~same]])
    if runs.numel() != runs.unique().numel():
        raise ValueError("window_index: a sequence's tokens in one call must be consecutive (one run per sequence)")


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
