"""The QJL residual's two products in fill and flatten, `_project_halves` (S r from the fp16 halves of r and of S)
and `_expand_signs` (S^T signs from S's halves), against float64; the modules make S's halves once in `_tables`
(`<side>_qjl_halves`), the kernel below as they do. Fill keeps only the sign of S r, and the kernel
tests allow a sign to flip where |S r| is within their margin of 0, so a lost half would still pass them: here each
product must stay within float32-like error of the exact one, relative to sum |r| |S| (a single fp16 dot is off by
about 5e-4 of it)."""

import torch
import triton
import triton.language as tl
from conftest import DEVICE, generated

ROWS, WIDTH, COLUMNS = 32, 128, 16
qjl = generated("turbo_qjl_k3v3")
project_halves, expand_signs = qjl._project_halves, qjl._expand_signs


@triton.jit
def _products_kernel(residual_ptr, matrix_ptr, signs_ptr, projected_ptr, expanded_ptr, ROWS: tl.constexpr,
                     WIDTH: tl.constexpr, COLUMNS: tl.constexpr):
    """As fill and flatten call them: each row scaled to a largest magnitude of 1 and split into fp16 halves,
    against COLUMNS rows of S's halves; fp16 +-1 signs against COLUMNS columns of S's halves."""
    row = tl.arange(0, ROWS)
    dim = tl.arange(0, WIDTH)
    column = tl.arange(0, COLUMNS)
    residual = tl.load(residual_ptr + row[:, None] * WIDTH + dim[None, :])
    residual = residual / tl.maximum(tl.max(tl.abs(residual), axis=1), 1e-30)[:, None]
    hi = residual.to(tl.float16)
    lo = (residual - hi.to(tl.float32)).to(tl.float16)
    rows_of_s = tl.load(matrix_ptr + column[:, None] * WIDTH + dim[None, :])
    high = rows_of_s.to(tl.float16)
    low = (rows_of_s - high.to(tl.float32)).to(tl.float16)
    tl.store(projected_ptr + row[:, None] * COLUMNS + column[None, :], project_halves(hi, lo, high, low))
    signs = tl.load(signs_ptr + row[:, None] * WIDTH + dim[None, :]).to(tl.float16)
    columns_of_s = tl.load(matrix_ptr + dim[:, None] * WIDTH + column[None, :])
    high = columns_of_s.to(tl.float16)
    low = (columns_of_s - high.to(tl.float32)).to(tl.float16)
    tl.store(expanded_ptr + row[:, None] * COLUMNS + column[None, :], expand_signs(signs, high, low))


def test_qjl_products_keep_float32_precision():
    g = torch.Generator().manual_seed(0)
    # Rows from magnitude 1 down to 1e-6: the scaling, not the magnitude, sets the halves' precision.
    residual = torch.randn(ROWS, WIDTH, generator=g) * torch.logspace(0, -6, ROWS)[:, None]
    matrix = torch.randn(WIDTH, WIDTH, generator=g)
    signs = torch.where(torch.rand(ROWS, WIDTH, generator=g) > 0.5, 1.0, -1.0)
    projected = torch.empty(ROWS, COLUMNS, device=DEVICE)
    expanded = torch.empty(ROWS, COLUMNS, device=DEVICE)
    _products_kernel[(1,)](residual.to(DEVICE), matrix.to(DEVICE), signs.to(DEVICE), projected, expanded, ROWS, WIDTH,
                           COLUMNS)
    r, s = residual.double() / residual.double().abs().amax(dim=1, keepdim=True), matrix.double()
    error = (projected.cpu().double() - r @ s[:COLUMNS].T).abs() / (r.abs() @ s[:COLUMNS].abs().T)
    assert float(error.max()) < 1e-6
    signs = signs.double()
    error = (expanded.cpu().double() - signs @ s[:, :COLUMNS]).abs() / (signs.abs() @ s[:, :COLUMNS].abs())
    assert float(error.max()) < 1e-6


def test_fill_and_flatten_read_the_halves_of_s():
    """`<side>_qjl_halves`, which fill and flatten read, is S's high half rounded to fp16 and what that left, also in
    fp16: together S within float32-like error, as the kernels' products assume."""
    tables = qjl._tables(WIDTH, torch.device("cpu"))
    s = tables["key_qjl"].double()
    high, low = tables["key_qjl_halves"].double()
    assert torch.equal(tables["key_qjl_halves"][0], tables["key_qjl"].to(torch.float16))
    assert float(((high + low) - s).abs().max() / s.abs().max()) < 1e-6
    assert float((high - s).abs().max() / s.abs().max()) > 1e-5  # the low half carries what fp16 alone loses
