"""Cache rows as the kernels address them: a row is one (token, KV head) pair of a cache tensor. A block holds
BLOCK_SIZE * NUM_KV_HEADS rows; inside it, HEAD_STRIDE rows lie between its KV heads and TOKEN_STRIDE rows between
its consecutive tokens (constexprs from the wrapper's _row_strides: head-major 'bhsd' or token-major 'bshd',
KVCache.layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout


def row(block: str, offset: str, head: str) -> str:
    """The row of token `offset` of `block` for KV head `head`."""
    return f"{block} * (BLOCK_SIZE * NUM_KV_HEADS) + {offset} * TOKEN_STRIDE + {head} * HEAD_STRIDE"


def group_first(side: SideLayout, rows: str = "row") -> str:
    """The row of the first slot of the token group holding each of `rows`: a block starts at a multiple of its
    block_size (a multiple of the group) times TOKEN_STRIDE, so the offset's place in its group is
    row // TOKEN_STRIDE % group."""
    return f"{rows} - ({rows} // TOKEN_STRIDE % {side.token_group}) * TOKEN_STRIDE"
