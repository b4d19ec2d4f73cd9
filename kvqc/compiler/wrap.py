"""Wrap a rendered module's long lines the way a person would, so that templates can keep one statement a line.

A statement longer than the limit is broken at its widest bracket (one argument a line, with a trailing comma),
else before its lowest-precedence operators inside added parentheses, else inside a long string literal (implicit
concatenation); a trailing comment moves above its statement, and a long comment line is refilled. Each result
is wrapped again until it fits or nothing is left to break. The caller checks that the module's syntax tree is
unchanged (`same_tree`), so a wrap can change layout and never meaning.
"""

from __future__ import annotations

import ast
import io
import keyword
import textwrap
import tokenize

LIMIT = 120
_OPEN, _CLOSE = "([{", ")]}"
# Binary operators from the loosest binding, the ones a line is broken before (inside parentheses).
_PRECEDENCE = (("or",), ("and",), ("<", "<=", ">", ">=", "==", "!="), ("|",), ("^",), ("&",), ("+", "-"),
               ("*", "/", "//", "%", "@"))
_OPERATORS = {op for group in _PRECEDENCE for op in group}


def same_tree(a: str | ast.AST, b: str | ast.AST) -> bool:
    """Whether two sources (or one's already parsed tree) have the same syntax tree, positions aside."""
    a, b = (x if isinstance(x, ast.AST) else ast.parse(x) for x in (a, b))
    return ast.dump(a) == ast.dump(b)


def wrap(source: str, limit: int = LIMIT) -> str:
    """`source` with every single-line statement and comment longer than `limit` wrapped, where it can be."""
    lines = source.split("\n")
    single, items = _wrappable_rows(source)
    # The header's comment lines are records kvqc reads back (the scheme file): kept whole.
    header = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    out: list[str] = lines[:header]
    for number, line in enumerate(lines[header:], header + 1):
        if len(line) <= limit:
            out.append(line)
        elif line.lstrip().startswith("#"):
            out.extend(_comment(line, limit))
        elif number in single or number in items:
            out.extend(_statement(line, limit, inside=number in items))
        else:
            out.append(line)
    return "\n".join(out)


def _wrappable_rows(source: str) -> tuple[set[int], set[int]]:
    """Line numbers holding one whole logical line, and those holding whole items inside a bracket that an
    earlier line opened (the line starts and ends at the same bracket depth, never below it, no string crossing)."""
    single: set[int] = set()
    start = None
    depth_at: dict[int, list[int]] = {}  # row -> [depth at its first token, lowest depth seen, depth at its end]
    crossing: set[int] = set()
    depth = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NL, tokenize.COMMENT, tokenize.ENCODING):
            continue
        if tok.type == tokenize.ENDMARKER:
            break
        row = tok.start[0]
        if tok.end[0] != row:
            crossing.update(range(row, tok.end[0] + 1))
        state = depth_at.setdefault(row, [depth, depth, depth])
        if tok.type == tokenize.OP and tok.string in _OPEN:
            depth += 1
        elif tok.type == tokenize.OP and tok.string in _CLOSE:
            depth -= 1
        state[1], state[2] = min(state[1], depth), depth
        if start is None:
            start = row
        if tok.type == tokenize.NEWLINE:
            if row == start:
                single.add(start)
            start = None
    items = {row for row, (first, low, last) in depth_at.items()
             if first > 0 and low == first == last and row not in crossing and row not in single}
    return single, items


def _comment(line: str, limit: int) -> list[str]:
    indent = line[: len(line) - len(line.lstrip())]
    text = line.lstrip()[1:].strip()
    return textwrap.wrap(text, width=limit, initial_indent=indent + "# ", subsequent_indent=indent + "# ",
                         break_long_words=False, break_on_hyphens=False) or [line]


_SKIPPED = (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT)
# Python 3.12 tokenizes an f-string into parts (PEP 701), its fields' braces as brackets; the wrapper treats every
# string literal as one token, as Python 3.11 does, so that a module renders the same on either.
_FSTRING_START = getattr(tokenize, "FSTRING_START", None)
_FSTRING_END = getattr(tokenize, "FSTRING_END", None)


def _tokens(code: str) -> list[tokenize.TokenInfo]:
    """The statement's tokens on its one line, each f-string one STRING token."""
    out: list[tokenize.TokenInfo] = []
    start, depth = None, 0
    for t in tokenize.generate_tokens(io.StringIO(code + "\n").readline):
        if t.type == _FSTRING_START:
            start, depth = start or t, depth + 1
        elif depth:
            if t.type == _FSTRING_END:
                depth -= 1
                if not depth:
                    text = code[start.start[1] : t.end[1]]
                    out.append(tokenize.TokenInfo(tokenize.STRING, text, start.start, t.end, t.line))
                    start = None
        elif t.type not in _SKIPPED:
            out.append(t)
    return out


def _statement(line: str, limit: int, depth: int = 0, inside: bool = False) -> list[str]:
    """`line` as lines within `limit` where it can be; `inside`: the line continues a bracket (an item)."""
    indent = line[: len(line) - len(line.lstrip())]
    code = line.strip()
    try:
        tokens = _tokens(code)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [line]
    if tokens and tokens[-1].type == tokenize.COMMENT:  # a trailing comment goes above the statement
        comment = tokens[-1]
        head = code[: comment.start[1]].rstrip()
        statement = indent + head
        above = _comment(indent + comment.string, limit)
        return above + ([statement] if len(statement) <= limit else _statement(statement, limit, depth, inside))
    pieces = _split(code, tokens, inside, limit - len(indent))
    if pieces is None or depth > 12:
        return [line]
    out: list[str] = []
    for level, piece in pieces:
        text = indent + "    " * level + piece
        out.extend(_statement(text, limit, depth + 1, inside=True) if len(text) > limit and level else [text])
    return out


def _split(code: str, tokens: list[tokenize.TokenInfo], inside: bool, width: int) -> list[tuple[int, str]] | None:
    """The statement as (extra indent level, text) lines, or None where there is no break to make."""
    if inside:
        items = _items(code, tokens)
        if items is not None and len(items) > 1:  # several items on one line: one a line
            if not code.rstrip().endswith(","):
                items[-1] = items[-1][:-1]
            return [(0, item) for item in items]
    bracket = _widest_bracket(code, tokens)
    if bracket is not None and bracket[0] > 40:
        return _hug(bracket[1], width) or bracket[1]
    broken = _operators(code, tokens, inside, width)
    if broken is not None:
        return broken
    broken = _string(code, tokens, inside)
    if broken is None and bracket is not None and bracket[0] and len(code) > width:  # a call chain: its widest bracket
        return bracket[1]
    return broken


def _widest_bracket(code: str, tokens: list[tokenize.TokenInfo]) -> tuple[int, list[tuple[int, str]]] | None:
    """The widest bracket's body length, and the statement broken inside it (one item a line); None where no
    bracket at depth 0 has items."""
    pairs = _bracket_pairs(tokens)
    if not pairs:
        return None
    (a, b) = max(pairs, key=lambda p: tokens[p[1]].start[1] - tokens[p[0]].end[1])
    body_start, body_end = tokens[a].end[1], tokens[b].start[1]
    items = _items(code, tokens[a + 1 : b])
    if items is None:
        return None
    head, tail = code[:body_start], code[body_end:]
    return len(code[body_start:body_end].strip()), [(0, head), *((1, item) for item in items), (0, tail)]


def _hug(lines: list[tuple[int, str]], width: int) -> list[tuple[int, str]] | None:
    """A bracket broken one item a line, with its items back on one line of their own where they fit there
    (`f(\n    a, b, c\n)`), as a person (or black) writes a call too long for its line; None where they do not."""
    head, *items, tail = lines
    body = " ".join(item for _, item in items)
    if len(items) > 1 and body.endswith(","):
        body = body[:-1]  # a trailing comma would ask for one item a line
    return [head, (1, body), tail] if len(items) > 1 and len(body) + 4 <= width else None


def _bracket_pairs(tokens: list[tokenize.TokenInfo]) -> list[tuple[int, int]]:
    """(open, close) token indexes of the brackets at depth 0."""
    pairs, stack = [], []
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string in _OPEN:
            stack.append(i)
        elif tok.type == tokenize.OP and tok.string in _CLOSE and stack:
            j = stack.pop()
            if not stack:
                pairs.append((j, i))
    return pairs


def _items(code: str, body: list[tokenize.TokenInfo]) -> list[str] | None:
    """A bracket's contents one item a line, each ending in a comma where items are comma-separated."""
    depth, cuts = 0, []
    for i, tok in enumerate(body):
        if tok.type == tokenize.OP and tok.string in _OPEN:
            depth += 1
        elif tok.type == tokenize.OP and tok.string in _CLOSE:
            depth -= 1
        elif depth == 0 and tok.type == tokenize.NAME and tok.string in ("for", "lambda"):
            return None if cuts else [code[body[0].start[1] : body[-1].end[1]]]
        elif depth == 0 and tok.type == tokenize.OP and tok.string == ",":
            cuts.append(i)
    if not body:
        return None
    start, end = body[0].start[1], body[-1].end[1]
    if not cuts:
        return [code[start:end]]
    items, begin = [], start
    for i in cuts:
        items.append(code[begin : body[i].start[1]].strip() + ",")
        begin = body[i].end[1]
    last = code[begin:end].strip()
    if last:
        items.append(last + ",")
    if all(len(item) <= 16 and not any(c in item for c in _OPEN) for item in items):
        return _pack(items, 100)  # a table of numbers: as many a line as fit
    return items


def _pack(parts: list[str], room: int) -> list[str]:
    """`parts` joined by spaces into as few lines of at most `room` characters as they go, in order."""
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + 1 + len(part) <= room:
            lines[-1] += " " + part
        else:
            lines.append(part)
    return lines


def _operators(code: str, tokens: list[tokenize.TokenInfo], inside: bool, width: int) -> list[tuple[int, str]] | None:
    """Break an expression before its loosest binary operators, packing as many terms a line as fit: inside
    added parentheses for the right-hand side of an assignment or return or the condition of an if, elif or
    while; as it stands for an item inside brackets (a keyword argument's value, say)."""
    first = tokens[0].string if tokens else ""
    if inside:
        start = 2 if len(tokens) > 2 and tokens[1].string == "=" and tokens[0].type == tokenize.NAME else 0
        end = len(tokens) - 1 if tokens and tokens[-1].string == "," else len(tokens)
    elif first in ("if", "elif", "while"):
        start, end = 1, len(tokens) - 1  # up to the colon
        if tokens[end].string != ":":
            return None
    elif first == "return":
        start, end = 1, len(tokens)
    else:
        eq = [i for i, t in enumerate(tokens) if t.type == tokenize.OP and t.string in ("=", "+=", "-=", "*=", "|=")]
        if not eq or any(t.type == tokenize.OP and t.string in _OPEN for t in tokens[: eq[0]]):
            return None
        start, end = eq[0] + 1, len(tokens)
    depth, at = 0, {}
    for i in range(start, end):
        tok = tokens[i]
        if tok.type == tokenize.OP and tok.string in _OPEN:
            depth += 1
        elif tok.type == tokenize.OP and tok.string in _CLOSE:
            depth -= 1
        elif depth == 0 and i > start and tok.string in _OPERATORS:
            if tok.type == tokenize.OP or keyword.iskeyword(tok.string):
                at.setdefault(tok.string, []).append(i)
        elif depth == 0 and tok.string in ("if", "else", "lambda", "not") and tok.type == tokenize.NAME:
            if tok.string != "not":
                return None  # a conditional expression or a lambda: left as it is
    for group in _PRECEDENCE:
        cuts = sorted(i for op in group for i in at.get(op, []))
        if cuts:
            break
    else:
        return None
    head = code[: tokens[start].start[1]]
    tail = code[tokens[end - 1].end[1] :]
    parts, begin = [], tokens[start].start[1]
    for i in cuts:
        parts.append(code[begin : tokens[i].start[1]].strip())
        begin = tokens[i].start[1]
    parts.append(code[begin : tokens[end - 1].end[1]].strip())
    lines = _pack(parts, width - (0 if inside else 4))
    if len(lines) == 1 and inside:
        return None
    if inside:  # the bracket around the item already continues the line
        lines[0] = head + lines[0]
        lines[-1] += tail
        return [(0, line) for line in lines]
    return [(0, head.rstrip() + " ("), *((1, line) for line in lines), (0, ")" + tail)]


def _string(code: str, tokens: list[tokenize.TokenInfo], inside: bool) -> list[tuple[int, str]] | None:
    """Break the longest string literal in two at a space outside any {...} field, as implicit concatenation."""
    strings = [t for t in tokens if t.type == tokenize.STRING]
    if not strings:
        return None
    tok = max(strings, key=lambda t: len(t.string))
    text = tok.string
    prefix = text[: len(text) - len(text.lstrip("rbfuRBFU"))]
    quote = text[len(prefix)]
    if text[len(prefix) : len(prefix) + 3] == quote * 3 or len(text) < 60:
        return None
    inner = text[len(prefix) + 1 : -1]
    depth, spaces = 0, []
    for i, ch in enumerate(inner):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == " " and depth == 0 and 20 < i < len(inner) - 10:
            spaces.append(i)
    if not spaces:
        return None
    cut = min(spaces, key=lambda i: abs(i - len(inner) // 2)) + 1
    left, right = inner[:cut], inner[cut:]
    f = "f" in prefix.lower()
    pre = prefix.replace("f", "").replace("F", "")

    def literal(part: str) -> str:
        return (pre + ("f" if f and "{" in part else "")) + quote + part + quote

    start, end = tok.start[1], tok.end[1]
    head, tail = code[:start], code[end:]
    if inside and not head.strip():  # the bracket around the item already continues the line
        return [(0, literal(left)), (0, literal(right) + tail)]
    return [(0, head + "("), (1, literal(left)), (1, literal(right)), (0, ")" + tail)]
