"""Fill's cell search where the symmetric search scans (SideLayout.fast_cell): a helper a kind, `<side.cell_helper>`,
with the compiled CUDA path in PTX (FAST_CELL) and the same codes in Triton compares for the interpreter and HIP.

Why PTX: written as selects, turbo_k4v2's looping fill is bound by the ALU pipe (ncu: the busiest pipe at 60.6%,
instruction issue at 48.6%), where compares, selects, shifts and logic ops go at half the rate of float and integer
multiply-adds. Here only the compares (setp) stay there; what they decide is done by predicated adds and fma on the FMA
pipe. A centroid is fetched by fma(magnitude, 0, c), which is c exactly for any finite magnitude: a plain predicated
move becomes a select again. On an H100 (turbo_k4v2, 8 x 8192 tokens) the Triton scan fills at 57% of copy bandwidth,
these helpers at 59%, and 64% once the looping fill also runs as one wave (which alone gains nothing); the sign residual
outside the helper costs 4 points.

Kinds: "code" (the code alone), "sign" (and the residual, whose sign sets the bit above the level), "signed" (and
the centroid with the value's sign), "magnitude" (and the centroid's magnitude).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout

ASM = " " * 12  # the PTX lines inside the helper's asm string


def helper(side: SideLayout) -> str:
    """The @triton.jit source of the side's cell helper."""
    half, kind = side.half, side.fast_cell
    outputs = 1 if kind == "code" else 2
    centroids = kind != "code"
    params = "value" + "".join(f", b{j}" for j in range(1, half))
    params += "".join(f", c{j}" for j in range(half)) if centroids else ""
    returned = {"code": "code", "sign": "code, residual"}.get(kind, "code, centroid")
    boundaries = f"positive boundaries b1 < ... < b{half - 1}" if half > 2 else "positive boundary b1"
    also = {"sign": " And the residual value - (+-c[level]), whose\n    sign (>= 0) sets bit "
                    f"{side.level_bits} of the code.",
            "signed": " And the centroid +-c[level], with the value's sign.",
            "magnitude": " And c[level], the centroid's magnitude."}.get(kind, "")
    lines = ["@triton.jit", f"def {side.cell_helper}({params}, FAST_CELL: tl.constexpr):",
             f'    """The symmetric cell of each value: code {half} + level above 0, {half - 1} - level at or below, '
             "where level counts the",
             f"    {boundaries} below |value|.{also}",
             '    PTX with FAST_CELL (compiled CUDA), Triton compares otherwise."""',
             "    if FAST_CELL:", f"        {returned} = tl.inline_asm_elementwise(", '            asm="""{']
    asm = [".reg .pred up, past;", f".reg .f32 mag{', c' if centroids else ''};", f"abs.f32 mag, ${outputs};",
           f"setp.gt.f32 up, ${outputs}, 0f00000000;", f"mov.b32 $0, {half};"]
    asm += [f"mov.b32 c, ${outputs + half};"] if centroids else []
    for j in range(1, half):
        asm += [f"setp.gt.f32 past, mag, ${outputs + j};", "@past add.s32 $0, $0, 1;"]
        asm += [f"@past fma.rn.f32 c, mag, 0f00000000, ${outputs + half + j};"] if centroids else []
    asm.append(f"@!up mad.lo.s32 $0, $0, -1, {2 * half - 1};")
    asm += ["@!up fma.rn.f32 c, c, 0fBF800000, 0f80000000;"] if kind in ("sign", "signed") else []
    if kind == "sign":
        asm += [f"sub.f32 $1, ${outputs}, c;", "setp.ge.f32 past, $1, 0f00000000;",
                f"@past add.s32 $0, $0, {side.levels};"]
    elif centroids:
        asm.append("mov.b32 $1, c;")
    constraints = ",".join(["=r"] * outputs + ["r"] * (1 + (half - 1) + (half if centroids else 0)))
    lines += [ASM + line for line in asm] + [
        '            }""",', f'            constraints="{constraints}",', f"            args=[{params}],",
        f"            dtype={'(tl.int32, tl.float32)' if centroids else 'tl.int32'},", "            is_pure=True,",
        "            pack=1,", "        )", "    else:", "        magnitude = tl.abs(value)",
        "        code = tl.zeros(value.shape, tl.int32)"]
    lines += ["        centroid = tl.full(value.shape, c0, tl.float32)"] if centroids else []
    for j in range(1, half):
        lines += [f"        beyond = magnitude > b{j}", "        code += beyond.to(tl.int32)"]
        lines += [f"        centroid = tl.where(beyond, c{j}, centroid)"] if centroids else []
    lines += ["        upper = value > 0", f"        code = tl.where(upper, {half} + code, {half - 1} - code)"]
    lines += ["        centroid = tl.where(upper, centroid, -centroid)"] if kind in ("sign", "signed") else []
    if kind == "sign":
        lines += ["        residual = value - centroid",
                  f"        code = code | ((residual >= 0).to(tl.int32) << {side.level_bits})"]
    return "\n".join(lines + [f"    return {returned}"])
