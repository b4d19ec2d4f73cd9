"""A channel split's decode ends (Layout.split), as lines of `_query_parts_kernel` and `_merge_parts_kernel`
(templates/kernels/parts.py.j2): each key part's query moved into its position order, each value part's merged
splits moved back to its channels. A part moves as the tables say: by its float32 rotation (uses_matrix; padded, with
zero rows and columns past its width), a block of 32 rows or columns at a time (a whole one at head_dim 256, a
192-channel part's padded to 256, is 256 KiB of float32: past tl.dot's shared memory and any program's registers);
else its chunks padded to powers of two (position p holds column p // CHUNK_PAD * CHUNK + p % CHUNK_PAD); else as it
stands. A split side's columns sit in its KV head's channel order (`_channel`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.packing import BODY

if TYPE_CHECKING:
    from kvqc.compiler.layout import Layout, SideLayout

LOOP = " " * 8  # a block loop's body


def _channel(side: SideLayout, col: str, mask: str) -> str:
    """Where columns `col` of a split side's part sit in the head as given."""
    return f"_channel({side.base}_channels_ptr + kv_head * HEAD_DIM{side.offset_term} + {col}, {mask}, HEAD_DIM)"


def _block(side: SideLayout) -> str:
    return f"{side.name.upper()}_BLOCK"


def query_parts(layout: Layout) -> str:
    """`_query_parts_kernel`'s body after its rows: every key part's query in float32, in position order (and QJL's
    projection of it)."""
    out = ""
    for key in layout.key_parts:
        pad, split, lines = key.head_pad, key.base in layout.split_bases, []
        lines += [f"# {key.name}", f"pos = tl.arange(0, {pad})"]
        if key.uses_matrix:
            block = _block(key)
            lines += [f"{block}: tl.constexpr = min({pad}, 32)",
                      f"x = tl.zeros([ROWS, {pad}], tl.float32)",
                      f"for first in range(0, {pad}, {block}):",
                      f"    block = first + tl.arange(0, {block})  # columns of the part",
                      f"    mask = real[:, None] & (block < {key.dim})[None, :]"]
            if split:
                lines.append(f"    column = {_channel(key, 'block[None, :]', 'mask')}")
            column = "column" if split else "block[None, :]"
            lines += [f"    part = tl.load(query_ptr + row[:, None] * HEAD_DIM + {column}, mask=mask, "
                      "other=0.0).to(tl.float32)",
                      f"    matrix = tl.load({key.name}_rotation_ptr + pos[:, None] * {pad} + block[None, :])",
                      "    x = _mm(part, tl.trans(matrix), DOT_PRECISION, x)"]
        else:
            columns = "block" if key.padded else "pos"
            chunk, chunk_pad = f"{key.dim} // {key.chunks}", f"{pad} // {key.chunks}"
            if key.padded:
                lines += ["# Position p holds column p // CHUNK_PAD * CHUNK + p % CHUNK_PAD of the part, where "
                          "p % CHUNK_PAD < CHUNK.",
                          f"block = pos // ({chunk_pad}) * ({chunk}) + pos % ({chunk_pad})",
                          f"mask = real[:, None] & (pos % ({chunk_pad}) < {chunk})[None, :]"]
            else:
                lines.append(f"mask = real[:, None] & (pos < {key.dim})[None, :]")
            if split:
                lines.append(f"column = {_channel(key, columns + '[None, :]', 'mask')}")
            column = "column" if split else columns + "[None, :]"
            lines.append(f"x = tl.load(query_ptr + row[:, None] * HEAD_DIM + {column}, mask=mask, other=0.0)"
                         ".to(tl.float32)")
        lines.append(f"tl.store(query_{key.tag}out_ptr + row[:, None] * {pad} + pos[None, :], x, mask=real[:, None])")
        if key.qjl:
            lines.append(f"_project_qjl(x, {key.name}_qjl_ptr, query_{key.tag}qjl_out_ptr, row, real, {pad}, "
                         "DOT_PRECISION)")
        out += "".join(f"{BODY}{line}\n" for line in lines)
    return out


def _qjl_share(value: SideLayout, into: str, columns: str, mask: str) -> list[str]:
    """`into` += the merged QJL partial (position order) times the projection's rows, columns `columns`, a block
    of rows at a time."""
    pad, block = value.head_pad, _block(value)
    return [f"for first in range(0, {pad}, {block}):",
            f"    block = first + tl.arange(0, {block})",
            f"    acc = tl.load(partial_{value.tag}qjl_ptr + part[:, None] * {pad} + block[None, :], "
            "mask=has[:, None], other=0.0)",
            f"    matrix = tl.load({value.name}_qjl_ptr + block[:, None] * {pad} + {columns}[None, :]{mask})",
            f"    {into} += tl.sum(matrix * tl.sum(acc * weight[:, None], axis=0)[:, None], axis=0)"]


def merge_parts(layout: Layout) -> str:
    """`_merge_parts_kernel`'s body after the splits' weights: every value part merged and stored at its channels'
    places in the head."""
    out = ""
    store = "tl.store(out_ptr + q_row * HEAD_DIM + {}, out.to(out_ptr.dtype.element_ty), mask=inside)"
    for value in layout.value_parts:
        pad, split, tag = value.head_pad, value.base in layout.split_bases, value.tag
        lines = [f"# {value.name}", f"pos = tl.arange(0, {pad})"]
        if value.uses_matrix or value.qjl:
            lines.append(f"{_block(value)}: tl.constexpr = min({pad}, 32)")
        if value.uses_matrix:
            lines += [f"acc = tl.load(partial_{tag}out_ptr + part[:, None] * {pad} + pos[None, :], mask=has[:, None], "
                      "other=0.0)",
                      "merged = tl.sum(acc * weight[:, None], axis=0)"]
            if value.qjl:
                lines += _qjl_share(value, "merged", "pos", "")
            lines += [f"for first in range(0, {pad}, {_block(value)}):",
                      f"    block = first + tl.arange(0, {_block(value)})  # columns of the part",
                      f"    matrix = tl.load({value.name}_rotation_ptr + pos[:, None] * {pad} + block[None, :])",
                      "    out = tl.sum(matrix * merged[:, None], axis=0)  # column j: sum over positions p of "
                      "merged[p] * rotation[p, j]",
                      f"    inside = block < {value.dim}"]
            if split:
                lines.append(f"    column = {_channel(value, 'block', 'inside')}")
            lines.append("    " + store.format("column" if split else "block"))
        else:
            lines += ["# Column j of the part, read where it sits.", f"inside = pos < {value.dim}"]
            at = "at" if value.padded else "pos"
            if value.padded:
                chunk, chunk_pad = f"{value.dim} // {value.chunks}", f"{pad} // {value.chunks}"
                lines.append(f"at = pos // ({chunk}) * ({chunk_pad}) + pos % ({chunk})")
            lines += [f"acc = tl.load(partial_{tag}out_ptr + part[:, None] * {pad} + {at}[None, :], "
                      "mask=has[:, None] & inside[None, :], other=0.0)",
                      "out = tl.sum(acc * weight[:, None], axis=0)"]
            if value.qjl:
                lines += _qjl_share(value, "out", at, ", mask=inside[None, :], other=0.0")
            if split:
                lines.append(f"column = {_channel(value, 'pos', 'inside')}")
            lines.append(store.format("column" if split else "pos"))
        out += "".join(f"{BODY}{line}\n" for line in lines)
    return out
