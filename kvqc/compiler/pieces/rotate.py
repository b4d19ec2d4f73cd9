"""Fill and flatten move rows between the input basis and position order with one d x d matrix: the rotation and
the packing's permutation together, stored with entries -1, 0 and 1 in fp16 (tables' `<side>_matrix`), so
tensor-core products with it are exact. The rows it meets are divided by their largest magnitude and split into two
fp16 halves (`_halves`: hi + lo hold 22 significant bits): two fp16 dots give float32's precision where tf32x3 took
three tf32 ones on a float32 matrix twice the size.

Sylvester's H_d is H_n (x) H_C over (chunk, column) for n chunks of C columns: entry (i, j) is -1 where i & j has
odd parity, and the bits of i split into the chunk's and the column's (SideLayout.hadamard_blocks). So with
positions in coordinate order a side rotates by one C x C dot per chunk and butterflies across the n chunks, n times
fewer products than the d x d matrix, and H_C comes from bit parity in registers, not memory. The random signs are
the matrix's first row (Sylvester's first row is all ones).

Each function returns kernel lines at the kernel body's indent (4 spaces).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.packing import BODY, indented

if TYPE_CHECKING:
    from kvqc.compiler.layout import SideLayout



def row_spread(var: str, side: SideLayout) -> str:
    """`largest`: the rows' largest magnitude over the side's chunks `<var>_<c>` (float32), `spread` its inverse
    (no newline after the last line)."""
    return (f"{BODY}largest = {side.reduce_chunks('tl.maximum', f'tl.max(tl.abs({var}_%d), axis=1)')}\n"
            f"{BODY}spread = 1.0 / tl.maximum(largest, 1e-30)")


def row_halves(var: str, side: SideLayout) -> str:
    """`hi_<c>`, `lo_<c>`: halves of `<var>_<c>` over the rows' largest magnitude, for a dense matrix's dots, which
    take each chunk's halves once per block of output columns."""
    out = row_spread(var, side) + "\n"
    for c in range(side.chunks):
        out += f"{BODY}tile = {var}_{c} * spread[:, None]\n{BODY}hi_{c}, lo_{c} = _halves(tile)\n"
    return out


def chunk_hadamard(side: SideLayout) -> str:
    """`<side>_hadamard`: H_C, +-1 in fp16 (no newline after the last line)."""
    chunk = f"{side.name}_chunk"
    return "\n".join(BODY + line for line in [*_parity(f"{chunk}[:, None]", f"{chunk}[None, :]"),
                                               f"{side.name}_hadamard = (1 - 2 * (parity & 1)).to(tl.float16)"])


def _parity(rows: str, columns: str) -> list[str]:
    """`parity`, whose low bit is the parity of rows & columns (indices below 256): entry (i, j) of a Sylvester
    Hadamard matrix is -1 where it is 1."""
    return [f"parity = {rows} & {columns}", "parity = parity ^ (parity >> 4)", "parity = parity ^ (parity >> 2)",
            "parity = parity ^ (parity >> 1)"]


def butterflies(var: str, side: SideLayout) -> str:
    """`<var>_0 .. <var>_(n-1)` <- H_n applied across a side's n chunks (a fast Walsh-Hadamard transform over whole
    tiles)."""
    return "".join(f"{BODY}twin = {var}_{i} - {var}_{j}\n{BODY}{var}_{i} = {var}_{i} + {var}_{j}\n"
                   f"{BODY}{var}_{j} = twin\n" for i, j in side.butterflies)


def rotate_in_blocks(side: SideLayout) -> str:
    """Fill: `x_<c>` = chunk c of the rotated rows (position order), float32, from `<side>_input_<c>`."""
    name, chunks, unit = side.name, range(side.chunks), side.matrix_unit
    signs = [f"tl.load({name}_matrix_ptr + {side.chunk_columns(c)})" for c in chunks]
    halves_dot = "".join(f"{BODY}x_{c} = {name}_input_{c}.to(tl.float32) * {signs[c]}.to(tl.float32)[None, :]\n"
                         for c in chunks)
    halves_dot += row_spread("x", side) + "\n"
    halves_dot += "".join(f"{BODY}x_{c} = _halves_dot(x_{c} * spread[:, None], {name}_hadamard)\n" for c in chunks)
    halves_dot += f"{BODY}largest = largest * {unit}\n"
    out = (f"{BODY}# Into position order by H_{side.chunks} (x) H_chunk (pieces/rotate.py): one dot per chunk, then "
           f"butterflies.\n{chunk_hadamard(side)}\n")
    if side.centered:
        out += f"{BODY}# Centered rows are float32: each row divided by its largest magnitude, then its fp16 halves.\n"
        out += halves_dot
    else:
        out += (f"{BODY}if {side.base}_ptr.dtype.element_ty == tl.float16:\n"
                f"{BODY}    # fp16 rows times +-1 are exact products as they stand: one dot.\n")
        out += "".join(f"{BODY}    x_{c} = tl.dot({name}_input_{c} * {signs[c]}[None, :], {name}_hadamard)\n"
                       for c in chunks)
        out += (f"{BODY}    largest = tl.full([BLOCK_T], {unit}, tl.float32)\n{BODY}else:\n"
                f"{BODY}    # Other dtypes: each row divided by its largest magnitude, then its fp16 halves.\n")
        out += indented(halves_dot)
    out += butterflies("x", side) + "\n"
    return out + "".join(f"{BODY}x_{c} = x_{c} * largest[:, None]\n" for c in chunks)


def rotate_in_by_matrix(side: SideLayout, valid: str) -> str:
    """Fill: `x_<c>` = chunk c of the rows in position order, float32, by the d x d -1/0/1 matrix, IN_BLOCK input
    columns at a time (the rows are read inside the column loop)."""
    chunks, pad = range(side.chunks), side.head_pad
    load = f"tl.load({side.input_rows} + k + dim[None, :], mask={valid}[:, None]{side.block_mask}, other=0.0)"
    out = f"{BODY}# Into position order by the -1/0/1 matrix (pieces/rotate.py), IN_BLOCK input columns at a time.\n"
    out += "".join(f"{BODY}x_{c} = tl.zeros([BLOCK_T, {side.chunk_pad}], tl.float32)\n" for c in chunks)
    out += (f"{BODY}if {side.base}_ptr.dtype.element_ty == tl.float16:\n"
            f"{BODY}    # fp16 rows times -1/0/1 are exact products as they stand: one dot.\n"
            f"{BODY}    for k in tl.static_range(0, {pad}, IN_BLOCK):\n"
            f"{BODY}        x = {load}\n")
    out += "".join(f"{BODY}        x_{c} = tl.dot(x, tl.trans(tl.load({side.matrix_block(c)})), x_{c})\n"
                   for c in chunks)
    out += (f"{BODY}    largest = tl.full([BLOCK_T], {side.matrix_unit}, tl.float32)\n"
            f"{BODY}else:\n"
            f"{BODY}    # Other dtypes: a first pass finds each row's largest magnitude, the second takes its fp16 "
            "halves.\n"
            f"{BODY}    largest = tl.zeros([BLOCK_T], tl.float32)\n"
            f"{BODY}    for k in tl.static_range(0, {pad}, IN_BLOCK):\n"
            f"{BODY}        x = {load}.to(tl.float32)\n"
            f"{BODY}        largest = tl.maximum(largest, tl.max(tl.abs(x), axis=1))\n"
            f"{BODY}    spread = 1.0 / tl.maximum(largest, 1e-30)\n"
            f"{BODY}    for k in tl.static_range(0, {pad}, IN_BLOCK):\n"
            f"{BODY}        x = {load}.to(tl.float32) * spread[:, None]\n"
            f"{BODY}        hi, lo = _halves(x)\n")
    out += "".join(f"{BODY}        matrix = tl.trans(tl.load({side.matrix_block(c)}))\n"
                   f"{BODY}        x_{c} = tl.dot(lo, matrix, tl.dot(hi, matrix, x_{c}))\n" for c in chunks)
    out += f"{BODY}    largest = largest * {side.matrix_unit}\n"
    return out + "".join(f"{BODY}x_{c} = x_{c} * largest[:, None]\n" for c in chunks)


def rotate_out_blocks(side: SideLayout) -> str:
    """Flatten: `tile_<c>` (position order, float32) <- chunk c of the rows in the input basis. The tiles come in as
    float32, or as fp16 codebook entries for an fp16 or bf16 output (flatten's PTX lookups), which the one-dot
    branch takes as they are."""
    name, chunks = side.name, range(side.chunks)
    out = (f"{BODY}# Back to the input basis by H_{side.chunks} (x) H_chunk (pieces/rotate.py), then the signs.\n"
           f"{chunk_hadamard(side)}\n{BODY}if {side.base}_out_ptr.dtype.element_ty == tl.float32:\n"
           f"{indented(row_spread('tile', side))}\n")
    out += "".join(f"{BODY}    tile_{c} = _halves_dot(tile_{c} * spread[:, None], {name}_hadamard)\n" for c in chunks)
    out += f"{BODY}else:\n"
    if side.factor_after_matrix:
        out += (f"{BODY}    # The codebook's values as they stand (the row factor follows the matrix).\n"
                f"{BODY}    largest = tl.full([BLOCK_T], 1.0, tl.float32)\n")
        out += "".join(f"{BODY}    tile_{c} = tl.dot(tile_{c}.to(tl.float16), {name}_hadamard)\n" for c in chunks)
    else:
        out += (f"{BODY}    # The hi halves alone, for an fp16 or bf16 output: their rounding (2^-11 of the row's "
                f"largest entry) adds\n{BODY}    # about as much error as the output's own.\n"
                f"{indented(row_spread('tile', side))}\n")
        out += "".join(f"{BODY}    tile_{c} = tl.dot((tile_{c} * spread[:, None]).to(tl.float16), {name}_hadamard)\n"
                       for c in chunks)
    out += butterflies("tile", side) + "\n"
    factor = f" * {name}_{side.row_factor}" if side.factor_after_matrix else ""
    out += f"{BODY}largest = largest * {side.matrix_unit}{factor}\n"
    return out + "".join(f"{BODY}tile_{c} = tile_{c} * largest[:, None] * tl.load({name}_matrix_ptr + "
                         f"{side.chunk_columns(c)}).to(tl.float32)[None, :]\n" for c in chunks)


def flatten_back(side: SideLayout, keep_rotated: bool) -> str:
    """Flatten: a Hadamard-block side's tiles back to the input basis (rotate_out_blocks); where the kernel can also
    keep the rotated basis, that under ROTATED instead. Nothing for other sides."""
    if not side.hadamard_blocks:
        return ""
    if not keep_rotated:
        return rotate_out_blocks(side) + "\n"
    factor = f" * {side.name}_{side.row_factor}[:, None]" if side.factor_after_matrix else ""
    return (f"{BODY}if ROTATED:\n"
            + "".join(f"{BODY}    tile_{c} = tile_{c}.to(tl.float32){factor}\n" for c in range(side.chunks))
            + f"{BODY}else:\n" + indented(rotate_out_blocks(side)) + "\n")


def decode_query(key: SideLayout) -> str:
    """_decode_kernel's query in position order, `rotated_<c>` (float32 [GROUP_PAD, C], chunk c). With ROTATE, from the
    query as given (rows of head_dim in the model's dtype), where `_rotate_query_kernel` takes a launch and a float32
    copy: the signs, then H_d as H_n (x) H_C over the n chunks of C columns - each chunk times H_C, ROT query columns a
    dot against the matching rows of H_C (bit parity in registers: entries +-1, exact in any dot dtype), then
    butterflies across the chunks. Without, `_rotate_query_kernel`'s rows."""
    name, upper, chunks = key.name, key.name.upper(), range(key.chunks)
    rows = "query_ptr + q_row[:, None] * HEAD_DIM"
    rotating = ""
    for c in chunks:
        rotating += "".join(f"{BODY}{line}\n" for line in [
            f"rotated_{c} = tl.zeros([GROUP_PAD, {upper}_CHUNK], tl.float32)",
            f"for k in tl.static_range({upper}_CHUNK // ROT):",
            f"    column = {c} * {upper}_CHUNK + k * ROT + rot",
            f"    x = tl.load({rows} + column[None, :], mask=q_valid[:, None], other=0.0)",
            f"    x = x.to(tl.float32) * tl.load({name}_matrix_ptr + column).to(tl.float32)[None, :]"
            "  # the signs: exact",
            *("    " + line for line in _parity("(k * ROT + rot)[:, None]", f"{name}_chunk[None, :]")),
            f"    rotated_{c} = _mm(x.to(DOT_DTYPE), (1 - 2 * (parity & 1)).to(DOT_DTYPE), DOT_PRECISION, "
            f"rotated_{c})"])
    rotating += butterflies("rotated", key) + "\n"
    rotating += "".join(f"{BODY}rotated_{c} *= {key.matrix_unit}\n" for c in chunks)
    out = (f"{BODY}ROT: tl.constexpr = min({upper}_CHUNK, 32)  # query columns a dot takes: H_C's rows in registers "
           f"stay few\n{BODY}rot = tl.arange(0, ROT)\n{BODY}if ROTATE:\n{indented(rotating)}{BODY}else:\n")
    return out + "".join(f"{BODY}    rotated_{c} = tl.load({rows} + {c} * {upper}_CHUNK + {name}_chunk[None, :], "
                         "mask=q_valid[:, None], other=0.0)\n" for c in chunks)
