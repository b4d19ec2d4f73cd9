"""The Gluon decode kernel's PTX unpacking of whole code words into mma operand registers: `_gluon_key_words` for K's
lut3s (3-bit index + residual sign, LMDeploy's format) or lut4 codes, `_gluon_value_words` for V's lut2 codes.
templates/kernels/gluon_unpack.py.j2 places them under `if gluon is not None:` (hence the 4-space indent)."""

from __future__ import annotations

DEF = " " * 4  # the helpers' def, inside `if gluon is not None:`
ASM = " " * 12  # the PTX lines inside the asm string


def key_words(kind: str, luts: int) -> str:
    """`_gluon_key_words(words, [rms,] lut_0, ..)`: one 32-bit word of K codes -> four int32 registers of fp16
    pairs. $0..$3 out, $4 the word, [$5 the rms pair,] then the lookup words."""
    signed = kind == "lut3s"
    lut0 = 6 if signed else 5
    args = ", ".join(["words"] + (["rms"] if signed else []) + [f"lut_{i}" for i in range(luts)])
    if signed:
        doc = ['"""One 32-bit word of K codes (bytes b0..b3, two codes each: a 3-bit index and the residual\'s sign) '
               "-> fp16",
               "pairs: low nibbles of bytes (0, 1) and (2, 3), then the high nibbles'. rms holds the token's residual "
               "RMS",
               "twice; the sign bit flips it before the paired add. The lookups are _unpack_lut3s's, a word at a "
               'time."""']
    else:
        doc = ['"""One 32-bit word of K codes (bytes b0..b3, two 4-bit indices each) -> fp16 pairs: low nibbles of '
               "bytes",
               "(0, 1) and (2, 3), then the high nibbles'. The lookups are _unpack_lut4's, a word at a time.\"\"\""]
    asm = [f".reg .b32 z, a, y, s, l, h, t, u{', m' if signed else ', f'};", "mov.b32 z, 0;"]
    asm += ["mov.b32 m, 0x80008000;"] if signed else []
    for half in range(2):
        asm += ["shr.b32 a, $4, 4;", "and.b32 a, a, 0x07070707;"] if half else ["and.b32 a, $4, 0x07070707;"]
        asm += ["shr.b32 y, a, 4;", "or.b32 y, y, a;", "prmt.b32 s, y, z, 0x0020;"]
        if signed:
            asm += [f"prmt.b32 l, ${lut0}, ${lut0 + 1}, s;", f"prmt.b32 h, ${lut0 + 2}, ${lut0 + 3}, s;"]
        else:
            asm += [f"shr.b32 f, $4, {7 if half else 3};", "and.b32 f, f, 0x01010101;", "mul.lo.u32 f, f, 255;",
                    f"prmt.b32 t, ${lut0}, ${lut0 + 1}, s;", f"prmt.b32 u, ${lut0 + 2}, ${lut0 + 3}, s;",
                    "lop3.b32 l, t, u, f, 0xd8;", f"prmt.b32 t, ${lut0 + 4}, ${lut0 + 5}, s;",
                    f"prmt.b32 u, ${lut0 + 6}, ${lut0 + 7}, s;", "lop3.b32 h, t, u, f, 0xd8;"]
        asm += [f"prmt.b32 ${2 * half}, l, h, 0x5140;", f"prmt.b32 ${2 * half + 1}, l, h, 0x7362;"]
    if signed:
        for pair, select in ((0, "0x1404"), (1, "0x3424")):
            asm += [f"prmt.b32 t, $4, z, {select};", "shl.b32 u, t, 4;", "lop3.b32 u, u, m, $5, 0xa6;",
                    f"add.f16x2 ${pair}, ${pair}, u;", "lop3.b32 u, t, m, $5, 0xa6;",
                    f"add.f16x2 ${pair + 2}, ${pair + 2}, u;"]
    constraints = "=r,=r,=r,=r,r" + (",r" if signed else "") + ",r" * luts
    lines = ["@gluon.jit", f"def _gluon_key_words({args}):", *("    " + line for line in doc),
             "    return gl.inline_asm_elementwise(", '        asm="""{', *("        " + line for line in asm),
             '        }""",', f'        constraints="{constraints}",', f"        args=[{args}],",
             "        dtype=(gl.int32, gl.int32, gl.int32, gl.int32),", "        is_pure=True,", "        pack=1,",
             "    )"]
    return "\n".join(DEF + line for line in lines)


def value_words() -> str:
    """`_gluon_value_words(words, lut_0, lut_1)`: V code words of tokens 2i and 2i + 1 (pack=2: sixteen 2-bit indices
    each) -> sixteen fp16 pairs in the order the V dot's A operand holds them."""
    asm = [".reg .b32 x, y, u, s, t;", "prmt.b32 x, $16, $17, 0x5140;", "prmt.b32 y, $16, $17, 0x7362;"]
    for src, first in (("x", 0), ("y", 8)):
        for field in range(4):
            asm += ([f"shr.b32 u, {src}, {2 * field};", "and.b32 u, u, 0x03030303;"] if field
                    else [f"and.b32 u, {src}, 0x03030303;"])
            asm += ["mad.lo.u32 s, u, 0x11, 0x40404040;", f"prmt.b32 ${first + 2 * field}, $18, $20, s;",
                    "shr.b32 t, s, 16;", f"prmt.b32 ${first + 2 * field + 1}, $18, $20, t;"]
    lines = ["@gluon.jit", "def _gluon_value_words(words, lut_0, lut_1):",
             '    """V code words of tokens 2i and 2i + 1 (pack=2: one word each, sixteen 2-bit indices) -> sixteen '
             "fp16 pairs",
             "    (token 2i, token 2i + 1), output 8 * (byte >> 1) + 2 * field + (byte & 1): the pairs the V dot's A "
             "operand",
             "    holds. One prmt interleaves the two words' bytes; _unpack_lut2's multiply-add makes the "
             'selectors."""',
             "    return gl.inline_asm_elementwise(", '        asm="""{', *("        " + line for line in asm),
             '        }""",', f'        constraints="{"=r," * 16}r,r,r,r,r,r",',
             "        args=[words, lut_0, lut_1],",
             "        dtype=(gl.float16, ) * 16,", "        is_pure=True,", "        pack=2,", "    )"]
    return "\n".join(DEF + line for line in lines)
