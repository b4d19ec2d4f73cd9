"""The hand-written PTX helpers that decode (and flatten, where it shares decode's lookups) unpack whole chunks of
code bytes with: u8 and u4 grids, lut2 and lut4 codebook lookups, lut3s (a 3-bit index with a sign residual), and u4
read as 32-bit words. A generated module carries those its plan names (Layout.ptx_helpers), each as it stands below
the marker line (codegen.helper_sources); the helpers that gather codes from several bit planes are generated per
format in templates/kernels/unpack.py.j2.

PTX that turns 32-bit registers of packed codes into fp16 pairs. Every helper is lane-wise (output element k
depends on input element k only), so it is correct for whatever register layout Triton picks; pack=4 hands it
four bytes in one register, pack=2 the words of two elements. Only the compiled (CUDA) path calls them: the
interpreter cannot run PTX.

is_pure decides where the unpacking runs. A pure helper may be moved by Triton past the layout change into
tl.dot's operand layout, so it unpacks code bytes read from shared memory in that layout (for V, whose pairs
run along tokens, one LDS.U8 per byte); an impure one stays in the load's layout, and the fp16 tiles take
16-byte stores and ldmatrix instead. H100, 8 x 32k, head_dim 128: the codebook lookups
(lut*) run 11% faster impure (turbo_k4v2's decode), the integer grids (u4, u8) 12-24% slower,
though impure they issue 19-27% fewer instructions: at one warp per program decode waits on latency, and
the shared-memory round trip costs more than the byte loads it replaces. But Triton moves the layout change only
past operands that are loads or constants, not a table word loaded once per program: lut1's words are constants
(SideLayout.lut_expr), and its pure K helper reads K's bytes by one ldmatrix a tile, instead of eight fp16
store-and-ldmatrix round trips (on an H100, sign1_window's split kernel at 8 x 32k in 64% of the time).
"""

import triton
import triton.language as tl

# ---- generated modules carry the rest of this file verbatim ----


@triton.jit
def _unpack_u8(codes):
    """uint8 codes -> fp16 code - 128 (centred, see decode): prmt writes 0x64 above each byte (1024 + code), one
    subtraction of 1152 per pair."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 e, m;
        mov.b32 e, 0x64646464;
        mov.b32 m, 0x64806480;
        prmt.b32 $0, $2, e, 0x4140;
        prmt.b32 $1, $2, e, 0x4342;
        sub.f16x2 $0, $0, m;
        sub.f16x2 $1, $1, m;
        }""",
        constraints="=r,=r,r",
        args=[codes],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _unpack_u4(codes):
    """Two 4-bit codes per byte -> fp16 code - 8 (centred, see decode) of the low nibbles (chunk 0) and of the high
    nibbles (chunk 1).

    A nibble or'ed into 0x6400 is 1024 + code; a high nibble lands four bits up, 1024 + 16 * code, and one fma
    (x / 16 - 72) takes it back.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 z, t0, t1, m, c, lo, hi, s, o;
        mov.b32 z, 0;
        mov.b32 m, 0x64006400;
        mov.b32 c, 0x64086408;
        mov.b32 lo, 0x000f000f;
        mov.b32 hi, 0x00f000f0;
        mov.b32 s, 0x2c002c00;
        mov.b32 o, 0xd480d480;
        prmt.b32 t0, $4, z, 0x4140;
        prmt.b32 t1, $4, z, 0x4342;
        lop3.b32 $0, t0, lo, m, 0xea;
        lop3.b32 $1, t1, lo, m, 0xea;
        lop3.b32 $2, t0, hi, m, 0xea;
        lop3.b32 $3, t1, hi, m, 0xea;
        sub.f16x2 $0, $0, c;
        sub.f16x2 $1, $1, c;
        fma.rn.f16x2 $2, $2, s, o;
        fma.rn.f16x2 $3, $3, s, o;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[codes],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _unpack_lut2(codes, lo, hi):
    """Four 2-bit indices per byte -> fp16 codebook entries for chunks 0..3 (bits 0, 2, 4, 6).

    lo / hi hold the low / high bytes of the four entries; selector nibbles (i0, i0 + 4, i1, i1 + 4), made by one
    multiply-add from the index bytes, make one prmt return the entries of two indices.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, s, t;
        and.b32 a, $8, 0x03030303;
        mad.lo.u32 s, a, 0x11, 0x40404040;
        prmt.b32 $0, $9, $13, s;
        shr.b32 t, s, 16;
        prmt.b32 $1, $9, $13, t;
        shr.b32 a, $8, 2;
        and.b32 a, a, 0x03030303;
        mad.lo.u32 s, a, 0x11, 0x40404040;
        prmt.b32 $2, $9, $13, s;
        shr.b32 t, s, 16;
        prmt.b32 $3, $9, $13, t;
        shr.b32 a, $8, 4;
        and.b32 a, a, 0x03030303;
        mad.lo.u32 s, a, 0x11, 0x40404040;
        prmt.b32 $4, $9, $13, s;
        shr.b32 t, s, 16;
        prmt.b32 $5, $9, $13, t;
        shr.b32 a, $8, 6;
        and.b32 a, a, 0x03030303;
        mad.lo.u32 s, a, 0x11, 0x40404040;
        prmt.b32 $6, $9, $13, s;
        shr.b32 t, s, 16;
        prmt.b32 $7, $9, $13, t;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
        args=[codes, lo, hi],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=False,
        pack=4,
    )


@triton.jit
def _unpack_lut3s(codes, rms, lo0, lo1, hi0, hi1):
    """Two codes per byte, each a 3-bit index and the residual's sign (bit 3) -> fp16 entry[index] + -rms.

    The four index nibbles of a register become one prmt selector; prmt then reads the low bytes (lo0: entries
    0..3, lo1: 4..7) and the high bytes of four entries at once, and two more interleave them. The sign bit,
    moved to bit 15 of each half, flips rms's sign with one lop3 before a paired add.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 z, m, a, y, s, l, h, t, u;
        mov.b32 z, 0;
        mov.b32 m, 0x80008000;
        and.b32 a, $4, 0x07070707;
        shr.b32 y, a, 4;
        or.b32 y, y, a;
        prmt.b32 s, y, z, 0x0020;
        prmt.b32 l, $7, $11, s;
        prmt.b32 h, $15, $19, s;
        prmt.b32 $0, l, h, 0x5140;
        prmt.b32 $1, l, h, 0x7362;
        shr.b32 a, $4, 4;
        and.b32 a, a, 0x07070707;
        shr.b32 y, a, 4;
        or.b32 y, y, a;
        prmt.b32 s, y, z, 0x0020;
        prmt.b32 l, $7, $11, s;
        prmt.b32 h, $15, $19, s;
        prmt.b32 $2, l, h, 0x5140;
        prmt.b32 $3, l, h, 0x7362;
        prmt.b32 t, $4, z, 0x1404;
        shl.b32 u, t, 4;
        lop3.b32 u, u, m, $5, 0xa6;
        add.f16x2 $0, $0, u;
        lop3.b32 u, t, m, $5, 0xa6;
        add.f16x2 $2, $2, u;
        prmt.b32 t, $4, z, 0x3424;
        shl.b32 u, t, 4;
        lop3.b32 u, u, m, $6, 0xa6;
        add.f16x2 $1, $1, u;
        lop3.b32 u, t, m, $6, 0xa6;
        add.f16x2 $3, $3, u;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[codes, rms, lo0, lo1, hi0, hi1],
        dtype=(tl.float16, tl.float16),
        is_pure=False,
        pack=4,
    )


@triton.jit
def _unpack_lut4(codes, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3):
    """Two 4-bit indices per byte -> fp16 entries: prmt looks up 0..7 and 8..15 by the low three bits, then the
    fourth bit picks one of the two bytes (a 0x00 / 0xff mask and one lop3)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 z, a, y, s, l, h, t, u, f;
        mov.b32 z, 0;
        and.b32 a, $4, 0x07070707;
        shr.b32 y, a, 4;
        or.b32 y, y, a;
        prmt.b32 s, y, z, 0x0020;
        shr.b32 f, $4, 3;
        and.b32 f, f, 0x01010101;
        mul.lo.u32 f, f, 255;
        prmt.b32 t, $5, $9, s;
        prmt.b32 u, $13, $17, s;
        lop3.b32 l, t, u, f, 0xd8;
        prmt.b32 t, $21, $25, s;
        prmt.b32 u, $29, $33, s;
        lop3.b32 h, t, u, f, 0xd8;
        prmt.b32 $0, l, h, 0x5140;
        prmt.b32 $1, l, h, 0x7362;
        shr.b32 a, $4, 4;
        and.b32 a, a, 0x07070707;
        shr.b32 y, a, 4;
        or.b32 y, y, a;
        prmt.b32 s, y, z, 0x0020;
        shr.b32 f, $4, 7;
        and.b32 f, f, 0x01010101;
        mul.lo.u32 f, f, 255;
        prmt.b32 t, $5, $9, s;
        prmt.b32 u, $13, $17, s;
        lop3.b32 l, t, u, f, 0xd8;
        prmt.b32 t, $21, $25, s;
        prmt.b32 u, $29, $33, s;
        lop3.b32 h, t, u, f, 0xd8;
        prmt.b32 $2, l, h, 0x5140;
        prmt.b32 $3, l, h, 0x7362;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[codes, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3],
        dtype=(tl.float16, tl.float16),
        is_pure=False,
        pack=4,
    )


@triton.jit
def _unpack_u4_words(words):
    """Words of 4 bytes of two 4-bit codes -> fp16 code - 8 of the low nibbles of bytes 0..3, then of the high
    nibbles (eight tiles, see decode).

    pack=2 hands over the words of two elements; one prmt per byte puts the two elements' bytes in the low
    halves, then _unpack_u4's lop3 with 0x6400 and its subtraction (low nibble) or fma (high nibble).
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m, c, lo, hi, s, o;
        mov.b32 m, 0x64006400;
        mov.b32 c, 0x64086408;
        mov.b32 lo, 0x000f000f;
        mov.b32 hi, 0x00f000f0;
        mov.b32 s, 0x2c002c00;
        mov.b32 o, 0xd480d480;
        prmt.b32 t, $8, $9, 0x0400;
        lop3.b32 $0, t, lo, m, 0xea;
        lop3.b32 $4, t, hi, m, 0xea;
        prmt.b32 t, $8, $9, 0x0501;
        lop3.b32 $1, t, lo, m, 0xea;
        lop3.b32 $5, t, hi, m, 0xea;
        prmt.b32 t, $8, $9, 0x0602;
        lop3.b32 $2, t, lo, m, 0xea;
        lop3.b32 $6, t, hi, m, 0xea;
        prmt.b32 t, $8, $9, 0x0703;
        lop3.b32 $3, t, lo, m, 0xea;
        lop3.b32 $7, t, hi, m, 0xea;
        sub.f16x2 $0, $0, c;
        sub.f16x2 $1, $1, c;
        sub.f16x2 $2, $2, c;
        sub.f16x2 $3, $3, c;
        fma.rn.f16x2 $4, $4, s, o;
        fma.rn.f16x2 $5, $5, s, o;
        fma.rn.f16x2 $6, $6, s, o;
        fma.rn.f16x2 $7, $7, s, o;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r",
        args=[words],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )
