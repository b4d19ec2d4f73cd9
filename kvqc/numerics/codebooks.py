"""Lloyd-Max scalar codebooks for one coordinate of a randomly rotated unit vector.

After a random rotation each coordinate x of a unit vector in R^d follows the
same law, whose density is proportional to (1 - x^2)^((d-3)/2) on [-1, 1].
Everything here is in standardized units t = x * sqrt(d) (unit variance):

* ``"sphere"``: that exact law, for d = ``head_dim`` >= 3;
* ``"gaussian"``: its large-d limit N(0, 1).

This runs at build time and its numbers are embedded in generated code, so it
is sequential pure-Python float64 (no torch/numpy, whose reductions vary by
machine) and the centroids are rounded to 10 significant digits at the end.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

LAWS = ("gaussian", "sphere")
MAX_BITS = 8

_TOL = 1e-12  # Convergence: largest centroid update, standardized units.
_MAX_ITER = 200  # Newton needs < 20 steps even at 8 bits; the rest is slack for fallbacks.
_GL_ORDER = 10  # Gauss-Legendre nodes per panel for the sphere law.


@dataclass(frozen=True)
class Codebook:
    """A symmetric scalar quantizer in standardized units.

    ``centroids`` (2**bits, ascending) are the reconstruction levels and
    ``boundaries`` (2**bits - 1) the decision thresholds between them.
    ``mse`` is the expected squared error of one unit-variance coordinate.
    """

    centroids: tuple[float, ...]
    boundaries: tuple[float, ...]
    mse: float


class _Law(NamedTuple):
    # All three take t >= 0 and must be accurate relative to their (tiny) tail values,
    # because outer cells are differences of them.
    tail: Callable[[float], float]  # P(T > t)
    tail_mean: Callable[[float], float]  # E[T; T > t]
    density: Callable[[float], float]
    upper: float  # end of the support


def _gaussian_law() -> _Law:
    inv_sqrt2 = 1.0 / math.sqrt(2.0)
    inv_sqrt2pi = 1.0 / math.sqrt(2.0 * math.pi)

    def density(t: float) -> float:
        return inv_sqrt2pi * math.exp(-0.5 * t * t)

    # erfc rather than 1 - erf: keeps relative accuracy in the tails.
    return _Law(lambda t: 0.5 * math.erfc(t * inv_sqrt2), density, density, math.inf)


@functools.lru_cache(maxsize=None)
def _gauss_legendre(m: int) -> tuple[tuple[float, float], ...]:
    """Nodes and weights of m-point Gauss-Legendre quadrature on [-1, 1]."""
    rule = []
    for i in range(m):
        x = math.cos(math.pi * (i + 0.75) / (m + 0.5))  # standard starting guess for root i
        for _ in range(100):
            p0, p1 = 1.0, x  # Legendre recurrence up to P_m(x)
            for k in range(2, m + 1):
                p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
            dp = m * (x * p1 - p0) / (x * x - 1.0)
            step = p1 / dp
            x -= step
            if abs(step) < 1e-16:
                break
        rule.append((x, 2.0 / ((1.0 - x * x) * dp * dp)))
    return tuple(rule)


@functools.lru_cache(maxsize=None)
def _sphere_law(d: int) -> _Law:
    # With x = sin(theta) the density times dx is cos(theta)**(d-2) dtheta, which is
    # smooth up to theta = pi/2 for every d (in x it has a sqrt cusp at x = 1 for even d).
    n = d - 2
    sqrt_d = math.sqrt(d)
    rule = _gauss_legendre(_GL_ORDER)

    def weight(theta: float) -> float:
        s2 = math.sin(theta) ** 2
        if s2 >= 1.0:
            return 0.0  # n >= 1
        # log1p keeps ~1e-15 relative accuracy; cos(theta)**n would lose n ulps.
        return math.exp(0.5 * n * math.log1p(-s2))

    def integral(lo: float, hi: float) -> float:
        half, mid = 0.5 * (hi - lo), 0.5 * (hi + lo)
        return half * sum(w * weight(mid + half * x) for x, w in rule)

    # Panels of about half the width of the bulk (1/sqrt(n)) resolve it to ~1e-15;
    # tails are cumulated from pi/2 down so that small tails stay relatively accurate.
    panels = max(16, math.ceil(math.pi * math.sqrt(n)))
    nodes = [0.5 * math.pi * k / panels for k in range(panels)] + [0.5 * math.pi]
    tails = [0.0] * (panels + 1)
    for k in range(panels - 1, -1, -1):
        tails[k] = tails[k + 1] + integral(nodes[k], nodes[k + 1])
    scale = 0.5 / tails[0]  # normalise numerically, so the cells add up to exactly 1

    def tail(t: float) -> float:
        if t >= sqrt_d:
            return 0.0
        theta = math.asin(t / sqrt_d)
        k = min(bisect.bisect_right(nodes, theta), panels) - 1
        return scale * (tails[k + 1] + integral(theta, nodes[k + 1]))

    def tail_mean(t: float) -> float:
        # Closed form: the integral of sin * cos**n is -cos**(n+1) / (n+1).
        if t >= sqrt_d:
            return 0.0
        return scale * sqrt_d / (n + 1) * math.exp(0.5 * (n + 1) * math.log1p(-t * t / d))

    def density(t: float) -> float:
        if t >= sqrt_d:
            return 0.0
        return scale / sqrt_d * math.exp(0.5 * (n - 1) * math.log1p(-t * t / d))

    return _Law(tail, tail_mean, density, sqrt_d)


def _cells(law: _Law, positive: list[float]) -> tuple[list[float], list[float], list[float]]:
    """Boundaries, masses and first moments of the cells on t >= 0."""
    b = [0.0] + [0.5 * (lo + hi) for lo, hi in zip(positive, positive[1:])] + [law.upper]
    tails = [law.tail(x) for x in b]
    means = [law.tail_mean(x) for x in b]
    masses = [tails[j] - tails[j + 1] for j in range(len(positive))]
    moments = [means[j] - means[j + 1] for j in range(len(positive))]
    return b, masses, moments


def _quantile(law: _Law, q: float) -> float:
    """The t >= 0 with P(T > t) = q, by bisection."""
    lo, hi = 0.0, min(law.upper, 40.0)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if law.tail(mid) > q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _solve_tridiagonal(sub: list[float], diag: list[float], sup: list[float], rhs: list[float]) -> list[float]:
    # Thomas algorithm; no pivoting needed since the Jacobian I - dm/dc is an M-matrix.
    m = len(diag)
    c, r = [0.0] * m, [0.0] * m
    for i in range(m):
        denom = diag[i] - (sub[i] * c[i - 1] if i else 0.0)
        c[i] = sup[i] / denom
        r[i] = (rhs[i] - (sub[i] * r[i - 1] if i else 0.0)) / denom
    for i in range(m - 2, -1, -1):
        r[i] -= c[i] * r[i + 1]
    return r


def _lloyd_half(law: _Law, levels: int) -> list[float]:
    """Positive centroids of the symmetric Lloyd-Max quantizer with ``levels`` levels.

    Plain Lloyd iteration contracts by only ~1 - 10/levels**2 per step (about 10^5
    steps at 8 bits), so each Lloyd step is Newton-accelerated: the Lloyd map's
    Jacobian is tridiagonal in the centroids.  A Newton step is kept only if it
    keeps the centroids ordered and shrinks the residual; otherwise we fall back
    to the plain Lloyd step, which always keeps them ordered.  Converged means the
    last update moved no centroid by more than 1e-12.
    """
    half = levels // 2
    # Mid-quantiles of the law; the negative half is the mirror image.
    p = [_quantile(law, (half - j - 0.5) / levels) for j in range(half)]

    def residual(p: list[float]) -> tuple[list[float], list[float], list[float], list[float]]:
        b, masses, moments = _cells(law, p)
        m = [m1 / m0 for m0, m1 in zip(masses, moments)]
        return b, masses, m, [pj - mj for pj, mj in zip(p, m)]

    def ordered(p: list[float]) -> bool:
        return 0.0 < p[0] and all(a < b for a, b in zip(p, p[1:])) and p[-1] < law.upper

    b, masses, m, r = residual(p)
    for _ in range(_MAX_ITER):
        # dm_j/db: moving a boundary adds or removes mass at the boundary value.
        f = [law.density(x) for x in b]
        up = [f[j + 1] * (b[j + 1] - m[j]) / masses[j] if j + 1 < half else 0.0 for j in range(half)]
        lo = [f[j] * (m[j] - b[j]) / masses[j] if j else 0.0 for j in range(half)]
        diag = [1.0 - 0.5 * (u + v) for u, v in zip(up, lo)]
        step = _solve_tridiagonal([-0.5 * v for v in lo], diag, [-0.5 * u for u in up], r)
        if max(map(abs, step)) < _TOL:
            return [pj - sj for pj, sj in zip(p, step)]
        size = max(map(abs, r))
        for damping in (1.0, 0.5, 0.25, 0.125):
            trial = [pj - damping * sj for pj, sj in zip(p, step)]
            if ordered(trial):
                trial_state = residual(trial)
                if max(map(abs, trial_state[3])) < size:
                    p, (b, masses, m, r) = trial, trial_state
                    break
        else:
            lloyd = m
            if max(abs(a - c) for a, c in zip(p, lloyd)) < _TOL:
                return lloyd
            p = lloyd
            b, masses, m, r = residual(p)
    raise RuntimeError(f"Lloyd-Max did not converge for {levels} levels in {_MAX_ITER} iterations")


def _round(x: float) -> float:
    # 10 significant digits: far below any quantization error and, except for the few
    # centroids below 0.01 (7-8 bits), above the ~1e-12 solver noise that libm
    # differences in erfc/exp/sin could cause.
    return float(f"{x:.10g}")


# typed: lloyd_max(2.0) must not be answered from the cache entry of lloyd_max(2).
@functools.lru_cache(maxsize=None, typed=True)
def lloyd_max(bits: int, law: str = "gaussian", head_dim: int | None = None) -> Codebook:
    """The optimal (Lloyd-Max) ``bits``-bit scalar quantizer for ``law``.

    ``head_dim`` (d >= 3) is required for ``"sphere"`` and ignored for ``"gaussian"``.
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in 1..{MAX_BITS}, got {bits!r}")
    if law not in LAWS:
        raise ValueError(f"law must be one of {LAWS}, got {law!r}")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if law == "sphere":
        if head_dim is None or head_dim < 3:
            raise ValueError(f"the sphere law needs head_dim >= 3, got {head_dim!r}")
        dist = _sphere_law(head_dim)
    else:
        dist = _gaussian_law()

    positive = [_round(x) for x in _lloyd_half(dist, 2**bits)]
    centroids = tuple(-x for x in reversed(positive)) + tuple(positive)
    boundaries = tuple(0.5 * (a + b) for a, b in zip(centroids, centroids[1:]))

    # E(t - c)^2 = E t^2 - sum over cells of (2 c M1 - c^2 M0), with E t^2 = 1; the two
    # halves contribute equally.  Uses the rounded codebook: this is what ships.
    _, masses, moments = _cells(dist, positive)
    captured = sum(c * (2.0 * m1 - c * m0) for c, m0, m1 in zip(positive, masses, moments))
    return Codebook(centroids, boundaries, _round(1.0 - 2.0 * captured))


def distortion_unit_vector(codebook: Codebook, head_dim: int) -> float:
    """E||x - x_hat||^2 for a unit vector x in R^head_dim, quantized per coordinate.

    Each coordinate has variance 1/d and is quantized with the codebook scaled
    by 1/sqrt(d), so it contributes mse/d; the d coordinates sum to ``mse``.
    This is the quantity the TurboQuant paper reports as D_mse.
    """
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return head_dim * (codebook.mse / head_dim)
