"""The oracle: quantize, dequantize and attend over a quantized cache, in float64 torch, read off the Scheme.

It shares constants with the generated kernels (codebooks, sign vectors, the QJL matrix) and no code paths:
rotations here are fast Walsh-Hadamard butterflies in coordinate order, packing is written per coordinate from
its definition, and the paged cache is walked sequence by sequence. A template bug cannot hide in here.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from kvqc.numerics import rotation
from kvqc.compiler.layout import SideLayout, plan
from kvqc.compiler.spec import FP8_FORMATS, FP8_TARGET, Scheme, scheme_from_dict


@dataclass
class Quantized:
    codes: torch.Tensor  # uint8 [N, code bytes], packed as the cache stores them
    meta: torch.Tensor  # [N, len(metadata) * scale groups] in the metadata dtype
    code: torch.Tensor  # int64 [N, d] unpacked codes, coordinate order
    margin: torch.Tensor  # float64 [N, d]: distance of each coordinate's decision from flipping


class SideReference:
    """One side (or one part of a channel split) at one head_dim; self.d is the width it quantizes."""

    def __init__(self, side: SideLayout, head_dim: int):
        self.side, self.d, self.s = side, side.part_dim(head_dim), side.scheme
        signs = side.signs(head_dim)
        self.signs = None if signs is None else torch.tensor(signs, dtype=torch.float64)
        c = side.centroids(head_dim)
        self.centroids = None if c is None else torch.tensor(c, dtype=torch.float64)
        self.boundaries = None if c is None else (self.centroids[1:] + self.centroids[:-1]) / 2
        r = self.s.residual
        self.qjl = (
            torch.tensor(rotation.gaussian_matrix(self.d, self.d, r.seed), dtype=torch.float64)
            if r.kind == "qjl"
            else None
        )

    # -- rotation (coordinate order; y = H D x / sqrt(d), H H^T = d I; Paley-Kronecker H for 80, 96)
    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.s.rotation.kind == "none":
            return x
        if self.signs is not None:
            x = x * self.signs
        return rotation.hadamard_transform(x) / math.sqrt(self.d)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        if self.s.rotation.kind == "none":
            return y
        x = rotation.hadamard_transform(y, transpose=True) / math.sqrt(self.d)
        return x * self.signs if self.signs is not None else x

    # -- packing
    def pack(self, code: torch.Tensor) -> torch.Tensor:
        n, d = code.shape
        out = []
        for plane in self.side.planes:
            k, field = plane.per_byte, (code >> plane.shift) & (2**plane.width - 1)
            byte = torch.zeros(n, d // k, dtype=torch.int64)
            for i in range(k):
                # interleaved: byte j, field i holds coordinate j*k + i; split: coordinate i*(d/k) + j
                part = (
                    field[:, i::k] if self.s.packing == "interleaved" else field[:, i * (d // k) : (i + 1) * (d // k)]
                )
                byte |= part << (i * plane.width)
            out.append(byte)
        return torch.cat(out, dim=1).to(torch.uint8)

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        n, d = codes.shape[0], self.d
        codes = codes.to(torch.int64)
        code = torch.zeros(n, d, dtype=torch.int64)
        at = 0
        for plane in self.side.planes:
            k = plane.per_byte
            byte = codes[:, at : at + d // k]
            at += d // k
            for i in range(k):
                field = (byte >> (i * plane.width)) & (2**plane.width - 1)
                if self.s.packing == "interleaved":
                    code[:, i::k] |= field << plane.shift
                else:
                    code[:, i * (d // k) : (i + 1) * (d // k)] |= field << plane.shift
        return code

    # -- quantization
    def quantize(self, x: torch.Tensor, meta_dtype: torch.dtype) -> Quantized:
        y = self.rotate(x.to(torch.float64))
        if self.s.scale.kind == "norm":
            return self._quantize_norm(y, meta_dtype)
        n, d = y.shape
        groups = self.s.groups(d)
        yg = y.view(n, groups, d // groups)  # scale groups are runs of coordinates (the rotated basis)
        code, margin, meta = self._grid(yg)
        meta = meta.reshape(n, groups * meta.shape[-1])  # group-major: the fields of group 0, then of group 1, ...
        code, margin = code.view(n, d), margin.view(n, d)
        if self.s.residual.kind != "none":
            # A residual stage on a uniform grid: r = y - y_hat in the rotated basis, per token (no groups).
            y_hat = self._level(code) * meta[:, 0:1] + (meta[:, 1:2] if self.s.scale.kind == "minmax" else 0)
            code, margin, extra = self._residual(y - y_hat, code, margin)
            meta = torch.cat([meta, extra[:, None]], dim=1)
        return Quantized(self.pack(code), meta.to(meta_dtype), code, margin)

    def _residual(self, residual: torch.Tensor, code: torch.Tensor, margin: torch.Tensor):
        """The residual stage's bit above the codebook bits, its stored value, and the margins it adds: in units of
        the decision's spread (r's coordinates have RMS |r| / sqrt(d), each coordinate of S r has RMS |r|)."""
        if self.s.residual.kind == "sign":
            decided, value = residual, residual.pow(2).mean(dim=1).sqrt()
            spread = residual.norm(dim=1, keepdim=True) / math.sqrt(self.d)
        else:
            decided, value = residual @ self.qjl.T, residual.norm(dim=1)  # S r
            spread = residual.norm(dim=1, keepdim=True)
        code = code | ((decided >= 0).to(torch.int64) << self.s.codebook.bits)
        return code, torch.minimum(margin, decided.abs() / spread.clamp_min(1e-300)), value

    def quantize_channels(self, x: torch.Tensor, meta_dtype: torch.dtype) -> Quantized:
        """A whole token group x [group_size, d] with one scale (and zero) per channel (scale.axis: channel).

        The group's d x fields metadata values, channel-major, are spread over its slots: meta [group_size, width].
        """
        g, d = x.shape
        yg = x.to(torch.float64).T  # [d, group_size]: each channel's run of tokens shares its scale
        code, margin, meta = self._grid(yg)
        code, margin = code.T.contiguous(), margin.T.contiguous()
        return Quantized(self.pack(code), meta.reshape(g, -1).to(meta_dtype), code, margin)

    def dequantize_channels(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """The inverse of quantize_channels for one complete group: [group_size, d] float64."""
        code = self.unpack(codes)
        g, d = code.shape
        meta = meta.to(torch.float64).reshape(d, len(self.s.metadata))
        y = self._level(code) * meta[None, :, 0]
        return y + meta[None, :, 1] if self.s.scale.kind == "minmax" else y

    def roundtrip(self, x: torch.Tensor, meta_dtype: torch.dtype) -> torch.Tensor:
        """x [tokens, d], one sequence's K or V in order, quantized and read back (no window: every token).

        Per-channel scales take consecutive groups of group_size tokens; a last, incomplete group is quantized
        over the tokens it has (its last row repeated, which moves no minimum or maximum).
        """
        if not self.s.per_channel:
            q = self.quantize(x, meta_dtype)
            return self.dequantize(q.codes, q.meta)
        g = self.s.scale.group_size
        out = torch.empty(x.shape, dtype=torch.float64)
        for start in range(0, x.shape[0], g):
            group = x[start : start + g].to(torch.float64)
            n = group.shape[0]
            group = torch.cat([group, group[-1:].expand(g - n, -1)])
            q = self.quantize_channels(group, meta_dtype)
            out[start : start + n] = self.dequantize_channels(q.codes, q.meta)[:n]
        return out

    def _level(self, code: torch.Tensor) -> torch.Tensor:
        """A uniform or fp8 code's grid value before any scale."""
        if self.s.scale.kind == "minmax":
            return code.to(torch.float64)
        if self.s.codebook.kind == "fp8":
            return fp8_grid(self.s.codebook.format, by_code=True)[code]
        return code.to(torch.float64) - (2 ** (self.s.codebook.bits - 1) - 1)

    def _grid(self, yg: torch.Tensor):
        """Codes, margins and metadata of a uniform or fp8 grid, one scale per run along yg's last dimension."""
        if self.s.scale.kind == "minmax":
            return self._affine(yg)
        if self.s.codebook.kind == "fp8":
            return self._fp8(yg)
        return self._symmetric(yg)

    def _affine(self, yg: torch.Tensor):
        levels = 2**self.s.codebook.bits - 1
        lo, hi = yg.min(dim=-1).values, yg.max(dim=-1).values
        scale = (hi - lo) / levels
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        t = (yg - lo[..., None]) * inverse[..., None] + 0.5
        code = t.floor().clamp(0, levels).to(torch.int64)
        margin = (t - t.round()).abs()  # distance from a rounding tie, in grid steps
        margin = torch.where(scale[..., None] > 0, margin, torch.full_like(margin, math.inf))
        return code, margin, torch.stack([scale, lo], dim=-1)

    def _symmetric(self, yg: torch.Tensor):
        top = 2 ** (self.s.codebook.bits - 1) - 1  # levels -top..top, stored as code - top
        scale = yg.abs().max(dim=-1).values / top
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        t = yg * inverse[..., None] + 0.5
        code = t.floor().clamp(-top, top).to(torch.int64) + top
        margin = (t - t.round()).abs()
        margin = torch.where(scale[..., None] > 0, margin, torch.full_like(margin, math.inf))
        return code, margin, scale[..., None]

    def _fp8(self, yg: torch.Tensor):
        largest = FP8_FORMATS[self.s.codebook.format][2]
        scale = yg.abs().max(dim=-1).values / FP8_TARGET
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        t = (yg * inverse[..., None]).clamp(-largest, largest)
        # Nearest value of the format's grid, read off the table of every finite code (independent of the
        # kernels' bit arithmetic); a value on a midpoint is a tie that either neighbour may take.
        values, codes = fp8_grid(self.s.codebook.format)
        mid = (values[1:] + values[:-1]) / 2
        index = torch.searchsorted(mid, t.contiguous())
        gap = (values[1:] - values[:-1])[(index - 1).clamp(0, len(mid) - 1)]
        # Near zero the grid is finer than float32's error on a rotated coordinate (relative to max|y|): measure
        # the distance in steps of at least FP8_TARGET * 2^-12.
        margin = (t[..., None] - mid).abs().min(dim=-1).values / gap.clamp_min(FP8_TARGET * 2.0**-12)
        return codes[index], margin, scale[..., None]

    def _quantize_norm(self, y: torch.Tensor, meta_dtype: torch.dtype) -> Quantized:
        norm = y.norm(dim=1)
        unit = y / norm.clamp_min(1e-300)[:, None]
        index = torch.searchsorted(self.boundaries, unit.contiguous(), right=False)  # number of boundaries < u
        nearest = (unit[..., None] - self.boundaries).abs().min(dim=-1).values
        margin = nearest * math.sqrt(self.d)  # in N(0,1) units, comparable across head_dims
        fields = [norm]
        code = index
        unit_hat = self.centroids[index]
        if self.s.residual.kind != "none":
            residual = unit - self.centroids[index]
            code, margin, value = self._residual(residual, code, margin)
            fields.append(value)
            if self.s.residual.kind == "sign":
                unit_hat = unit_hat + torch.where(residual >= 0, 1.0, -1.0) * value[:, None]
        if self.s.scale.unbiased:
            # DRIVE/EDEN: |y|^2 / <y, y_hat_unit> makes <y, y_hat> = |y|^2 exactly and <q, y_hat> unbiased over
            # the random rotation; a non-positive alignment (only for degenerate rows) keeps the plain norm.
            align = (unit * unit_hat).sum(dim=1)
            fields[0] = torch.where(align > 1e-30, norm / align.clamp_min(1e-30), norm)
        meta = torch.stack(fields, dim=1)
        return Quantized(self.pack(code), meta.to(meta_dtype), code, margin)

    def dequantize(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        code = self.unpack(codes)
        meta = meta.to(torch.float64)
        bits = self.s.codebook.bits
        n, d = code.shape
        if self.s.scale.kind != "norm":
            groups = self.s.groups(d)
            meta = meta.view(n, groups, len(self.s.metadata))
            y = self._level(code & (2**bits - 1)).view(n, groups, d // groups) * meta[..., 0:1]
            if self.s.scale.kind == "minmax":
                y = y + meta[..., 1:2]
            y = y.view(n, d)
            if self.s.residual.kind != "none":
                y = y + self._residual_value(code, meta[:, 0, -1:])
            return self.unrotate(y)
        unit = self.centroids[code & (2**bits - 1)]
        if self.s.residual.kind != "none":
            unit = unit + self._residual_value(code, meta[:, 1:2])
        y = meta[:, 0:1] * unit
        return self.unrotate(y)

    def _residual_value(self, code: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """What the residual bit adds back, from its stored value [n, 1] (RMS, or |r| for QJL)."""
        sign = ((code >> self.s.codebook.bits) & 1).to(torch.float64) * 2 - 1
        if self.s.residual.kind == "sign":
            return sign * stored
        # QJL: x_qjl = sqrt(pi/2) / d * |r| * S^T sign(S r), unbiased for <y, r>.
        return math.sqrt(math.pi / 2) / self.d * stored * (sign @ self.qjl)


def select_channels(x: torch.Tensor, whole, head_dim: int) -> torch.Tensor:
    """The channel order of a split side for one KV head: its outlier channels, then the rest, each ascending.

    x [tokens, head_dim] is calibration data (unused for select: fixed). variance: the channels of largest
    variance over the tokens; rms: of largest mean square; ties go to the lower channel index.
    """
    o = whole.outliers
    n = o.count(head_dim)
    if o.select == "fixed":
        chosen = torch.tensor(o.channels, dtype=torch.int64)
    else:
        x = x.to(torch.float64)
        score = x.var(dim=0, unbiased=False) if o.select == "variance" else x.pow(2).mean(dim=0)
        order = sorted(range(head_dim), key=lambda c: (-float(score[c]), c))
        chosen = torch.tensor(sorted(order[:n]), dtype=torch.int64)
    rest = torch.ones(head_dim, dtype=torch.bool)
    rest[chosen] = False
    return torch.cat([chosen, rest.nonzero().flatten()])


def fp8_grid(fmt: str, by_code: bool = False):
    """The finite values of an fp8 format: (sorted values, their codes), or by_code: value of each code 0..255.

    Decoded from the bit layout by torch's own float8 dtypes, not by kvqc's arithmetic.
    """
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    every = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float64)
    if by_code:
        return torch.nan_to_num(every, nan=0.0, posinf=0.0, neginf=0.0)  # never stored: fill saturates
    finite = torch.isfinite(every) & ~((every == 0) & (torch.arange(256) >= 128))  # one zero, code 0
    values, order = every[finite].sort()
    return values, torch.arange(256)[finite][order]


class Reference:
    """The float64 twin of a generated module: the same fill / flatten / decode surface on the same cache."""

    def __init__(self, scheme: Scheme):
        self.scheme = scheme
        self.layout = plan(scheme)
        self._sides: dict[tuple[str, int], SideReference] = {}

    def side(self, name: str, head_dim: int) -> SideReference:
        """name: "key", "value", or a split's "key_outlier" / "value_outlier" (then "key" is the rest)."""
        if (name, head_dim) not in self._sides:
            self._sides[(name, head_dim)] = SideReference(getattr(self.layout, name), head_dim)
        return self._sides[(name, head_dim)]

    def quantize(
        self, name: str, x: torch.Tensor, meta_dtype: torch.dtype = torch.float32, head_dim: int | None = None
    ) -> Quantized:
        """x [N, width] -> packed codes and metadata for K (name='key') or V (name='value'), or one part of a
        split side (x holds that part's channels of the permuted head; head_dim names the whole head's)."""
        return self.side(name, head_dim or x.shape[-1]).quantize(x.cpu(), meta_dtype)

    def dequantize(self, name: str, codes: torch.Tensor, meta: torch.Tensor, head_dim: int) -> torch.Tensor:
        return self.side(name, head_dim).dequantize(codes.cpu(), meta.cpu())

    # -- channel splits: the parts of a side, its channel order per KV head, and the head split into parts

    def channels(self, base: str, x: torch.Tensor) -> torch.Tensor:
        """A split side's channel order per KV head, int64 [num_kv_heads, head_dim], from x [tokens, heads, d]."""
        whole = getattr(self.scheme, base)
        return torch.stack([select_channels(x[:, h].cpu(), whole, x.shape[-1]) for h in range(x.shape[1])])

    def calibrate(self, cache: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        """Choose each split side's outlier channels, and a centered key's mean, from key/value [tokens,
        num_kv_heads, head_dim] (the generated module's calibrate, in float64)."""
        for base, x in (("key", key), ("value", value)):
            if getattr(self.layout, base).split:
                setattr(cache, f"{base}_channels", self.channels(base, x).to(getattr(cache, f"{base}_codes").device))
        if self.scheme.key.center == "calibrated":
            cache.key_mean = key.cpu().to(torch.float64).mean(dim=0).to(torch.float32).to(cache.key_codes.device)

    def split(self, base: str, x: torch.Tensor, order: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [..., heads, d] in each head's channel order, cut into its parts: {part name: [..., heads, width]}."""
        order = order.cpu()
        permuted = x.gather(-1, order.expand(x.shape))
        out, at = {}, 0
        for part in self.layout.parts(base):
            width = part.part_dim(x.shape[-1])
            out[part.name] = permuted[..., at : at + width]
            at += width
        return out

    def join(self, base: str, parts: list[torch.Tensor], order: torch.Tensor) -> torch.Tensor:
        """The inverse of split: the parts' values [..., heads, width], outliers first, back in channel order."""
        permuted = torch.cat(parts, dim=-1)
        return torch.empty_like(permuted).scatter_(-1, order.cpu().expand(permuted.shape), permuted)

    def roundtrip(self, base: str, x: torch.Tensor, meta_dtype: torch.dtype) -> torch.Tensor:
        """One KV head's tokens x [tokens, d] quantized and read back (a split side chooses its channels on x, a
        centered one takes x's mean: calibrate's rules on these tokens)."""
        if getattr(self.scheme, base).center == "calibrated":
            mean = x.to(torch.float64).mean(dim=0)
            return self.side(base, x.shape[-1]).roundtrip(x.to(torch.float64) - mean, meta_dtype) + mean
        if not getattr(self.layout, base).split:
            return self.side(base, x.shape[-1]).roundtrip(x, meta_dtype)
        order = self.channels(base, x[:, None])  # [1, d]
        parts = self.split(base, x[:, None].to(torch.float64), order)
        back = [self.side(name, x.shape[-1]).roundtrip(p[:, 0], meta_dtype)[:, None] for name, p in parts.items()]
        return self.join(base, back, order)[:, 0]

    # -- the paged surface, on any object with key_codes/key_meta/value_codes/value_meta/head_dim/layout

    def _blocks(self, cache: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's codes and metadata as [num_blocks, block_size, num_kv_heads, ...] views, whatever its layout
        ('bhsd' blocks are transposed views; writes through them land in the cache)."""
        codes, meta = getattr(cache, f"{name}_codes"), getattr(cache, f"{name}_meta")
        if cache.layout == "bhsd":
            return codes.transpose(1, 2), meta.transpose(1, 2)
        if cache.layout != "bshd":
            raise ValueError(f"cache.layout: expected 'bhsd' or 'bshd', got {cache.layout!r}")
        return codes, meta

    def fill(
        self,
        cache: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        window_index: torch.Tensor | None = None,
    ) -> None:
        """Tokens are taken one after another, in the order given: the definition the kernels must match."""
        self._require("fill", positions=positions, window_index=window_index)
        keep = (slot_mapping >= 0).cpu()
        slots = slot_mapping.cpu()[keep].to(torch.int64)
        block_size = self._blocks(cache, "key")[0].shape[1]
        block, offset = slots // block_size, slots % block_size
        for base, x in (("key", key), ("value", value)):
            if getattr(self.layout, base).per_channel or not len(slots):
                continue  # per channel: quantized a whole token group at a time, below
            x = x.cpu()[keep]
            if getattr(self.scheme, base).center == "calibrated":
                x = x.to(torch.float64) - self.key_mean(cache)
            d = x.shape[-1]
            parts = (
                self.split(base, x, getattr(cache, f"{base}_channels"))
                if getattr(self.layout, base).split
                else {base: x}
            )
            for name, xp in parts.items():
                codes, meta = self._blocks(cache, name)
                q = self.quantize(name, xp.reshape(-1, xp.shape[-1]), meta.dtype, head_dim=d)
                at = (block.to(codes.device), offset.to(codes.device))
                codes[at] = q.codes.view(len(slots), x.shape[1], -1).to(codes.device)
                meta[at] = q.meta.view(len(slots), x.shape[1], -1).to(meta.device)
        if not self.scheme.window:
            return
        w = self.scheme.window
        for t in keep.nonzero().flatten().tolist():
            slot, p, seq = int(slot_mapping[t]), int(positions[t]), int(window_index[t])
            for name, x in (("key", key), ("value", value)):
                ring = getattr(cache, f"{name}_window")
                ring[seq, self.exact_slot(p)] = x[t].to(ring.dtype)
                side = getattr(self.layout, name)
                if side.per_channel and p % side.token_group == side.token_group - 1:
                    g = side.token_group
                    members = torch.arange(p - g + 1, p + 1) % w
                    codes, meta = self._blocks(cache, name)
                    b, o = divmod(slot, codes.shape[1])  # a group never straddles a block
                    for h in range(ring.shape[2]):
                        group = ring[seq, members.to(ring.device), h].cpu()
                        q = self.side(name, cache.head_dim).quantize_channels(group, meta.dtype)
                        codes[b, o - g + 1 : o + 1, h] = q.codes.to(codes.device)
                        meta[b, o - g + 1 : o + 1, h] = q.meta.to(meta.device)

    def key_mean(self, cache: Any) -> torch.Tensor:
        """float64 [num_kv_heads, head_dim]: the mean key each head's keys are quantized against (calibrate's)."""
        if cache.key_mean is None:
            raise ValueError(
                f"cache.key_mean: {self.scheme.name} quantizes each key minus its head's mean; calibrate first"
            )
        return cache.key_mean.cpu().to(torch.float64)

    def exact_slot(self, position: int) -> int:
        """Where a position lives in its sequence's row of exact tokens: a sink at its position, any later one in
        the ring of the last `window`, after the sinks."""
        sinks = self.scheme.sinks
        return position if position < sinks else sinks + position % self.scheme.window

    def _require(self, call: str, **arguments) -> None:
        """The module's arguments, with its rule: a window scheme needs every token's ring row."""
        for name, value in arguments.items():
            if self.scheme.window and value is None:
                raise ValueError(f"{call}: {self.scheme.name} keeps each sequence's last {self.scheme.window} tokens "
                                 f"in a ring: pass the {name} keyword")

    def gather(
        self, cache: Any, name: str, block_table: torch.Tensor, seq_len: int, window_row: int | None = None,
        part: bool = False,
    ) -> torch.Tensor:
        """One sequence's K or V, float64 [seq_len, num_kv_heads, head_dim]: dequantized, except its first `sinks`
        and last `window` tokens, read as given from the row `window_row`."""
        side = getattr(self.layout, name)
        if side.split and not part:
            # Each part (one of name's cache tensors) dequantized on its own, then put back in channel order.
            parts = [
                self.gather(cache, p.name, block_table, seq_len, window_row, True) for p in self.layout.parts(name)
            ]
            return self.join(name, parts, getattr(cache, f"{name}_channels"))
        codes, meta = self._blocks(cache, name)
        block_size, h = codes.shape[1], codes.shape[2]
        quantized = max(seq_len - self.scheme.window, 0)
        # Per-channel scales dequantize whole groups: every token before the window lies in a complete one.
        span = -(-quantized // side.token_group) * side.token_group if side.per_channel else quantized
        position = torch.arange(span)
        at = (
            block_table.cpu().to(torch.int64)[position // block_size].to(codes.device),
            (position % block_size).to(codes.device),
        )
        c, m = codes[at].cpu(), meta[at].cpu()  # gather, then copy
        if side.per_channel:
            ref, g = self.side(name, cache.head_dim), side.token_group
            x = torch.zeros(span, h, cache.head_dim, dtype=torch.float64)
            for start in range(0, span, g):
                for head in range(h):
                    x[start : start + g, head] = ref.dequantize_channels(
                        c[start : start + g, head], m[start : start + g, head]
                    )
        else:
            x = self.dequantize(
                name, c.reshape(span * h, c.shape[-1]), m.reshape(span * h, m.shape[-1]), cache.head_dim
            )
            x = x.view(span, h, self.side(name, cache.head_dim).d)
        x = x[:quantized]
        if name == "key" and self.scheme.key.center == "calibrated":
            x = x + self.key_mean(cache)
        if seq_len > quantized or self.scheme.sinks:
            row = getattr(cache, f"{name}_window")[window_row].cpu().to(torch.float64)
            recent = [self.exact_slot(p) for p in range(quantized, seq_len)]
            sinks = min(self.scheme.sinks, quantized)
            x = torch.cat([row[:sinks], x[sinks:], row[recent]])
        return x

    def flatten(
        self,
        cache: Any,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        window_index: torch.Tensor | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        start_loc: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 key, value [sum(seq_lens), num_kv_heads, head_dim], sequences packed in order; with out=(key,
        value), sequence b written from row start_loc[b] (default: packed from row 0) in the buffers' dtype, rows
        past their end dropped, and the buffers returned, as the module's flatten."""
        return self._flatten(cache, block_tables, seq_lens, window_index, out, start_loc, rotated=False)

    def _flatten(self, cache, block_tables, seq_lens, window_index, out, start_loc, rotated: bool):
        self._require("flatten", window_index=window_index)
        keys, values = [], []
        rows = window_index.tolist() if window_index is not None else [None] * len(seq_lens)
        for table, n, r in zip(block_tables.cpu(), seq_lens.tolist(), rows):
            keys.append(self.gather(cache, "key", table, n, r))
            values.append(self.gather(cache, "value", table, n, r))
        if rotated:
            keys = [self.side("key", cache.head_dim).rotate(k) for k in keys]
            values = [self.side("value", cache.head_dim).rotate(v) for v in values]
        if out is not None:
            starts = start_loc.tolist() if start_loc is not None else [0, *itertools.accumulate(len(k) for k in keys)]
            for buffer, parts in zip(out, (keys, values)):
                for at, x in zip(starts, parts):
                    fits = x[: max(buffer.shape[0] - at, 0)]
                    buffer[at : at + len(fits)] = fits.to(buffer.device, buffer.dtype)
            return out
        empty = torch.zeros(0, self._blocks(cache, "key")[0].shape[2], cache.head_dim, dtype=torch.float64)
        return (torch.cat(keys) if keys else empty), (torch.cat(values) if values else empty)

    def decode(
        self, query: torch.Tensor, cache: Any, block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
        window_index: torch.Tensor | None = None, scale: float | None = None, plan: Any = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float64 [batch, num_q_heads, head_dim]; an empty sequence attends to nothing and gives zeros. plan only
        saves the module host time and changes no result; out= receives the result (in its dtype) and is returned."""
        self._require("decode", window_index=window_index)
        batch, num_q_heads, d = query.shape
        group = num_q_heads // self._blocks(cache, "key")[0].shape[2]
        scale = 1 / math.sqrt(d) if scale is None else scale
        result = torch.zeros(batch, num_q_heads, d, dtype=torch.float64)
        rows = window_index.tolist() if window_index is not None else [None] * batch
        for b, (table, n, r) in enumerate(zip(block_tables.cpu(), seq_lens.tolist(), rows)):
            if n:
                result[b] = self._causal(cache, table, n, r, query[b : b + 1], group, scale)[0]
        return result if out is None else out.copy_(result)

    def attend(
        self, query: torch.Tensor, cache: Any, block_tables: torch.Tensor, seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor, *, window_index: torch.Tensor | None = None, scale: float | None = None,
    ) -> torch.Tensor:
        """float64 [total_q, num_q_heads, head_dim]: sequence b's query rows query_start_loc[b]:query_start_loc[b + 1]
        are its last q_len cached tokens, and token j of them sees cached positions 0 .. seq_lens[b] - q_len + j."""
        self._require("attend", window_index=window_index)
        total_q, num_q_heads, d = query.shape
        group = num_q_heads // self._blocks(cache, "key")[0].shape[2]
        scale = 1 / math.sqrt(d) if scale is None else scale
        out = torch.zeros(total_q, num_q_heads, d, dtype=torch.float64)
        starts = query_start_loc.tolist()
        rows = window_index.tolist() if window_index is not None else [None] * len(seq_lens)
        for b, (table, n, r) in enumerate(zip(block_tables.cpu(), seq_lens.tolist(), rows)):
            q_len = starts[b + 1] - starts[b]
            if not q_len:
                continue
            rows_b = slice(starts[b], starts[b + 1])
            out[rows_b] = self._causal(cache, table, n, r, query[rows_b], group, scale)
        return out

    def _causal(self, cache: Any, table: torch.Tensor, n: int, row: int | None, q: torch.Tensor, group: int,
                scale: float) -> torch.Tensor:
        """float64 [q_len, num_q_heads, head_dim]: one sequence's last q_len tokens q attending causally over its n
        cached tokens (token j sees positions 0 .. n - q_len + j; a single token sees them all)."""
        k = self.gather(cache, "key", table, n, row).repeat_interleave(group, dim=1)  # [n, Hq, d]
        v = self.gather(cache, "value", table, n, row).repeat_interleave(group, dim=1)
        q_len = q.shape[0]
        scores = torch.einsum("thd,nhd->htn", q.cpu().to(torch.float64), k) * scale
        visible = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]  # [q_len, n]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("htn,nhd->thd", p, v)


class RotatedBasisReference(Reference):
    """The reference of a scheme whose flatten also returns the rotated basis (Layout.flatten_rotated)."""

    def flatten(
        self,
        cache: Any,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        window_index: torch.Tensor | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        start_loc: torch.Tensor | None = None,
        rotated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference.flatten; rotated=True gives each side's values rotated as its codes hold them (R x)."""
        return self._flatten(cache, block_tables, seq_lens, window_index, out, start_loc, rotated)


def bind(scheme: Scheme | dict) -> Reference:
    """The reference for a scheme, given as a Scheme or as the plain data a generated module embeds."""
    if isinstance(scheme, dict):
        scheme = scheme_from_dict(scheme, source="<generated module>")
    return RotatedBasisReference(scheme) if plan(scheme).flatten_rotated else Reference(scheme)
