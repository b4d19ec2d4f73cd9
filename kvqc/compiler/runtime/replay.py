"""A decode plan's replay: the first layer's launches, run again for every later layer with that layer's own
tensors. Modules whose decode is kernel launches alone (Layout.decode_replays) carry it.

Every such module carries this text (see kvqc/compiler/runtime/__init__.py), after launch.py's.
"""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvqc.compiler.runtime.launch import _RAW_STREAM, _hooked

# ---- generated modules carry the rest of this file verbatim ----


class _Replay:
    """One layer's decode launches, taken by the first call of a plan, run again for every later layer: each
    launch's compiled kernel and arguments, all fixed but the layer's own tensors (the query, the output and the
    cache's), which go in by position. Compiled launches take addresses as integers, which Triton's launcher passes
    as they are (a tensor costs it a driver call to check its pointer, about half a microsecond each). A layer's
    host time is then the cache check, the output's allocation and the launches."""

    __slots__ = ("launches", "out_dtype", "kept")

    def __init__(self, launches: list, out_dtype: torch.dtype, kept: tuple) -> None:
        self.launches = launches
        self.out_dtype = out_dtype
        self.kept = kept  # the tensors whose addresses the launches hold, alive as long as the replay

    @classmethod
    def of(cls, taken: list, query: torch.Tensor, cache_tensors: tuple, out: torch.Tensor, kept: tuple
           ) -> "_Replay | None":
        """The replay of the call that launched `taken` and returned `out`, or None where some launch reads a
        tensor that is neither the layer's (the query or a view of it, out, a cache tensor) nor one in `kept`
        (what the plan and the module hold for every layer): a temporary a torch op made, which a replay would
        not remake."""
        kept_ids = {id(t) for t in kept}
        launches, writes_out = [], False
        for kernel, grid, args, constexprs, entry in taken:
            slots, addresses = [], list(args)
            for at, arg in enumerate(args):
                if not isinstance(arg, torch.Tensor):
                    continue
                if id(arg) in kept_ids:
                    addresses[at] = arg.data_ptr()
                    continue
                layer = _layer_slot(arg, query, out, cache_tensors)
                if layer is None:
                    return None
                slots.append((at, layer))
                writes_out |= layer == 1
            compiled, tail = entry if entry is not None else (None, ())
            grid = (*grid, 1, 1)[:3]
            launches.append((grid, kernel, args, (*addresses, *tail), tuple(slots), constexprs, compiled))
        return cls(launches, out.dtype, kept) if writes_out else None

    def __call__(self, query: torch.Tensor, cache_tensors: tuple, cache_addresses: list,
                 out: "torch.Tensor | None" = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(query, dtype=self.out_dtype)
        hooked = _hooked()
        if not hooked:
            stream = _RAW_STREAM(torch.cuda.current_device())
            layer = (query.data_ptr(), out.data_ptr(), *cache_addresses)
        for grid, kernel, args, addresses, slots, constexprs, compiled in self.launches:
            if compiled is None or hooked:  # Triton's own launch (the interpreter, a profiler's hooks)
                args = list(args)
                for at, index in slots:
                    args[at] = (query, out, *cache_tensors)[index]
                kernel[grid](*args, **constexprs)
                continue
            if slots:
                addresses = list(addresses)
                for at, index in slots:
                    addresses[at] = layer[index]
            compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *addresses)
        return out


def _layer_slot(arg: torch.Tensor, query: torch.Tensor, out: torch.Tensor, cache_tensors: tuple) -> "int | None":
    """Where `arg` comes from in a replay's (query, out, *cache_tensors): kernels read a tensor by its address
    alone, so a contiguous view of the query (its rows flattened) is the query."""
    for index, t in enumerate(cache_tensors):
        if arg is t:
            return 2 + index
    for index, t in ((0, query), (1, out)):
        if arg.data_ptr() == t.data_ptr() and arg.dtype == t.dtype and arg.numel() == t.numel() and arg.is_contiguous():
            return index
    return None
