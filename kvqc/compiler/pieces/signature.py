"""A kernel's parameters and its launch's arguments, from the one list the Layout decides for both (KernelParam,
e.g. Layout.decode_params), so that a signature and its call cannot disagree. Each goes where a template indents it,
one a line; `packed`, as many a line as fit (for short lists without notes)."""

from __future__ import annotations


def flowed(items: list[str], indent: str, width: int = 120) -> str:
    """`items`, each followed by a comma, as few lines within `width` columns as fit them: the first line's indent is
    the template's, the others' `indent`."""
    lines, line = [], ""
    for item in items:
        if line and len(indent) + len(line) + len(item) + 2 > width:
            lines.append(line.rstrip())
            line = ""
        line += f"{item}, "
    lines.append(line.rstrip())
    return ("\n" + indent).join(lines)


def params(items: list, indent: str = "    ", packed: bool = False) -> str:
    """A kernel's parameter names, after the template's `def <kernel>(` line."""
    names = [name for item in items for name in item.names]
    return flowed(names, indent) if packed else (",\n" + indent).join(names) + ","


def arguments(items: list, indent: str = "        ", packed: bool = False) -> str:
    """A launch's arguments, after the template's kernel and grid."""
    if packed:
        return flowed([item.arg for item in items], indent)
    return ("\n" + indent).join(item.line for item in items)
