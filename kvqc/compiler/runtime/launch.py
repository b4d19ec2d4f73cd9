"""Launching kernels with little host time: Triton's own launch once per launch key, its compiled launcher after
that (the comment below the marker says why); replay.py replays a decode plan's whole call for the next layers.

Every generated module carries this text (see kvqc/compiler/runtime/__init__.py).
"""

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvqc.compiler.runtime.environment import _COMPILED_CUDA

# ---- generated modules carry the rest of this file verbatim ----


# Triton binds, specializes and hashes every argument of every launch in Python, which for decode's few dozen
# arguments is most of an eager call's host time. _launch takes Triton's path once per launch key, which compiles
# (or loads) the kernel, and afterwards calls the compiled kernel's launcher itself; _launch_at goes further for
# launches that repeat layer after layer (a decode plan's) and skips even the key.


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a constexpr function, a few microseconds a call on the host


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0  # triton.next_power_of_2, likewise


def _launch_knobs():
    """Triton's run-time knobs where _launch may call compiled kernels itself: compiled CUDA with the interfaces it
    was written against (triton 3.6: launch hook chains, CompiledKernel.run), and KVQC_TRITON_LAUNCH unset;
    otherwise None, and every launch is Triton's own."""
    if not _COMPILED_CUDA or os.environ.get("KVQC_TRITON_LAUNCH", "0") == "1":
        return None
    try:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel
    except ImportError:
        return None
    hooks = getattr(getattr(knobs, "runtime", None), "launch_enter_hook", None)
    if not hasattr(hooks, "calls") or not hasattr(CompiledKernel, "run"):
        return None
    return knobs.runtime


_KNOBS = _launch_knobs()
# Launch key (see _launch) -> (the compiled kernel, its constexprs in parameter order), or None for a call that
# cannot be launched directly.
_LAUNCHES: dict = {}
_RAW_STREAM = None  # Triton's current-stream getter (a torch.cuda.Stream object costs 2-6 us to build)


def _hooked() -> bool:
    """Whether a launch hook is registered (Triton's profilers): then every launch is Triton's own."""
    return _KNOBS is None or bool(_KNOBS.launch_enter_hook.calls or _KNOBS.launch_exit_hook.calls)


def _specialization(arg) -> tuple:
    """What Triton compiles a run-time argument into: a tensor's dtype and whether its data is 16-byte aligned; an
    integer's type (i32, i64 or u64), whether it is divisible by 16, and whether it is 1 (Triton makes a 1 a
    constant); the type of a float, bool or None. Arguments with equal tuples run the same compiled kernel
    (tests/test_launch.py checks this against Triton's own specialization)."""
    kind = type(arg)
    if kind is not bool and isinstance(arg, int):
        return (int, arg == 1, arg % 16 == 0, -(1 << 31) <= arg < (1 << 31), -(1 << 63) <= arg < (1 << 63))
    if kind is bool or arg is None or isinstance(arg, float):
        return (kind,)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    raise TypeError(f"_launch: no launch key for an argument of type {type(arg).__name__}")


def _launch(kernel, grid: tuple, *args, **constexprs) -> "tuple | None":
    """kernel[grid](*args, **constexprs): args are the kernel's run-time arguments, in order, and constexprs the
    rest of its parameters by name, with Triton's launch options (num_warps, num_stages, maxnreg, launch_pdl).

    The launch key is the current device, each run-time argument's _specialization, and every constexpr and option
    by name. A key's first launch is Triton's; later ones call the compiled kernel's launcher on the current stream
    with the same arguments. A registered launch hook (Triton's profilers) keeps every launch Triton's. Returns
    the key's direct launcher, (compiled kernel, its constexprs in order), or None where launches stay Triton's.
    """
    global _RAW_STREAM
    if _hooked():
        kernel[grid](*args, **constexprs)
        return None
    device = torch.cuda.current_device()
    key = (kernel, device, *map(_specialization, args), *constexprs.items())
    entry = _LAUNCHES.get(key, False)
    if entry is False:
        compiled = kernel[grid](*args, **constexprs)
        params = getattr(kernel, "params", None) or []  # a stand-in for a kernel (tests' spies) has none
        names = [p.name for p in params[len(args):]]
        # Direct only where the run-time arguments all came by position and the constexprs name every parameter
        # after them: then args + the constexprs in order are the arguments Triton's launcher takes.
        direct = (
            bool(params) and not any(p.is_constexpr for p in params[:len(args)])
            and all(p.is_constexpr for p in params[len(args):]) and set(names) <= set(constexprs)
            and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
        )
        _LAUNCHES[key] = (compiled, tuple(constexprs[n] for n in names)) if direct else None
        if _RAW_STREAM is None:
            from triton.runtime.driver import driver

            _RAW_STREAM = driver.active.get_current_stream
        return _LAUNCHES[key]
    if entry is None:
        kernel[grid](*args, **constexprs)
        return None
    compiled, tail = entry
    x, y, z = (*grid, 1, 1)[:3]
    compiled.run(x, y, z, _RAW_STREAM(device), compiled.function, compiled.packed_metadata, None, None, None, *args,
                 *tail)
    return entry


def _launch_at(launches: "dict | None", site: tuple, kernel, grid: tuple, *args, **constexprs) -> None:
    """_launch for a call repeated with the same grid, integers, dtypes and constexprs, only tensor addresses
    changing (a decode plan's launches, once per layer): `site` names it with whatever alignment may change, and
    its compiled kernel is looked up once per site, not per call. While `launches` holds a list under _TAKEN, each
    launch is also appended to it, for _Replay."""
    entry = launches.get(site) if launches is not None else None
    if entry is None or _hooked():
        entry = _launch(kernel, grid, *args, **constexprs)
        if entry is not None and launches is not None:
            launches[site] = entry
    else:
        compiled, tail = entry
        x, y, z = (*grid, 1, 1)[:3]
        compiled.run(x, y, z, _RAW_STREAM(torch.cuda.current_device()), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *tail)
    taken = launches.get(_TAKEN) if launches is not None else None
    if taken is not None:
        taken.append((kernel, grid, args, constexprs, entry))


_TAKEN = "taken"  # the key of _launch_at's list of launches in a plan's `launches` (sites are tuples)


def _alignment(query: torch.Tensor, cache_addresses: list, out: "torch.Tensor | None") -> tuple:
    """What a plan's launches may differ in from layer to layer: whether the query, each cache tensor and the output
    the kernels write start on a 16-byte boundary. It keys the launch sites and, with the scale, the replays."""
    return (query.data_ptr() % 16 == 0, *(a % 16 == 0 for a in cache_addresses), _output_aligned(out))


def _output_aligned(out: "torch.Tensor | None") -> bool:
    """Whether the output the kernels write starts on a 16-byte boundary: `out` where it is contiguous, else a new
    tensor, which does."""
    return out is None or not out.is_contiguous() or out.data_ptr() % 16 == 0
