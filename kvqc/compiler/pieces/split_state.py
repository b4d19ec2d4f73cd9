"""The state a decode split program keeps per side, as lines of `_decode_kernel` (templates/kernels/decode.py.j2
places them around its tile loop): K's query tiles, loaded once before the loop, and V's accumulators, from zeros
through each rescale to the split's partial output; and in the loop, how a K part's dots become scores and the
probabilities become a V part's weights. Their number and shape follow the side's plan (chunks, pairs of chunks,
32-bit words, scale groups, a QJL residual, a per-token shift), which is why they are laid out here, in Python, and
not unrolled in Jinja.

Names in the kernel: `query_<tag><c>` (chunk c of the query in DOT_DTYPE), `query_<tag>p<k>` (chunks 2k and 2k + 1),
`query_<tag>qjl_<c>` (the projected query), `query_<tag>sum` (the query's sum, for the shift); `acc_<tag><suffix>`
per SideLayout.acc_tiles, `acc_<tag>qjl_<c>`, `acc_<tag>shift`. Each function returns whole lines, each ending in a
newline, indented for the kernel's body (4 spaces) or, for `rescale`, for the loop's branch (12, under the template's
filter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces import scale_groups

if TYPE_CHECKING:
    from kvqc.compiler.layout import Layout, SideLayout

LOOP = " " * 12  # the rescale branch inside the tile loop, as decode.py.j2 writes it before its indent filter


def queries(layout: Layout) -> str:
    """K's query tiles: a scale-group side's per unit, a pairs side's per pair of chunks, else per chunk (the rotated
    chunks `rotated_<c>` where the split kernels rotate the query, else loaded from its rows)."""
    out = ""
    for key in layout.key_parts:
        if key.group_dots:
            out += scale_groups.query_loads(key) + "\n"
        elif key.pairs:
            out += _lines(_pair_queries(key)) + "\n"
        else:
            out += _lines(_chunk_queries(key, layout.fuses_query_rotation))
    return out


def init(layout: Layout) -> str:
    """V's accumulators, zeros, and the masks a pairs side reads its chunks with."""
    lines = []
    for value in layout.value_parts:
        tag = value.tag
        if value.decode_shift:
            lines.append(f"    acc_{tag}shift = tl.zeros([GROUP_PAD], tl.float32)  # sum of p * shift, the same for "
                         "every column")
        if value.transposed_acc:
            lines.append("    # Transposed, out^T += tile^T @ p^T: the query heads are the dots' N (8 rows, not 16), "
                         "half the registers")
        if value.group_dots:
            lines.append(scale_groups.value_accs(value, "init", 4) + "\n")  # and a blank line
        elif value.word_unpack:
            words = f"{value.name.upper()}_WORDS"
            lines.append(f"    # acc_<field>_<byte>: column w holds position field * {value.name.upper()}_CHUNK + 4w + "
                         "byte (the row's word w)")
            lines += [f"    acc_{tag}{t} = tl.zeros([GROUP_PAD, {words}], tl.float32)" for t in value.acc_tiles]
        elif value.pairs:
            lines.append("    # acc_p<k>: chunks 2k and 2k + 1, side by side (position order)")
            lines += [f"    acc_{tag}{t} = tl.zeros({_acc_shape(value, f'2 * {value.chunk_pad}')}, tl.float32)"
                      for t in value.acc_tiles]
            masks = _pair_masks(value)
            lines += [masks[0], "    # Where a pair's bytes of the narrowest plane are the upper chunk's: its field is "
                      "the next one.", *masks[1:]]
        else:
            for c in range(value.chunks):
                lines.append(f"    acc_{tag}{c} = tl.zeros({_acc_shape(value, value.chunk_pad)}, tl.float32)")
                if value.qjl:
                    lines.append(f"    acc_{tag}qjl_{c} = tl.zeros([GROUP_PAD, {value.chunk_pad}], tl.float32)")
    return _lines(lines)


def _acc_shape(value: SideLayout, columns: str) -> str:
    """A V accumulator's shape: [GROUP_PAD, columns], or [columns, GROUP_PAD] where it is accumulated transposed."""
    return f"[{columns}, GROUP_PAD]" if value.transposed_acc else f"[GROUP_PAD, {columns}]"


def rescale(layout: Layout) -> str:
    """V's accumulators times alpha, where a tile raised a row's max."""
    out = ""
    for value in layout.value_parts:
        tag = value.tag
        if value.decode_shift:
            out += f"{LOOP}acc_{tag}shift *= alpha\n"
        if value.group_dots:
            out += scale_groups.value_accs(value, "rescale", len(LOOP))
            continue
        for t in value.acc_tiles:
            out += f"{LOOP}acc_{tag}{t} *= alpha[{'None, :' if value.transposed_acc else ':, None'}]\n"
            if value.qjl:
                out += f"{LOOP}acc_{tag}qjl_{t} *= alpha[:, None]\n"
    return out


def finish(layout: Layout) -> str:
    """After the loop: transposed accumulators back to [GROUP_PAD, columns], V read as words back to position
    order, and the shift's sum added to every column."""
    lines = []
    for value in layout.value_parts:
        if value.transposed_acc:
            lines += [f"    acc_{value.tag}{t} = tl.trans(acc_{value.tag}{t})" for t in value.acc_tiles]
    for value in layout.value_parts:
        if not value.word_unpack:
            continue
        lines.append("    # Back to position order, a chunk at a time: byte b of word w is the chunk's column 4w + b.")
        for c in range(value.chunks):
            acc = f"acc_{value.tag}{c}"
            lines.append(f"    {acc} = tl.reshape(tl.join(tl.join({acc}_0, {acc}_2), tl.join({acc}_1, {acc}_3)), "
                         f"[GROUP_PAD, {value.chunk_pad}])")
    for value in layout.value_parts:
        if value.decode_shift:
            tiles = value.acc_tiles if value.pairs else range(value.chunks)
            lines += [f"    acc_{value.tag}{t} += acc_{value.tag}shift[:, None]" for t in tiles]
    return _lines(lines)


def store(layout: Layout) -> str:
    """The split's partial output, V's accumulators in position order (and QJL's beside them), row `part`."""
    out = ""
    for value in layout.value_parts:
        tag, row = value.tag, f"part[:, None] * {value.head_pad}"
        if value.group_dots:
            out += scale_groups.value_accs(value, "store", 4)
            continue
        for k in range(value.chunks // 2 if value.pairs else 0):
            columns = f"{k} * 2 * {value.chunk_pad} + {value.name}_pair[None, :]"
            out += f"    tl.store(partial_{tag}out_ptr + {row} + {columns}, acc_{tag}p{k}, mask=q_valid[:, None])\n"
        for c in range(0 if value.pairs else value.chunks):
            columns = f"{c} * {value.chunk_pad} + {value.name}_chunk[None, :]"
            out += f"    tl.store(partial_{tag}out_ptr + {row} + {columns}, acc_{tag}{c}, mask=q_valid[:, None])\n"
            if value.qjl:
                out += (f"    tl.store(partial_{tag}qjl_ptr + {row} + {columns}, acc_{tag}qjl_{c}, "
                        "mask=q_valid[:, None])\n")
    return out


def scores(key: SideLayout, first: bool) -> str:
    """`scores` (`=` for the first key part, else `+=`) from a K part's `dots` (and `dots_qjl`): times its per-token
    factor, plus its shift times the query's sum. A scale-group side's dots come scaled (scale_groups.key_dots)."""
    op, name, lines = "scores = " if first else "scores += ", key.name, []
    if key.decode_shift and not key.group_dots:
        shift = f"query_{key.tag}sum[:, None] * {name}_shift[None, :]"
        lines.append(f"{op}dots * {name}_{key.row_factor}[None, :] + {shift}")
    elif key.row_factor and not key.group_dots:
        lines.append(f"{op}dots * {name}_{key.row_factor}[None, :]")
    elif not key.group_dots:
        lines.append(f"{op}dots")
    if key.qjl:
        lines.append(f"scores += dots_qjl * {name}_qjl_row[None, :]")
    return "".join(f"        {line}\n" for line in lines)


def weights(value: SideLayout) -> str:
    """The probabilities as a V part's dots take them: times its per-token factor, in DOT_DTYPE (and QJL's), and the
    shift's share summed apart."""
    name = value.name
    lines = [f"weights = (p * {name}_{value.row_factor}[None, :]).to(DOT_DTYPE)" if value.row_factor
             else "weights = p.to(DOT_DTYPE)"]
    if value.decode_shift:
        lines.append(f"acc_{value.tag}shift += tl.sum(p * {name}_shift[None, :], axis=1)")
    if value.qjl:
        lines.append(f"weights_qjl = (p * {name}_qjl_row[None, :]).to(DOT_DTYPE)")
    return "".join(f"        {line}\n" for line in lines)


def _chunk_queries(key: SideLayout, rotated: bool) -> list[str]:
    tag, lines = key.tag, []
    columns = f"q_row[:, None] * {key.head_pad} + {{c}} * {key.chunk_pad} + {key.name}_chunk[None, :]"
    for c in range(key.chunks):
        at = columns.format(c=c)
        if rotated:
            lines.append(f"    query = rotated_{c}")
        else:
            lines.append(f"    query = tl.load(query_{tag}ptr + {at}, mask=q_valid[:, None], other=0.0).to(tl.float32)")
        if key.decode_shift:
            lines.append(f"    query_{tag}sum {'=' if c == 0 else '+='} tl.sum(query, axis=1)")
        lines.append(f"    query_{tag}{c} = query.to(DOT_DTYPE)")
        if key.qjl:
            lines.append(f"    query_{tag}qjl_{c} = tl.load(query_{tag}qjl_ptr + {at}, mask=q_valid[:, None], "
                         "other=0.0).to(DOT_DTYPE)")
    return lines


def _pair_queries(key: SideLayout) -> list[str]:
    """A K read in pairs of chunks (SideLayout.pairs): its masks and the query's pairs, `query_p<k>` and
    `query_qjl_p<k>` (position order, so a pair is 2 * CHUNK adjacent columns)."""
    tag, lines = key.tag, _pair_masks(key)
    for k in range(key.chunks // 2):
        for q in ("", "qjl_"):
            load = (f"tl.load(query_{tag}{q}ptr + q_row[:, None] * {key.head_pad} + {k} * 2 * {key.chunk_pad} + "
                    f"{key.name}_pair[None, :], mask=q_valid[:, None], other=0.0)")
            if key.decode_shift and not q:
                lines += [f"    query = {load}.to(tl.float32)",
                          f"    query_{tag}sum {'=' if k == 0 else '+='} tl.sum(query, axis=1)",
                          f"    query_{tag}p{k} = query.to(DOT_DTYPE)"]
            else:
                lines.append(f"    query_{tag}{q}p{k} = {load}.to(DOT_DTYPE)")
    return lines


def _pair_masks(side: SideLayout) -> list[str]:
    """`<side>_pair`, a pair's columns; `<side>_upper(_bits)`, 0xff (the narrowest plane's width) where a column is
    the upper chunk's, whose field in the pair's bytes is the next one."""
    n, pad = side.name, side.chunk_pad
    return [f"    {n}_pair = tl.arange(0, 2 * {pad})",
            f"    {n}_upper = tl.where({n}_pair >= {pad}, 255, 0).to(tl.uint8)[None, :]",
            f"    {n}_upper_bits = ({n}_pair >= {pad}).to(tl.int32)[None, :] * {side.planes[0].width}"]


def _lines(lines: list[str]) -> str:
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)
