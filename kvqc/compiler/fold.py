"""Fold a rendered module's unit terms (`x * 1`, `1 * x`, `x + 0`, `0 + x`) the way a person would write them.

Templates write an index as every term it may have (`row * WIDTH + FIELD`, `c * CHUNK`), so they need no guard for
the widths of one and the offsets of zero that some schemes give; this pass leaves those terms out of the source.
A zero in a sum may be a product of constants (`+ 0 * CHUNK`: integer literals and capitalised names, the kernels'
constexprs). Only integer literals count (`x * 1.0` and `x + 0.0` stay: they can change a dtype or a signed zero),
and only code: strings and comments are kept as written. Parentheses left around one name go too. The caller checks
that the result's syntax tree is the rendered one with those identities applied (`folded_tree`), so a fold can drop
terms and never change anything else.
"""

from __future__ import annotations

import ast
import io
import keyword
import re
import tokenize

# Tokens after which a `1 *` or `0 +` starts an operand of its own: what follows it is not bound by a tighter operator
# on the left (`2 ** 1 * x`, `-1 * x` keep theirs).
_OPERAND_START = {"(", "[", "{", ",", "=", ":", "+=", "-=", "*=", "return", "if", "else", "and", "or", "not", "in"}
# Tokens after an `* 1` or `+ 0` that would take the literal as their own left operand.
_BINDS_LITERAL = {"**", "*", "/", "//", "%", "@", ".", "(", "["}
_BINDS_ONE = {"**", ".", "(", "["}
# Tokens after which a parenthesis groups (not a call or subscript, whose parentheses and brackets belong to it).
_BEFORE_GROUP = {"=", "+", "-", "*", "//", "%", "(", ",", "[", ":", "&", "|", "<", ">", "<=", ">=", "==", "!="}
_CONSTANT = re.compile(r"[A-Z][A-Z0-9_]*")  # a constexpr or module constant, an integer where a zero multiplies it


def fold(source: str) -> str:
    """`source` with every `x * 1`, `1 * x`, `x + 0` and `0 + x` (integer literals, in code; a zero may be a product
    of constants) reduced to `x`, and no parentheses around one name."""
    tokens = _code_tokens(source)
    cuts: list[tuple[tuple[int, int], tuple[int, int]]] = []  # (start, end) spans to delete
    gone: set[int] = set()  # tokens an earlier cut took

    def kept_before(j: int) -> int:
        j -= 1
        while j in gone:
            j -= 1
        return j

    for i, tok in enumerate(tokens):
        if tok.type != tokenize.NUMBER or tok.string not in ("0", "1"):
            continue
        last = i  # a zero times constants (`0 * CHUNK`, `0 * 2 * CHUNK`) counts as one zero
        while tok.string == "0" and last + 3 < len(tokens) and tokens[last + 1].string == "*" \
                and _constant(tokens[last + 2]) and tokens[last + 3].string not in _BINDS_ONE:
            last += 2
        if last + 2 >= len(tokens):
            continue
        op = "*" if tok.string == "1" else "+"
        binds = _BINDS_ONE if op == "*" else _BINDS_LITERAL
        before, after = kept_before(i), tokens[last + 1].string
        if before < 0:
            continue
        # `x * 1` / `x + 0`: the operator before the literal, nothing after it that takes the literal instead.
        if tokens[before].string == op and before == i - 1 and kept_before(before) >= 0 \
                and _ends_operand(tokens[kept_before(before)]) and after not in binds:
            cuts.append((tokens[kept_before(before)].end, tokens[last].end))
            gone.update(range(i - 1, last + 1))
        # `1 * x` / `0 + x`: the literal starts an operand and the operator follows it.
        elif after == op and (tokens[before].string in _OPERAND_START or tokens[before].type == tokenize.NEWLINE
                              or (tokens[before].string in ("+-" if op == "*" else "+")
                                  and _ends_operand(tokens[kept_before(before)]))):
            cuts.append((tok.start, tokens[last + 2].start))
            gone.update(range(i, last + 2))
    return _bare(_cut(source, cuts))


def _bare(source: str) -> str:
    """`source` without the parentheses around one name (with its attributes, calls and subscripts) that a fold
    left, or a template wrote: `(key_chunk[:, None]) * WIDTH` is `key_chunk[:, None] * WIDTH`."""
    tokens = _code_tokens(source)
    cuts = []
    for a, tok in enumerate(tokens):
        if tok.string != "(" or a == 0 or tokens[a - 1].string not in _BEFORE_GROUP:
            continue
        depth, b = 0, a + 1
        while b < len(tokens) and (depth or tokens[b].string != ")"):
            inner = tokens[b]
            depth += (inner.string in "([{") - (inner.string in ")]}") if inner.type == tokenize.OP else 0
            if not depth and not (inner.type == tokenize.NAME and not keyword.iskeyword(inner.string)
                                  or inner.string in (".", "]", ")")):
                break
            b += 1
        if b < len(tokens) and tokens[b].string == ")" and b > a + 1 and tokens[a + 1].type == tokenize.NAME \
                and tokens[b].start[0] == tok.start[0]:
            cuts += [(tok.start, tok.end), (tokens[b].start, tokens[b].end)]
    return _cut(source, cuts)


def folded_tree(tree: ast.AST) -> ast.AST:
    """`tree` with the identities `fold` applies to source applied to its nodes."""
    return _Fold().visit(tree)


class _Fold(ast.NodeTransformer):
    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        unit = 1 if isinstance(node.op, ast.Mult) else 0 if isinstance(node.op, ast.Add) else None
        if unit is None:
            return node
        if _is_int(node.right, unit) or (unit == 0 and _zero_product(node.right)):
            return node.left
        if _is_int(node.left, unit) or (unit == 0 and _zero_product(node.left)):
            return node.right
        return node


def _zero_product(node: ast.AST) -> bool:
    """`0 * C`, `0 * 2 * C`: zero times integer literals and capitalised names (constexpr integers in generated
    code), which a sum may leave out like a zero."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return False
    right = node.right
    constant = (isinstance(right, ast.Name) and _CONSTANT.fullmatch(right.id)) or (
        isinstance(right, ast.Constant) and type(right.value) is int)
    return bool(constant) and (_is_int(node.left, 0) or _zero_product(node.left))


def _is_int(node: ast.AST, value: int) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == value


def _constant(tok: tokenize.TokenInfo) -> bool:
    return (tok.type == tokenize.NUMBER and tok.string.isdigit()) or (
        tok.type == tokenize.NAME and _CONSTANT.fullmatch(tok.string) is not None)


def _ends_operand(tok: tokenize.TokenInfo) -> bool:
    return tok.type in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING) or tok.string in (")", "]", "}")


def _code_tokens(source: str) -> list[tokenize.TokenInfo]:
    """The tokens of `source` that code is made of: no comments, line continuations or indentation."""
    return [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]


def _cut(source: str, cuts: list[tuple[tuple[int, int], tuple[int, int]]]) -> str:
    if not cuts:
        return source
    lines = source.split("\n")
    spans: list[list[int]] = []  # [row, start, end], overlapping spans of a row merged
    for (row, start), (end_row, end) in sorted(cuts):
        if row != end_row:  # a term split over lines is left as it stands
            continue
        if spans and spans[-1][0] == row and start <= spans[-1][2]:
            spans[-1][2] = max(spans[-1][2], end)
        else:
            spans.append([row, start, end])
    for row, start, end in reversed(spans):
        line = lines[row - 1]
        lines[row - 1] = line[:start] + line[end:]
    return "\n".join(lines)
