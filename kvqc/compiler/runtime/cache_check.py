"""The check of the cache an engine passes, run in full only when something the kernels' addresses depend on
changed, and the bounds of a tensor's memory that it and the channel-order check use.

Every generated module carries this text (see kvqc/compiler/runtime/__init__.py); _check_cache_fields, the check
of the scheme's own tensors, is rendered per scheme.
"""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvqc.compiler.runtime.scope import KVCache, _check_cache_fields

# ---- generated modules carry the rest of this file verbatim ----


def _check_cache(cache: KVCache) -> None:
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache: expected a KVCache from this module's allocate_cache, got {type(cache).__name__}")
    # An engine passes the same cache on every call: the full check runs again only once something the kernels'
    # addresses depend on has changed. That is every field's value and, for a tensor, its memory and layout, which
    # .data =, resize_() and set_() change in place (a storage resized under it too), and for the channel orders
    # the wrappers index with, their contents (the version counter of in-place writes). The comparison costs about
    # 1 us of host time a tensor (a 2-core CPU host: 4.3 us a call for four tensors, 9.6 for a channel split's ten),
    # the full check 13-75 us.
    state = vars(cache)
    try:
        seen = _cache_state(state)
    except RuntimeError:  # a tensor without ordinary memory (sparse, ...): the full check says which
        seen = None
    if seen is None or state.get("_checked") != seen:
        state["_checked"] = seen if _check_cache_fields(cache) else None


def _cache_state(state: dict) -> tuple:
    return tuple([
        (value.data_ptr(), value.untyped_storage().nbytes(), value.storage_offset(), value.shape, value.stride(),
         value.dtype, value.device, _contents(value) if name.endswith("_channels") else 0)
        if isinstance(value, torch.Tensor) else (type(value), value)  # another type compares unequal, unlooked-at
        for name, value in state.items() if name[0] != "_"  # the fields, not what the wrappers keep beside them
    ])


def _contents(t: torch.Tensor) -> int:
    # Inference-mode tensors keep no version counter (and refuse in-place writes outside inference mode).
    return -1 if t.is_inference() else t._version


def _check_memory(name: str, t: torch.Tensor) -> tuple:
    """t's bytes as addresses [start, end), refused unless its storage holds them from the tensor's offset."""
    item = t.element_size()
    span = item * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) if t.numel() else 0
    held = t.untyped_storage().nbytes() - t.storage_offset() * item
    if span > held:
        raise ValueError(
            f"cache.{name}: spans {span} bytes but its storage holds {max(held, 0)} from the "
            "tensor's start (resized or replaced under it); use a tensor that owns its memory"
        )
    return t.data_ptr(), t.data_ptr() + span
