"""Bit planes <-> codes, one chunk of CHUNK = HEAD_DIM // chunks positions at a time (CHUNK is KEY_CHUNK or
VALUE_CHUNK in the kernels): a side's chunk constants, the plane bytes a chunk reads, each chunk's code, and fill's
packed bytes. A plane with k codes per byte has chunks // k byte ranges of CHUNK bytes each; chunk c reads range
c % ranges at field c // ranges, so unpacking is a shift and a mask on a contiguous load, never a reshape or a
gather. Which planes, ranges and fields a side has is its plan's (SideLayout.plane_ranges, chunk_code, packed,
chunk_packing); the lines are written here and placed by the fill, flatten and decode templates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kvqc.compiler.layout import Layout, SideLayout

BODY = " " * 4  # a kernel body's indent


def over(expr: str, n: int) -> str:
    """`expr // n` as a person writes it: `expr` alone where n is 1 (also the templates' `over` filter)."""
    return expr if n == 1 else f"{expr} // {n}"


def plane_ptr(side: SideLayout, plane: int, r: int) -> str:
    """The addresses of the rows `row` in byte range r of a plane (plane index)."""
    return (f"{side.name}_codes_ptr + row[:, None] * {side.code_row_bytes} + {side.plane_offsets_expr[plane]} + {r} * "
            f"{side.name.upper()}_CHUNK + {side.name}_chunk[None, :]")


def column_mask(side: SideLayout, valid: str) -> str:
    """rows x chunk columns: the `valid` rows, and where chunks are padded only the chunk's real columns."""
    return f"{valid}[:, None]" + (f" & {side.name}_in[None, :]" if side.padded else "")


def load_planes(side: SideLayout, valid: str, raw: bool = False) -> str:
    """`<side>_bytes_<plane>_<range>` for the rows `row`: int32, or as loaded (uint8) where `raw` (for the PTX
    helpers)."""
    convert = "" if raw else ".to(tl.int32)"
    return "".join(f"{BODY}{side.name}_bytes_{p}_{r} = tl.load({plane_ptr(side, p, r)}, "
                   f"mask={column_mask(side, valid)}, other=0){convert}\n" for p, r in side.plane_ranges)


def chunk_code(side: SideLayout, c: int) -> str:
    """`code`, chunk c's codes, from its plane bytes."""
    return "".join(f"{BODY}code = {bits}\n" for bits in side.chunk_code(c))


def pack_and_store(side: SideLayout, valid: str) -> str:
    """Every byte range of every plane packed from the chunks' codes and stored."""
    return "".join(f"{BODY}packed = {packed}\n"
                   f"{BODY}tl.store({plane_ptr(side, p, r)}, packed.to(tl.uint8), mask={column_mask(side, valid)})\n"
                   for p, r, packed in side.packed)


def packed_codes(side: SideLayout) -> str:
    """`packed_<plane>_<range>`: every byte range packed from the chunks' codes, for a residual stage to or its bits
    into before storing them (store_packed)."""
    return "".join(f"{BODY}packed_{p}_{r} = {packed}\n" for p, r, packed in side.packed)


def store_packed(side: SideLayout, valid: str, planes: Callable[[int], bool]) -> str:
    """The byte ranges `packed_<plane>_<range>` of the planes `planes` takes, stored."""
    return "".join(f"{BODY}tl.store({plane_ptr(side, p, r)}, packed_{p}_{r}.to(tl.uint8), "
                   f"mask={column_mask(side, valid)})\n" for p, r, _ in side.packed if planes(p))


def pack_chunk(side: SideLayout, c: int, valid: str) -> str:
    """After chunk c's codes are final: its fields or'ed into their byte ranges, each range stored once complete."""
    out = ""
    for line, done in side.chunk_packing(c):
        out += f"{BODY}{line}\n"
        if done:
            p, r = done
            out += (f"{BODY}tl.store({plane_ptr(side, p, r)}, packed_{p}_{r}.to(tl.uint8), "
                    f"mask={column_mask(side, valid)})\n")
    return out


def chunk_consts(side: SideLayout, span: bool = False) -> str:
    """A side's chunk width (padded where its chunks are), its scale groups per chunk where some head_dim has groups
    inside chunks, and its chunks per scale group where some head_dim's groups span chunks and the kernel reads them:
    it branches per head_dim, or `span` says it reads metadata a chunk at a time."""
    name, upper, size = side.name, side.name.upper(), side.group_size
    lines = [f"{upper}_CHUNK: tl.constexpr = {over(side.dim, side.chunks)}"]
    if side.padded:
        lines += [f"{upper}_CHUNK_PAD: tl.constexpr = {over(str(side.head_pad), side.chunks)}",
                  f"{name}_in = tl.arange(0, {upper}_CHUNK_PAD) < {upper}_CHUNK  # the chunk's real columns; the rest "
                  "is padding"]
    if size and side.spans:
        if side.spanning_head_dims != side.head_dims:
            lines.append(f"{upper}_GROUPS: tl.constexpr = {side.chunk_pad} // {size}  # scale groups per chunk; 0 "
                         "where a group is wider than a chunk")
        if span or len(side.group_variants) > 1:
            lines.append(f"{upper}_SPAN: tl.constexpr = {size} // {side.chunk_pad}  # chunks per scale group where it "
                         "spans several")
    elif size:
        lines.append(f"{upper}_GROUPS: tl.constexpr = {side.chunk_pad} // {size}  # scale groups per chunk")
        if side.padded:
            lines.append(f"{name}_group_in = tl.arange(0, {upper}_GROUPS) < {upper}_CHUNK // {size}")
    lines.append(f"{name}_chunk = tl.arange(0, {side.chunk_pad})")
    return "\n".join(BODY + line for line in lines)


def load_codes(side: SideLayout, fast: str) -> str:
    """Decode's code loads for the rows `row`: V's 32-bit words (word_unpack); every plane's bytes as loaded, for the
    PTX helpers (plane_unpack), or a whole-byte PTX kind's one plane; else as int32, for the portable path."""
    name = side.name
    if side.word_unpack:
        return (f"        {name}_words = tl.load({name}_codes_ptr.to(tl.pointer_type(tl.int32)) + row[:, None] * "
                f"{name.upper()}_WORDS + {name}_word[None, :], mask=valid[:, None], other=0)\n")
    if fast and not side.plane_unpack:
        return (f"        {name}_bytes_0_0 = tl.load({plane_ptr(side, 0, 0)}, mask={column_mask(side, 'valid')}, "
                "other=0)\n")
    return indented(load_planes(side, "valid", raw=bool(fast))) + "\n"


def load_pairs(side: SideLayout) -> str:
    """A side read in pairs of chunks (SideLayout.pairs): `<side>_pair_0`, the narrowest plane's chunk bytes twice
    over, and `<side>_pair_<p>_<j>`, plane p's byte runs j of two chunks."""
    return "".join(f"        {name} = tl.load({side.name}_codes_ptr + row[:, None] * {side.code_row_bytes}{at}, "
                   "mask=valid[:, None], other=0)\n" for name, at in side.pair_loads)


def int_pairs(side: SideLayout) -> str:
    """The portable path's int32 view of the pair bytes."""
    return "".join(f"            {name} = {name}.to(tl.int32)\n" for name, _ in side.pair_loads)


def pair_code(side: SideLayout, k: int) -> str:
    """`code` of pair k (plane 0's field one further where `upper`), on the portable path."""
    return "".join(f"            code = {bits}\n" for bits in side.pair_code(k))


def int_planes(side: SideLayout) -> str:
    """The portable path's int32 view of every plane's bytes that a plane_unpack side loaded raw."""
    return "".join(f"            {side.name}_bytes_{p}_{r} = {side.name}_bytes_{p}_{r}.to(tl.int32)\n"
                   for p, r in side.plane_ranges)


def indented(text: str, width: int = 4) -> str:
    """`width` more spaces on every line that has text, and on the first (Jinja's `indent(width, first=True)`)."""
    pad = " " * width
    first, *rest = text.split("\n")
    return "\n".join([pad + first] + [pad + line if line else line for line in rest])


def decode_consts(layout: Layout) -> str:
    """The split kernel's chunk constants per side: a scale-group side's columns come in runs per head_dim (a
    comment says so), a pairs side needs its chunk width alone, and a side read as 32-bit words its word range."""
    out = ""
    for side in layout.sides:
        name, upper = side.name, side.name.upper()
        if side.group_dots:
            out += f"{BODY}# {name}: columns in runs of its scale groups, each head_dim's own (group_dots)\n"
        elif side.pairs:
            out += f"{BODY}{upper}_CHUNK: tl.constexpr = {over(side.dim, side.chunks)}\n"
        else:
            out += chunk_consts(side) + "\n"
        if side.word_unpack:
            out += (f"{BODY}{upper}_WORDS: tl.constexpr = {upper}_CHUNK // 4  # {name} codes are read as 32-bit words\n"
                    f"{BODY}{name}_word = tl.arange(0, {upper}_WORDS)\n")
    return out
