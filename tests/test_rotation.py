import inspect
import math

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, generated
from hypothesis import given
from hypothesis import strategies as st

from kvqc.numerics import rotation
from kvqc.numerics.rotation import fwht, gaussian_matrix, hadamard_matrix, sign_vector, splitmix64, uniform

RENDERED = (splitmix64, uniform, gaussian_matrix)


def uniform_bits(seed: int, index: int) -> int:
    """The 64 random bits behind uniform(seed, index)."""
    return splitmix64((seed + index * 0x9E3779B97F4A7C15) % 2**64)


def test_splitmix64_reference_stream():
    # The first outputs of the reference SplitMix64 generator seeded with 0.
    assert [uniform_bits(0, i) for i in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert uniform(0, 2) == ((0x06C45D188009454F >> 11) + 1) * 2.0**-53


@given(st.integers(min_value=-(2**80), max_value=2**80), st.integers(min_value=0, max_value=2**40))
def test_ranges(seed, index):
    assert 0 <= splitmix64(seed) < 2**64
    assert 0.0 < uniform(seed, index) <= 1.0
    # Seeds are taken modulo 2**64.
    assert uniform(seed, index) == uniform(seed % 2**64, index)


def test_pinned_values():
    # Exact: these are integer and dyadic computations.  A change here changes every compiled scheme.
    assert uniform(0, 0) == 0.8833108082136427
    assert [uniform(42, i) for i in range(3)] == [0.7415648787718234, 0.15991039287692022, 0.2786011302551388]
    assert sign_vector(16, 0) == (1, 1, 1, 1, -1, 1, -1, 1, 1, 1, -1, 1, 1, -1, 1, -1)
    # Through libm log/cos/sin, so compared with a tolerance.
    expected = [
        [-0.45275774021745807, 0.20776603893419174, 2.650605812079669],
        [-0.4904228253986477, -0.9886041246243285, 1.8721013803315412],
    ]
    got = gaussian_matrix(2, 3, 0)
    assert [len(row) for row in got] == [3, 3]
    for row, ref in zip(got, expected):
        assert row == pytest.approx(ref, rel=1e-13, abs=1e-15)


def test_sign_balance():
    d = 100_000
    signs = sign_vector(d, 7)
    assert len(signs) == d and set(signs) == {-1, 1}
    assert abs(sum(signs)) < 4 * math.sqrt(d)
    # Signs and gaussians use different streams of the same seed.
    gauss_signs = [1 if g > 0 else -1 for g in gaussian_matrix(1, 64, 7)[0]]
    assert list(sign_vector(64, 7)) != gauss_signs


def test_gaussian_moments():
    n = 200_000
    z = gaussian_matrix(400, n // 400, 12345)
    flat = [v for row in z for v in row]
    mean = sum(flat) / n
    var = sum((v - mean) ** 2 for v in flat) / (n - 1)
    kurt = sum((v - mean) ** 4 for v in flat) / n / var**2
    # 4 standard errors: sd(mean) = 1/sqrt(n), sd(var) = sqrt(2/n), sd(kurtosis) = sqrt(24/n).
    assert abs(mean) < 4 / math.sqrt(n)
    assert abs(var - 1) < 4 * math.sqrt(2 / n)
    assert abs(kurt - 3) < 4 * math.sqrt(24 / n)
    # Odd entries take the sine of the pair's angle: check they are not correlated with even ones.
    corr = sum(a * b for a, b in zip(flat[::2], flat[1::2])) / (n // 2)
    assert abs(corr) < 4 / math.sqrt(n // 2)


def test_gaussian_row_major_and_odd_counts():
    flat = gaussian_matrix(1, 15, 3)[0]
    assert [v for row in gaussian_matrix(3, 5, 3) for v in row] == flat
    assert [v for row in gaussian_matrix(5, 3, 3) for v in row] == flat
    assert gaussian_matrix(0, 4, 3) == [] and gaussian_matrix(2, 0, 3) == [[], []]


def test_different_seeds_differ():
    assert gaussian_matrix(4, 4, 0) != gaussian_matrix(4, 4, 1)
    assert sign_vector(64, 0) != sign_vector(64, 1)
    assert uniform(0, 5) != uniform(1, 5)


def test_rendered_functions_are_self_contained():
    for fn in RENDERED:
        assert not inspect.getclosurevars(fn).nonlocals
        assert set(inspect.getclosurevars(fn).globals) <= {"math", "splitmix64", "uniform"}
    # Render them the way the code generator does and check they still agree.
    namespace = {"math": math}
    exec("\n\n".join(inspect.getsource(fn) for fn in RENDERED), namespace)
    assert namespace["gaussian_matrix"](3, 7, 99) == gaussian_matrix(3, 7, 99)


@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 64])
def test_hadamard_orthogonal(d):
    h = torch.tensor(hadamard_matrix(d), dtype=torch.float64)
    assert set(h.flatten().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, d * torch.eye(d, dtype=torch.float64))
    assert torch.equal(h, h.T)
    i, j = 5 % d, 3 % d
    assert h[i, j].item() == (-1) ** bin(i & j).count("1")


@pytest.mark.parametrize("d", [0, 3, 6, 12, -4])
def test_not_power_of_two(d):
    if d != 12:  # 12 is Paley's order (tests below); the fast butterfly still refuses it
        with pytest.raises(ValueError):
            hadamard_matrix(d)
    if d > 0:
        with pytest.raises(ValueError):
            fwht(torch.zeros(2, d))


@pytest.mark.parametrize("d", [1, 2, 8, 32, 128, 256])
def test_fwht_matches_matmul(d):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(3, 5, d, generator=gen, dtype=torch.float64)
    h = torch.tensor(hadamard_matrix(d), dtype=torch.float64)
    y = fwht(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, x @ h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fwht(y), d * x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fwht_other_dtypes_and_shapes(dtype):
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h = torch.tensor(hadamard_matrix(64), dtype=torch.float64)
    y = fwht(x.to(dtype))
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), x.to(dtype).double() @ h, rtol=0.05, atol=0.3)
    # A single vector and a non-contiguous view work too.
    torch.testing.assert_close(fwht(x[0]), x[0] @ h)
    torch.testing.assert_close(fwht(x.T.contiguous().T), x @ h)


# -- orders that are not powers of two (head_dim 80 and 96)


@pytest.mark.parametrize("n", [12, 20])
def test_paley_hadamard_is_hadamard(n):
    h = torch.tensor(rotation.paley_hadamard(n), dtype=torch.float64)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("n", [2, 10, 13, 16, 22])
def test_paley_refuses_orders_it_cannot_build(n):
    with pytest.raises(ValueError, match="prime = 3 mod 4"):
        rotation.paley_hadamard(n)


@pytest.mark.parametrize("d, factors", [(64, (1, 64)), (80, (20, 4)), (96, (12, 8)), (48, (12, 4)), (160, (20, 8))])
def test_hadamard_orders(d, factors):
    assert rotation.hadamard_factors(d) == factors
    h = torch.tensor(rotation.hadamard_matrix(d), dtype=torch.float64)
    assert torch.equal(h @ h.T, d * torch.eye(d, dtype=torch.float64))
    # Every coordinate of a rotated basis vector has magnitude 1/sqrt(d): the rotation mixes all of them.
    assert torch.equal(h.abs(), torch.ones(d, d, dtype=torch.float64))


@pytest.mark.parametrize("d", [64, 80, 96])
def test_hadamard_transform_matches_the_matrix(d):
    h = torch.tensor(rotation.hadamard_matrix(d), dtype=torch.float64)
    x = torch.randn(5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(rotation.hadamard_transform(x), x @ h.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(rotation.hadamard_transform(x, transpose=True), x @ h, rtol=0, atol=1e-12)
    # H^T H = d I: the transpose undoes the transform
    torch.testing.assert_close(rotation.hadamard_transform(rotation.hadamard_transform(x), transpose=True) / d, x)


def test_hadamard_refuses_other_orders():
    with pytest.raises(ValueError, match="12 \\* 2\\^k or 20 \\* 2\\^k"):
        rotation.hadamard_factors(72)


# Decode's in-kernel rotation (the query's, and the merged output's), as a module that rotates renders it.
_walsh_hadamard = generated("turbo_k4v2")._walsh_hadamard


@triton.jit
def _transform_rows(x_ptr, y_ptr, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    tl.store(y_ptr + offsets, _walsh_hadamard(tl.load(x_ptr + offsets), WIDTH))


@pytest.mark.parametrize("width", [1, 2, 16, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 16])
def test_walsh_hadamard_kernel_matches_sylvester(rows, width):
    # float32 butterflies against the float64 Sylvester matrix, to float32 rounding. A transform that skipped a pass
    # or swapped a pair's sum and difference misses by O(1) (both fail this, tried by editing the rendered module).
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(width))
    y = torch.empty_like(x, device=DEVICE)
    _transform_rows[(1,)](x.to(DEVICE), y, ROWS=rows, WIDTH=width)
    want = x.double() @ torch.tensor(hadamard_matrix(width), dtype=torch.float64)
    assert torch.allclose(y.cpu().double(), want, rtol=0, atol=1e-5 * math.sqrt(width) * float(x.abs().max()))
