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

import math
from dataclasses import dataclass

from kvqc.numerics import rotation
from kvqc.compiler.spec import FP8_FORMATS, FP8_TARGET, Scheme, TensorScheme


@dataclass(frozen=True)
class Plane:
    width: int  # bits per code in this plane: 8, 4, 2 or 1
    shift: int  # the plane holds bits [shift, shift + width) of the code

    @property
    def per_byte(self) -> int:
        return 8 // self.width


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
    def packing(self) -> str:
        """"split" (each plane's chunks side by side) or "interleaved" (position order mixes the chunks)."""
        return self.scheme.packing

    @property
    def qjl(self) -> bool:
        return self.residual == "qjl"

    @property
    def qjl_seed(self) -> int:
        return self.scheme.residual.seed

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
            out.append(f"{self.dim} * {bits} // 8" if bits else "0")
            bits += plane.width
        return tuple(out)

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
    def code_mid(self) -> int:
        """The code decode subtracts before its dot products where a row shift follows (0 elsewhere): centred
        codes keep the tensor cores' float32 accumulator near the size of the output instead of carrying
        2**(bits - 1) * scale per token, which the shift would only cancel at the end."""
        return 2 ** (self.scheme.codebook.bits - 1) if self.row_shift else 0

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
            out += ["centroids", "boundaries"]
        if self.qjl:
            out.append("qjl")
        return tuple(out)

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
        order (K: one dot with H_C per chunk, butterflies across chunks), the merge the merged output back (V:
        Walsh-Hadamard butterflies). Where positions are in coordinate order and no QJL projection follows (it stays
        in the wrapper)."""
        return self.coordinate_order and not self.qjl

    @property
    def wrapper_maps(self) -> bool:
        """Decode's wrapper moves this side's vectors in torch, in float32 (a rotation or permutation the kernels
        do not do themselves, padding positions, QJL's projection): the query before the kernel for K, the output
        after the merge for V. Otherwise the kernels read the query and write the output in the model's dtype."""
        return (self.uses_matrix and not self.kernel_rotates) or self.padded or self.qjl

    @property
    def factor_after_matrix(self) -> bool:
        """Flatten applies the row factor after the matrix instead of before it (it commutes with a linear map):
        the codebook's own values (unit-scale centroids, integer or fp8 levels) fit fp16 as they stand, so an fp16
        or bf16 output needs no per-row rescaling before the one fp16 dot. Not with a row shift (a constant row
        does not stay constant) nor QJL (its correction is added at full scale)."""
        return self.uses_matrix and self.row_factor is not None and not self.row_shift and not self.qjl

    @property
    def fast_unpack(self) -> str:
        """Decode's PTX unpacking of this side's codes on NVIDIA (kernels/unpack.py.j2), "" for the portable select
        trees: "u8" / "u4" uniform codes with a scale and zero, "lut2" / "lut4" Lloyd-Max indices, "lut3s" a 3-bit
        index and a residual sign. One plane, no padding and scales per token only: group and channel scales keep
        the portable path."""
        s = self.scheme
        if len(self.planes) != 1 or self.padded or self.group_size or self.per_channel:
            return ""
        bits, residual = s.codebook.bits, s.residual.kind
        if s.codebook.kind == "uniform" and s.scale.kind == "minmax" and residual == "none" and bits in (4, 8):
            return f"u{bits}"
        if s.codebook.kind == "lloyd_max" and residual == "none" and bits in (2, 4):
            return f"lut{bits}"
        if s.codebook.kind == "lloyd_max" and residual == "sign" and bits == 3:
            return "lut3s"
        return ""

    @property
    def lut_words(self) -> int:
        """int32 words of the fp16 codebook the PTX lookups read (low bytes, then high bytes, four entries a word)."""
        return 2 ** self.scheme.codebook.bits // 2 if self.scheme.codebook.kind == "lloyd_max" else 0

    @property
    def word_unpack(self) -> str:
        """"u4" where decode reads V's u4 codes as 32-bit words: tl.dot wants V's operand in pairs along tokens, and
        a word of a token and one of the next make eight such pairs with four prmt (measured on an H100: int4_token
        8 x 32k 0.1526 -> 0.1495 ms at head_dim 128, 0.1207 -> 0.0818 at 64; u8 and lut2 words gained nothing)."""
        whole = self.base == "value" and not self.split and min(self.head_dims) >= 64
        return "u4" if whole and self.fast_unpack == "u4" else ""

    @property
    def flatten_fast(self) -> str:
        """The PTX kind flatten takes for an fp16 or bf16 output, "" for none: rotated sides in Hadamard blocks
        whose row factor follows the matrix, so the fp16 codebook entries go straight into the one fp16 dot."""
        fast = self.hadamard_blocks and self.factor_after_matrix and self.fast_unpack in ("lut2", "lut3s", "lut4")
        return self.fast_unpack if fast else ""

    def decode_path(self) -> str:
        """How decode reads this side, in words (`kvqc explain`)."""
        if self.fast_unpack:
            how = f"PTX unpacking ({self.fast_unpack}{', 32-bit words' if self.word_unpack else ''}) on NVIDIA"
        else:
            how = "portable unpacking (shift, mask and select trees)"
        if self.per_channel:
            scales = f"per-channel scales shared by {self.token_group} tokens, factored out of the dots"
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
    def fill_loops(self) -> bool:
        """Fill programs loop over several token tiles, so Triton prefetches the next tile's rows while this one is
        rotated and quantized: where some side rotates in Hadamard blocks. The elementwise fills and the dense
        matrix ones keep one tile a program (measured on an H100)."""
        return any(side.hadamard_blocks for side in self.sides)

    @property
    def rotates_query(self) -> bool:
        """The split kernels take the query as given and rotate it into position order, each program its own rows
        (kernels/fused.j2; a split layout maps each part in torch)."""
        return not self.split and self.key.kernel_rotates

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
    def builds_hadamard(self) -> bool:
        """`_tables` builds a Hadamard matrix (`_hadamard`): some side rotates by a matrix."""
        return any(side.uses_matrix and side.rotated for side in self.sides)

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
        128 among the scheme's (measured on an H100: turbo_k4v2 8 x 32k 0.1835 -> 0.1547 ms). With a window it
        takes the quantized splits and _window_decode_kernel the ring, as beside _decode_kernel; it does not skip
        attention sinks, so a scheme with sinks has none."""
        key, value = self.key, self.value
        whole = not self.split and not self.padded and 128 in key.head_dims
        norms = key.row_factor == value.row_factor == "norm" and not key.row_shift and not value.row_shift
        fits = key.fast_unpack in ("lut3s", "lut4") and value.fast_unpack == "lut2"
        return key.fast_unpack if whole and norms and fits and not self.sinks else ""

    @property
    def decode_replays(self) -> bool:
        """A decode call is kernel launches alone, with no torch op on the query, the scratch or the output in
        between: so a plan takes one layer's launches and replays them for the next layers with their own tensors
        (`_Replay`). Not where the wrapper maps a side in torch (a dense matrix, padding, QJL, a channel split)
        or moves the window's output into the rotated basis (a rotated side the kernels do not rotate)."""
        in_kernels = not self.split and not self.key.wrapper_maps and not self.value.wrapper_maps
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
        `_window_decode_kernel`, which runs after the quantized splits. "" where `_decode_reduce_kernel` always
        merges: a channel split or a QJL value (several partial outputs a row), or a window whose output the
        wrapper maps in torch before the merge."""
        if self.split or self.value.qjl:
            return ""
        if self.window:
            return "" if self.padded or (self.value.uses_matrix and not self.rotates_output) else "window"
        return "split"

    @property
    def flatten_unpacks(self) -> bool:
        """Some side's flatten takes decode's PTX lookups for an fp16 or bf16 output (FAST_UNPACK)."""
        return any(side.flatten_fast for side in self.sides)

    @property
    def dense_matrix(self) -> bool:
        """Some side's fill and flatten take the d x d matrix IN_BLOCK columns at a time (an IN_BLOCK argument)."""
        return any(side.dense_matrix for side in self.sides)

    def bytes_per_token(self, head_dim: int, metadata_bytes: int = 2) -> int:
        """Cache bytes for one token and one KV head: K and V codes plus their metadata."""
        return sum(s.code_bytes(head_dim) + metadata_bytes * s.meta_width(head_dim) for s in self.sides)

    def compression_ratio(self, head_dim: int) -> float:
        return 2 * head_dim * 2 / self.bytes_per_token(head_dim)


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
    return Layout(scheme, **parts)
