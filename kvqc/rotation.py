"""Deterministic random rotations: a counter-based generator and Hadamard transforms.

Seeded torch/numpy RNGs are not stable across versions and devices, so the
rotation a scheme is compiled with comes from SplitMix64 in pure Python
instead.  ``splitmix64``, ``uniform`` and ``gaussian_matrix`` are rendered
into generated source with ``inspect.getsource``: they must stay
self-contained (only ``math`` and each other, no decorators, no globals).

Bit-for-bit the integer outputs (``splitmix64``, ``sign_vector``) are the
same everywhere; ``uniform`` is exact too.  ``gaussian_matrix`` goes through
the platform's ``log``/``cos``/``sin``, which are correctly rounded in
practice but not guaranteed to be, so compare its output with a tolerance.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def splitmix64(x: int) -> int:
    """One step of the standard SplitMix64 generator whose state is ``x``.

    Adds the golden-ratio increment before mixing (as Vigna's reference
    ``next()`` does), so ``splitmix64(0)`` is 0xE220A8397B1DCDAF rather than
    the mixer's fixed point 0.
    """
    z = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def uniform(seed: int, index: int) -> float:
    """Draw number ``index`` of the SplitMix64 stream seeded with ``seed``, in (0, 1].

    The state after ``index`` steps is ``seed + index * golden``, so any draw
    can be computed on its own.  Excluding 0 keeps ``log(u)`` finite.
    """
    h = splitmix64((seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    return ((h >> 11) + 1) * 2.0**-53


def sign_vector(d: int, seed: int) -> tuple[int, ...]:
    """``d`` independent random signs (+1 / -1)."""
    if d < 0:
        raise ValueError(f"d must be >= 0, got {d}")
    # A stream of its own, so the signs are independent of gaussian_matrix(seed).
    stream = seed ^ 0x5A17C0DE5A17C0DE
    # u is k * 2**-53 for k in 1..2**53, so u > 0.5 has probability exactly 1/2.
    return tuple(1 if uniform(stream, i) > 0.5 else -1 for i in range(d))


def gaussian_matrix(rows: int, cols: int, seed: int) -> list[list[float]]:
    """A ``rows x cols`` matrix of i.i.d. N(0, 1) draws (Box-Muller).

    Entry ``k = r * cols + c`` (row-major) belongs to pair ``k // 2``, which
    uses draws ``k`` and ``k ^ 1`` of the stream: the even one sets the
    radius, the odd one the angle; even entries take the cosine.
    """
    if rows < 0 or cols < 0:
        raise ValueError(f"shape must be non-negative, got {rows} x {cols}")
    n = rows * cols
    flat = []
    for p in range((n + 1) // 2):
        radius = math.sqrt(-2.0 * math.log(uniform(seed, 2 * p)))
        angle = 2.0 * math.pi * uniform(seed, 2 * p + 1)
        flat.append(radius * math.cos(angle))
        flat.append(radius * math.sin(angle))
    return [flat[r * cols:(r + 1) * cols] for r in range(rows)]


def _check_power_of_two(d: int) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"dimension must be a power of two, got {d}")


def hadamard_matrix(d: int) -> list[list[float]]:
    """Unnormalised Sylvester Hadamard matrix, ``H[i][j] = (-1)**popcount(i & j)``."""
    _check_power_of_two(d)
    return [[-1.0 if bin(i & j).count("1") & 1 else 1.0 for j in range(d)] for i in range(d)]


def fwht(x: "torch.Tensor") -> "torch.Tensor":
    """Unnormalised fast Walsh-Hadamard transform over the last dim: ``x @ H``."""
    import torch  # optional dependency: only this function needs it

    d = x.shape[-1]
    _check_power_of_two(d)
    batch = x.shape[:-1]
    y = x
    h = 1
    while h < d:
        # View index i as (block, bit h of i, low bits): pairs (i, i + h) differ in that bit.
        y = y.reshape(*batch, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(x.shape)
