"""The Triton helpers that fill, flatten and decode call, as plain @triton.jit functions: the float32 dot at a chosen
precision, the fp16 halves of float32 tiles and their dots, the Walsh-Hadamard butterflies, QJL's projections,
joining chunks, fp8 encoding.

A generated module carries those of them its kernels call (Layout.jit_helpers), each as it stands below the marker
line with the comment and constants above it (codegen.helper_sources); the codebook select trees, whose size varies,
come from module.py.j2.
"""

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    from kvqc.compiler.runtime.environment import _COMPILED_CUDA

# ---- generated modules carry the rest of this file verbatim ----


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, acc=None):
    """a @ b (+ acc, added by the tensor cores) with float32 accumulation; float32 operands get the precision
    asked for (tf32x3 or ieee)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision=PRECISION)
    return tl.dot(a, b, acc)


@triton.jit
def _halves(x):
    """hi, lo: a float32 tile x in fp16 and what that rounding left, in fp16. Together they hold about 22
    significant bits of x where |x| is within fp16's normal range (rows scaled to a largest magnitude of 1, or
    Gaussian entries), so fp16 dots of the halves with float32 accumulation come near float32's precision."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _halves_dot(x, b):
    """x @ b for a float32 tile x in [-1, 1] and b of entries -1, 0 and 1 in fp16, as two fp16 dots of x's halves
    (exact products) with float32 accumulation, near float32's precision where tf32x3 takes three tf32 dots on a
    float32 b."""
    hi, lo = _halves(x)
    return tl.dot(lo, b, tl.dot(hi, b))


@triton.jit
def _walsh_hadamard(x, WIDTH: tl.constexpr):
    """x @ H_WIDTH (Sylvester's order, entries +-1, not normalized) along the last axis of x [rows, WIDTH],
    float32: log2(WIDTH) butterfly passes of exact adds and subtracts, so decode rotates its few query and output
    rows in Triton without reading a d x d matrix."""
    tl.static_assert(WIDTH <= 256, "head_dim above 256 needs more butterfly passes")
    ROWS: tl.constexpr = x.shape[0]
    for stage in tl.static_range(8):
        if (1 << stage) < WIDTH:
            # Pairs (i, i + 2^stage) inside each block of 2^(stage+1) columns become the split's last axis.
            pairs = tl.permute(tl.reshape(x, [ROWS, WIDTH // (2 << stage), 2, 1 << stage]), (0, 1, 3, 2))
            low, high = tl.split(pairs)
            x = tl.reshape(tl.permute(tl.join(low + high, low - high), (0, 1, 3, 2)), [ROWS, WIDTH])
    return x


@triton.jit
def _project_qjl(x, qjl_ptr, out_ptr, row, real, WIDTH: tl.constexpr, PRECISION: tl.constexpr):
    """S x, the QJL projection of query rows x [ROWS, WIDTH] in position order (S: WIDTH x WIDTH float32 at
    qjl_ptr), stored at out_ptr's rows `row` where `real`: the operand of K's sign tiles' dot. BLOCK rows of S a dot,
    so the block in flight stays small at any head_dim; a loop, not unrolled, because unrolled every block's dot keeps
    shared memory of its own, past an SM's at head_dim 256."""
    BLOCK: tl.constexpr = min(WIDTH, 32)
    dim = tl.arange(0, WIDTH)
    for first in range(0, WIDTH, BLOCK):
        block = first + tl.arange(0, BLOCK)
        matrix = tl.load(qjl_ptr + block[:, None] * WIDTH + dim[None, :])
        projected = _mm(x, tl.trans(matrix), PRECISION)
        tl.store(out_ptr + row[:, None] * WIDTH + block[None, :], projected, mask=real[:, None])


@triton.jit
def _project_halves(hi, lo, high, low):
    """(hi + lo) @ (high + low)^T for the fp16 halves of a float32 tile and of a float32 matrix (S's, made once in
    `_tables`): three fp16 dots with float32 accumulation (hi and lo against the high half, hi against the low
    half), about 22 bits relative to each operand's largest magnitude, as tf32x3's three dots keep, in half their
    operand registers."""
    return tl.dot(hi, tl.trans(low), tl.dot(lo, tl.trans(high), tl.dot(hi, tl.trans(high))))


@triton.jit
def _chunk_bits(positive, weight, CHUNKS: tl.constexpr):
    """[rows, width // CHUNKS] from 0/1 positive [rows, width] whose column i * CHUNKS + c is chunk c's position
    i: each chunk's bit times its weight (its place in a packed byte, or 0), summed over the chunks, which or's
    them, the bits being disjoint."""
    ROWS: tl.constexpr = positive.shape[0]
    WIDTH: tl.constexpr = positive.shape[1]
    return tl.sum(tl.reshape(positive * weight[None, :], [ROWS, WIDTH // CHUNKS, CHUNKS]), axis=2)


@triton.jit
def _expand_signs(signs, high, low):
    """signs @ (high + low) for +-1 signs in fp16 and the fp16 halves of a float32 matrix (S's, made once in
    `_tables`): two fp16 dots, whose products with +-1 are exact, with float32 accumulation."""
    return tl.dot(signs, low, tl.dot(signs, high))


@triton.jit
def _concat(a, b):
    """a and b [rows, width] side by side: [rows, 2 * width]."""
    ROWS: tl.constexpr = a.shape[0]
    WIDTH: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [ROWS, 2 * WIDTH])


# Compiled CUDA converts to fp8 in hardware (cvt.rn.satfinite: to nearest even, as _fp8_code's arithmetic does).
_FP8_CAST = tl.constexpr(_COMPILED_CUDA)


@triton.jit
def _fp8_code(x, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The fp8 bit pattern of x (already within the format's range), rounded to nearest even, as int32.

    On compiled CUDA the hardware's conversion. Elsewhere bit arithmetic, because Triton's interpreter rounds
    float8 casts wrongly: the interpreter and the GPU store the same bytes. Subnormals share the smallest normal
    exponent's step, and a mantissa that rounds up to 2^(MANTISSA+1) carries into the exponent field by itself.
    """
    if _FP8_CAST:
        if MANTISSA == 3:
            return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            return x.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    magnitude = tl.abs(x)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    exponent = tl.maximum(exponent, 1 - BIAS)
    step = ((exponent - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - MANTISSA), exact
    steps = magnitude / step
    whole = tl.floor(steps)
    rest = steps - whole
    mantissa = whole.to(tl.int32)
    mantissa += ((rest > 0.5) | ((rest == 0.5) & ((mantissa & 1) == 1))).to(tl.int32)
    code = (exponent + BIAS - 1) * (1 << MANTISSA) + mantissa
    return tl.where(x < 0, code | 128, code)
