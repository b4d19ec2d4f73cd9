"""kvqc/compiler/fold.py: unit terms (`x * 1`, `1 * x`, `x + 0`, `0 + x`) left out, nothing else changed."""

import ast
import re
from pathlib import Path

import pytest

from kvqc.compiler.fold import fold, folded_tree

ROOT = Path(__file__).resolve().parents[1]

FOLDED = {
    "row * 1 + 0": "row",
    "ptr + row[:, None] * (D // 32 * 1) + group[None, :] * 1": "ptr + row[:, None] * (D // 32) + group[None, :]",
    "(1 * CHUNK + c)": "(CHUNK + c)",
    "p + 1 * 2 * CHUNK": "p + 2 * CHUNK",
    "HEAD_DIM * 1 // 8": "HEAD_DIM // 8",
    "f(x + 0, 0 + z)": "f(x, z)",
    "a - 1 * x": "a - x",
    "a + 0 - b": "a - b",
    "x + 0 + 1 * c": "x + c",
    "1 * 1 * x": "x",
    "a * 1 * 1": "a",
    "x[0 + i]": "x[i]",
    "tl.load(lut_ptr + 0)": "tl.load(lut_ptr)",
    "a + 0 * CHUNK + c": "a + c",
    "m_ptr + (0 * CHUNK_PAD + chunk[:, None]) * PAD + k": "m_ptr + chunk[:, None] * PAD + k",
    "p + 0 * 2 * 128": "p",
    "(h_row)[:, None] & byte": "h_row[:, None] & byte",
}

# Where the literal is not the operand of the unit operator, or dropping it could change a value: left as written.
KEPT = [
    "a - 0 + x",  # (a - 0) + x: `0 + x` is not an operand here
    "2 ** 1 * x",
    "-1 * x",
    "x + 0 * z",
    "x * 1 ** 2",
    "x * 1.0 + 0.0",  # floats: a dtype or a signed zero
    "x // 1",
    "'a * 1'",
    "a + 0 * CHUNK * tile",  # a tensor's zeros keep its shape
    "a + 0 * chunk",  # a lower-case name may be a tensor
    "0 * CHUNK",
    "(a + b) * c",
    "(-x) * 2",
    "(1).bit_length()",
    "(x if c else z)",
]


@pytest.mark.parametrize("expr", FOLDED)
def test_unit_terms_are_left_out(expr):
    source = f"y = {expr}\n"
    out = fold(source)
    assert out == f"y = {FOLDED[expr]}\n"
    assert ast.dump(folded_tree(ast.parse(source))) == ast.dump(ast.parse(out))


@pytest.mark.parametrize("expr", KEPT)
def test_other_literals_stay(expr):
    source = f"y = {expr}  # x * 1 + 0\n"
    assert fold(source) == source


def test_a_fold_the_tree_does_not_make_is_caught():
    # folded_tree is what codegen.render holds fold's output to: a text edit past the identities shows.
    source = "y = a - 0 + x\n"
    assert ast.dump(folded_tree(ast.parse(source))) != ast.dump(ast.parse("y = a - x\n"))


def test_generated_modules_have_no_unit_terms():
    unit = re.compile(r"(?<![\w.])(\w+|\)|\]) \* 1\b(?![.\w])|(?<![\w.])\+ 0\b(?![.\w])|// 1\b")
    for path in sorted((ROOT / "generated").glob("*.py")):
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        found = [m.group(0) for m in unit.finditer(code)]
        assert not found, f"{path.name}: {found[:5]}"
