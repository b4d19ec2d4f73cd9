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


# Hadamard orders that are not powers of two: 12 * 2^k and 20 * 2^k (80 = 20 * 4, 96 = 12 * 8).
PALEY_ORDERS = (12, 20)


def paley_hadamard(n: int) -> list[list[int]]:
    """Paley's construction I of a Hadamard matrix of order n = q + 1, q a prime = 3 (mod 4): H = I + S with
    S = [[0, 1...], [-1..., Q]] and Q the Jacobsthal matrix Q[i][j] = chi(j - i), chi the quadratic character mod q.
    Entries +-1, H H^T = n I (not symmetric)."""
    q = n - 1
    if q < 3 or q % 4 != 3 or any(q % k == 0 for k in range(2, int(q**0.5) + 1)):
        raise ValueError(f"Paley's construction needs n - 1 a prime = 3 mod 4, got n = {n}")
    squares = {(k * k) % q for k in range(1, q)}
    chi = [0] + [1 if k in squares else -1 for k in range(1, q)]
    h = [[1] * n]
    for i in range(q):
        h.append([-1] + [(1 if i == j else 0) + chi[(j - i) % q] for j in range(q)])
    h[0][0] = 1
    return h


def hadamard_factors(d: int) -> tuple[int, int]:
    """d = m * p with p a power of two and m in (1,) + PALEY_ORDERS: the rotation is H_m (x) H_p (Sylvester's H_p)."""
    for m in (1,) + PALEY_ORDERS:
        p = d // m
        if d % m == 0 and p >= 1 and not p & (p - 1):
            return m, p
    raise ValueError(f"no Hadamard matrix of order {d} here: expected 2^k, 12 * 2^k or 20 * 2^k")


def hadamard_matrix(d: int) -> list[list[float]]:
    """Unnormalised Hadamard matrix of order d: Sylvester's ``H[i][j] = (-1)**popcount(i & j)`` for powers of two,
    else Paley's H_m (x) Sylvester's H_p (``hadamard_factors``)."""
    m, p = hadamard_factors(d)
    sylvester = [[-1.0 if bin(i & j).count("1") & 1 else 1.0 for j in range(p)] for i in range(p)]
    if m == 1:
        return sylvester
    paley = paley_hadamard(m)
    return [[paley[i // p][j // p] * sylvester[i % p][j % p] for j in range(d)] for i in range(d)]


def hadamard_transform(x: "torch.Tensor", transpose: bool = False) -> "torch.Tensor":
    """Unnormalised ``x @ H^T`` (each row mapped by H), or ``x @ H`` with transpose, over the last dim.

    Powers of two run the fast butterfly (Sylvester's H is symmetric); other orders apply H_m (x) H_p as two small
    products on x viewed as [m, p]: (H_m (x) H_p) vec(X) = vec(H_m X H_p^T).
    """
    import torch

    d = x.shape[-1]
    m, p = hadamard_factors(d)
    if m == 1:
        return fwht(x)
    h_m = torch.tensor(paley_hadamard(m), dtype=x.dtype)
    if transpose:
        h_m = h_m.t()
    y = fwht(x.reshape(*x.shape[:-1], m, p))  # X H_p^T (symmetric)
    return torch.matmul(h_m, y).reshape(x.shape)


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
