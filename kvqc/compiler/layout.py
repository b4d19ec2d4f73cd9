"""Plan: everything the templates need about a scheme's cache, so that they compute nothing themselves.

Terms used across kvqc and the generated code:

- *code*: the unsigned integer stored for one coordinate: the codebook index in the low `codebook.bits` bits and,
  for a residual stage, its sign bit above them (LMDeploy's nibble = idx3 | sign << 3).
- *plane*: codes are split into bit planes of width 8, 4, 2 or 1 (the binary digits of the code width), each
  plane packed on its own so that a 3-bit code costs 3 bits and not 4.
- *position*: kernels work on `chunks` column tiles of `head_dim / chunks` positions each (chunks = codes per
  byte of the narrowest plane), so that unpacking is a shift and a mask, never a reshape. A plane with k codes per
  byte keeps position i * (d / k) + j in byte j, field i. `split` packing stores coordinate p at position p (this
  is LMDeploy's layout, and it works for any number of planes); `interleaved` packing (byte j holds coordinates
  j*k .. j*k+k-1, single-plane codes only) stores another coordinate there, and that permutation is folded into
  the rotation matrix, so it costs nothing at run time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import textwrap
from dataclasses import dataclass
from pathlib import Path

from kvqc.numerics import rotation
from kvqc.compiler.spec import FP8_FORMATS, FP8_TARGET, Scheme, TensorScheme

# Measured decode and fill settings (`kvqc tune --write`): codegen renders the launch settings, plan() reads the
# schemes some of its decisions are made for.
DECODE_TUNING = Path(__file__).resolve().parent / "templates" / "decode_tuning.json"


# The portable path's one fast case (SideLayout.portable_reason): fp8 codes, which the hardware converts.
HARDWARE_CONVERTED = "fp8 codes, which the hardware converts"
# Lloyd-Max indices of this many bits or more read their entries with loads (SideLayout.lut_gather), fewer by prmt.
# At 4 bits prmt stays ahead: turbo_eden_k4v2's K read from the codebook's shared copy issued 13-20% fewer
# instructions a tile, yet took 1.00-1.09x the time (H200, CUDA graphs, head_dim 64 and 256, 8 x 8k and 8 x 32k).
GATHER_BITS = 5
# The PTX kinds whose helpers are hand-written for whole code bytes (runtime/ptx.py); planes.py writes the others.
WHOLE_BYTE_KINDS = ("u4", "u8", "lut2", "lut4", "lut3s")


@dataclass(frozen=True)
class KernelParam:
    """One entry of a kernel's parameter list and what its launch passes there, decided once for both: `names` are
    the kernel's parameters (a constexpr's with its annotation), `arg` the wrapper's argument (NAME=value for a
    constexpr; **expr where one expression fills several), `note` a comment on the launch line."""

    names: tuple[str, ...]
    arg: str
    note: str = ""
    table: bool = False  # arg is one of `_tables`' entries

    @property
    def line(self) -> str:
        """The launch line: the argument, its comma, the note."""
        return f"{self.arg},  # {self.note}" if self.note else f"{self.arg},"


def _positional(name: str, arg: str, note: str = "") -> KernelParam:
    return KernelParam((name,), arg, note)


def _table(name: str, key: str) -> KernelParam:
    """A pointer to `_tables`' entry `key`: the wrapper binds `tables = _tables(...)` before the launch."""
    return KernelParam((name,), f'tables["{key}"]', table=True)


def _constexpr(name: str, value: str) -> KernelParam:
    return KernelParam((f"{name}: tl.constexpr",), f"{name}={value}")


# A cache row's strides, which `_row_strides(cache)` gives for the cache's layout.
_ROW_STRIDES = KernelParam(("HEAD_STRIDE: tl.constexpr", "TOKEN_STRIDE: tl.constexpr"), "**_row_strides(cache)")
# Whether the grid puts a row's KV heads side by side on axis 0: the wrapper's `heads_fastest = _heads_fastest(cache)`
# shapes the grid and tells the kernel.
_HEADS_FASTEST = KernelParam(("HEADS_FASTEST: tl.constexpr",), "HEADS_FASTEST=heads_fastest")


@dataclass(frozen=True)
class Plane:
    width: int  # bits per code in this plane: 8, 4, 2 or 1
    shift: int  # the plane holds bits [shift, shift + width) of the code

    @property
    def per_byte(self) -> int:
        return 8 // self.width


def _bytes_expr(width: str, bits: int) -> str:
    """The bytes `width` codes of `bits` bits take, as a person writes it: "0", "HEAD_DIM // 4",
    "HEAD_DIM * 3 // 8"."""
    if bits == 0:
        return "0"
    if bits % 8 == 0:
        return width if bits == 8 else f"{width} * {bits // 8}"
    return f"{width} // {8 // bits}" if 8 % bits == 0 else f"{width} * {bits} // 8"


@dataclass(frozen=True)
class SideLayout:
    """The cache format of one of K or V, for every head_dim the scheme supports."""

    name: str  # "key" or "value"; "key_outlier" / "value_outlier" for the outlier part of a channel split
    scheme: TensorScheme  # this part's: for the outlier part, the side's with the outliers' codebook and residual
    # Some head_dim is not a power of two: kernels work on chunks padded to one (Triton ranges must be), in a
    # position space of next_power_of_2(head_dim) columns, masking the padding out of every load and store.
    padded: bool = False
    head_dims: tuple[int, ...] = ()  # the scheme's head_dims: where scale groups lie relative to chunks differs
    # A channel split (scheme.outliers) makes each side two sub-heads: the outlier channels, permuted to the front
    # of the head, and the rest after them. Each part is quantized like a side of its own width.
    part: str = ""  # "" (the whole side, or the rest of a split) | "outlier"
    whole: TensorScheme | None = None  # a split side's own scheme (its `outliers` say how); None: not split
    # The scheme is in decode_tuning.json's `transposed_value_acc` (measured faster there): see transposed_acc.
    transposed_listed: bool = False

    @property
    def split(self) -> bool:
        return self.whole is not None

    def __post_init__(self):
        # spec.py only lets a group span chunks that divide it, and a power of two divides no chunk of a padded
        # head_dim's (80 * w / 8, 96 * w / 8) unless it fits inside it: no head_dim list gives both.
        if self.padded and self.spans:
            raise ValueError(f"{self.name}: scale groups spanning chunks with padded chunks are not supported")

    @property
    def base(self) -> str:
        """The tensor this part quantizes: "key" or "value"."""
        return self.name.split("_")[0]

    @property
    def tag(self) -> str:
        """Prefix of the kernels' per-part variable names: "" for the whole side or the rest of a split."""
        return f"{self.part}_" if self.part else ""

    def part_dim(self, head_dim: int) -> int:
        """The channels this part quantizes at head_dim."""
        if not self.split:
            return head_dim
        return self.whole.part_dims(head_dim)[0 if self.part else 1]

    @property
    def dim(self) -> str:
        """The constexpr holding this part's width (HEAD_DIM for a side that is not split)."""
        return f"{self.name.upper()}_DIM" if self.split else "HEAD_DIM"

    @property
    def offset_expr(self) -> str:
        """The constexpr holding this part's first channel in the permuted head; "" for a side that is not split."""
        return f"{self.name.upper()}_OFFSET" if self.split else ""

    @property
    def offset_term(self) -> str:
        """What a part adds to a head's first column to reach its own (" + <PART>_OFFSET"); "" for a whole side."""
        return f" + {self.offset_expr}" if self.split else ""

    @property
    def chunk_pad(self) -> str:
        """The constexpr holding a chunk's width in position space (padded or not)."""
        return f"{self.name.upper()}_CHUNK_PAD" if self.padded else f"{self.name.upper()}_CHUNK"

    @property
    def head_pad(self) -> str:
        """The constexpr holding this side's (or part's) width in position space."""
        if self.split:
            return f"{self.name.upper()}_PAD" if self.padded else self.dim
        return "HEAD_PAD" if self.padded else "HEAD_DIM"

    # The scheme's fields the templates name, read here so that templates read the plan alone.
    @property
    def level_bits(self) -> int:
        """Bits of the codebook index, before any residual bit."""
        return self.scheme.codebook.bits

    @property
    def residual(self) -> str:
        """The residual stage: "none", "sign" (one bit and the residual's RMS) or "qjl"."""
        return self.scheme.residual.kind

    @property
    def levels(self) -> int:
        return 2 ** self.level_bits

    @property
    def scalar_codebook(self) -> bool:
        """A Lloyd-Max codebook of at most 16 entries: kernels load it into scalars once and select among them."""
        return self.lloyd_max and self.level_bits <= 4

    @property
    def gathers_cells(self) -> bool:
        """Fill finds a Lloyd-Max cell and its centroid by loads from the tables (binary search), past 16 entries."""
        return self.lloyd_max and not self.scalar_codebook

    @property
    def packing(self) -> str:
        """"split" (each plane's chunks side by side) or "interleaved" (position order mixes the chunks)."""
        return self.scheme.packing

    @property
    def qjl(self) -> bool:
        return self.residual == "qjl"

    @property
    def qjl_seed(self) -> int:
        return self.scheme.residual.seed

    # The widest part whose S a QJL fill keeps for every tile, both fp16 halves in shared memory (4 d^2 bytes): at
    # 128, 64 KiB, and a program takes 100 KiB with its tiles' buffers (sm_90), so two reside per SM.
    QJL_WIDE_WIDTH = 128

    @property
    def qjl_wide_dims(self) -> tuple[int, ...]:
        """The head_dims where fill projects a QJL residual for the whole row at once (N = the padded width) against
        S's halves, loaded once a program, before a looping fill's tiles: up to QJL_WIDE_WIDTH. Elsewhere one
        projection per chunk of positions, on S's rows for it, loaded per tile."""
        return tuple(d for d in self.head_dims if self.padded_width(d) <= self.QJL_WIDE_WIDTH)

    def padded_width(self, head_dim: int) -> int:
        """This part's width in position space at head_dim: its channels padded to a power of two."""
        return 1 << (self.part_dim(head_dim) - 1).bit_length()

    @property
    def sign_plane(self) -> tuple[int, Plane]:
        """The plane (index, plane) holding the residual's bit, the code's bit level_bits."""
        return next((i, plane) for i, plane in enumerate(self.planes)
                    if plane.shift <= self.level_bits < plane.shift + plane.width)

    def sign_place(self, c: int) -> tuple[int, int, int]:
        """Where chunk c's residual bit is packed: (plane index, byte range, bit in the byte)."""
        i, plane = self.sign_plane
        ranges = self.ranges(plane)
        return i, c % ranges, c // ranges * plane.width + self.level_bits - plane.shift

    def sign_weights(self, chunk_of: str) -> tuple[tuple[int, str], ...]:
        """(byte range, the residual bit's value in it for a position of chunk `chunk_of`) per byte range of the
        sign plane: chunk c's bit where c % ranges is the range, 0 elsewhere."""
        # The bit sits above the index (offset > 0) in a plane of 2, 4 or 8 bits: a 1-bit plane holds bit 0.
        _, plane = self.sign_plane
        ranges, offset = self.ranges(plane), self.level_bits - plane.shift
        if ranges == 1:
            return ((0, f"1 << ({chunk_of} * {plane.width} + {offset})"),)
        return tuple((r, f"tl.where({chunk_of} % {ranges} == {r}, 1 << ({chunk_of} // {ranges} * {plane.width} + "
                         f"{offset}), 0)") for r in range(ranges))

    @property
    def scale_kind(self) -> str:
        """"norm" (per-token L2 norm), "absmax" (symmetric scale) or "minmax" (scale and zero)."""
        return self.scheme.scale.kind

    @property
    def unbiased(self) -> bool:
        """Norm-scaled codes rescaled by <x, x_hat> / ||x_hat||^2 (DRIVE/EDEN), so inner products are unbiased."""
        return self.scheme.scale.unbiased

    @property
    def outlier_fraction(self) -> float:
        """A split side's share of head_dim's channels quantized apart."""
        return self.whole.outliers.fraction

    @property
    def outlier_select(self) -> str:
        """How a split side's outlier channels are chosen: "fixed" (outlier_channels) or the statistic calibrate()
        ranks each KV head's channels by."""
        return self.whole.outliers.select

    @property
    def outlier_channels(self) -> tuple[int, ...]:
        return tuple(self.whole.outliers.channels)

    @property
    def lloyd_max(self) -> bool:
        return self.scheme.codebook.kind == "lloyd_max"

    @property
    def fp8_dtype(self) -> str:
        """The Triton dtype of an fp8 codebook's codes."""
        return "tl.float8e4nv" if self.scheme.codebook.format == "e4m3" else "tl.float8e5"

    @property
    def rotation_seed(self) -> int:
        return self.scheme.rotation.seed

    @property
    def code_bits(self) -> int:
        return self.scheme.code_bits

    @property
    def planes(self) -> tuple[Plane, ...]:
        out, shift = [], 0
        for width in (1, 2, 4, 8):  # least significant bits first
            if self.code_bits & width:
                out.append(Plane(width, shift))
                shift += width
        return tuple(out)

    def code_bytes(self, head_dim: int) -> int:
        return self.part_dim(head_dim) * self.code_bits // 8

    @property
    def plane_offsets_expr(self) -> tuple[str, ...]:
        """The plane offsets as constexpr expressions of HEAD_DIM (the part's width), for the kernels."""
        out, bits = [], 0
        for plane in self.planes:
            out.append(_bytes_expr(self.dim, bits))
            bits += plane.width
        return tuple(out)

    @property
    def code_row_bytes(self) -> str:
        """A row's code bytes as a constexpr expression of HEAD_DIM (the part's width), a product's factor."""
        expr = _bytes_expr(self.dim, self.code_bits)
        return expr if expr == self.dim else f"({expr})"

    @property
    def metadata(self) -> tuple[str, ...]:
        return self.scheme.metadata

    @property
    def group_size(self) -> int | None:
        """Channels sharing one set of metadata (per-token scales); None for whole-head or per-channel scales."""
        return None if self.per_channel else self.scheme.scale.group_size

    @property
    def per_channel(self) -> bool:
        return self.scheme.per_channel

    def span(self, head_dim: int) -> int:
        """Consecutive chunks one scale group covers at head_dim: 1 where groups lie inside a chunk (or there are
        none), G / chunk where a group of G channels is wider than the head_dim / chunks columns of a chunk."""
        g, chunk = self.group_size, self.part_dim(head_dim) // self.chunks
        return g // chunk if g and g > chunk else 1

    @property
    def spans(self) -> tuple[int, ...]:
        """The spans above 1 of the scheme's head_dims, ascending; () when every group lies inside a chunk at
        every head_dim, and the kernels are then the same as before groups could span chunks."""
        return tuple(sorted({self.span(d) for d in self.head_dims} - {1}))

    def head_dims_with_span(self, span: int) -> tuple[int, ...]:
        return tuple(d for d in self.head_dims if self.span(d) == span)

    @property
    def spanning_head_dims(self) -> tuple[int, ...]:
        """The head_dims where a scale group covers several chunks."""
        return tuple(d for d in self.head_dims if self.span(d) > 1)

    @property
    def groups_inside(self) -> bool:
        """Some head_dim has its scale groups inside chunks (G <= head_dim / chunks)."""
        return any(self.span(d) == 1 for d in self.head_dims)

    @property
    def token_group(self) -> int | None:
        """Tokens sharing one per-channel scale; their head_dim x metadata values lie spread over their slots."""
        return self.scheme.scale.group_size if self.per_channel else None

    @property
    def row_metadata(self) -> tuple[str, ...]:
        """The fields stored once per token and head (the row factors); () when scales vary along the row."""
        return () if self.scheme.scale.group_size else self.metadata

    def meta_width(self, head_dim: int) -> int:
        """Metadata values per token and head: the fields, once per scale group."""
        return len(self.metadata) * self.scheme.groups(self.part_dim(head_dim))

    @property
    def row_factor(self) -> str | None:
        """The metadata field that multiplies a whole row (decode applies it to scores and probabilities, not
        to tiles); None when scales vary along the row (groups), so tiles are dequantized in full."""
        if self.group_size or self.per_channel:
            return None
        return "norm" if self.scheme.scale.kind == "norm" else "scale"

    @property
    def row_shift(self) -> str | None:
        """The metadata field added to a whole row (a per-token affine zero), or None."""
        return "zero" if self.scheme.scale.kind == "minmax" and not (self.group_size or self.per_channel) else None

    @property
    def decode_shift(self) -> bool:
        """Decode's dots take uniform codes centred on code_mid, and a shift per token adds the rest back (to the
        scores through the query's sum, to the output through the probabilities' sum): per-token minmax grids,
        whose zero the shift carries too, and absmax ones, whose levels lie one above the codes the PTX helpers
        centre (code - 2**(bits - 1)), so their shift is the scale."""
        return bool(self.row_shift) or (self.scale_kind == "absmax" and bool(self.row_factor)
                                        and self.scheme.codebook.kind == "uniform"
                                        and (self.residual != "qjl" or self.base == "key"))

    @property
    def code_mid(self) -> int:
        """The code decode subtracts before its dot products where a shift follows (0 elsewhere): centred codes
        keep the tensor cores' float32 accumulator near the size of the output instead of carrying
        2**(bits - 1) * scale per token, which the shift would only cancel at the end."""
        return 2 ** (self.scheme.codebook.bits - 1) if self.decode_shift else 0

    @property
    def level_mid(self) -> int:
        """What decode subtracts from a level (code less the grid's offset, the portable tiles) to centre it on
        code_mid: code_mid itself for minmax, 1 for absmax (levels run from 1 - 2**(bits - 1))."""
        return self.code_mid - self.grid_offset if self.decode_shift else 0

    @property
    def shift_expr(self) -> str:
        """decode's per-token shift: what the level_mid the dots left out adds, times the scale (and the zero)."""
        unit = f"{self.name}_{self.row_factor}"
        return f"{self.name}_zero + {self.level_mid} * {unit}" if self.row_shift else unit

    @property
    def level_top(self) -> int:
        """A symmetric grid's largest level: codes 0..2*top hold levels -top..top."""
        return 2 ** (self.scheme.codebook.bits - 1) - 1

    @property
    def fp8(self) -> tuple[int, int, float] | None:
        """(mantissa bits, exponent bias, largest finite value) of an fp8 codebook."""
        cb = self.scheme.codebook
        return FP8_FORMATS[cb.format] if cb.kind == "fp8" else None

    @property
    def fp8_target(self) -> float:
        """The fp8 value that max|y| maps to (spec.FP8_TARGET)."""
        return FP8_TARGET

    @property
    def meta_width_expr(self) -> str:
        """meta_width as a constexpr expression of HEAD_DIM, for the kernels."""
        n = len(self.metadata)
        g = self.scheme.scale.group_size
        return f"({self.dim} // {g} * {n})" if g else str(n)

    @property
    def tables(self) -> tuple[str, ...]:
        """Constant tensors the kernels read, built once per head_dim and device by the generated module."""
        out = ["matrix"] if self.uses_matrix else []
        if self.lloyd_max:
            out.append("centroids")
            if self.cell_search != "sign":  # a sign's cell search compares against 0
                out.append("boundaries")
        if self.qjl:
            out.append("qjl")
        if self.lut_gather:
            out.append("entries")
        return tuple(out)

    def params(self, tables: tuple[str, ...]) -> tuple[KernelParam, ...]:
        """The kernel parameters for this part's cache tensors and the constant tables a kernel reads, in order, with
        the wrappers' arguments for them: the cache's tensors and the module's tables."""
        cache = [_positional(f"{self.name}_{field}_ptr", f"cache.{self.name}_{field}") for field in ("codes", "meta")]
        return tuple(cache + [_table(f"{self.name}_{table}_ptr", f"{self.name}_{table}") for table in tables])

    @property
    def fill_tables(self) -> tuple[str, ...]:
        """The tables fill reads: all but decode's entries and the centroids, which it reads where it carries one
        (with_centroid); S as its fp16 halves."""
        return tuple("qjl_halves" if table == "qjl" else table for table in self.tables
                     if table != "entries" and (table != "centroids" or self.with_centroid))

    @property
    def flatten_tables(self) -> tuple[str, ...]:
        """The tables flatten reads: the rotation back, the centroids and S's fp16 halves (never the boundaries, nor
        decode's entries)."""
        return tuple("qjl_halves" if table == "qjl" else table for table in self.tables
                     if table not in ("boundaries", "entries"))

    # What fill's and flatten's dense matrix loops (IN_BLOCK columns `k + dim` at a time) substitute.
    @property
    def input_rows(self) -> str:
        """Where fill's new rows of this part start: the tile's tokens `token` of KV head `head`, at the part's first
        channel."""
        base = self.base
        rows = f"token[:, None].to(tl.int64) * stride_{base}_token + head * stride_{base}_head"
        return f"{base}_ptr + {rows}{self.offset_term}"

    @property
    def block_mask(self) -> str:
        """What a padded part's IN_BLOCK columns add to a mask: the columns inside its real width; "" unpadded."""
        return f" & (k + dim[None, :] < {self.dim})" if self.padded else ""

    def matrix_block(self, c: int) -> str:
        """The matrix entries between chunk c's positions and the IN_BLOCK input columns from k: chunk x IN_BLOCK."""
        return (f"{self.name}_matrix_ptr + ({c} * {self.chunk_pad} + {self.name}_chunk[:, None]) * {self.head_pad} + k"
                " + dim[None, :]")

    # What pieces/packing.py writes to unpack and pack the bit planes (see the module docstring on positions).
    @property
    def plane_ranges(self) -> tuple[tuple[int, int], ...]:
        """(plane index, byte range) of every chunk-wide byte range of every plane, in load order: each is one
        load `<side>_bytes_<plane>_<range>`."""
        return tuple((i, r) for i, plane in enumerate(self.planes) for r in range(self.ranges(plane)))

    def chunk_code(self, c: int) -> tuple[str, ...]:
        """What `code` is set to, line by line, to gather chunk c's codes from the loaded bytes: the first plane's
        field, then each further plane's field or'ed in above the bits before it."""
        places = []
        for i, plane in enumerate(self.planes):
            ranges = self.ranges(plane)
            places.append((f"{self.name}_bytes_{i}_{c % ranges}", c // ranges * plane.width))
        return self._gathered(places)

    @property
    def acc_tiles(self) -> tuple[str, ...]:
        """The suffixes of a V side's decode accumulators `acc_<tag><suffix>` (QJL's aside): chunk c; or `<c>_<b>`,
        byte b of chunk c's words where V is read as words (in the order the word helpers return their tiles); or
        `p<k>`, chunks 2k and 2k + 1, where it is read in pairs."""
        if self.word_unpack:
            return tuple(f"{c}_{b}" for c in range(self.chunks) for b in range(4))
        if self.pairs:
            return tuple(f"p{k}" for k in range(self.chunks // 2))
        return tuple(str(c) for c in range(self.chunks))

    @property
    def transposed_acc(self) -> bool:
        """Decode accumulates this V side transposed, out^T += tile^T @ p^T: positions as the dot's M, the query
        heads (padded to 8, not 16) as N, so the accumulators take half the registers. For the schemes the tuning
        table lists (`transposed_value_acc`, its note has the measurements), where V's Lloyd-Max lookups are impure
        PTX helpers: their fp16 tiles reach tl.dot through shared memory either way. It pays in one-warp programs
        only, and not where a pure helper (u4, u8) unpacks bytes that Triton reads in tl.dot's operand layout."""
        return (self.transposed_listed and self.lloyd_max and self.fast_unpack not in ("", "lut1") and not self.qjl
                and not self.group_dots and not self.word_unpack)

    @property
    def word_fields(self) -> tuple[tuple[str, str], ...]:
        """V read as words, on the portable path: each accumulator's suffix (acc_tiles) and its codes taken from
        the 32-bit words `<side>_words` (byte b of chunk c: shifted right by 8 b + width c, masked)."""
        width = self.planes[0].width
        out = []
        for c in range(self.chunks):
            for b in range(4):
                shift = 8 * b + width * c
                words = f"({self.name}_words >> {shift})" if shift else f"{self.name}_words"
                out.append((f"{c}_{b}", f"{words} & {2 ** width - 1}"))
        return tuple(out)

    @property
    def pair_loads(self) -> tuple[tuple[str, str], ...]:
        """A pairs side's code loads (SideLayout.pairs), each (variable, its columns' offset in the row's bytes): the
        narrowest plane's chunk bytes twice over (`<side>_pair_0`), then each wider plane's byte runs j of two
        chunks (`<side>_pair_<plane>_<j>`)."""
        out = []
        for i, plane in enumerate(self.planes):
            at = f" + {self.plane_offsets_expr[i]}"  # render's fold leaves out a zero offset
            if i == 0:
                out.append((f"{self.name}_pair_0", f"{at} + ({self.name}_pair % {self.name.upper()}_CHUNK)[None, :]"))
                continue
            for j in range(self.ranges(plane) // 2):
                run = f" + {j} * 2 * {self.name.upper()}_CHUNK"
                out.append((f"{self.name}_pair_{i}_{j}", f"{at}{run} + {self.name}_pair[None, :]"))
        return tuple(out)

    def pair_fields(self, k: int) -> tuple[tuple[str, int], ...]:
        """Pair k's loads (SideLayout.pairs) and the bit offset of its field in each, per plane: the narrowest
        plane's bytes twice over (`<side>_pair_0`, at the lower chunk's field), every other plane's byte run j."""
        out = []
        for i, plane in enumerate(self.planes):
            ranges = self.ranges(plane)
            loaded = f"{self.name}_pair_{i}_{2 * k % ranges // 2}" if i else f"{self.name}_pair_0"
            out.append((loaded, 2 * k // ranges * plane.width))
        return tuple(out)

    def pair_code(self, k: int) -> tuple[str, ...]:
        """chunk_code for pair k on the portable path: the narrowest plane's field one further where `upper`."""
        upper = f"{self.name}_upper_bits"
        return self._gathered([(loaded, (f"({field} + {upper})" if field else upper) if i == 0 else field)
                               for i, (loaded, field) in enumerate(self.pair_fields(k))])

    def plane_args(self, c: int) -> str:
        """A plane helper's arguments for chunk c (planes.py): each plane's bytes for c, the bit offset of c's field
        in them, then lookup_args."""
        loads = [f"{self.name}_bytes_{i}_{c % self.ranges(plane)}" for i, plane in enumerate(self.planes)]
        fields = [str(c // self.ranges(plane) * plane.width) for plane in self.planes]
        return ", ".join(loads + fields) + self.lookup_args

    def pair_args(self, k: int) -> str:
        """A plane helper's arguments for pair k (pairs): each plane's bytes, `upper`, each plane's bit offset, then
        lookup_args."""
        fields = self.pair_fields(k)
        loads = [loaded for loaded, _ in fields] + [f"{self.name}_upper"]
        return ", ".join(loads + [str(field) for _, field in fields]) + self.lookup_args

    def unit_code(self, unit: dict) -> tuple[str, ...]:
        """chunk_code for one of group_dots' units (an item of `units`), from its byte runs as int32."""
        return self._gathered([(f"{self.name}_bytes_{i}_{place['window']}.to(tl.int32)", place["field"] * plane.width)
                               for i, (plane, place) in enumerate(zip(self.planes, unit["planes"]))])

    def _gathered(self, places) -> tuple[str, ...]:
        """`code`'s lines from each plane's (loaded bytes, right shift to its field): that plane's bits, or'ed in
        above the bits of the planes before it."""
        out = []
        for i, (plane, (loaded, shift)) in enumerate(zip(self.planes, places)):
            bits = f"({loaded} >> {shift})" if shift else loaded
            bits += f" & {2 ** plane.width - 1}" if plane.width < 8 else ""
            out.append(f"code | (({bits}) << {plane.shift})" if i else bits)
        return tuple(out)

    @property
    def packed(self) -> tuple[tuple[int, int, str], ...]:
        """(plane index, byte range, the byte's value) for every byte range fill stores: the fields of the chunks
        `code_<c>` that share the range's bytes, each plane's bits of each code shifted into its field."""
        out = []
        for i, plane in enumerate(self.planes):
            ranges = self.ranges(plane)
            for r in range(ranges):
                fields = [self._field(plane, field * ranges + r, field) for field in range(plane.per_byte)]
                out.append((i, r, " | ".join(fields)))
        return tuple(out)

    @staticmethod
    def _field(plane: Plane, c: int, field: int) -> str:
        """Chunk c's bits of a plane, in place as the byte's field `field`."""
        code = f"(code_{c} >> {plane.shift})" if plane.shift else f"code_{c}"
        bits = f"{code} & {2 ** plane.width - 1}" if plane.width < 8 else code
        return f"({bits}) << {field * plane.width}" if field else bits

    def chunk_packing(self, c: int) -> tuple[tuple[str, tuple[int, int] | None], ...]:
        """Packing chunk c as soon as its codes `code_<c>` are final, so that one byte range a plane is live rather
        than every chunk's codes: per plane, a line or'ing the chunk's field into `packed_<plane>_<range>`, with
        that (plane, range) where chunk c is the range's last field (to be stored then), else None."""
        out = []
        for i, plane in enumerate(self.planes):
            ranges = self.ranges(plane)
            r, field = c % ranges, c // ranges
            line = f"packed_{i}_{r} {'|=' if field else '='} {self._field(plane, c, field)}"
            out.append((line, (i, r) if field == plane.per_byte - 1 else None))
        return tuple(out)

    @property
    def group_params(self) -> tuple[KernelParam, ...]:
        """A per-channel side's _<side>_group_kernel parameters and fill's launch arguments for it: the new rows,
        their slots, positions and ring rows, the side's ring, codes and metadata, the counts and strides; then the
        constexprs."""
        n = self.name
        return (_positional(f"{n}_ptr", n), _positional("slot_mapping_ptr", "slot_mapping"),
                _positional("positions_ptr", "positions"), _positional("window_index_ptr", "window_index"),
                _positional(f"{n}_window_ptr", f"cache.{n}_window"), _positional(f"{n}_codes_ptr", f"cache.{n}_codes"),
                _positional(f"{n}_meta_ptr", f"cache.{n}_meta"), _positional("num_tokens", "num_tokens"),
                _positional("num_slots", "num_slots"), _positional("max_seqs", "cache.max_seqs"),
                _positional(f"stride_{n}_token", f"{n}.stride(0)"), _positional(f"stride_{n}_head", f"{n}.stride(1)"),
                _constexpr("NUM_KV_HEADS", "cache.num_kv_heads"), _constexpr("BLOCK_SIZE", "cache.block_size"),
                _ROW_STRIDES, _constexpr("HEAD_DIM", "cache.head_dim"), _constexpr("WINDOW", "WINDOW"),
                _constexpr("TOKENS", "_GROUP_TOKENS"))

    def reduce_chunks(self, combine: str, each: str, chunks: int | None = None, first: int = 0) -> str:
        """`combine(each_0, combine(each_1, ...))`: one value per row from every chunk, or from `chunks` chunks from
        chunk `first` on (`each` holds %d for the chunk)."""
        items = [each % c for c in range(first, first + (self.chunks if chunks is None else chunks))]
        out = items[-1]
        for item in reversed(items[:-1]):
            out = f"{combine}({item}, {out})"
        return out

    def joined(self, var: str) -> str:
        """The chunks `<var>_<c>` side by side, the whole row in position order (`_concat`, a pair at a time)."""
        parts = [f"{var}_{c}" for c in range(self.chunks)]
        while len(parts) > 1:
            parts = [f"_concat({a}, {b})" for a, b in zip(parts[::2], parts[1::2])]
        return parts[0]

    def sum_squares(self, var: str) -> str:
        """Each row's sum of squares over the chunks `<var>_<c>`."""
        return " + ".join(f"tl.sum({var}_{c} * {var}_{c}, axis=1)" for c in range(self.chunks))

    # What pieces/rotate.py writes for rotations in Hadamard blocks.
    @property
    def matrix_unit(self) -> str:
        """What the matrix's -1/0/1 entries are multiplied by: the rotation's 1/sqrt(d), or 1 for a permutation."""
        return self.unit_of(self.dim)

    def unit_of(self, head_dim: str) -> str:
        """matrix_unit with the head size named `head_dim` (a kernel's constexpr, or a wrapper's variable)."""
        return f"(1.0 / {head_dim} ** 0.5)" if self.rotated else "1.0"

    @property
    def butterflies(self) -> tuple[tuple[int, int], ...]:
        """The (i, j) chunk pairs of H_(chunks) applied across the chunks (a fast Walsh-Hadamard transform), in
        order: for h = 1, 2, 4 each chunk i with bit h clear pairs with i + h."""
        n = self.chunks
        return tuple((i, i + h) for h in (1, 2, 4) if h < n for i in range(n) if (i // h) % 2 == 0)

    def chunk_columns(self, c: int) -> str:
        """Chunk c's columns in a head-wide row: `<SIDE>_CHUNK` steps from the first chunk's `<side>_chunk`."""
        return f"{c} * {self.name.upper()}_CHUNK + {self.name}_chunk" if c else f"{self.name}_chunk"

    # What pieces/tables.py writes into `_tables` to build this part's constant tensors (d: the part's width there).
    @property
    def order_expr(self) -> str:
        """The coordinate held at each position, as `_tables` computes it: interleaved packing's order, or
        coordinate order."""
        return f"_interleaved_order(d, {8 // self.code_bits})" if self.permuted else "torch.arange(d)"

    @property
    def signed_expr(self) -> str:
        """The d x d matrix `_tables` orders into position order (before any random signs): H_d for a rotation, the
        identity for a permutation alone."""
        return "_hadamard(d)" if self.rotated else "torch.eye(d, dtype=torch.float64)"

    @property
    def sign_flips(self) -> bool:
        """The rotation carries random signs (`_<SIDE>_SIGNS`, one vector per width)."""
        return self.rotated and self.scheme.rotation.signs

    @property
    def table_width(self) -> str:
        """What `_tables` sets d to for this part in a layout with a channel split, and why: a part's own channels,
        or every channel for a side that is not split."""
        if self.split:
            return f'_part_dims(head_dim)["{self.name}"]  # the channels this part quantizes'
        return "head_dim  # an unsplit side takes every channel"

    @property
    def table_key(self) -> str:
        """The key of this part's per-width constants (signs, centroids) in `_tables`: a split part's are listed by
        the head's head_dim, a whole side's by its own width d."""
        return "head_dim" if self.split else "d"

    @property
    def rotated(self) -> bool:
        return self.scheme.rotation.kind == "hadamard"

    @property
    def chunks(self) -> int:
        return 8 // self.planes[0].width

    def ranges(self, plane: Plane) -> int:
        """How many chunk-wide byte ranges a plane has: chunk c reads range c % ranges, field c // ranges."""
        return self.chunks // plane.per_byte

    @property
    def permuted(self) -> bool:
        return self.scheme.packing == "interleaved" and self.code_bits < 8

    @property
    def uses_matrix(self) -> bool:
        """Kernels move between the input basis and position order with one d x d matrix."""
        return self.rotated or self.permuted

    @property
    def coordinate_order(self) -> bool:
        """A rotated side whose positions are the rotated coordinates in order (not permuted, padded or split):
        Sylvester's H_d applies to position space as it stands."""
        return self.rotated and not self.permuted and not self.padded and not self.split

    @property
    def hadamard_blocks(self) -> bool:
        """Fill and flatten rotate chunk by chunk: Sylvester's H_d is H_(chunks) (x) H_(chunk) over (chunk, column)
        when positions are in coordinate order, so each chunk takes one chunk x chunk dot and the chunks combine by
        butterflies. Needs chunks of 16 columns or more at every head_dim (tl.dot's smallest K)."""
        return self.coordinate_order and all(d // self.chunks >= 16 for d in self.head_dims)

    @property
    def centered(self) -> bool:
        """Fill quantizes each vector minus its KV head's calibrated mean (`key_mean`), flatten adds it back. The
        spec allows it only where fill and flatten move whole chunks (no dense matrix, no padding)."""
        return self.scheme.center != "none"

    @property
    def dense_matrix(self) -> bool:
        """Fill and flatten multiply by the whole d x d matrix, IN_BLOCK columns at a time."""
        return self.uses_matrix and not self.hadamard_blocks

    @property
    def kernel_rotates(self) -> bool:
        """Decode rotates this side's vectors in its kernels, in registers: the split kernels the query into position
        order (K: one dot with H_C per chunk, butterflies across chunks; with QJL `_rotate_query_kernel`, which
        projects it too, Layout.projects_query), the merge the merged output back (V: Walsh-Hadamard butterflies).
        Where positions are in coordinate order, but not for V with QJL: the wrapper maps its second output through
        the projection's transpose."""
        return self.coordinate_order and not (self.qjl and self.base == "value")

    @property
    def wrapper_maps(self) -> bool:
        """Decode's wrapper moves this side's vectors in torch, in float32 (a rotation or permutation the kernels
        do not do themselves, padding positions, a QJL projection no kernel makes): the query before the kernel for
        K, the output after the merge for V. Otherwise the kernels read the query and write the output in the model's
        dtype. A channel split's parts move in kernels of their own (kernels/parts.py.j2) whatever this says."""
        return (self.uses_matrix and not self.kernel_rotates) or self.padded or (self.qjl and not self.kernel_rotates)

    @property
    def factor_after_matrix(self) -> bool:
        """Flatten applies the row factor after the matrix instead of before it (it commutes with a linear map):
        the codebook's own values (unit-scale centroids, integer or fp8 levels) fit fp16 as they stand, so an fp16
        or bf16 output needs no per-row rescaling before the one fp16 dot. Not with a row shift (a constant row
        does not stay constant) nor QJL (its correction is added at full scale)."""
        return self.uses_matrix and self.row_factor is not None and not self.row_shift and not self.qjl

    @property
    def fast_unpack(self) -> str:
        """Decode's PTX unpacking of this side's codes on NVIDIA (runtime/ptx.py, kernels/unpack.py.j2), "" for the
        portable select trees. "u8" / "u4": uniform 8- / 4-bit codes in one plane, "lut2" / "lut4" Lloyd-Max indices in
        one plane, "lut3s" a 3-bit index and a residual sign; "u<bits>" (other widths, 1 to 8), "lut<bits>" (other
        index widths), "lut<bits>s" (an index and the residual's sign above it: entry + -rms) and "lut<bits>qjl" (K's
        index and its QJL sign bit above it: the codebook tile and a +-1 tile for the projected query's dot),
        "u<bits>s" (a uniform level and the residual's sign: + - rms / scale, the residual in grid steps) and
        "u<bits>qjl" (K's level and its QJL sign bit, as lut<bits>qjl) are made by one helper per kind that gathers a
        code's bits from every plane (planes.py; lut_gather: indices from GATHER_BITS bits on load their entries from
        the fp16 codebook's copy in shared memory).
        Uniform codes take a scale (and zero) per token, applied with a shift (decode_shift), or scales that stay
        outside the tiles: per group of channels (group_dots) or K's per channel (channel_dots); Lloyd-Max codes a norm.
        V's per-channel scales, scale groups without group_dots and QJL on V keep the portable path.
        Chunks padded to a power of two take the helpers as whole ones do: the load masks the padding columns' bytes to
        0, and what code 0 decodes to there (a finite codebook entry or grid level) meets zeros: K's padded query
        columns, and the padding rows of V's way back (the matrix's, or the positions the wrapper keeps), as on the
        portable path."""
        s = self.scheme
        bits, residual, kind = s.codebook.bits, s.residual.kind, s.codebook.kind
        if (self.per_channel and not self.channel_dots) or (self.group_size and not self.group_dots):
            return ""
        if kind == "uniform" and residual == "none":
            return f"u{bits}"
        if kind == "uniform" and residual == "sign":
            return f"u{bits}s"
        if kind == "uniform" and residual == "qjl" and self.base == "key":
            return f"u{bits}qjl"
        if kind == "lloyd_max" and residual == "none":
            return f"lut{bits}"
        if kind == "lloyd_max" and residual == "sign":
            return "lut3s" if bits == 3 else f"lut{bits}s"
        if kind == "lloyd_max" and residual == "qjl" and self.base == "key":
            return f"lut{bits}qjl"
        return ""

    @property
    def plane_unpack(self) -> bool:
        """The side's PTX kind is made by the generated helper that gathers each code's bits from its planes
        (planes.py: one tile per call), not by one of the hand-written whole-byte helpers."""
        return bool(self.fast_unpack) and self.fast_unpack not in WHOLE_BYTE_KINDS

    @property
    def pairs(self) -> bool:
        """V's plane_unpack tiles, and a QJL K's, span two chunks (2 * head_dim / chunks columns) where a chunk is
        narrower than 32 columns at some head_dim: Triton 3.6 stages a 16-column tl.dot B operand through shared
        memory column-major, one 2-byte store per element (128 a 32-token tile for 3-bit codes at head_dim 128), a
        32-column one row-major in 16-byte stores, with half the barriers. K's tiles are B operands as
        tl.trans(tile), and a QJL K has two a chunk (its codebook and sign tiles): sm_90 PTX of turbo_qjl_k3v3's
        decode loop, 32-token tiles, one warp, 258 such stores and 28 barriers a tile in chunks. Chunks 2k and 2k + 1
        read the same bytes of the narrowest plane (fields 2k and 2k + 1) and adjacent byte runs, at one field, of
        every other plane. Not with padded chunks, whose pair would hold the lower chunk's padding in its middle,
        nor group_dots' units."""
        if not self.plane_unpack or self.split or self.padded or self.group_dots or self.chunks < 2:
            return False
        if self.base == "key" and not self.qjl:
            return False
        return any(self.part_dim(d) // self.chunks < 32 for d in self.head_dims)

    @property
    def group_dots(self) -> bool:
        """Scales per group of channels stay outside the tiles, which stay integer codes: decode takes one dot per run
        of `unit(d)` columns (a group, or the chunk where a group spans several). K dots each unit with the matching
        query columns and multiplies each group's dots by its scale per token (plus its zero times the query's sum
        over the group); V scales the probabilities by each group's scale before its units' dots, one accumulator
        per unit, and sums the probabilities against the group's level_shift apart. Needs units of 16 columns or
        more (tl.dot's smallest K for K, its smallest N for V) at every head_dim, uniform codes and a whole side."""
        if not self.group_size or self.per_channel or self.split or self.padded:
            return False
        if self.scheme.codebook.kind != "uniform":
            return False
        return all(self.unit(d) >= 16 for d in self.head_dims)

    @property
    def channel_dots(self) -> bool:
        """K with per-channel scales shared by a token group of 16 or more: decode's tiles lie inside one group (the
        plan caps BLOCK_N at it), so a chunk's scales are one vector, loaded a tile ahead, that folds into the query
        (q * scale dotted with the tiles, plus <q, level_shift>) and never multiplies the tiles. V's per-channel
        scales keep their own accumulation (scales after the dot) on the portable path."""
        return self.base == "key" and self.per_channel and self.token_group >= 16

    @property
    def tile_level(self) -> int:
        """What a uniform tile of channel_dots or group_dots (code - code_centre, the PTX helpers' form, on either
        path) lacks of its level: code_centre less the grid's offset (minmax 2**(bits-1), absmax 1); 0 for fp8 codes,
        whose tiles are their levels."""
        return self.code_centre - self.grid_offset if self.scheme.codebook.kind == "uniform" else 0

    def level_shift(self, scale: str, zero: str) -> str:
        """What a channel (channel_dots) or a group (group_dots on V) adds per unit of query or probability to the dot
        of its tiles: its zero (minmax) and tile_level times its scale, as an operand (a sum in parentheses); ""
        where that is nothing (fp8 codes)."""
        terms = [zero] if self.scale_kind == "minmax" else []
        terms += [f"{self.tile_level} * {scale}" if self.tile_level != 1 else scale] if self.tile_level else []
        return f"({' + '.join(terms)})" if len(terms) > 1 else "".join(terms)

    def unit(self, head_dim: int) -> int:
        """Columns of one group_dots tile at head_dim: the scale group, or the chunk where a group spans chunks."""
        return min(self.group_size, self.part_dim(head_dim) // self.chunks)

    def unit_loads(self, head_dim: int) -> tuple[tuple[str, int], ...]:
        """group_dots' code loads at head_dim, each (variable `<side>_bytes_<plane>_<run>`, its first byte in the
        row): every plane's bytes in runs of unit(d)."""
        w, out, offset = self.unit(head_dim), [], 0
        for p, plane in enumerate(self.planes):
            plane_bytes = head_dim * plane.width // 8
            out += [(f"{self.name}_bytes_{p}_{j}", offset + j * w) for j in range(plane_bytes // w)]
            offset += plane_bytes
        return tuple(out)

    def units(self, head_dim: int) -> list[dict]:
        """group_dots' tiles at head_dim, in position order: each one's scale group and, per plane, the byte run
        (`window`, of unit(d) bytes from the plane's start) and the bit field it reads. A plane with k codes per
        byte keeps position p in byte p % (d / k), field p // (d / k) (module docstring)."""
        w = self.unit(head_dim)
        out = []
        for u in range(head_dim // w):
            first = u * w
            planes = []
            for plane in self.planes:
                plane_bytes = head_dim * plane.width // 8
                planes.append({"window": first % plane_bytes // w, "field": first // plane_bytes})
            out.append({"group": first // self.group_size, "planes": planes})
        return out

    def unit_unpack(self, head_dim: int, unit: dict, u: int) -> str:
        """group_dots' PTX line for unit u (an item of `units`) at head_dim: the helper's call into `tile_<u>`; for
        u4, whose call makes a byte's two tiles at once, the second unit's line says which made it."""
        kind, name = self.fast_unpack, self.name
        if kind in ("u4", "u8"):
            place, w = unit["planes"][0], self.unit(head_dim)
            if place["field"]:
                return f"pass  # made with tile_{u - head_dim // 2 // w}"
            if kind == "u4":
                return f"tile_{u}, tile_{u + head_dim // 2 // w} = _unpack_u4({name}_bytes_0_{place['window']})"
            return f"tile_{u} = _unpack_u8({name}_bytes_0_{place['window']})"
        loads = "".join(f"{name}_bytes_{i}_{place['window']}, " for i, place in enumerate(unit["planes"]))
        fields = ", ".join(str(place["field"] * plane.width) for place, plane in zip(unit["planes"], self.planes))
        return f"tile_{u} = _unpack_{kind}({loads}{fields})"

    @property
    def code_centre(self) -> int:
        """What the uniform PTX helpers subtract from a code (2**(bits-1)): decode adds the difference from the
        level back (absmax levels are code - (2**(bits-1) - 1): one query sum per group)."""
        return 2 ** (self.scheme.codebook.bits - 1)

    @property
    def lut_words(self) -> int:
        """int32 words of the fp16 codebook the PTX lookups read (low bytes, then high bytes, four entries a word);
        lut1's two are its entries themselves, each in both halves (lut_expr). None where the helper
        gathers its entries (lut_gather)."""
        if self.fast_unpack == "lut1":
            return 2
        return self.levels // 2 if self.lloyd_max and not self.lut_gather else 0

    @property
    def lut_gather(self) -> bool:
        """The plane helper reads each index's entry from `tables["<side>_entries"]` (the codebook in fp16), copied
        into shared memory once a program (planes.to_shared_source): one prmt and one load a code up to 7 bits,
        instead of prmt over lookup words: prmt picks among 8 bytes, so an index of b bits takes 2**(b - 2) prmt and a
        select tree over them, more instructions than the loads from GATHER_BITS on."""
        return self.plane_unpack and self.lloyd_max and self.level_bits >= GATHER_BITS

    @property
    def lookup_loads(self) -> tuple[tuple[str, str], ...]:
        """What decode loads once per program for this side's PTX lookups, as (name, expression): the lookup words,
        or the entries' address for lut_gather."""
        if self.lut_gather:
            return ((f"{self.name}_entries", f"_{self.name}_entries_to_shared({self.name}_entries_ptr)"),)
        return tuple((f"{self.name}_lut_{i}", self.lut_expr(i)) for i in range(self.lut_words))

    @property
    def lookup_args(self) -> str:
        """The trailing arguments of this side's PTX helper calls: a sign residual's RMS per row in fp16 (in grid
        steps on a uniform grid, whose scale multiplies the dots afterwards), then lookup_loads' names."""
        rms = []
        if self.residual == "sign" and self.lloyd_max:
            rms = [f"{self.name}_residual_rms.to(tl.float16)[:, None]"]
        elif self.residual == "sign":
            scale = f"{self.name}_scale"
            rms = [f"tl.where({scale} > 0, {self.name}_residual_rms / tl.maximum({scale}, 1e-30), 0.0)"
                   ".to(tl.float16)[:, None]"]
        return "".join(f", {arg}" for arg in rms + [name for name, _ in self.lookup_loads])

    def lut_expr(self, i: int) -> str:
        """Decode's lookup word i: a load from `tables["<side>_lut"]`, or for lut1 entry i's fp16 bits in both
        halves, a number per head_dim that HEAD_DIM picks when the kernel is compiled. Triton moves a tile's change
        into tl.dot's operand layout onto the code bytes only past a pure helper whose operands are loads or
        constants, and a loaded word is neither (kernels/unpack.py.j2)."""
        if self.lut_table:
            return f"tl.load({self.name}_lut_ptr + {i})"
        words = [(d, self._fp16_entries(d)[i] * 0x10001) for d in self.head_dims]
        word = " else ".join([f"0x{w:08X} if HEAD_DIM == {d}" for d, w in words[:-1]] + [f"0x{words[-1][1]:08X}"])
        return f"tl.full([], {word}, tl.uint32)"  # a negative entry's word is past int32's range

    def _fp16_entries(self, head_dim: int) -> tuple[int, ...]:
        """The codebook's entries at head_dim as fp16 bits, rounded as `_lut_words` and the select trees round them
        (to float32, then to fp16)."""
        rounded = (struct.unpack("<f", struct.pack("<f", c))[0] for c in self.centroids(head_dim))
        return tuple(struct.unpack("<H", struct.pack("<e", c))[0] for c in rounded)

    @property
    def lut_table(self) -> bool:
        """Decode reads this side's lookup words from `tables["<side>_lut"]` (`_lut_words`); lut1's are numbers in
        the kernel (lut_expr)."""
        return bool(self.fast_unpack and self.lut_words) and self.fast_unpack != "lut1"

    @property
    def decode_tiles(self) -> str:
        """How decode turns this side's code bytes into its dots, the piece templates/kernels/decode/ holds for it
        (key_<name> for K's scores, value_<name> for V's accumulators): a dot per scale group ("group_dots"), K's
        per-channel scales folded into the query ("channel_dots"), V read as 32-bit words ("words"), two chunks a
        helper call ("pairs"), a PTX helper gathering each tile's bits from the planes ("planes") or unpacking a
        chunk's bytes ("bytes"), or the portable shifts, masks and select trees ("portable")."""
        if self.group_dots:
            return "group_dots"
        if self.channel_dots:
            return "channel_dots"
        if self.word_unpack:
            return "words"
        if self.pairs:
            return "pairs"
        if self.fast_unpack:
            return "planes" if self.plane_unpack else "bytes"
        return "portable"

    @property
    def word_unpack(self) -> str:
        """"u4" where decode reads V's u4 codes as 32-bit words: tl.dot wants V's operand in pairs along tokens, and
        a word of a token and one of the next make eight such pairs with four prmt. u8 and lut2 codes gain nothing
        from words, and a padded chunk's columns are no run of whole words."""
        whole = self.base == "value" and not self.split and not self.padded and not self.group_dots
        whole = whole and min(self.head_dims) >= 64
        return "u4" if whole and self.fast_unpack == "u4" else ""

    @property
    def flatten_fast(self) -> str:
        """The PTX kind flatten takes for an fp16 or bf16 output, "" for none: rotated sides in Hadamard blocks
        whose row factor follows the matrix, so the fp16 codebook entries go straight into the one fp16 dot."""
        fast = self.hadamard_blocks and self.factor_after_matrix and self.fast_unpack in ("lut2", "lut3s", "lut4")
        return self.fast_unpack if fast else ""

    @property
    def portable_reason(self) -> str:
        """Why decode reads this side's codes on the portable path (fast_unpack empty), in a few words; "" where a
        PTX helper unpacks them. `kvqc explain` says it, so a scheme author knows before a benchmark."""
        if self.fast_unpack:
            return ""
        kind = self.scheme.codebook.kind
        if self.per_channel and not self.channel_dots:
            if self.base == "value":
                return "per-channel scales on values"
            return "per-channel scales shared by fewer than 16 tokens"
        if self.group_size:
            if self.split:
                return "scales per group of channels in a channel split"
            return "scales per group of channels on fp8 codes" if kind == "fp8" else "scale groups under 16 columns"
        if self.qjl:
            return "a QJL residual on V"
        return HARDWARE_CONVERTED  # fp8: every other whole side has a PTX helper

    @property
    def without_fast_decode(self) -> bool:
        """Decode reads this side on the portable path and no hardware conversion stands in for a PTX helper: the
        side `kvqc build` notes, so that a scheme author hears it before a benchmark (fp8 codes, which the hardware
        converts, reach the PTX formats' share of their floor)."""
        return self.portable_reason not in ("", HARDWARE_CONVERTED)

    def decode_path(self) -> str:
        """How decode reads this side, in words (`kvqc explain`)."""
        if self.fast_unpack:
            planes = ", bits gathered from each plane" if self.plane_unpack and len(self.planes) > 1 else ""
            planes += ", the QJL sign bit as a +-1 tile for the projected query's dot" if self.qjl else ""
            if self.lut_gather:
                planes += f", {self.levels} entries loaded from the codebook's copy in shared memory"
            how = f"PTX unpacking ({self.fast_unpack}{', 32-bit words' if self.word_unpack else ''}{planes}) on NVIDIA"
        else:
            how = f"portable unpacking (shift, mask and select trees: {self.portable_reason})"
        if self.channel_dots:
            scales = f"per-channel scales shared by {self.token_group} tokens, folded into the query"
        elif self.per_channel:
            where = "applied to the dots' columns" if self.token_group >= 16 else "applied to every element"
            scales = f"per-channel scales shared by {self.token_group} tokens, {where}"
        elif self.group_dots:
            applied = "the scores" if self.base == "key" else "the probabilities"
            scales = f"scales per group of {self.group_size} channels, one dot per group, applied to {applied}"
        elif self.group_size:
            scales = f"scales per group of {self.group_size} channels, loaded per chunk and applied to every element"
        elif self.row_factor:
            scales = f"one {self.row_factor} per token, applied to the scores" if self.base == "key" else \
                f"one {self.row_factor} per token, applied to the probabilities"
        else:
            scales = "no scale"
        return f"{how}; {scales}"

    def signs(self, head_dim: int) -> tuple[int, ...] | None:
        r = self.scheme.rotation
        return rotation.sign_vector(self.part_dim(head_dim), r.seed) if r.kind == "hadamard" and r.signs else None

    def centroids_std(self, head_dim: int) -> tuple[float, ...] | None:
        """Lloyd-Max centroids in N(0,1) units; the unit vector's coordinates are these over sqrt(d)."""
        cb = self.scheme.codebook
        if cb.kind != "lloyd_max":
            return None
        if cb.centroids is not None:
            return cb.centroids
        from kvqc.numerics import codebooks  # the solver runs at build time only

        d = self.part_dim(head_dim)
        return codebooks.lloyd_max(cb.bits, cb.law, d if cb.law == "sphere" else None).centroids

    @property
    def symmetric_codebook(self) -> bool:
        """A Lloyd-Max codebook whose centroids are their own negatives (the solver's always are; a scheme's own
        list may not be) at every head_dim: fill then searches |u| among the positive boundaries alone."""
        tables = [self.centroids_std(d) for d in self.head_dims]
        return all(c is not None and len(c) >= 2 and all(a == -b for a, b in zip(c, reversed(c))) for c in tables)

    def centroids(self, head_dim: int) -> tuple[float, ...] | None:
        std = self.centroids_std(head_dim)
        return None if std is None else tuple(c / math.sqrt(self.part_dim(head_dim)) for c in std)

    # What the codecs (pieces/codecs/) need decided: they read these and never work them out themselves.
    @property
    def codec(self) -> str:
        """The codec that quantizes and dequantizes this side's codebook (pieces/codecs.CODECS): its kind."""
        return self.scheme.codebook.kind

    @property
    def symmetric(self) -> bool:
        """Fill finds a scalar Lloyd-Max codebook's cell from |value| among the positive boundaries, the sign picking
        the half: its centroids are their own negatives (symmetric_codebook)."""
        return self.scalar_codebook and self.symmetric_codebook

    @property
    def half(self) -> int:
        """Levels on each side of the codebook's middle: a symmetric search's first boundary and centroid."""
        return 2 ** (self.level_bits - 1)

    @property
    def with_centroid(self) -> bool:
        """Fill carries each code's centroid: a residual is taken from it, and the unbiased scale's <u, u_hat>."""
        return self.residual != "none" or self.unbiased

    @property
    def signed(self) -> bool:
        """The carried centroid has the value's sign. The unbiased scale alone reads unit * centroid, which is
        |unit| * |centroid| in a symmetric codebook, so there the magnitude is enough."""
        return self.residual != "none" or not self.unbiased

    @property
    def centroid_magnitude(self) -> bool:
        """Fill's carried centroid is the magnitude alone (a symmetric search that needs no sign)."""
        return self.symmetric and not self.signed

    @property
    def cell_search(self) -> str:
        """How fill finds a value's Lloyd-Max cell, "" for other codebooks: in a symmetric codebook "sign" (1 bit:
        the value's sign), "scan" (|value| against each positive boundary) or "bisect" (a binary search, where a
        centroid is carried over 8 levels: on an H100, turbo_eden_k4v2's fill at 42% of copy bandwidth against the
        scan's 36%; without a centroid (turbo_k4mse_v2 50% against 52.5%) or over 4 levels (turbo_k4v2, 10% more
        instructions) the scan is faster); otherwise "compare" (count the boundaries below, scalars) or "gather" (a
        binary search over the table, over 16 levels). The binary search stays for turbo_eden_k4v2 though the scan's
        PTX helper carrying the centroid (kernels/cell.py.j2) filled it 1.15-1.18x faster than the search for fp16
        and bf16 rows at head_dim 128 (under a 168-register cap, the same codes): it took 1.2x as long for fp32 rows
        there, and 1.03-1.64x at head_dim 256, where it spills."""
        if not self.lloyd_max:
            return ""
        if self.symmetric:
            if self.half == 1:
                return "sign"
            return "scan" if self.half <= 4 or not self.with_centroid else "bisect"
        return "compare" if self.scalar_codebook else "gather"

    @property
    def fill_boundaries(self) -> tuple[int, ...]:
        """The boundaries fill loads into scalars `<side>_b<i>`: the positive ones for a symmetric search."""
        if not self.scalar_codebook:
            return ()
        return tuple(range(self.half if self.symmetric else 0, self.levels - 1))

    @property
    def fill_centroids(self) -> tuple[int, ...]:
        """The centroids fill loads into scalars `<side>_c<i>`, where it carries them."""
        if not (self.scalar_codebook and self.with_centroid):
            return ()
        return tuple(range(self.half if self.symmetric else 0, self.levels))

    @property
    def centroid_scalars(self) -> tuple[int, ...]:
        """The centroids flatten and decode load into scalars `<side>_c<i>` for their select trees."""
        return tuple(range(self.levels)) if self.scalar_codebook else ()

    @property
    def centroid_names(self) -> str:
        """Those scalars as the arguments of the module's `_codebook_<levels>` select tree."""
        return ", ".join(f"{self.name}_c{i}" for i in self.centroid_scalars)

    @property
    def grid_levels(self) -> tuple[int, int]:
        """The lowest and highest level of a uniform grid: 0 .. levels - 1 above `zero` (minmax), -top .. top around
        zero (absmax)."""
        return (0, self.levels - 1) if self.scale_kind == "minmax" else (-self.level_top, self.level_top)

    @property
    def grid_offset(self) -> int:
        """What a uniform grid's code adds to its level (codes are unsigned): top for a symmetric grid, else 0."""
        return 0 if self.scale_kind == "minmax" else self.level_top

    def shifted(self, code: str) -> str:
        """A uniform grid's level of `code`: the code less the grid's offset."""
        return f"({code} - {self.grid_offset})" if self.grid_offset else code

    @property
    def index_bits(self) -> str:
        """The codebook index of `code`: its bits below any residual bit."""
        return f"(code & {self.levels - 1})" if self.residual != "none" else "code"

    def scaled(self, x: str, at: str) -> str:
        """`x` over its scale, as a uniform grid's code takes it: less `zero` (minmax), times `inverse`; both
        indexed by `at` to meet x's shape."""
        return (f"({x} - zero{at})" if self.scale_kind == "minmax" else x) + f" * inverse{at}"

    def grid_residual(self, c: int) -> str:
        """What a per-row uniform grid leaves of chunk c: `x_<c>` less its codes' level times the scale (plus the
        zero)."""
        zero = " + zero[:, None]" if self.scale_kind == "minmax" else ""
        return f"x_{c} - ({self.shifted(f'code_{c}')}.to(tl.float32) * scale[:, None]{zero})"

    @property
    def group_variants(self) -> tuple[int, ...]:
        """The spans fill's and flatten's scale groups take over the scheme's head_dims, one constexpr branch each:
        1 (groups inside chunks) where some head_dim has it, then the spans above 1 (`spans`)."""
        return ((1,) if self.groups_inside else ()) + self.spans

    def chunk_groups(self, c: int) -> str:
        """The scale groups of chunk c where they lie inside it (<SIDE>_GROUPS to a chunk; a padded chunk's real
        columns hold fewer than its padded width does)."""
        name, groups = self.name.upper(), f"tl.arange(0, {self.name.upper()}_GROUPS)"
        if not c:
            return groups
        per_chunk = f"({name}_CHUNK // {self.group_size})" if self.padded else f"{name}_GROUPS"
        return f"{c} * {per_chunk} + {groups}"

    def real(self, fill: str) -> str:
        """`x_%d` (a chunk, its index left to fill in) with any padding columns replaced by `fill`, to keep them out of
        a minimum or a maximum."""
        return f"tl.where({self.name}_in[None, :], x_%d, float('{fill}'))" if self.padded else "x_%d"

    @property
    def probes(self) -> int:
        """Compares of the symmetric binary search ("bisect"): one per bit of |value|'s level among `half`."""
        return (self.half - 1).bit_length()

    def probe_threshold(self, k: int) -> str:
        """The boundary probe k compares |value| with, chosen by the probes before it (a tree of selects)."""
        step = self.half // 2 ** (k + 1)
        return _select_tree(f"{self.name}_b", range(k), range(self.half - 1 + step, 2 * self.half - 1, 2 * step))

    @property
    def probe_centroid(self) -> str:
        """The carried centroid's magnitude after the symmetric binary search, chosen by every probe."""
        return _select_tree(f"{self.name}_c", range(self.probes), range(self.half, 2 * self.half))

    @property
    def group_branches(self) -> tuple[tuple[int, str], ...]:
        """Each of group_variants with the line that opens its constexpr branch in fill (codecs.scales.spanning_groups):
        the test on <SIDE>_GROUPS or <SIDE>_SPAN, and the head_dims that take it."""
        name, out = self.name.upper(), []
        for i, span in enumerate(self.group_variants):
            test = f"{name}_GROUPS > 0" if span == 1 else f"{name}_SPAN == {span}"
            what = "groups inside chunks" if span == 1 else f"a group spans {span} chunks"
            dims = ", ".join(str(d) for d in self.head_dims_with_span(span))
            out.append((span, f"{'elif' if i else 'if'} {test}:  # head_dim {dims}: {what}"))
        return tuple(out)

    @property
    def fast_cell(self) -> str | None:
        """Fill's cell helper (kernels/cell.py.j2: PTX or Triton compares behind FAST_CELL) where the symmetric
        search scans, by what it returns beside the code: "code" (nothing), "sign" (the residual, its sign already in
        the code), "signed" (the centroid, with the value's sign) or "magnitude" (the centroid's magnitude). None: the
        search is inline Triton (a sign test, a binary search or a sorted one)."""
        if self.cell_search != "scan":
            return None
        if not self.with_centroid:
            return "code"
        if self.residual == "sign" and not self.unbiased:
            return "sign"
        return "signed" if self.signed else "magnitude"

    @property
    def cell_scalars(self) -> str:
        """The boundaries and centroids fill passes its cell helper after the value, each after a comma."""
        names = [f"{self.name}_b{i}" for i in self.fill_boundaries] + [f"{self.name}_c{i}" for i in self.fill_centroids]
        return "".join(f", {name}" for name in names)

    @property
    def cell_helper(self) -> str | None:
        """The name of fill's cell helper (fast_cell), None without one."""
        kind = self.fast_cell
        if kind is None:
            return None
        suffix = {"code": "", "sign": f"_sign{self.level_bits}"}.get(kind, f"_{kind}")
        return f"_symmetric_cell_{self.half}{suffix}"

    # What the API templates (templates/api/) substitute for this part: decided here, placed there.
    @property
    def tensor_doc(self) -> str:
        """KVCache's docstring lines for this part's codes and metadata tensors."""
        width = ("its channels" if self.part else "the other channels") if self.split else "head_dim"
        planes = ", ".join(str(plane.width) for plane in self.planes)
        n, fields, group = len(self.metadata), ", ".join(self.metadata), self.group_size
        meta = f"{n}: {fields}"
        code_bytes = _bytes_expr(width, self.code_bits).replace("//", "/")
        if group:
            per_group = f"{n} * " if n > 1 else ""
            channels = "channels" if self.split else "head_dim"
            meta = f"{per_group}{channels} / {group}: {fields} per group of {group} channels"
        return (
            f"    {self.name}_codes: uint8, last dim {code_bytes} (bit planes {planes}, "
            f"{self.packing} packing)\n"
            f"    {self.name}_meta:  model dtype, last dim {meta}"
        )

    @property
    def outlier_doc(self) -> str:
        """How an outlier part's channels are chosen, for calibrate's docstring."""
        if self.outlier_select == "fixed":
            # Each line within 120 columns after the docstring's "    Value: " (a long list takes several).
            text = f"fixed by the scheme (channels {list(self.outlier_channels)}); calibrate leaves them."
            return "\n    ".join(textwrap.wrap(text, 120 - len("    Value: ")))
        score = "variance" if self.outlier_select == "variance" else "mean square"
        return (f"the {self.base.upper()}_OUTLIERS * head_dim channels of largest {score} over the tokens "
                "(ties: the lower channel).")

    @property
    def constexprs(self) -> tuple[tuple[str, str], ...]:
        """A split part's constexprs and their values in `_part_constexprs` (from `dims`, _part_dims(head_dim)):
        its width, its first channel in the permuted head and, padded, its power-of-two width; () for a side that
        is not split."""
        if not self.split:
            return ()
        name = self.name.upper()
        offset = "0" if self.part else f'dims["{self.base}_outlier"]'
        out = [(f"{name}_DIM", f'dims["{self.name}"]'), (f"{name}_OFFSET", offset)]
        if self.padded:
            out.append((f"{name}_PAD", f'_pow2(dims["{self.name}"])'))
        return tuple(out)

@dataclass(frozen=True)
class Ring:
    """A window scheme's ring row as the API names and documents it: a sequence's first `sinks` tokens, then a
    ring of its last `window`. The templates place these expressions and sentences; the sinks choose them."""

    window: int
    sinks: int
    groups: tuple[tuple[str, int], ...] = ()  # (side, tokens) of each per-channel side, quantized from the ring

    @property
    def slots(self) -> str:
        """A row's slots as an expression of the module's constants."""
        return "SINKS + WINDOW" if self.sinks else "WINDOW"

    @property
    def slots_factor(self) -> str:
        """`slots` as a factor of a product."""
        return f"({self.slots})" if self.sinks else self.slots

    @property
    def cache_doc(self) -> str:
        """KVCache's docstring lines for key_window and value_window."""
        if self.sinks:
            return (
                "    key_window, value_window: model dtype [max_seqs, SINKS + WINDOW, num_kv_heads, head_dim]: "
                "each sequence's first\n"
                f"        SINKS = {self.sinks} tokens (slot position) and last WINDOW = {self.window} "
                "(slot SINKS + position % WINDOW) as\n"
                "        given, in the row its window_index names"
            )
        return (
            "    key_window, value_window: model dtype [max_seqs, WINDOW, num_kv_heads, head_dim]: each sequence's "
            "last\n"
            f"        WINDOW = {self.window} tokens as given (slot position % WINDOW), in the row its window_index "
            "names"
        )

    @property
    def bytes_doc(self) -> str:
        """What window_bytes counts, inside its docstring's parentheses."""
        if self.sinks:
            return "its first SINKS and last WINDOW tokens' K and V, model dtype"
        return "its last WINDOW tokens of K and V in the model dtype"

    @property
    def fill_doc(self) -> str:
        """The end of fill's docstring sentence on what the ring holds, and when each per-channel side's tokens
        are quantized."""
        out = ", the row's first SINKS\n    slots the sequence's positions 0..SINKS-1." if self.sinks else "."
        for side, tokens in self.groups:
            out += (f"\n    {side.capitalize()} is quantized {tokens} tokens at a time, when the token at a position"
                    f"\n    p with p % {tokens} == {tokens - 1} arrives.")
        return out

    @property
    def flatten_doc(self) -> str:
        """flatten's docstring lines for window_index."""
        if self.sinks:
            return (
                "    window_index [batch] (required): each sequence's ring row; its first SINKS and last WINDOW "
                "tokens come from\n"
                "    there, as given."
            )
        return ("    window_index [batch] (required): each sequence's ring row; its last WINDOW tokens come from "
                "there, as given.")

    @property
    def decode_doc(self) -> str:
        """decode's docstring lines for window_index."""
        if self.sinks:
            return (
                "    window_index [batch] (required): each sequence's ring row, whose first SINKS and last WINDOW "
                "tokens are attended\n"
                "    unquantized;"
            )
        return ("    window_index [batch] (required): each sequence's ring row, whose last WINDOW tokens are attended "
                "unquantized;")


@dataclass(frozen=True)
class Layout:
    scheme: Scheme
    key: SideLayout
    value: SideLayout

    key_outlier: SideLayout | None = None
    value_outlier: SideLayout | None = None

    @property
    def name(self) -> str:
        return self.scheme.name

    @property
    def content_hash(self) -> str:
        return self.scheme.content_hash

    @property
    def head_dims(self) -> tuple[int, ...]:
        return self.scheme.head_dims

    @property
    def padded(self) -> bool:
        """Some head_dim is not a power of two: kernels take HEAD_PAD."""
        return any(d & (d - 1) for d in self.scheme.head_dims)

    @property
    def paley(self) -> bool:
        """Some side (or part) has a width that is not a power of two: the module carries Paley's matrices."""
        return any(s.padded for s in self.sides)

    @property
    def split(self) -> bool:
        """Some side is split into outlier channels and the rest (scheme.outliers)."""
        return any(s.split for s in self.sides)

    def parts(self, base: str) -> tuple[SideLayout, ...]:
        """The parts of one side, outliers first (the order of the permuted head)."""
        main = getattr(self, base)
        outlier = getattr(self, f"{base}_outlier")
        return (outlier, main) if outlier else (main,)

    @property
    def key_parts(self) -> tuple[SideLayout, ...]:
        return self.parts("key")

    @property
    def value_parts(self) -> tuple[SideLayout, ...]:
        return self.parts("value")

    @property
    def window(self) -> int:
        """Recent tokens per sequence also kept in the model dtype (0: none)."""
        return self.scheme.window

    @property
    def sinks(self) -> int:
        """Each sequence's first tokens also kept in the model dtype, in the ring's rows before the ring (0: none)."""
        return self.scheme.sinks

    @property
    def paging(self) -> tuple[str, ...]:
        """The paging tensors decode's steps pass on, in the module's order (a window scheme adds its ring rows)."""
        return ("block_tables", "seq_lens", "window_index") if self.window else ("block_tables", "seq_lens")

    @property
    def decode_splits(self) -> str:
        """The split programs the quantized-cache kernels take of num_splits (the window kernel takes the last): their
        grid, and the share of a sequence each takes."""
        return "num_splits - 1" if self.window else "num_splits"

    @property
    def window_slots(self) -> int:
        """Exact tokens a sequence's row holds: its sinks, then the ring of its last `window`."""
        return self.scheme.sinks + self.scheme.window

    @property
    def centered(self) -> bool:
        """Keys are quantized minus their KV head's mean, which `calibrate` sets (`key_mean`)."""
        return self.key.centered

    @property
    def per_channel(self) -> tuple[SideLayout, ...]:
        """The sides whose scales are per channel: fill quantizes them a whole token group at a time."""
        return tuple(s for s in self.sides if s.per_channel)

    @property
    def sides(self) -> tuple[SideLayout, ...]:
        """Every part of K, then of V: one set of cache tensors each."""
        return self.key_parts + self.value_parts

    @property
    def any_fast_cell(self) -> bool:
        """Some side's fill calls a cell helper, which branches on the fill kernel's FAST_CELL."""
        return any(side.fast_cell for side in self.sides)

    @property
    def jit_helpers(self) -> tuple[str, ...]:
        """The Triton helpers (runtime/helpers.py) the module's kernels call."""
        needed = {"_mm": True, "_halves": self.splits_halves, "_halves_dot": self.rotates_in_blocks,
                  "_walsh_hadamard": self.kernel_rotates, "_project_qjl": self.projects_qjl,
                  "_project_halves": self.builds_qjl, "_chunk_bits": self.projects_wide,
                  "_expand_signs": self.builds_qjl, "_concat": self.joins_chunks,
                  "_fp8_code": bool(self.key.fp8 or self.value.fp8)}
        return tuple(name for name, wanted in needed.items() if wanted)

    @property
    def splits_halves(self) -> bool:
        """Some kernel splits float32 tiles into fp16 halves (runtime/helpers.py's `_halves`): fill or flatten rotates
        in Hadamard blocks or by a dense matrix, or projects a QJL residual."""
        return self.rotates_in_blocks or self.dense_matrix or self.builds_qjl or self.maps_by_matrix

    @property
    def rotates_in_blocks(self) -> bool:
        """Fill or flatten rotates some side in Hadamard blocks (pieces/rotate.py), by runtime/helpers.py's
        `_halves_dot`."""
        return any(side.hadamard_blocks for side in self.sides)

    @property
    def codebook_sizes(self) -> tuple[int, ...]:
        """The entry counts of the scalar codebooks some side selects from (`_codebook_<levels>`, pieces/selects.py)."""
        return tuple(sorted({side.levels for side in self.sides if side.scalar_codebook}))

    @property
    def cell_helpers(self) -> tuple[SideLayout, ...]:
        """One side for each distinct cell helper, in side order: kernels/cell.py.j2 defines each once."""
        out: dict[str, SideLayout] = {}
        for side in self.sides:
            if side.cell_helper and side.cell_helper not in out:
                out[side.cell_helper] = side
        return tuple(out.values())

    @property
    def fill_loops(self) -> bool:
        """Fill programs loop over several token tiles, so Triton prefetches the next tile's rows while this one is
        rotated and quantized: where some side rotates in Hadamard blocks. The elementwise fills and the dense
        matrix ones keep one tile a program, which is as fast for them. A QJL side's S is loaded before the loop
        where it fits (SideLayout.qjl_wide_dims), else per tile without pipelining (loop_stages)."""
        return self.rotates_in_blocks

    @property
    def rotates_query(self) -> bool:
        """The split kernels take the query as given and rotate it into position order, each program its own rows
        (kernels/fused.j2; a split layout maps each part in torch)."""
        return not self.split and self.key.kernel_rotates

    @property
    def fuses_query_rotation(self) -> bool:
        """The split kernels can rotate the query themselves (their ROTATE constexpr; `_ROTATE_IN_DECODE` says
        whether they do): rotates_query, except where K's group_dots read the query one unit of columns at a time
        from `_rotate_query_kernel`'s rows, or where that kernel projects it for QJL (projects_query)."""
        return self.rotates_query and not self.key.group_dots and not self.projects_query

    @property
    def projects_query(self) -> bool:
        """`_rotate_query_kernel` also makes K's QJL projection of the rotated query (S q, the operand of the sign
        tiles' dot), in the same launch: a split program would redo the d x d product for its few rows (S is
        64 KiB of float32 at head_dim 128), and torch would take a launch of its own and keep a plan from
        replaying (decode_replays)."""
        return self.rotates_query and self.key.qjl

    # Of an SM's 227 KiB of shared memory (sm_90), what a tile loop's pipeline stages may give to copies of the
    # matrices it loads, the rest left to the loop's own buffers.
    PIPELINE_SHARED = 200 * 1024

    @property
    def loop_stages(self) -> dict[int, int]:
        """Pipeline stages of fill's tile loop, per head_dim where Triton's own (3, or a looping fill's 2) would not
        fit (flatten's takes one stage): the pipeliner gives every stage past the first a copy of each load in the
        loop, and the matrices are loaded there a block at a time, though they are the same on every tile. A dense
        rotation is fp16 (+-1 entries), as wide as the part's positions; where a QJL side loads S's rows per tile,
        one stage, and where it gathers its cells and centroids from the tables (over 16 entries): S's product then
        depends on those loads, and Triton 3.6's pipeliner, scheduling the loads a stage early, fails to compile the
        tile's first dots ("doesn't know how to predicate" them). Where the tiles of bf16 and fp32 inputs pass an SM,
        `fill_stages_split_inputs` in templates/decode_tuning.json says so per scheme."""
        stages = {}
        for d in self.head_dims if self.fill_loops else ():
            if any(side.qjl and (d not in side.qjl_wide_dims or side.gathers_cells) for side in self.sides):
                stages[d] = 1  # S's rows would be copied by each stage, or the gathers would be pipelined
                continue
            copy = 0
            for part in self.sides:
                width = part.padded_width(d)
                copy += 2 * part.dense_matrix * width * width
            fit = 1 + self.PIPELINE_SHARED // copy if copy else 3
            if fit < 3:
                stages[d] = fit
        return stages

    @property
    def fill_single_tiles(self) -> bool:
        """Some head_dim's fill loop takes one stage (loop_stages), where a program takes one tile: a loop that
        prefetches nothing only makes fewer, longer programs (turbo_qjl_k3v3 at head_dim 256, H200: 2.97 ms for
        8 x 8192 tokens on one stage against 3.24 looping, on 4 warps)."""
        return 1 in self.loop_stages.values()

    @property
    def joins_chunks(self) -> bool:
        """Some side's fill puts its chunks side by side (`_concat`): a QJL residual, projected a row at a time."""
        return any(side.qjl and side.chunks > 1 for side in self.sides)

    @property
    def projects_qjl(self) -> bool:
        """Some kernel makes K's QJL projection of the query (`_project_qjl`): `_rotate_query_kernel`
        (projects_query) or a channel split's `_query_parts_kernel` for a QJL key part."""
        return self.projects_query or (self.split and any(part.qjl for part in self.key_parts))

    @property
    def rotates_output(self) -> bool:
        """The merge (`_merge_splits` or `_decode_reduce_kernel`) rotates the merged output back (a split layout maps
        each part in torch)."""
        return not self.split and self.value.kernel_rotates

    @property
    def kernel_rotates(self) -> bool:
        """Decode rotates in Triton: the module carries `_walsh_hadamard`."""
        return self.rotates_query or self.rotates_output

    @property
    def has_tables(self) -> bool:
        """The module builds constant tensors (`_tables`): some side has a matrix, a codebook, a QJL projection or
        padded positions."""
        return any(side.tables or side.padded for side in self.sides)

    @property
    def fill_reads_tables(self) -> bool:
        """fill passes some of `_tables` to its kernel."""
        return any(p.table for p in self.fill_params)

    @property
    def flatten_reads_tables(self) -> bool:
        """flatten passes some of `_tables` to its kernel."""
        return any(p.table for p in self.flatten_params)

    @property
    def builds_hadamard(self) -> bool:
        """`_tables` builds a Hadamard matrix (`_hadamard`): some side rotates by a matrix."""
        return any(side.uses_matrix and side.rotated for side in self.sides)

    @property
    def builds_paley(self) -> bool:
        """`_hadamard` takes Paley's matrices (`_PALEY`): it is built for a width that is not a power of two."""
        return self.paley and self.builds_hadamard

    @property
    def projects_wide(self) -> bool:
        """Some side's fill projects its QJL residual in one product for the whole row at some head_dim
        (SideLayout.qjl_wide_dims), whose sign bits `_chunk_bits` gathers per chunk."""
        return any(side.qjl and side.qjl_wide_dims for side in self.sides)

    @property
    def builds_qjl(self) -> bool:
        """The module generates a QJL projection (the seeded Gaussian generator): some side has a QJL residual."""
        return any(side.qjl for side in self.sides)

    @property
    def builds_lut_words(self) -> bool:
        """The module packs Lloyd-Max codebooks into decode's PTX lookup words (`_lut_words`)."""
        return any(side.lut_table for side in self.sides)

    @property
    def builds_interleaved_order(self) -> bool:
        """`_tables` orders a matrix or projection by interleaved positions (`_interleaved_order`)."""
        return any(side.permuted and (side.uses_matrix or side.qjl) for side in self.sides)

    @property
    def flatten_rotated(self) -> bool:
        """flatten can return K and V in the rotated basis (`rotated=True`: position order, each side's
        `rotation(side)` applied), skipping its way back: every side rotates in Hadamard blocks, with no window (the
        ring holds input-basis tokens) and no channel split (parts take their own rotations)."""
        return not self.window and not self.split and all(side.hadamard_blocks for side in self.sides)

    @property
    def gluon_decode(self) -> str:
        """The K kind ("lut3s" or "lut4") of a layout whose decode has a Gluon kernel too (kernels/decode_gluon.py.j2),
        "" otherwise: whole sides (not split or padded), K and V scaled by their norm alone, V lut2, and head_dim
        128 among the scheme's. With a window it
        takes the quantized splits and _window_decode_kernel the ring, as beside _decode_kernel; it does not skip
        attention sinks, so a scheme with sinks has none."""
        key, value = self.key, self.value
        whole = not self.split and not self.padded and 128 in key.head_dims
        norms = key.row_factor == value.row_factor == "norm" and not key.row_shift and not value.row_shift
        fits = key.fast_unpack in ("lut3s", "lut4") and value.fast_unpack == "lut2"
        return key.fast_unpack if whole and norms and fits and not self.sinks else ""

    @property
    def kernel_files(self) -> tuple[str, ...]:
        """The kernel templates a module carries, in order: fill, flatten, decode and the merge always; the dense
        maps of a padded head, a channel split's part kernels, the Gluon decode and a window's kernels where the
        layout has them."""
        files = ["kernels/fill.py.j2", "kernels/flatten.py.j2", "kernels/decode.py.j2", "kernels/merge.py.j2"]
        for wanted, name in ((self.maps_by_matrix, "maps"), (self.split, "parts"), (self.gluon_decode, "decode_gluon"),
                             (self.window, "window")):
            if wanted:
                files.append(f"kernels/{name}.py.j2")
        return tuple(files)

    @property
    def maps_by_matrix(self) -> bool:
        """Decode maps a padded head through dense matrices in Triton (`_map_rows_kernel`):
        the query into position order before the splits, the merged output back to the input basis after them,
        where both sides are moved by a matrix and no QJL share of V has to be added first."""
        return (self.padded and not self.split and self.key.uses_matrix and self.value.uses_matrix
                and not self.value.qjl)

    @property
    def query_map(self) -> str:
        """How decode's wrapper brings the query into the split kernels' position order, the piece it includes
        (templates/api/query/<name>.py.j2; "" where the kernels read it as given or rotate it themselves with
        `_ROTATE_IN_DECODE` on): a padded head by `_map_rows_kernel` ("map_kernel"), by its rotation in torch
        ("pad_matrix") or by scattering it to its positions ("pad_positions"); `_rotate_query_kernel`, where the split
        kernels cannot rotate it (K's scale groups, K's QJL projection: "rotate_apart") or `_ROTATE_IN_DECODE` is
        off ("rotate"); a matrix in torch ("matrix").
        A channel split's parts move in `_query_parts_kernel` instead."""
        if self.split:
            return ""
        if self.padded:
            return "map_kernel" if self.maps_by_matrix else "pad_matrix" if self.key.uses_matrix else "pad_positions"
        if self.fuses_query_rotation:
            return "rotate"
        if self.rotates_query:
            return "rotate_apart"
        return "matrix" if self.key.uses_matrix else ""

    @property
    def output_map(self) -> str:
        """How decode's wrapper turns the merged splits into the output (templates/api/output/<name>.py.j2): the merge
        writes it, rotated back ("rotate_back") or as it is ("as_merged"); or the wrapper maps it from position order
        after the merge, in `_map_rows_kernel` ("map_kernel"), by its rotation in torch ("matrix", "pad_matrix" for a
        padded head), by gathering its positions ("positions"), or only adds V's QJL share ("qjl"). A channel split's
        parts merge in `_merge_parts_kernel` instead."""
        if self.split:
            return ""
        if self.rotates_output:
            return "rotate_back"
        if not self.value.wrapper_maps:
            return "as_merged"
        if self.maps_by_matrix:
            return "map_kernel"
        if self.value.uses_matrix:
            return "pad_matrix" if self.padded else "matrix"
        return "positions" if self.padded else "qjl"

    @property
    def merged_into(self) -> str:
        """Where a merging kernel (decode_merge) writes the merged output (templates/api/merged/<name>.py.j2): the
        caller's rows or a new tensor in the query's dtype, where it is the output ("caller"); the plan's scratch for
        `_map_rows_kernel` ("scratch"); a new float32 tensor for the wrapper to map ("float32")."""
        if self.output_map in ("rotate_back", "as_merged"):
            return "caller"
        return "scratch" if self.output_map == "map_kernel" else "float32"

    @property
    def decode_replays(self) -> bool:
        """A decode call is kernel launches alone, with no torch op on the query, the scratch or the output in
        between: so a plan takes one layer's launches and replays them for the next layers with their own tensors
        (`_Replay`). A channel split's are (kernels/parts.py.j2 maps its parts; a replay first sees that the
        cache's channel orders are set). Not where the wrapper maps a side in torch (a dense matrix, padding, QJL
        that no kernel maps)
        or moves the window's output into the rotated basis (a rotated side the kernels do not rotate). A padded
        head mapped by dense matrices (maps_by_matrix) keeps its mapped vectors in the plan's scratch."""
        mapped = self.maps_by_matrix and not self.key.qjl  # a padded head's maps in Triton, without S q in torch
        in_kernels = self.split or mapped or not self.key.wrapper_maps and not self.value.wrapper_maps
        return in_kernels and not (self.window and self.value.uses_matrix and not self.rotates_output)

    # The most partial rows (query heads per KV head x splits) that decode_merge's kernel merges for its (sequence,
    # KV head), a few thousand values a round; past it _decode_reduce_kernel spreads them over a program per query
    # head (DecodePlan.merge). H100, CUDA-graph decode, 32 query / 8 KV heads, 8k, fused against the merge kernel:
    # a split program's merge, int4_token 64 rows (batch 8) 0.0385 / 0.0388 ms, 128 rows (batch 4) 0.0236 / 0.0231,
    # 512 (batch 1) 0.0194 / 0.0117; the window kernel's (4 warps), 68 rows (batch 8) as fast as the merge kernel.
    MERGE_ROWS = {"split": 64, "window": 128}

    @property
    def decode_merge(self) -> str:
        """Which kernel that decode launches anyway merges the splits' partials, where the plan's split count keeps
        that merge short (DecodePlan.merge says per batch, `kvqc explain` says the rule): "split", the last of each
        (sequence, KV head)'s split programs to finish, which a ticket (an atomic count per pair) names; "window",
        `_window_decode_kernel`, which waits for the quantized splits before it merges. "" where
        `_decode_reduce_kernel` always merges: a channel split or a QJL value (several partial outputs a row), or a
        window whose output the wrapper maps in torch before the merge."""
        if self.split or self.value.qjl:
            return ""
        if self.window:
            return "" if self.padded or (self.value.uses_matrix and not self.rotates_output) else "window"
        return "split"

    @property
    def decode_unpacks(self) -> bool:
        """Some side's decode takes PTX unpacking on compiled CUDA with fp16 queries (FAST_UNPACK)."""
        return any(side.fast_unpack for side in self.sides)

    @property
    def unpack_helpers(self) -> tuple[str, ...]:
        """The PTX helpers (runtime/ptx.py) that unpack whole chunks of bytes, by kind (u8, u4, lut2, ...)."""
        return tuple(side.fast_unpack for side in self.sides
                     if side.fast_unpack and not side.plane_unpack and not side.word_unpack)

    @property
    def ptx_helpers(self) -> tuple[str, ...]:
        """The hand-written PTX helpers (runtime/ptx.py) decode and flatten call: whole chunks of bytes by kind, and V
        read as 32-bit words."""
        return tuple(dict.fromkeys([f"_unpack_{kind}" for kind in self.unpack_helpers]
                                   + [f"_unpack_{kind}_words" for kind in self.word_helpers]))

    @property
    def word_helpers(self) -> tuple[str, ...]:
        """The PTX helpers that unpack V read as 32-bit words, by kind."""
        return tuple(side.word_unpack for side in self.sides if side.word_unpack and not side.plane_unpack)

    @property
    def plane_helpers(self) -> tuple[tuple[str, bool, SideLayout], ...]:
        """The PTX helpers that gather codes from several bit planes: each (kind, in pairs of chunks, the side whose
        planes and codebook words it takes), once per kind and form."""
        by_kind = {side.fast_unpack: side for side in self.sides if side.plane_unpack}
        forms = dict.fromkeys((side.fast_unpack, side.pairs) for side in self.sides if side.plane_unpack)
        return tuple((kind, pairs, by_kind[kind]) for kind, pairs in forms)

    @property
    def unpacks_in_ptx(self) -> bool:
        """Some kernel takes FAST_UNPACK: the module says whether its PTX helpers run (`_FAST_UNPACK`)."""
        return self.decode_unpacks or self.flatten_unpacks

    @property
    def flatten_unpacks(self) -> bool:
        """Some side's flatten takes decode's PTX lookups for an fp16 or bf16 output (FAST_UNPACK)."""
        return any(side.flatten_fast for side in self.sides)

    @property
    def dense_matrix(self) -> bool:
        """Some side's fill and flatten take the d x d matrix IN_BLOCK columns at a time (an IN_BLOCK argument)."""
        return any(side.dense_matrix for side in self.sides)

    # What the kernel templates (templates/kernels/) list in their signatures: decided here, placed there.
    def bytes_per_token(self, head_dim: int, metadata_bytes: int = 2) -> int:
        """Cache bytes for one token and one KV head: K and V codes plus their metadata."""
        return sum(s.code_bytes(head_dim) + metadata_bytes * s.meta_width(head_dim) for s in self.sides)

    def compression_ratio(self, head_dim: int) -> float:
        return 2 * head_dim * 2 / self.bytes_per_token(head_dim)

    # What the API templates (templates/api/) substitute: decided here, placed there.
    @property
    def ring(self) -> Ring | None:
        """The ring rows of a window scheme, as the API names and documents them; None without a window."""
        groups = tuple((side.name, side.token_group) for side in self.per_channel)
        return Ring(self.window, self.sinks, groups) if self.window else None

    @property
    def fill_window_doc(self) -> str:
        """fill's docstring lines on positions and window_index: what a window scheme requires of them, or that this
        scheme reads neither."""
        if not self.window:
            return ("    positions and window_index serve schemes with a recent-token window; this one has none and "
                    "reads neither.")
        return (
            "    Required, since the last WINDOW tokens of each sequence are kept in a ring:\n"
            "    positions [num_tokens]: each token's position in its sequence (offset = position % block_size);\n"
            "    window_index [num_tokens]: its sequence's ring row, 0..max_seqs-1, the same for the sequence's whole "
            "life.\n"
            "    A sequence's tokens in one call must be consecutive and in position order, as engines lay out a "
            "batch, and\n"
            "    every token of a sequence must be filled: the ring holds the last WINDOW of those filled"
            + self.ring.fill_doc
        )

    @property
    def flatten_window_doc(self) -> str:
        """flatten's docstring lines on window_index (Ring.flatten_doc), or that this scheme does not read it."""
        if not self.window:
            return "    window_index serves schemes with a recent-token window; this one has none and does not read it."
        return self.ring.flatten_doc

    @property
    def split_bases(self) -> tuple[str, ...]:
        """The sides ("key", "value") whose channels are split into outliers and the rest."""
        return tuple(base for base in ("key", "value") if len(self.parts(base)) > 1)

    @property
    def outlier_parts(self) -> tuple[SideLayout, ...]:
        """The outlier part of each split side."""
        return tuple(side for side in self.sides if side.part)

    @property
    def calibrated_outliers(self) -> tuple[SideLayout, ...]:
        """The outlier parts whose channels calibrate() chooses per KV head (`_channel_order`)."""
        return tuple(side for side in self.outlier_parts if side.outlier_select != "fixed")

    @property
    def fixed_outliers(self) -> tuple[SideLayout, ...]:
        """The outlier parts whose channels the scheme fixes (`_fixed_order`, set by allocate_cache)."""
        return tuple(side for side in self.outlier_parts if side.outlier_select == "fixed")

    @property
    def part_constexprs(self) -> tuple[tuple[str, str], ...]:
        """Every split part's constexprs and their values, in kernel parameter order."""
        return tuple(pair for side in self.sides for pair in side.constexprs)

    @property
    def cache_fields(self) -> tuple[tuple[str, str], ...]:
        """KVCache's fields and their annotations (with a default where one has one), in declaration order."""
        tensor, optional = "torch.Tensor", '"torch.Tensor | None" = None'
        out = [("key_codes", tensor), ("key_meta", tensor), ("value_codes", tensor), ("value_meta", tensor),
               ("head_dim", "int"), ("layout", "str")]
        out += [(f"{side.name}_{what}", tensor) for side in self.outlier_parts for what in ("codes", "meta")]
        out += [(f"{side.base}_channels", optional) for side in self.outlier_parts]
        out += [("key_window", tensor), ("value_window", tensor)] if self.window else []
        out += [("key_mean", optional)] if self.centered else []
        return tuple(out)

    @property
    def tensors_doc(self) -> str:
        """KVCache's docstring lines for its tensors: each part's codes and metadata, the ring rows, the key mean,
        the channel orders."""
        out = [side.tensor_doc for side in self.sides] + ([self.ring.cache_doc] if self.ring else [])
        if self.centered:
            out.append(
                "    key_mean: float32 [num_kv_heads, head_dim], each KV head's mean key, which its keys are "
                "quantized against; None\n"
                "        until `calibrate` sets it"
            )
        for side in self.outlier_parts:
            chosen = "fixed by the scheme" if side.outlier_select == "fixed" else "None until `calibrate` chooses them"
            out.append(
                f"    {side.base}_channels: int64 [num_kv_heads, head_dim], each KV head's channel order: its "
                f"{side.base} outlier channels\n"
                f"        (the first {side.base.upper()}_OUTLIERS * head_dim), then the rest; {chosen}"
            )
        return "\n".join(out)

    @property
    def outliers_doc(self) -> str:
        """calibrate's docstring lines for a channel split: how each split side's outlier channels are chosen."""
        return "\n".join(f"    {side.base.capitalize()}: {side.outlier_doc}" for side in self.outlier_parts)

    @property
    def written(self) -> tuple[str, ...]:
        """The cache tensors the kernels write (`_WRITTEN`): each part's codes and metadata, and the ring rows."""
        names = [f"{side.name}_{what}" for side in self.sides for what in ("codes", "meta")]
        return tuple(names + (["key_window", "value_window"] if self.window else []))

    @property
    def channel_fields(self) -> tuple[str, ...]:
        """The cache's channel orders, one per split side (`_CHANNELS`)."""
        return tuple(f"{side.base}_channels" for side in self.outlier_parts)

    @property
    def token_fill(self) -> bool:
        """fill launches `_fill_kernel`: some side is quantized token by token (a per-channel side is quantized by
        its own group kernel once a group of tokens is complete)."""
        return len(self.per_channel) < 2

    def in_block(self, most: str) -> str:
        """IN_BLOCK of a dense matrix's fill or flatten launch, at most the constant `most`: a power of two no wider
        than the head, or than any part of a split one (`_in_block`)."""
        return f"_in_block(cache.head_dim, {most})" if self.split else f"min({most}, _pow2(cache.head_dim))"

    def decode_tables(self, side: SideLayout) -> tuple[str, ...]:
        """The tables of `side` the split kernels read (the Gluon kernel takes _decode_kernel's arguments): the
        centroids; K's rotation where they rotate the query, V's where they merge and rotate the output back. S is
        applied outside them (_rotate_query_kernel projects the query; V's QJL share is mapped back after the
        merge), and the boundaries are fill's alone."""
        wanted = {"centroids", "entries"}
        if side.name == "key" and self.fuses_query_rotation:
            wanted.add("matrix")
        if side.name == "value" and self.rotates_output and self.decode_merge == "split":
            wanted.add("matrix")
        return tuple(table for table in side.tables if table in wanted)

    @property
    def decode_params(self) -> tuple[KernelParam, ...]:
        """_decode_kernel's and _decode_kernel_gluon's parameters and decode's launch arguments, in order: each key
        part's query (and its QJL projection), the paging, every part's tensors and tables (and lookup words for the
        PTX lookups), each value part's partial output, the splits' max and sum, the merge's counters and output
        where split programs merge, the softmax scale and the paging's sizes; then the constexprs."""
        split = self.split
        params = []
        for key in self.key_parts:
            params.append(_positional(f"query_{key.tag}ptr", f'scratch["query_{key.name}"]' if split else "q"))
            if key.qjl:
                params.append(_positional(f"query_{key.tag}qjl_ptr",
                                          f'scratch["query_{key.name}_qjl"]' if split else "q_qjl"))
        params += [_positional("block_tables_ptr", "block_tables"), _positional("seq_lens_ptr", "seq_lens")]
        for side in self.sides:
            params += side.params(self.decode_tables(side))
            if side.lut_table:
                params.append(_table(f"{side.name}_lut_ptr", f"{side.name}_lut"))
        for value in self.value_parts:
            params.append(_positional(f"partial_{value.tag}out_ptr",
                                      f'partials["{value.name}"]' if split else "partial_out"))
            if value.qjl:
                params.append(_positional(f"partial_{value.tag}qjl_ptr",
                                          f'partials["{value.name}_qjl"]' if split else "partial_qjl"))
        params += [_positional("partial_max_ptr", "partial_max"), _positional("partial_sum_ptr", "partial_sum")]
        if self.decode_merge == "split":
            params += [_positional("counters_ptr", 'scratch.get("counters", partial_max)', "read only with MERGE"),
                       _positional("out_ptr", "merged")]
        params += [
            _positional("sm_scale_log2", "scale * 1.4426950408889634", "exp(x) = exp2(x * log2(e))"),
            _positional("num_blocks", "cache.num_blocks"),
            _positional("stride_block_table", "block_tables.stride(0)"),
            _positional("max_blocks_per_seq", "block_tables.shape[1]"),
            _positional("num_splits", "num_splits"),
            _constexpr("NUM_KV_HEADS", "cache.num_kv_heads"),
            _constexpr("GROUP", "group"),
            _constexpr("GROUP_PAD", "max(_DOT_ROWS, _pow2(group), _QUERY_ROWS.get(head_dim, 1))"),
        ]
        if self.reads_head_dim:
            params.append(_constexpr("HEAD_DIM", "head_dim"))
        params += self._widths("head_dim", "decode", pad="width")
        params += [
            _constexpr("BLOCK_SIZE", "cache.block_size"),
            _ROW_STRIDES,
            _HEADS_FASTEST,
            _constexpr("BLOCK_N", "block_n"),
            _constexpr("SPLIT_CHUNK", "plan.split_chunk"),
            _constexpr("DOT_DTYPE", "_DOT_DTYPES[query.dtype]"),
            _constexpr("DOT_PRECISION", "_DOT_PRECISION"),
            _constexpr("LAZY_RESCALE", "_LAZY_RESCALE"),
        ]
        if self.decode_unpacks:
            params.append(_constexpr("FAST_UNPACK", "_FAST_UNPACK and query.dtype == torch.float16"))
        if self.decode_merge == "split":
            params.append(_constexpr("MERGE", "merging"))
        if self.fuses_query_rotation:
            params.append(_constexpr("ROTATE", "_ROTATE_IN_DECODE"))
        return tuple(params + [_constexpr("PDL", "pdl")])

    @property
    def query_parts_params(self) -> tuple[KernelParam, ...]:
        """_query_parts_kernel's parameters and decode's launch arguments for it: the query, the key's channel order
        where it is split by channels, each key part's rotation and QJL projection with its scratch; the row
        count; then the constexprs."""
        params = [_positional("query_ptr", "query")]
        if "key" in self.split_bases:
            params.append(_positional("key_channels_ptr", '_channels(cache, "key")'))
        for key in self.key_parts:
            if key.uses_matrix:
                params.append(_table(f"{key.name}_rotation_ptr", f"{key.name}_rotation"))
            if key.qjl:
                params.append(_table(f"{key.name}_qjl_ptr", f"{key.name}_qjl"))
            params.append(_positional(f"query_{key.tag}out_ptr", f'scratch["query_{key.name}"]'))
            if key.qjl:
                params.append(_positional(f"query_{key.tag}qjl_out_ptr", f'scratch["query_{key.name}_qjl"]'))
        params.append(_positional("rows", "rows"))
        if "key" in self.split_bases:
            params += [_constexpr("NUM_KV_HEADS", "cache.num_kv_heads"), _constexpr("GROUP", "group")]
        dots = [_constexpr("DOT_PRECISION", "_DOT_PRECISION")] if any(
            key.uses_matrix or key.qjl for key in self.key_parts) else []  # a rotation's or S's dots
        return tuple(params + [_constexpr("HEAD_DIM", "head_dim")] + self._widths("head_dim", "query_parts") + [
            _constexpr("ROWS", "16"), *dots, _constexpr("PDL", "pdl")])

    @property
    def merge_parts_params(self) -> tuple[KernelParam, ...]:
        """_merge_parts_kernel's parameters and decode's launch arguments for it: each value part's partial output
        (with its QJL share and projection) and rotation, the value's channel order where it is split by channels,
        the splits' maxima and sums, the output, the lengths; then the constexprs."""
        params = []
        for value in self.value_parts:
            params.append(_positional(f"partial_{value.tag}out_ptr", f'partials["{value.name}"]'))
            if value.qjl:
                params += [_positional(f"partial_{value.tag}qjl_ptr", f'partials["{value.name}_qjl"]'),
                           _table(f"{value.name}_qjl_ptr", f"{value.name}_qjl")]
            if value.uses_matrix:
                params.append(_table(f"{value.name}_rotation_ptr", f"{value.name}_rotation"))
        if "value" in self.split_bases:
            params.append(_positional("value_channels_ptr", '_channels(cache, "value")'))
        params += [_positional("partial_max_ptr", "partial_max"), _positional("partial_sum_ptr", "partial_sum"),
                   _positional("out_ptr", "out"), _positional("seq_lens_ptr", "seq_lens"),
                   _positional("num_splits", "num_splits"), _constexpr("NUM_Q_HEADS", "num_q_heads")]
        if "value" in self.split_bases:
            params.append(_constexpr("GROUP", "group"))
        return tuple(params + [_constexpr("HEAD_DIM", "head_dim")] + self._widths("head_dim", "merge_parts") + [
            _constexpr("SPLIT_CHUNK", "plan.split_chunk"), _constexpr("SPLITS_PAD", "_pow2(num_splits)"),
            _constexpr("PDL", "pdl")])

    @property
    def window_store_params(self) -> tuple[KernelParam, ...]:
        """_window_store_kernel's parameters and fill's launch arguments for it, in order: the new rows, their slots,
        positions and ring rows, the rings, the counts and the rows' strides; then the constexprs."""
        return (_positional("key_ptr", "key"), _positional("value_ptr", "value"),
                _positional("slot_mapping_ptr", "slot_mapping"), _positional("positions_ptr", "positions"),
                _positional("window_index_ptr", "window_index"), _positional("key_window_ptr", "cache.key_window"),
                _positional("value_window_ptr", "cache.value_window"), _positional("num_tokens", "num_tokens"),
                _positional("max_seqs", "cache.max_seqs"), _positional("stride_key_token", "key.stride(0)"),
                _positional("stride_key_head", "key.stride(1)"), _positional("stride_value_token", "value.stride(0)"),
                _positional("stride_value_head", "value.stride(1)"),
                _constexpr("NUM_KV_HEADS", "cache.num_kv_heads"), _constexpr("HEAD_DIM", "cache.head_dim"),
                _constexpr("D_PAD", "_pow2(cache.head_dim)"), _constexpr("WINDOW", "WINDOW"),
                _constexpr("BLOCK_T", "_FILL_BLOCK_T"))

    @property
    def rotate_query_params(self) -> tuple[KernelParam, ...]:
        """_rotate_query_kernel's parameters and decode's launch arguments for it: the query, the signs, the rotated
        rows' scratch (and the QJL projection with its scratch where decode projects the query), the row count;
        then the constexprs."""
        params = [_positional("query_ptr", "q" if self.projects_query else "q.contiguous()"),
                  _table("key_matrix_ptr", "key_matrix"), _positional("out_ptr", 'scratch["rotated"]')]
        if self.projects_query:
            params += [_table("key_qjl_ptr", "key_qjl"),
                       _positional("projected_ptr", 'scratch["projected"]')]
        params += [_positional("rows", "q.shape[0]"), _constexpr("HEAD_DIM", "head_dim"), _constexpr("ROWS", "16")]
        if self.projects_query:
            params.append(_constexpr("PRECISION", "_DOT_PRECISION"))
        return tuple(params + [_constexpr("PDL", "pdl")])

    @property
    def reduce_params(self) -> tuple[KernelParam, ...]:
        """_decode_reduce_kernel's parameters and _reduce's launch arguments for it: the splits' scratch, the
        output, the lengths (and the output rotation's signs); then the constexprs."""
        params = [_positional("partial_out_ptr", "partial"), _positional("partial_max_ptr", "partial_max"),
                  _positional("partial_sum_ptr", "partial_sum"), _positional("out_ptr", "out"),
                  _positional("seq_lens_ptr", "seq_lens")]
        if self.rotates_output:
            params.append(_positional("value_matrix_ptr", "value_matrix"))
        return tuple(params + [_positional("num_splits", "num_splits"),
                               _constexpr("NUM_Q_HEADS", "num_q_heads"), _constexpr("SPLIT_CHUNK", "split_chunk"),
                               _constexpr("SPLITS_PAD", "_pow2(num_splits)"), _constexpr("HEAD_DIM", "head_dim"),
                               _constexpr("PDL", "pdl")])

    @property
    def window_decode_params(self) -> tuple[KernelParam, ...]:
        """_window_decode_kernel's parameters and decode's launch arguments for it, in order: the query as given,
        the sequences' lengths and ring rows, the rings, the key mean, the rotation the merge undoes, the splits'
        scratch (the window's split is the last), the merged output where this kernel merges; then the constexprs,
        PDL last: it launches dependent on decode's split kernel."""
        params = [_positional("query_ptr", "q_input.contiguous()"), _positional("seq_lens_ptr", "seq_lens"),
                  _positional("window_index_ptr", "window_index"),
                  _positional("key_window_ptr", "cache.key_window"),
                  _positional("value_window_ptr", "cache.value_window")]
        if self.centered:
            params.append(_positional("key_mean_ptr", "_key_mean(cache)"))
        if self.rotates_output:
            params.append(_table("value_matrix_ptr", "value_matrix"))
        params += [_positional("partial_out_ptr", "partial_out"), _positional("partial_max_ptr", "partial_max"),
                   _positional("partial_sum_ptr", "partial_sum")]
        if self.decode_merge:
            params.append(_positional("out_ptr", "merged"))
        params += [_positional("sm_scale_log2", "scale * 1.4426950408889634"),
                   _positional("num_splits", "num_splits"), _positional("max_seqs", "cache.max_seqs"),
                   _constexpr("NUM_KV_HEADS", "cache.num_kv_heads"), _constexpr("GROUP", "group"),
                   _constexpr("GROUP_PAD", "max(_DOT_ROWS, _pow2(group))"), _HEADS_FASTEST,
                   _constexpr("HEAD_DIM", "head_dim"), _constexpr("D_PAD", "_pow2(head_dim)"),
                   _constexpr("WINDOW", "WINDOW"),
                   _constexpr("BLOCK_W", "max(16, min(64 if head_dim <= 128 else 32, _pow2(WINDOW)))"),
                   # The ring's dots in the query's precision where the ring holds the query's dtype; a ring of
                   # another dtype in float32 (a bf16 ring's values can pass fp16's range).
                   _constexpr("DOT_DTYPE", "_DOT_DTYPES[query.dtype] if cache.key_window.dtype == query.dtype "
                              "else tl.float32"),
                   _constexpr("DOT_PRECISION", "_DOT_PRECISION")]
        if self.decode_merge:
            params += [_constexpr("SPLIT_CHUNK", "plan.split_chunk"), _constexpr("MERGE", "merging")]
        return tuple(params + [_constexpr("PDL", "pdl")])

    def _widths(self, head_dim: str, kernel: str, pad: str = "") -> list[KernelParam]:
        """The constexprs for the widths besides HEAD_DIM at the wrapper's `head_dim`: the power-of-two width of a
        padded head (`pad` where the wrapper has it at hand), then the split parts' widths and offsets `kernel`
        reads (part_constexpr_names)."""
        widths = [_constexpr("HEAD_PAD", pad or f"_pow2({head_dim})")] if self.padded else []
        if self.split:
            names = self.part_constexpr_names.get(kernel, tuple(name for name, _ in self.part_constexprs))
            widths.append(KernelParam(tuple(f"{name}: tl.constexpr" for name in names),
                                      f'**_part_constexprs({head_dim})["{kernel}"]'))
        return widths

    @property
    def part_constexpr_names(self) -> dict[str, tuple[str, ...]]:
        """The kernels of a channel split that read some of the part constexprs, and those they read (fill and
        flatten read every part's width, first channel and padded width): the split kernels the widths alone, each
        part's query and output being rows of their own; the query's parts kernel K's parts, the merge's V's."""
        names = tuple(name for name, _ in self.part_constexprs)
        return {"decode": tuple(n for n in names if not n.endswith("_OFFSET")),
                "query_parts": tuple(n for n in names if n.startswith("KEY_")),
                "merge_parts": tuple(n for n in names if n.startswith("VALUE_"))}

    @property
    def reads_head_dim(self) -> bool:
        """fill, flatten and decode read HEAD_DIM: some side is whole (split parts take their own widths)."""
        return len(self.split_bases) < 2

    @property
    def fill_params(self) -> tuple[KernelParam, ...]:
        """_fill_kernel's parameters and fill's launch arguments, in order: the new rows and their slots, the key
        mean, every part's tensors and tables, the token count, slots and strides (and the tiles a program loops
        over); then the constexprs."""
        sides = [side for side in self.sides if not side.per_channel]  # per-channel sides: `_<side>_group_kernel`
        bases = [base for base in ("key", "value") if any(side.base == base for side in sides)]
        params = [_positional(f"{base}_ptr", base) for base in bases]
        params.append(_positional("slot_mapping_ptr", "slot_mapping"))
        if self.centered:
            params.append(_positional("key_mean_ptr", "_key_mean(cache)"))
        for side in sides:
            params += side.params(side.fill_tables)
        params += [_positional("num_tokens", "num_tokens"), _positional("num_slots", "num_slots")]
        for base in bases:
            params += [_positional(f"stride_{base}_token", f"{base}.stride(0)"),
                       _positional(f"stride_{base}_head", f"{base}.stride(1)")]
        if self.fill_loops:
            params.append(_positional("tiles", "tiles"))
        params += [_constexpr("NUM_KV_HEADS", "cache.num_kv_heads"), _constexpr("BLOCK_SIZE", "cache.block_size"),
                   _ROW_STRIDES, _HEADS_FASTEST]
        if self.reads_head_dim:
            params.append(_constexpr("HEAD_DIM", "cache.head_dim"))
        params += self._widths("cache.head_dim", "fill") + [_constexpr("BLOCK_T", "_FILL_BLOCK_T")]
        if self.dense_matrix:
            params.append(_constexpr("IN_BLOCK", self.in_block("_FILL_IN_BLOCK")))
        if self.any_fast_cell:
            params.append(_constexpr("FAST_CELL", "_COMPILED_CUDA"))
        return tuple(params)

    @property
    def flatten_params(self) -> tuple[KernelParam, ...]:
        """_flatten_kernel's parameters and flatten's launch arguments, in order: the output rows, the paging and
        each sequence's first row, every part's tensors and tables (with the PTX lookups' codebook words where
        flatten takes them), the ring rows, the key mean, the sizes and strides; then the constexprs, the last two
        for PTX lookups into an fp16 or bf16 output and the rotated basis asked for."""
        params = [_positional("key_out_ptr", "key"), _positional("value_out_ptr", "value"),
                  _positional("block_tables_ptr", "block_tables"), _positional("seq_lens_ptr", "seq_lens"),
                  _positional("start_loc_ptr", "start_loc")]
        for side in self.sides:
            params += side.params(side.flatten_tables)
            if side.flatten_fast and side.lut_words:
                params.append(_table(f"{side.name}_lut_ptr", f"{side.name}_lut"))
        if self.window:
            params += [_positional("window_index_ptr", "window_index"),
                       _positional("key_window_ptr", "cache.key_window"),
                       _positional("value_window_ptr", "cache.value_window"), _positional("max_seqs", "cache.max_seqs")]
        if self.centered:
            params.append(_positional("key_mean_ptr", "_key_mean(cache)"))
        params += [_positional("num_blocks", "cache.num_blocks"),
                   _positional("stride_block_table", "block_tables.stride(0)"),
                   _positional("max_blocks_per_seq", "block_tables.shape[1]"), _positional("out_rows", "key.shape[0]"),
                   _positional("stride_out_token", "key.stride(0)"), _positional("stride_out_head", "key.stride(1)"),
                   _constexpr("NUM_KV_HEADS", "cache.num_kv_heads")]
        if self.reads_head_dim:
            params.append(_constexpr("HEAD_DIM", "cache.head_dim"))
        params += self._widths("cache.head_dim", "flatten") + [
            _constexpr("BLOCK_SIZE", "cache.block_size"),
            _ROW_STRIDES,
            _HEADS_FASTEST,
            _constexpr("BLOCK_T", "_FLATTEN_BLOCK_T")]
        if self.dense_matrix:
            params.append(_constexpr("IN_BLOCK", self.in_block("_FLATTEN_IN_BLOCK")))
        if self.flatten_unpacks:
            params.append(_constexpr("FAST_UNPACK", "_FAST_UNPACK"))
        if self.flatten_rotated:
            params.append(_constexpr("ROTATED", "rotated"))
        return tuple(params)

def _select_tree(prefix: str, probes, indices) -> str:
    """The value `<prefix><i>` for i in `indices` picked by the predicates `probe_<k>` for k in `probes`, most
    significant first: a tree of selects."""
    if not len(probes):
        return f"{prefix}{indices[0]}"
    n = len(indices) // 2
    above, below = _select_tree(prefix, probes[1:], indices[n:]), _select_tree(prefix, probes[1:], indices[:n])
    return f"tl.where(probe_{probes[0]}, {above}, {below})"


def _side(name: str, t: TensorScheme, head_dims: tuple[int, ...], part: str = "") -> SideLayout:
    if not t.outliers:
        return SideLayout(name, t, any(d & (d - 1) for d in head_dims), head_dims)
    index = 0 if part else 1
    dims = [t.part_dims(d)[index] for d in head_dims]
    return SideLayout(name, t.outlier_part if part else t, any(p & (p - 1) for p in dims), head_dims, part, t)


def plan(scheme: Scheme) -> Layout:
    parts = {}
    for base in ("key", "value"):
        t: TensorScheme = getattr(scheme, base)
        parts[base] = _side(base, t, scheme.head_dims)
        parts[f"{base}_outlier"] = _side(f"{base}_outlier", t, scheme.head_dims, "outlier") if t.outliers else None
    if scheme.name in _tuning_table().get("transposed_value_acc", ()):
        parts["value"] = dataclasses.replace(parts["value"], transposed_listed=True)
    return Layout(scheme, **parts)


def _tuning_table() -> dict:
    """DECODE_TUNING's measured launch settings, and the schemes some plan decisions are made for."""
    return json.loads(DECODE_TUNING.read_text(encoding="utf-8"))
