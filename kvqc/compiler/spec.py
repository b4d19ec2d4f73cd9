"""The scheme language: a YAML file becomes a frozen, validated `Scheme`.

Every check names the file, the field path and what was expected, in one line:

    schemes/x.yaml: key.codebook.bits: expected an integer 1..8, got 9

The YAML is read with a safe loader, refusing aliases, duplicate keys, deep nesting and large files, because
schemes come from users and the compiler turns them into source that engines import.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import keyword
import math
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from kvqc.numerics import rotation
from kvqc.files import read_regular

FORMAT_VERSION = 1
MAX_FILE_BYTES = 64 * 1024
MAX_DEPTH = 8
DEFAULT_HEAD_DIMS = (64, 128, 256)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
MAX_WINDOW = 4096
MAX_SINKS = 256
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,62}\Z")
# A scheme named like an importable module builds <name>.py, which that file's folder then imports in its place
# (`import torch` run from generated/ would get the module built from a scheme named torch). The standard library
# of this Python and of those before and after it (so that a scheme is valid on all of them), the packages kvqc and
# the engines it serves import, and files Python or pytest run by name.
SHADOWED_MODULES = frozenset(sys.stdlib_module_names) | frozenset(
    """
    aifc asynchat asyncore audioop cgi cgitb chunk crypt distutils imghdr imp lib2to3 mailcap msilib nis nntplib
    ossaudiodev pipes smtpd sndhdr spwd sunau telnetlib uu xdrlib
    torch triton numpy kvqc generated jinja2 markupsafe yaml hypothesis pytest transformers vllm lmdeploy
    safetensors tokenizers huggingface_hub accelerate datasets scipy sympy networkx filelock fsspec packaging
    setuptools pip wheel tqdm regex pandas matplotlib flash_attn xformers
    conftest setup sitecustomize usercustomize
    """.split()
)


class SchemeError(ValueError):
    """A scheme that cannot be compiled; str() is the one line a user sees."""

    def __init__(self, source: str, field: str, message: str):
        self.source, self.field, self.message = source, field, message
        # One line on a terminal whatever a file name or a YAML problem holds (a newline, an escape sequence).
        super().__init__(printable(f"{source}: {field}: {message}" if field else f"{source}: {message}"))


def printable(text: str) -> str:
    """text with every character a terminal would act on (controls, escapes, line and paragraph separators, bidi
    overrides, lone surrogates) written as a Python escape: what is shown is what is there, on one line."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text
    )


@dataclass(frozen=True)
class Rotation:
    kind: str = "none"  # none | hadamard
    signs: bool = False  # random +-1 flips before the Hadamard (the paper's randomized Hadamard)
    seed: int = 0


@dataclass(frozen=True)
class Scale:
    # norm: L2 norm, codes index the unit vector | minmax: affine (scale, zero) | absmax: symmetric (scale only)
    kind: str
    # token: scales per token, shared by group_size channels (None: the whole head) | channel: scales per
    # channel, shared by group_size consecutive tokens of a sequence (KIVI's keys)
    axis: str = "token"
    group_size: int | None = None
    unbiased: bool = False  # norm only: store |y|^2 / <y, y_hat> so that <q, y_hat> is unbiased (DRIVE/EDEN)


FP8_FORMATS = {"e4m3": (3, 7, 448.0), "e5m2": (2, 15, 57344.0)}  # mantissa bits, exponent bias, largest finite
# max|y| maps to 448 in both formats: e5m2's own largest (57344) would put max|y| / 57344 below float16's normal
# range (6.1e-5) for every row with max|y| < 3.5, and the stored scale would lose its precision; e5m2 still has
# 22 binades of normal values below 448.
FP8_TARGET = 448.0


@dataclass(frozen=True)
class Codebook:
    kind: str  # lloyd_max | uniform | fp8
    bits: int
    law: str = "gaussian"  # lloyd_max only: gaussian (N(0,1) limit) | sphere (exact unit-vector marginal)
    centroids: tuple[float, ...] | None = None  # lloyd_max only: explicit table in N(0,1) units
    format: str | None = None  # fp8 only: e4m3 (OCP E4M3FN, torch.float8_e4m3fn) | e5m2


@dataclass(frozen=True)
class Residual:
    kind: str = "none"  # none | sign (sign of the residual, scaled by its RMS) | qjl (sign of S r, with |r|)
    seed: int = 0


OUTLIER_SELECTS = ("variance", "rms", "fixed")


@dataclass(frozen=True)
class Outliers:
    """A channel split (the TurboQuant paper's outlier channels): `fraction` of each head's channels, chosen by
    `select`, are quantized on their own, with their own rotation, norm and `codebook`; the rest by the side's."""

    fraction: float  # of head_dim: 0.25 is 32 of 128
    select: str  # variance | rms: per layer and KV head, from calibration data | fixed: `channels`
    codebook: Codebook
    residual: Residual
    channels: tuple[int, ...] | None = None  # select: fixed (one head_dim only)

    def count(self, head_dim: int) -> int:
        return round(head_dim * self.fraction)


@dataclass(frozen=True)
class TensorScheme:
    """How one of K or V is quantized."""

    rotation: Rotation
    scale: Scale
    codebook: Codebook
    residual: Residual
    packing: str = "split"  # split: byte j, field i holds coordinate j + i*d/k | interleaved: j*k + i
    outliers: Outliers | None = None
    # calibrated: each vector minus a per-KV-head mean that `calibrate` sets from sample keys, quantized (keys
    # only) | none
    center: str = "none"

    @property
    def code_bits(self) -> int:
        return self.codebook.bits + (self.residual.kind != "none")

    @property
    def outlier_part(self) -> "TensorScheme | None":
        """The scheme of the outlier channels: this side's, with the outliers' codebook and residual."""
        o = self.outliers
        return None if o is None else replace(self, codebook=o.codebook, residual=o.residual, outliers=None)

    def part_dims(self, head_dim: int) -> tuple[int, int]:
        """(outlier channels, the rest) at head_dim; (0, head_dim) without a split."""
        n = self.outliers.count(head_dim) if self.outliers else 0
        return n, head_dim - n

    def groups(self, head_dim: int) -> int:
        """Sets of `metadata` fields stored per token and head. Per-channel scales store head_dim sets per group
        of group_size tokens, spread over the group's slots: head_dim / group_size per token as well."""
        return head_dim // self.scale.group_size if self.scale.group_size else 1

    @property
    def per_channel(self) -> bool:
        return self.scale.axis == "channel"

    @property
    def metadata(self) -> tuple[str, ...]:
        """Values stored per scale group (per token and head without groups), in the model dtype."""
        extra = {"none": (), "sign": ("residual_rms",), "qjl": ("residual_norm",)}[self.residual.kind]
        if self.scale.kind == "minmax":
            return ("scale", "zero") + extra
        if self.scale.kind == "absmax":
            return ("scale",) + extra
        return ("norm",) + extra


@dataclass(frozen=True)
class Scheme:
    name: str
    version: int
    description: str
    head_dims: tuple[int, ...]
    key: TensorScheme
    value: TensorScheme
    source: str = "<memory>"
    # The most recent `window` tokens of each sequence are also kept unquantized, in the model dtype, in a ring of
    # window slots per sequence; attention reads them from there. 0: no window.
    window: int = 0
    # Each sequence's first `sinks` tokens (attention sinks: positions 0..sinks-1) are kept unquantized beside the
    # ring, in the same per-sequence rows; attention reads them from there. 0: none. Needs a window.
    sinks: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Canonical plain data that `scheme_from_dict` reads back: what modules embed and the hash covers."""

        def codebook(c: Codebook) -> dict[str, Any]:
            out: dict[str, Any] = {"kind": c.kind, "bits": c.bits}
            if c.kind == "fp8":
                out["format"] = c.format
            if c.kind == "lloyd_max":
                out["law"] = c.law
                if c.centroids is not None:
                    out["centroids"] = list(c.centroids)
            return out

        def residual(r: Residual) -> dict[str, Any]:
            return {"kind": r.kind, "seed": r.seed} if r.kind == "qjl" else {"kind": r.kind}

        def tensor(t: TensorScheme) -> dict[str, Any]:
            rotation: dict[str, Any] = {"kind": t.rotation.kind}
            if t.rotation.kind == "hadamard":
                rotation.update(signs=t.rotation.signs, seed=t.rotation.seed)
            scale: dict[str, Any] = {"kind": t.scale.kind, "axis": t.scale.axis}
            # Optional fields appear only when set, so schemes written before them keep their content hash.
            if t.scale.group_size:
                scale["group_size"] = t.scale.group_size
            if t.scale.unbiased:
                scale["unbiased"] = True
            out = {
                "rotation": rotation,
                "scale": scale,
                "codebook": codebook(t.codebook),
                "residual": residual(t.residual),
                "packing": t.packing,
            }
            if t.center != "none":  # only when set, like scale's optional fields
                out["center"] = t.center
            if t.outliers:  # only when set, like scale's optional fields
                o = t.outliers
                out["outliers"] = {
                    "fraction": o.fraction,
                    "select": o.select,
                    "codebook": codebook(o.codebook),
                    "residual": residual(o.residual),
                }
                if o.channels is not None:
                    out["outliers"]["channels"] = list(o.channels)
            return out

        out = {
            "version": self.version,
            "name": self.name,
            "description": self.description,
            "head_dims": list(self.head_dims),
            "key": tensor(self.key),
            "value": tensor(self.value),
        }
        if self.window:
            out["window"] = self.window
        if self.sinks:
            out["sinks"] = self.sinks
        return out

    @property
    def content_hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def bits_per_coordinate(self, head_dim: int, metadata_bytes: int = 2) -> tuple[float, float]:
        """Stored bits per coordinate for K and V, metadata included (both parts of a channel split)."""

        def bits(t: TensorScheme, d: int) -> float:
            return d * t.code_bits + 8 * metadata_bytes * len(t.metadata) * t.groups(d) if d else 0.0

        return tuple(  # type: ignore[return-value]
            (
                (bits(t.outlier_part, t.part_dims(head_dim)[0]) if t.outliers else 0.0)
                + bits(t, t.part_dims(head_dim)[1])
            )
            / head_dim
            for t in (self.key, self.value)
        )


# --------------------------------------------------------------------------------------------------------------
# Reading YAML safely


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one silently."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str):
            raise yaml.constructor.ConstructorError(
                None, None, f"mapping keys must be strings, got {key!r}", key_node.start_mark
            )
        if key in out:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(text: str, source: str) -> Any:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise SchemeError(source, "", f"file is larger than {MAX_FILE_BYTES} bytes; a scheme is a short file")
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise SchemeError(source, "", "YAML anchors and aliases are not allowed; write values out")
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise SchemeError(source, "", f"nesting deeper than {MAX_DEPTH} levels")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except SchemeError:
        raise
    except (ValueError, OverflowError) as exc:  # PyYAML's int() of a number too long to convert
        raise SchemeError(source, "", f"invalid YAML: {str(exc).splitlines()[0][:80]}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SchemeError(source, "", f"invalid YAML: {where}{problem}") from None


# --------------------------------------------------------------------------------------------------------------
# Field validation


class _Fields:
    """Reads one mapping, remembering its path so every error names the field."""

    def __init__(self, source: str, path: str, data: Any, allowed: tuple[str, ...]):
        self.source, self.path = source, path
        if not isinstance(data, dict):
            self.fail("", f"expected a mapping with fields {', '.join(allowed)}, got {_show(data)}")
        for key in data:
            if key not in allowed:
                hint = difflib.get_close_matches(key, allowed, n=1)
                fix = f"did you mean '{hint[0]}'?" if hint else f"expected one of {', '.join(allowed)}"
                self.fail(key, f"unknown field; {fix}")
        self.data = data

    def field(self, name: str) -> str:
        # A key that is not an identifier is quoted, so the path stays one unambiguous line.
        name = name if all(part.isidentifier() for part in name.split(".")) or not name else repr(name)
        return f"{self.path}.{name}" if self.path and name else (self.path or name)

    def fail(self, name: str, message: str):
        raise SchemeError(self.source, self.field(name), message)

    def has(self, name: str) -> bool:
        return name in self.data

    def require(self, name: str) -> Any:
        if name not in self.data:
            self.fail(name, "missing required field")
        return self.data[name]

    def integer(self, name: str, lo: int, hi: int, default: int | None = None) -> int:
        value = self.data.get(name, default) if default is not None else self.require(name)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.fail(name, f"expected an integer {lo}..{hi}, got {_show(value)}")
        return value

    def choice(self, name: str, options: tuple[str, ...], default: str | None = None) -> str:
        value = self.data.get(name, default) if default is not None else self.require(name)
        if not isinstance(value, str) or value not in options:
            hint = difflib.get_close_matches(value, options, n=1) if isinstance(value, str) else []
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            self.fail(name, f"expected one of {', '.join(options)}, got {_show(value)}{extra}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if not isinstance(value, bool):
            self.fail(name, f"expected true or false, got {_show(value)}")
        return value


def _show(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 1024:  # repr() refuses past 4300 digits
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(source: str, path: str, data: Any, kinds: tuple[str, ...], fields: tuple[str, ...]) -> _Fields:
    """A stage is `kind` or `{kind: ..., more fields}`: the string form is shorthand for the mapping."""
    if isinstance(data, str):
        data = {"kind": data}
    f = _Fields(source, path, data, ("kind",) + fields)
    f.choice("kind", kinds)
    return f


def _rotation(source: str, path: str, data: Any) -> Rotation:
    f = _kind(source, path, data, ("none", "hadamard"), ("signs", "seed"))
    if f.data["kind"] == "none":
        for extra in ("signs", "seed"):
            if f.has(extra):
                f.fail(extra, "only meaningful with kind: hadamard; remove it")
        return Rotation()
    return Rotation("hadamard", f.boolean("signs", False), f.integer("seed", 0, 2**32 - 1, default=0))


def _scale(source: str, path: str, data: Any) -> Scale:
    f = _kind(source, path, data, ("norm", "minmax", "absmax"), ("axis", "group_size", "unbiased"))
    kind = f.data["kind"]
    axis = f.choice("axis", ("token", "channel"), default="token")
    if axis == "channel" and kind == "norm":
        f.fail("axis", "a norm scale is per token (codes index the unit vector); use kind: minmax or absmax")
    if axis == "channel" and not f.has("group_size"):
        f.fail("group_size", "missing required field: per-channel scales are shared by group_size tokens (KIVI: 32)")
    group_size = None
    if f.has("group_size"):
        if kind == "norm":
            f.fail("group_size", "a norm scale covers the whole head (codes index the unit vector); remove it")
        group_size = f.integer("group_size", 2, 256)
        if group_size & (group_size - 1):
            f.fail("group_size", f"expected a power of two 2..256, got {group_size}")
    unbiased = f.boolean("unbiased", False)
    if unbiased and kind != "norm":
        f.fail("unbiased", "only meaningful with kind: norm; remove it")
    return Scale(kind, axis, group_size, unbiased)


CODEBOOK_KINDS = ("lloyd_max", "uniform", "fp8")  # each has a codec, kvqc/compiler/pieces/codecs/
RESIDUAL_KINDS = ("none", "sign", "qjl")


def _codebook(source: str, path: str, data: Any) -> Codebook:
    f = _Fields(source, path, data, ("kind", "bits", "law", "centroids", "format"))
    kind = f.choice("kind", CODEBOOK_KINDS)
    if kind != "fp8" and f.has("format"):
        f.fail("format", "only meaningful with kind: fp8; remove it")
    if kind == "fp8":
        for extra in ("law", "centroids"):
            if f.has(extra):
                f.fail(extra, "only meaningful with kind: lloyd_max; remove it")
        if f.has("bits") and (type(f.data["bits"]) is not int or f.data["bits"] != 8):
            f.fail("bits", f"fp8 codes are always 8 bits, got {_show(f.data['bits'])}; remove bits")
        if not f.has("format"):
            f.fail("format", f"missing required field; expected one of {', '.join(FP8_FORMATS)}")
        return Codebook(kind, 8, format=f.choice("format", tuple(FP8_FORMATS)))
    bits = f.integer("bits", 1, 8)
    if kind == "uniform":
        for extra in ("law", "centroids"):
            if f.has(extra):
                f.fail(extra, "only meaningful with kind: lloyd_max; remove it")
        return Codebook(kind, bits)
    law = f.choice("law", ("gaussian", "sphere"), default="gaussian")
    centroids = None
    if f.has("centroids"):
        raw = f.data["centroids"]
        n = 2**bits
        ok = isinstance(raw, list) and len(raw) == n
        ok = ok and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in raw)
        ok = ok and all(abs(c) <= 16 and math.isfinite(c) for c in raw) and all(a < b for a, b in zip(raw, raw[1:]))
        if not ok:
            f.fail("centroids", f"expected {n} strictly increasing finite numbers in N(0,1) units (|c| <= 16)")
        centroids = tuple(float(c) for c in raw)
    return Codebook(kind, bits, law, centroids)


def _residual(source: str, path: str, data: Any) -> Residual:
    f = _kind(source, path, data, RESIDUAL_KINDS, ("seed",))
    if f.data["kind"] != "qjl":
        if f.has("seed"):
            f.fail("seed", "only meaningful with kind: qjl; remove it")
        return Residual(f.data["kind"])
    return Residual("qjl", f.integer("seed", 0, 2**32 - 1, default=0))


def _tensor(source: str, path: str, data: Any) -> TensorScheme:
    f = _Fields(source, path, data, ("rotation", "scale", "codebook", "residual", "packing", "outliers", "center"))
    t = TensorScheme(
        rotation=_rotation(source, f.field("rotation"), f.data.get("rotation", "none")),
        scale=_scale(source, f.field("scale"), f.require("scale")),
        codebook=_codebook(source, f.field("codebook"), f.require("codebook")),
        residual=_residual(source, f.field("residual"), f.data.get("residual", "none")),
        packing=f.choice("packing", ("split", "interleaved"), default="split"),
        center=f.choice("center", ("none", "calibrated"), default="none"),
    )
    if t.center != "none":
        # Attention is unchanged by a constant subtracted from every key (softmax cancels it); a value mean would
        # have to be added back to every output, and a per-channel or split layout has no use for it.
        if path != "key":
            f.fail("center", "only keys are centered (attention cancels a key mean, not a value mean); remove it")
        if t.per_channel:
            f.fail(
                "center",
                "per-channel scales already remove each channel's offset; remove center or use axis: token",
            )
        if f.has("outliers"):
            f.fail("center", "a centered side cannot have a channel split; remove center or outliers")
        if t.packing != "split":
            f.fail("center", "a centered side needs split packing; use packing: split")
    _check_combination(f, t, "")
    if f.has("outliers"):
        t = replace(t, outliers=_outliers(source, f.field("outliers"), f.data["outliers"], t))
        _check_combination(f, t.outlier_part, "outliers.")
        if t.per_channel:
            f.fail(
                "outliers",
                "per-channel scales already give each channel its own range; remove outliers or use axis: token",
            )
        if t.packing != "split":
            f.fail("packing", "a channel split needs split packing; use split")
    return t


def _outliers(source: str, path: str, data: Any, side: TensorScheme) -> Outliers:
    f = _Fields(source, path, data, ("fraction", "select", "codebook", "residual", "channels"))
    fraction = f.require("fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        f.fail(
            "fraction",
            f"expected the share of head_dim's channels, a number between 0 and 1 (0.25: 32 of 128), "
            f"got {_show(fraction)}",
        )
    select = f.choice("select", OUTLIER_SELECTS, default="variance")
    channels = None
    if select == "fixed":
        raw = f.require("channels")
        if (
            not isinstance(raw, list)
            or not raw
            or any(type(c) is not int or not 0 <= c < 4096 for c in raw)
            or len(set(raw)) != len(raw)
        ):
            f.fail("channels", f"expected a list of distinct channel indices (ints from 0), got {_show(raw)}")
        channels = tuple(sorted(raw))
    elif f.has("channels"):
        f.fail("channels", "only meaningful with select: fixed; remove it")
    return Outliers(
        fraction=float(fraction),
        select=select,
        codebook=_codebook(source, f.field("codebook"), f.require("codebook")),
        residual=_residual(source, f.field("residual"), f.data.get("residual", "none")),
        channels=channels,
    )


def _check_combination(f: _Fields, t: TensorScheme, prefix: str) -> None:
    """Combinations the templates cannot honour are refused here, never compiled into something wrong."""
    if t.codebook.kind == "lloyd_max" and t.scale.kind != "norm":
        f.fail(
            prefix + "codebook" if prefix else "scale",
            "codebook kind lloyd_max indexes a unit vector and needs scale: norm",
        )
    if t.codebook.kind == "uniform" and t.scale.kind not in ("minmax", "absmax"):
        f.fail(
            prefix + "codebook" if prefix else "scale",
            "codebook kind uniform is an integer grid and needs scale: minmax or absmax",
        )
    if t.codebook.kind == "uniform" and t.scale.kind == "absmax" and t.codebook.bits < 2:
        f.fail(prefix + "codebook.bits", "a symmetric (absmax) grid needs 2 or more bits; use scale: minmax for 1 bit")
    if t.codebook.kind == "fp8" and t.scale.kind != "absmax":
        f.fail(
            prefix + "codebook" if prefix else "scale",
            "codebook kind fp8 needs scale: absmax (the largest |y| maps to the format's largest value)",
        )
    if t.scale.unbiased and t.residual.kind == "qjl":
        f.fail(
            prefix + "residual" if prefix else "scale.unbiased",
            "a qjl residual is already unbiased; remove unbiased or use residual: none or sign",
        )
    if t.scale.group_size and not t.per_channel and t.packing == "interleaved" and t.code_bits < 8:
        f.fail("packing", "scale groups need split packing (groups are runs of stored positions); use split")
    if t.residual.kind != "none" and t.codebook.kind != "lloyd_max" and (t.scale.group_size or t.per_channel):
        # The residual's one stored value (RMS or norm) is per token: it would need a place beside every group.
        f.fail(
            prefix + "residual",
            f"a {t.residual.kind} residual needs one scale per token (no scale.group_size); use residual: none",
        )
    if t.per_channel and t.rotation.kind != "none":
        # Per-channel scales exist to fence off outlier channels, and a rotation spreads every channel over all.
        f.fail("rotation", "per-channel scales (scale.axis: channel) work on the channels as given; use rotation: none")
    if t.per_channel and t.packing != "split":
        f.fail("packing", "per-channel scales need split packing (stored positions are the channels); use split")
    if t.code_bits > 8:
        f.fail(prefix + "codebook.bits", f"{t.codebook.bits} bits plus a 1-bit residual exceed 8 bits per coordinate")
    if t.packing == "interleaved" and t.code_bits not in (1, 2, 4, 8):
        f.fail("packing", f"interleaved packing needs 1, 2, 4 or 8 code bits, got {t.code_bits}; use split")


def scheme_from_dict(data: Any, source: str = "<memory>", default_name: str | None = None) -> Scheme:
    f = _Fields(source, "", data, ("version", "name", "description", "head_dims", "key", "value", "window", "sinks"))
    version = f.require("version")
    if type(version) is not int or version != FORMAT_VERSION:
        f.fail("version", f"expected {FORMAT_VERSION} (the only scheme format this kvqc reads), got {_show(version)}")
    name = f.data.get("name", default_name)
    if not isinstance(name, str) or not NAME_RE.match(name):
        f.fail("name", f"expected a lowercase identifier like turbo_k4v2 ([a-z][a-z0-9_]*), got {_show(name)}")
    if keyword.iskeyword(name):
        f.fail(
            "name",
            f"'{name}' is a Python keyword, so {name}.py cannot be imported by name; "
            f"choose another name, e.g. {name}_kv",
        )
    if name in SHADOWED_MODULES:
        f.fail(
            "name",
            f"'{name}' would build {name}.py, which code run from its folder imports in place of the module {name}; "
            f"choose another name, e.g. {name}_kv",
        )
    description = f.data.get("description", "")
    if not isinstance(description, str) or len(description) > 2000:
        f.fail("description", "expected a string of at most 2000 characters")
    head_dims = f.data.get("head_dims", list(DEFAULT_HEAD_DIMS))
    if (
        not isinstance(head_dims, list)
        or not head_dims
        or any(type(d) is not int or d not in SUPPORTED_HEAD_DIMS for d in head_dims)
        or len(set(head_dims)) != len(head_dims)
    ):
        f.fail(
            "head_dims",
            f"expected a list of distinct values from {list(SUPPORTED_HEAD_DIMS)}, got {_show(head_dims)}",
        )
    scheme = Scheme(
        name=name,
        version=version,
        description=description,
        head_dims=tuple(sorted(head_dims)),
        key=_tensor(source, "key", f.require("key")),
        value=_tensor(source, "value", f.require("value")),
        source=source,
        window=f.integer("window", 1, MAX_WINDOW) if f.has("window") else 0,
        sinks=f.integer("sinks", 1, MAX_SINKS) if f.has("sinks") else 0,
    )
    odd = [d for d in scheme.head_dims if d & (d - 1)]
    if scheme.key.center != "none" and odd:
        f.fail("head_dims", f"a centered key needs power-of-two head_dims; remove {odd}")
    if scheme.sinks and not scheme.window:
        # The sinks live in the per-sequence rows the window's ring has, read by the ring's decode split.
        f.fail(
            "sinks",
            "attention sinks are kept in the recent-token window's per-sequence rows; add window: N at the top level",
        )
    for side in ("key", "value"):
        t: TensorScheme = getattr(scheme, side)
        if t.outliers:
            _check_split(f, scheme, side, t)
            continue
        # Kernels unpack one byte field per column chunk of head_dim * (narrowest plane width) / 8 columns, and
        # tl.dot needs chunks of 16 or more (a zero-padded 8-column path was wrong when compiled on an H200).
        narrowest = min(b for b in (1, 2, 4, 8) if t.code_bits & b)
        too_small = [d for d in scheme.head_dims if d * narrowest // 8 < 16]
        if too_small:
            f.fail(
                "head_dims",
                f"{side}'s {t.code_bits}-bit codes need head_dim >= {128 // narrowest} (a {narrowest}-bit plane); "
                f"remove {too_small}",
            )
        if t.per_channel:
            g = t.scale.group_size
            if scheme.sinks:
                f.fail(
                    "sinks",
                    f"{side}'s per-channel scales with attention sinks are not supported; remove sinks or use "
                    "scale.axis: token",
                )
            odd = [d for d in scheme.head_dims if d & (d - 1)]
            if odd:
                f.fail("head_dims", f"{side}'s per-channel scales need power-of-two head_dims; remove {odd}")
            if scheme.window < g:
                f.fail(
                    "window" if scheme.window else f"{side}.scale.axis",
                    f"{side}'s per-channel scales wait for {g} tokens (group_size) before quantizing them: "
                    f"add window: {g} or more at the top level" + (f", got {scheme.window}" if scheme.window else ""),
                )
            # A group's head_dim x fields values are spread over its slots, head_dim / group_size channels a slot.
            uneven = [d for d in scheme.head_dims if d % g]
            if uneven:
                f.fail(
                    f"{side}.scale.group_size",
                    f"a group's metadata is spread over its {g} slots, {uneven[0]} / {g} channels a slot, which needs "
                    f"group_size to divide head_dim {uneven[0]}; use a group_size of at most {uneven[0]} "
                    f"or remove {uneven}",
                )
            continue
        # Kernels unpack chunks of d * narrowest / 8 consecutive columns. A scale group either lies inside one
        # (fill reduces it there) or covers whole consecutive chunks (fill combines their partial statistics).
        g = t.scale.group_size
        bad = [d for d in scheme.head_dims if g and not _group_fits(g, d, d * narrowest // 8)]
        if bad:
            d, chunk = bad[0], bad[0] * narrowest // 8
            f.fail(
                f"{side}.scale.group_size",
                f"group_size {g} is larger than head_dim {d}; use a smaller group_size or remove {bad}"
                if g > d
                else f"group_size {g} must divide the {chunk}-column chunks that {side}'s {t.code_bits}-bit codes "
                f"unpack at head_dim {d}, or be a multiple of them that divides head_dim; use a group_size that "
                f"divides {chunk} or remove {bad}",
            )
    return scheme


def _check_split(f: _Fields, scheme: Scheme, side: str, t: TensorScheme) -> None:
    """A channel split makes two sub-heads of head_dim * fraction and the rest: each must be one the kernels can
    unpack (chunks of 16 or more real columns), rotate (a Hadamard order) and group, at every listed head_dim."""
    o = t.outliers
    where = f"{side}.outliers"
    if scheme.window:
        f.fail(where, "a channel split with a recent-token window is not supported yet; remove window or outliers")
    odd = [d for d in scheme.head_dims if d & (d - 1)]
    if odd:
        f.fail("head_dims", f"{side}'s channel split needs power-of-two head_dims; remove {odd}")
    for d in scheme.head_dims:
        n = o.count(d)
        if abs(d * o.fraction - n) > 1e-9 or not 0 < n < d:
            f.fail(
                f"{where}.fraction",
                f"{o.fraction} of head_dim {d} is not a whole number of channels between 1 and {d - 1}; "
                f"use a multiple of 1/{d}",
            )
    if o.channels is not None:
        if len(scheme.head_dims) != 1:
            f.fail(
                f"{where}.channels",
                f"fixed channels name one head_dim's channels; list one head_dim, got {list(scheme.head_dims)}",
            )
        d = scheme.head_dims[0]
        if len(o.channels) != o.count(d) or max(o.channels) >= d:
            f.fail(
                f"{where}.channels",
                f"expected {o.count(d)} distinct channels 0..{d - 1} ({o.fraction} of head_dim {d}), "
                f"got {len(o.channels)} up to {max(o.channels)}",
            )
    for label, part, index in ((f"{where}.codebook", t.outlier_part, 0), (f"{side}.codebook", t, 1)):
        what = "outlier" if index == 0 else "other"
        narrowest = min(b for b in (1, 2, 4, 8) if part.code_bits & b)
        for d in scheme.head_dims:
            p = t.part_dims(d)[index]
            if p * narrowest % 8 or p * narrowest // 8 < 16:
                f.fail(
                    label,
                    f"at head_dim {d} the {p} {what} channels with {part.code_bits}-bit codes unpack "
                    f"{p * narrowest / 8:g}-column chunks (a {narrowest}-bit plane); kernels need whole chunks of 16 "
                    "or more: change fraction or bits",
                )
            if part.rotation.kind == "hadamard":
                try:
                    rotation.hadamard_factors(p)
                except ValueError:
                    f.fail(
                        f"{where}.fraction",
                        f"at head_dim {d} the {p} {what} channels have no Hadamard matrix "
                        "(orders 2^k, 12 * 2^k, 20 * 2^k); change fraction",
                    )
            g = part.scale.group_size
            chunk = p * narrowest // 8
            # As for a whole side (_group_fits), except that a group may span chunks only of an unpadded part.
            if g and not (_group_fits(g, p, chunk) and (chunk % g == 0 or not p & (p - 1))):
                f.fail(
                    f"{side}.scale.group_size",
                    f"group_size {g} must divide the {chunk}-column chunks of the {p} {what} channels at head_dim {d}; "
                    f"use a group_size that divides {chunk}",
                )


def _group_fits(group_size: int, head_dim: int, chunk: int) -> bool:
    """A per-token scale group of group_size channels lies inside one chunk of `chunk` columns, or covers whole
    consecutive chunks of the head (the chunk divides the group, the group divides head_dim)."""
    return chunk % group_size == 0 or (group_size % chunk == 0 and head_dim % group_size == 0)


def load_scheme(path: str | Path) -> Scheme:
    """Read and validate a scheme file; raises SchemeError with a one-line message."""
    path = Path(path)
    source = str(path)
    try:
        raw = read_regular(path, MAX_FILE_BYTES)
    except OSError as exc:
        raise SchemeError(source, "", f"cannot read file ({exc.strerror or exc})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise SchemeError(source, "", f"file is larger than {MAX_FILE_BYTES} bytes; a scheme is a short file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SchemeError(source, "", "not UTF-8 text") from None
    data = _read_yaml(text, source)
    stem = path.stem if NAME_RE.match(path.stem) else None
    return scheme_from_dict(data, source, default_name=stem)
