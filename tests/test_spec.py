"""The scheme language (kvqc/compiler/spec.py): shipped schemes load, valid schemes round-trip through their canonical
form, and every invalid input is refused with one SchemeError line naming the file, the field and what was
expected -- never another exception.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import keyword
import math
from pathlib import Path

import pytest
import yaml
from conftest import ALL_SCHEMES as SCHEMES
from conftest import ROOT
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvqc.compiler import spec
from kvqc.compiler.spec import (
    FORMAT_VERSION,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    SUPPORTED_HEAD_DIMS,
    SchemeError,
    load_scheme,
    scheme_from_dict,
)

SCHEME_DIR = ROOT / "kvqc" / "schemes"
DEFAULT_PACKING = spec.TensorScheme.__dataclass_fields__["packing"].default  # works for any 3, 5, 6 or 7-bit code
# A fuzz test draws many more examples than a unit test; scaled with the profile (ci 6 -> 60, deep 60 -> 600).
FUZZ = settings(max_examples=10 * settings.default.max_examples)
BASE = {name: yaml.safe_load((SCHEME_DIR / f"{name}.yaml").read_text(encoding="utf-8")) for name in SCHEMES}


def _write(tmp_path: Path, text: str | bytes, name: str = "scheme.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _refused(path: Path) -> SchemeError:
    with pytest.raises(SchemeError) as info:
        load_scheme(path)
    exc = info.value
    _assert_one_line(exc, str(path))
    return exc


def _assert_one_line(exc: SchemeError, source: str) -> None:
    text = str(exc)
    assert "\n" not in text and "\r" not in text, repr(text)
    assert exc.source == source
    assert exc.message, "an error must say what was expected"
    if exc.field:
        assert text == f"{source}: {exc.field}: {exc.message}"
    else:
        assert text == f"{source}: {exc.message}"


# --------------------------------------------------------------------------------------------------------------
# Shipped schemes


@pytest.mark.parametrize("name", SCHEMES)
def test_shipped_scheme_loads_and_is_canonical(name):
    path = SCHEME_DIR / f"{name}.yaml"
    scheme = load_scheme(path)
    assert scheme.name == name == path.stem
    assert scheme.version == FORMAT_VERSION
    assert scheme.source == str(path)
    assert scheme.description.strip()
    assert list(scheme.head_dims) == sorted(scheme.head_dims)
    assert all(type(d) is int and d in SUPPORTED_HEAD_DIMS for d in scheme.head_dims)

    data = scheme.to_dict()
    json.dumps(data)  # plain data only
    assert scheme_from_dict(data, str(path)) == scheme
    assert scheme_from_dict(copy.deepcopy(data), "elsewhere.yaml").content_hash == scheme.content_hash
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    assert scheme.content_hash == hashlib.sha256(blob).hexdigest()
    # The canonical form survives a YAML round trip unchanged.
    again = scheme_from_dict(yaml.safe_load(yaml.safe_dump(data)), "again.yaml")
    assert again.to_dict() == data and again.content_hash == scheme.content_hash


def test_shipped_schemes_have_distinct_hashes():
    hashes = {load_scheme(SCHEME_DIR / f"{n}.yaml").content_hash for n in SCHEMES}
    assert len(hashes) == len(SCHEMES)


@pytest.mark.parametrize(
    "name, bits, metadata",
    [
        ("turbo_k4v2", (4.25, 2.125), (("norm", "residual_rms"), ("norm",))),
        ("turbo_k4mse_v2", (4.125, 2.125), (("norm",), ("norm",))),
        ("turbo_qjl_k3v3", (3.25, 3.125), (("norm", "residual_norm"), ("norm",))),
        ("int8_token", (8.25, 8.25), (("scale", "zero"), ("scale", "zero"))),
        ("int4_token", (4.25, 4.25), (("scale", "zero"), ("scale", "zero"))),
        ("metal_q5_0_q3_0", (5.5, 3.125), (("scale",), ("norm",))),
    ],
)
def test_bits_per_coordinate_at_128(name, bits, metadata):
    scheme = load_scheme(SCHEME_DIR / f"{name}.yaml")
    assert scheme.bits_per_coordinate(128) == pytest.approx(bits)
    assert (scheme.key.metadata, scheme.value.metadata) == metadata


def test_turbo_k4v2_is_what_lmdeploy_uses():
    s = load_scheme(SCHEME_DIR / "turbo_k4v2.yaml")
    assert (s.key.rotation.kind, s.key.rotation.signs, s.key.scale.kind) == ("hadamard", False, "norm")
    assert (s.key.codebook.bits, s.key.residual.kind, s.key.code_bits, s.key.packing) == (3, "sign", 4, "split")
    assert (s.value.codebook.bits, s.value.residual.kind, s.value.code_bits) == (2, "none", 2)
    assert len(s.key.codebook.centroids) == 8 and len(s.value.codebook.centroids) == 4


def test_scheme_is_frozen():
    s = load_scheme(SCHEME_DIR / "int8_token.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.key.codebook.bits = 2  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------------------
# Defaults and equivalent spellings

MINIMAL = """version: 1
key: {scale: minmax, codebook: {kind: uniform, bits: 8}}
value: {scale: minmax, codebook: {kind: uniform, bits: 8}}
"""


def test_defaults(tmp_path):
    s = load_scheme(_write(tmp_path, MINIMAL, "my_scheme2.yaml"))
    assert s.name == "my_scheme2"  # from the file name
    assert s.description == ""
    assert s.head_dims == (64, 128, 256)
    for t in (s.key, s.value):
        assert (t.rotation.kind, t.residual.kind, t.packing, t.scale.axis) == ("none", "none", DEFAULT_PACKING, "token")


def test_name_field_wins_over_file_name(tmp_path):
    s = load_scheme(_write(tmp_path, MINIMAL + "name: chosen\n", "file_name.yaml"))
    assert s.name == "chosen"


@pytest.mark.parametrize("stem", ["My-Scheme", "1st", "UPPER", "with space", "é"])
def test_invalid_file_name_needs_a_name_field(tmp_path, stem):
    exc = _refused(_write(tmp_path, MINIMAL, f"{stem}.yaml"))
    assert exc.field == "name" and "got None" in exc.message
    assert load_scheme(_write(tmp_path, MINIMAL + "name: ok\n", f"{stem}.yaml")).name == "ok"


def test_shorthand_and_order_do_not_change_the_hash(tmp_path):
    long = f"""
version: 1
name: same
head_dims: [256, 64, 128]
key:
  rotation: {{kind: hadamard, signs: false, seed: 0}}
  scale: {{kind: norm, axis: token}}
  codebook: {{kind: lloyd_max, bits: 3, law: gaussian}}
  residual: {{kind: sign}}
  packing: {DEFAULT_PACKING}
value:
  rotation: {{kind: none}}
  scale: {{kind: minmax}}
  codebook: {{kind: uniform, bits: 4}}
  residual: {{kind: none}}
"""
    short = """
version: 1
name: same
key: {rotation: hadamard, scale: norm, codebook: {kind: lloyd_max, bits: 3}, residual: sign}
value: {scale: minmax, codebook: {kind: uniform, bits: 4}}
"""
    a, b = load_scheme(_write(tmp_path, long, "a.yaml")), load_scheme(_write(tmp_path, short, "b.yaml"))
    assert a.to_dict() == b.to_dict() and a.content_hash == b.content_hash
    assert a.head_dims == (64, 128, 256)


def test_hash_covers_what_the_kernels_depend_on():
    base = load_scheme(SCHEME_DIR / "turbo_qjl_k3v3.yaml")
    seen = {base.content_hash}
    for path, value in [
        (("key", "rotation", "seed"), 2),
        (("key", "residual", "seed"), 8),
        (("value", "codebook", "bits"), 2),
        (("value", "codebook", "law"), "gaussian"),
        (("head_dims",), [128]),
        (("name",), "other"),
    ]:
        data = copy.deepcopy(BASE["turbo_qjl_k3v3"])
        node = data
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        seen.add(scheme_from_dict(data).content_hash)
    assert len(seen) == 7


# --------------------------------------------------------------------------------------------------------------
# Field errors: (scheme, edit, field, expected text in the message)


def _set(path, value):
    def edit(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return edit


def _del(path):
    def edit(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]

    return edit


FIELD_ERRORS = [
    ("int8_token", _set(("key", "codebook", "bits"), 9), "key.codebook.bits", "expected an integer 1..8, got 9"),
    ("int8_token", _set(("key", "codebook", "bits"), 0), "key.codebook.bits", "expected an integer 1..8, got 0"),
    ("int8_token", _set(("value", "codebook", "bits"), -1), "value.codebook.bits", "expected an integer 1..8"),
    ("int8_token", _set(("key", "codebook", "bits"), True), "key.codebook.bits", "got True"),
    ("int8_token", _set(("key", "codebook", "bits"), "4"), "key.codebook.bits", "got '4'"),
    ("int8_token", _set(("key", "codebook", "bits"), 4.0), "key.codebook.bits", "got 4.0"),
    ("int8_token", _set(("key", "codebook", "bits"), 2**64), "key.codebook.bits", "expected an integer 1..8"),
    ("int8_token", _set(("key", "codebook", "bits"), None), "key.codebook.bits", "got None"),
    ("int8_token", _set(("key", "codebook", "bits"), [4]), "key.codebook.bits", "got [4]"),
    ("int8_token", _del(("key", "codebook", "bits")), "key.codebook.bits", "missing required field"),
    ("int8_token", _del(("key", "codebook")), "key.codebook", "missing required field"),
    ("int8_token", _del(("value", "scale")), "value.scale", "missing required field"),
    ("int8_token", _del(("value",)), "value", "missing required field"),
    ("int8_token", _del(("version",)), "version", "missing required field"),
    ("int8_token", _set(("version",), 2), "version", "expected 1"),
    ("int8_token", _set(("version",), "1"), "version", "got '1'"),
    ("int8_token", _set(("version",), True), "version", "got True"),
    ("int8_token", _set(("key",), 5), "key", "expected a mapping with fields rotation, scale, codebook"),
    ("int8_token", _set(("key",), ["scale", "minmax"]), "key", "expected a mapping"),
    ("int8_token", _set(("key", "rotaton"), "hadamard"), "key.rotaton", "unknown field; did you mean 'rotation'?"),
    ("int8_token", _set(("colour",), "blue"), "colour", "unknown field; expected one of version, name"),
    ("int8_token", _set(("key", "codebook", "kind"), "unifrom"), "key.codebook.kind", "(did you mean 'uniform'?)"),
    ("int8_token", _set(("key", "codebook", "kind"), 3), "key.codebook.kind",
     "expected one of lloyd_max, uniform, fp8, got 3"),
    ("int8_token", _set(("key", "rotation"), "hadamrd"), "key.rotation.kind", "did you mean 'hadamard'?"),
    ("int8_token", _set(("key", "rotation"), {"kind": "none", "seed": 3}), "key.rotation.seed",
     "only meaningful with kind: hadamard"),
    ("int8_token", _set(("key", "rotation"), {"kind": "hadamard", "seed": -1}), "key.rotation.seed",
     "expected an integer 0..4294967295"),
    ("int8_token", _set(("key", "rotation"), {"kind": "hadamard", "seed": 2**32}), "key.rotation.seed",
     "got 4294967296"),
    ("int8_token", _set(("key", "rotation"), {"kind": "hadamard", "signs": "maybe"}), "key.rotation.signs",
     "expected true or false"),
    ("int8_token", _set(("key", "rotation"), {"kind": "hadamard", "signs": 1}), "key.rotation.signs", "got 1"),
    ("int8_token", _set(("key", "rotation"), None), "key.rotation", "expected a mapping"),
    ("int8_token", _set(("key", "scale"), {"kind": "minmax", "axis": "channel"}), "key.scale.group_size",
     "missing required field: per-channel"),
    ("int8_token", _set(("key", "scale"), {"kind": "minmax", "axis": "channel", "group_size": 32}), "key.scale.axis",
     "add window: 32 or more"),
    ("int8_token", _set(("window",), 0), "window", "expected an integer 1..4096, got 0"),
    ("int8_token", _set(("window",), 4097), "window", "expected an integer 1..4096"),
    ("int8_token", _set(("window",), "64"), "window", "got '64'"),
    ("int8_token", _set(("window",), 1), "window", None),
    ("kivi_k2v2", _set(("window",), 16), "window",
     "wait for 32 tokens (group_size) before quantizing them: add window: 32 or more at the top level, got 16"),
    ("kivi_k2v2", _set(("window",), 32), "window", None),
    ("int8_token", _set(("sinks",), 4), "sinks", "add window: N at the top level"),
    ("turbo_k4v2_w8", _set(("sinks",), 0), "sinks", "expected an integer 1..256, got 0"),
    ("turbo_k4v2_w8", _set(("sinks",), 257), "sinks", "expected an integer 1..256"),
    ("turbo_k4v2_w8", _set(("sinks",), 4), "sinks", None),
    ("kivi_k2v2", _set(("sinks",), 4), "sinks",
     "per-channel scales with attention sinks are not supported; remove sinks"),
    ("turbo_k4v2_w8", _set(("key", "center"), "calibrated"), "key.center", None),
    ("turbo_k4v2", _set(("key", "center"), "calibrated"), "key.center", None),  # no window needed
    ("turbo_k4v2_w8", _set(("key", "center"), "mean"), "key.center", "expected one of none, calibrated, got 'mean'"),
    ("turbo_k4v2_w8", _set(("value", "center"), "calibrated"), "value.center", "only keys are centered"),
    ("kivi_k2v2", _set(("key", "center"), "calibrated"), "key.center",
     "per-channel scales already remove each channel's offset"),
    ("turbo_outlier_2p5", _set(("key", "center"), "calibrated"), "key.center", "cannot have a channel split"),
    ("int4_token", _set(("key",), {"scale": "minmax", "codebook": {"kind": "uniform", "bits": 4},
                                   "packing": "interleaved", "center": "calibrated"}), "key.center",
     "needs split packing; use packing: split"),
    ("turbo_k4v2_d80_96", _set(("key", "center"), "calibrated"), "head_dims",
     "a centered key needs power-of-two head_dims; remove [80, 96]"),
    ("kivi_k2v2", _set(("key", "scale"), {"kind": "norm", "axis": "channel"}), "key.scale.axis",
     "a norm scale is per token"),
    ("kivi_k2v2", _set(("key", "scale", "group_size"), 48), "key.scale.group_size", "expected a power of two"),
    ("kivi_k2v2", _set(("key", "scale", "kind"), "absmax"), "key.scale", None),
    ("kivi_k2v2", _set(("key", "rotation"), "hadamard"), "key.rotation", "use rotation: none"),
    ("kivi_k2v2", _set(("key", "packing"), "interleaved"), "key.packing", "per-channel scales need split packing"),
    ("kivi_k2v2", _set(("head_dims",), [96]), "head_dims",
     "per-channel scales need power-of-two head_dims; remove [96]"),
    ("kivi_k2v2", _set(("key", "scale", "group_size"), 64), "key.scale.group_size", None),
    # a group twice head_dim would leave no channel to a slot (meta width 0): refused
    ("kivi_k2v2", _set(("key", "scale", "group_size"), 128), "key.scale.group_size",
     "needs group_size to divide head_dim 64; use a group_size of at most 64 or remove [64]"),
    ("int8_token", _set(("key", "scale"), {"kind": "minmax", "axis": "head"}), "key.scale.axis",
     "expected one of token, channel"),
    ("int8_token", _set(("key", "scale"), "norm"), "key.scale",
     "uniform is an integer grid and needs scale: minmax or absmax"),
    ("int8_token", _set(("key", "scale"), {"kind": "norm", "group_size": 32}), "key.scale.group_size",
     "covers the whole head"),
    ("int8_token", _set(("key", "scale"), {"kind": "minmax", "group_size": 24}), "key.scale.group_size",
     "expected a power of two"),
    ("int8_token", _set(("key", "scale"), {"kind": "minmax", "group_size": 1}), "key.scale.group_size",
     "expected an integer 2..256"),
    ("int8_token", _set(("key", "scale"), {"kind": "minmax", "group_size": 512}), "key.scale.group_size", "got 512"),
    ("int8_token", _set(("key", "scale"), {"kind": "minmax", "group_size": 128}), "key.scale.group_size",
     "group_size 128 is larger than head_dim 64; use a smaller group_size or remove [64]"),
    ("int8_token", _set(("key", "scale"), {"kind": "minmax", "group_size": 64}), "key.scale.group_size", None),
    ("int8_token", _set(("key", "scale"), {"kind": "minmax", "unbiased": True}), "key.scale.unbiased",
     "only meaningful with kind: norm"),
    ("int8_token", _set(("key", "scale"), {"kind": "absmax"}), "key.scale", None),  # symmetric int8 (q8_0)
    ("int4_token", _set(("key", "scale"), {"kind": "minmax", "group_size": 64}),
     "key.scale.group_size", None),  # spans 2 chunks at 64
    ("int4_token", _set(("key", "scale"), {"kind": "minmax", "group_size": 128}), "key.scale.group_size",
     "larger than head_dim 64"),
    ("kivi_k2v2", _set(("value", "scale", "group_size"), 64), "value.scale.group_size", None),  # spans 4 chunks at 64
    ("kivi_k2v2", _set(("value", "scale", "group_size"), 128), "value.scale.group_size",
     "group_size 128 is larger than head_dim 64"),
    ("metal_q5_0_q3_0", _set(("head_dims",), [64, 128]), "head_dims",
     "key's 5-bit codes need head_dim >= 128 (a 1-bit plane); remove [64]"),
    ("int4_token", _set(("key", "packing"), "interleaved"), "key.packing", None),
    ("int8_token", _set(("key", "codebook"), {"kind": "uniform", "bits": 4}), "key.codebook", None),
    ("int8_token", _set(("key", "codebook"), {"kind": "fp8", "format": "e4m3"}), "key.scale",
     "fp8 needs scale: absmax"),
    ("int8_token", _set(("key", "codebook"), {"kind": "fp8"}), "key.codebook.format",
     "missing required field; expected one of e4m3, e5m2"),
    ("int8_token", _set(("key", "codebook"), {"kind": "fp8", "format": "e4m3", "bits": 8.0}), "key.codebook.bits",
     "always 8 bits, got 8.0; remove bits"),
    ("int8_token", _set(("key", "codebook"), {"kind": "fp8", "format": "e4m2"}), "key.codebook.format", "did you mean"),
    ("int8_token", _set(("key", "codebook"), {"kind": "fp8", "format": "e5m2", "bits": 4}), "key.codebook.bits",
     "fp8 codes are always 8 bits, got 4; remove bits"),
    ("int8_token", _set(("key", "codebook"), {"kind": "fp8", "format": "e5m2", "law": "sphere"}), "key.codebook.law",
     "only meaningful with kind: lloyd_max"),
    ("int8_token", _set(("key", "codebook"), {"kind": "uniform", "bits": 8, "format": "e5m2"}), "key.codebook.format",
     "only meaningful with kind: fp8"),
    ("turbo_k4mse_v2", _set(("key", "scale"), {"kind": "norm", "unbiased": True}), "key.scale", None),
    ("turbo_k4mse_v2", _set(("key", "scale"), {"kind": "norm", "unbiased": "yes"}), "key.scale.unbiased",
     "expected true or false"),
    ("turbo_qjl_k3v3", _set(("key", "scale"), {"kind": "norm", "unbiased": True}), "key.scale.unbiased",
     "already unbiased"),
    ("int8_token", _set(("key", "codebook", "law"), "gaussian"), "key.codebook.law",
     "only meaningful with kind: lloyd_max"),
    ("int8_token", _set(("key", "residual"), "sign"), "key.codebook.bits",
     "8 bits plus a 1-bit residual exceed 8 bits"),
    # residual stages on uniform grids with per-token scales (3 + 1 bits: one 4-bit plane)
    ("int4_token", _set(("key",), {"scale": "minmax", "codebook": {"kind": "uniform", "bits": 3},
                                   "residual": "sign"}), "key", None),
    ("int4_token", _set(("key",), {"scale": "absmax", "codebook": {"kind": "uniform", "bits": 3},
                                   "residual": {"kind": "qjl", "seed": 3}}), "key", None),
    ("metal_q4_0_q3_0", _set(("key", "residual"), "sign"), "key.residual",
     "needs one scale per token (no scale.group_size)"),
    ("kivi_k2v2", _set(("key", "residual"), "sign"), "key.residual", "needs one scale per token"),
    ("int8_token", _set(("key", "residual"), {"kind": "sign", "seed": 1}), "key.residual.seed",
     "only meaningful with kind: qjl"),
    ("int8_token", _set(("key", "packing"), "split"), "key.packing", None),  # valid: 8-bit codes may be split
    ("int8_token", _set(("key", "packing"), "tight"), "key.packing", "got 'tight'"),
    ("turbo_k4v2", _set(("key", "codebook", "bits"), 8), "key.codebook.centroids", "expected 256 strictly increasing"),
    ("turbo_k4mse_v2", _set(("key", "codebook", "bits"), 8), "key.packing", None),  # 8-bit split: valid
    ("turbo_qjl_k3v3", _set(("key", "codebook", "bits"), 8), "key.codebook.bits", "exceed 8 bits per coordinate"),
    ("turbo_qjl_k3v3", _set(("key", "scale"), "minmax"), "key.scale",
     "lloyd_max indexes a unit vector and needs scale: norm"),
    ("turbo_qjl_k3v3", _set(("key", "residual"), {"kind": "qjl", "seed": "7"}), "key.residual.seed",
     "expected an integer"),
    ("turbo_qjl_k3v3", _set(("value", "codebook", "law"), "laplace"), "value.codebook.law",
     "expected one of gaussian, sphere"),
    ("turbo_k4v2", _set(("key", "codebook", "centroids"), [0.0] * 8), "key.codebook.centroids", "strictly increasing"),
    ("turbo_k4v2", _set(("key", "codebook", "centroids"), list(range(7))), "key.codebook.centroids", "expected 8"),
    ("turbo_k4v2", _set(("key", "codebook", "centroids"), [float("nan")] + list(range(7))), "key.codebook.centroids",
     "finite"),
    ("turbo_k4v2", _set(("key", "codebook", "centroids"), [-math.inf] + list(range(7))), "key.codebook.centroids",
     "finite"),
    ("turbo_k4v2", _set(("key", "codebook", "centroids"), list(range(10, 18))), "key.codebook.centroids", "|c| <= 16"),
    ("turbo_k4v2", _set(("key", "codebook", "centroids"), [False, True, 2, 3, 4, 5, 6, 7]), "key.codebook.centroids",
     "numbers"),
    ("turbo_k4v2", _set(("key", "codebook", "centroids"), "fast"), "key.codebook.centroids", "numbers"),
    ("turbo_k4v2", _set(("name",), "Turbo"), "name", "expected a lowercase identifier"),
    ("turbo_k4v2", _set(("name",), "1st"), "name", "got '1st'"),
    ("turbo_k4v2", _set(("name",), "a" * 64), "name", "expected a lowercase identifier"),
    ("turbo_k4v2", _set(("name",), "x\nimport os"), "name", "got 'x\\nimport os'"),
    ("turbo_k4v2", _set(("name",), "x; import os"), "name", "expected a lowercase identifier"),
    ("turbo_k4v2", _set(("name",), "t\u0131"), "name", "expected a lowercase identifier"),  # dotless i
    ("turbo_k4v2", _set(("name",), "turbo\u200b"), "name", "expected a lowercase identifier"),  # zero-width space
    ("turbo_k4v2", _set(("name",), 42), "name", "got 42"),
    ("turbo_k4v2", _set(("description",), 42), "description", "expected a string of at most 2000 characters"),
    ("turbo_k4v2", _set(("description",), "x" * 2001), "description", "at most 2000 characters"),
    ("turbo_k4v2", _set(("head_dims",), [48]), "head_dims",
     "expected a list of distinct values from [16, 32, 64, 80, 96, 128, 256], got [48]"),
    ("turbo_k4v2", _set(("head_dims",), []), "head_dims", "got []"),
    ("turbo_k4v2", _set(("head_dims",), [64, 64]), "head_dims", "distinct"),
    ("turbo_k4v2", _set(("head_dims",), 128), "head_dims", "got 128"),
    ("turbo_k4v2", _set(("head_dims",), "128"), "head_dims", "got '128'"),
    ("turbo_k4v2", _set(("head_dims",), [True]), "head_dims", "got [True]"),
    ("turbo_k4v2", _set(("head_dims",), [[64]]), "head_dims", "got [[64]]"),
]


@pytest.mark.parametrize(
    "base, edit, field, expected", FIELD_ERRORS, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(FIELD_ERRORS)]
)
def test_field_errors(tmp_path, base, edit, field, expected):
    data = copy.deepcopy(BASE[base])
    edit(data)
    path = _write(tmp_path, yaml.safe_dump(data, sort_keys=False), f"{base}.yaml")
    if expected is None:  # a control: the edit is legal
        load_scheme(path)
        return
    exc = _refused(path)
    assert exc.field == field, str(exc)
    assert expected in exc.message, str(exc)
    # The in-memory path reports the same error.
    with pytest.raises(SchemeError) as again:
        scheme_from_dict(data, str(path), default_name=base)
    assert str(again.value) == str(exc)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_one_packing_needs_whole_codes_per_byte(bits):
    """One packing takes any code width (the default); the other only widths that divide a byte."""
    refused = {}
    for packing in ("interleaved", "split"):
        data = copy.deepcopy(BASE["int8_token"])
        data["key"].update(codebook={"kind": "uniform", "bits": bits}, packing=packing)
        data["head_dims"] = [128, 256]  # wide enough for any code width's chunks: only the packing rule may refuse
        try:
            scheme_from_dict(data, "p.yaml")
        except SchemeError as exc:
            refused[packing] = exc
    if bits in (1, 2, 4, 8):
        assert refused == {}
    else:
        assert list(refused) == [p for p in ("interleaved", "split") if p != DEFAULT_PACKING]
        exc = next(iter(refused.values()))
        assert exc.field == "key.packing" and f"packing needs 1, 2, 4 or 8 code bits, got {bits}" in exc.message
    # At the default head_dims (64 included) the default packing still refuses codes with a 1-bit plane, on head_dims.
    data = copy.deepcopy(BASE["int8_token"])
    data["key"]["codebook"] = {"kind": "uniform", "bits": bits}
    if bits % 2:
        with pytest.raises(SchemeError) as info:
            scheme_from_dict(data, "p.yaml")
        assert info.value.field == "head_dims"
        assert info.value.message == f"key's {bits}-bit codes need head_dim >= 128 (a 1-bit plane); remove [64]"
    else:
        assert scheme_from_dict(data, "p.yaml").head_dims == (64, 128, 256)


def test_longest_name_is_accepted():
    data = copy.deepcopy(BASE["int8_token"])
    data["name"] = "a" * 63
    assert scheme_from_dict(data).name == "a" * 63


def test_first_error_wins_and_long_values_are_shortened(tmp_path):
    data = copy.deepcopy(BASE["int8_token"])
    data["key"]["codebook"]["bits"] = "x" * 500
    exc = _refused(_write(tmp_path, yaml.safe_dump(data)))
    assert exc.field == "key.codebook.bits"
    assert len(str(exc)) < len(str(tmp_path)) + 120 and "..." in exc.message


# --------------------------------------------------------------------------------------------------------------
# File-level errors: the file, not a field, is wrong

GOOD = (SCHEME_DIR / "int8_token.yaml").read_text(encoding="utf-8")

FILE_ERRORS = [
    ("syntax", GOOD.replace("key:\n", "key: [\n", 1), "invalid YAML: line"),
    ("bad_indent", GOOD.replace("  codebook:", "   codebook:", 1), "invalid YAML: line"),
    ("tab", GOOD.replace("  scale", "\tscale", 1), "invalid YAML"),
    ("unclosed_quote", GOOD.replace("description: Per", 'description: "Per', 1), "invalid YAML"),
    ("duplicate_top", GOOD + "name: other\n", "invalid YAML: line 14, column 1: duplicate key 'name'"),
    ("duplicate_nested", GOOD.replace("{kind: uniform, bits: 8}", "{kind: uniform, bits: 8, bits: 4}", 1),
     "duplicate key 'bits'"),
    ("duplicate_block", GOOD.replace("value:\n", "value:\n  scale: minmax\n", 1), "duplicate key 'scale'"),
    ("anchor", GOOD.replace("key:\n", "key: &k\n", 1), "YAML anchors and aliases are not allowed"),
    ("alias", GOOD + "extra: *k\n", "anchors and aliases"),  # an alias alone, its anchor undefined
    ("undefined_alias", GOOD.replace("name: int8_token", "name: *nothing", 1), "anchors and aliases"),
    ("scalar_anchor", GOOD.replace("bits: 8}", "bits: &b 8}", 1), "anchors and aliases"),
    ("merge_key", GOOD + "<<: {name: other}\n", "duplicate key 'name'"),
    ("int_key", GOOD + "1: one\n", "mapping keys must be strings, got 1"),
    ("null_key", GOOD + "~: nothing\n", "mapping keys must be strings, got None"),
    ("bool_key", GOOD + "yes: please\n", "mapping keys must be strings, got True"),
    ("python_tag", GOOD.replace("bits: 8}", "bits: !!python/object/apply:os.system ['echo hi']}", 1),
     "could not determine a constructor"),
    ("local_tag", GOOD.replace("bits: 8}", "bits: !evil 8}", 1), "could not determine a constructor"),
    ("two_documents", GOOD + "---\n" + GOOD, "line 14, column 1: but found another document"),
    ("control_char", GOOD.replace("Per-token", "Per\x07token"), "unacceptable character #x0007"),
    ("nul", GOOD.replace("Per-token", "Per\x00token"), "unacceptable character #x0000"),
    ("too_deep", GOOD + "extra: " + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "\n",
     f"nesting deeper than {MAX_DEPTH} levels"),
    ("too_deep_block", GOOD + "".join("  " * i + f"l{i}:\n" for i in range(MAX_DEPTH + 2)), "nesting deeper"),
    ("too_large", GOOD + ("# " + "x" * 98 + "\n") * 700, f"file is larger than {MAX_FILE_BYTES} bytes"),
    ("top_level_list", "- 1\n- 2\n", "expected a mapping with fields version, name"),
    ("top_level_scalar", "just text\n", "got 'just text'"),
    ("empty", "", "got None"),
    ("comments_only", "# nothing here\n", "got None"),
]


@pytest.mark.parametrize("text, expected", [c[1:] for c in FILE_ERRORS], ids=[c[0] for c in FILE_ERRORS])
def test_file_errors(tmp_path, text, expected):
    exc = _refused(_write(tmp_path, text))
    assert exc.field == "", str(exc)
    assert expected in exc.message, str(exc)


@pytest.mark.parametrize(
    "raw",
    [
        GOOD.encode("utf-16"),
        GOOD.encode("utf-8").replace(b"Per-token", b"Per\xfftoken"),
        GOOD.encode("utf-8").replace(b"Per-token", b"Per\xed\xa0\x80token"),  # an encoded surrogate
        GOOD.replace("Per-token", "Pér-token").encode("latin-1"),
        b"\x89PNG\r\n\x1a\n\x00\x00" * 10,
    ],
    ids=["utf16", "ff", "surrogate", "latin1", "binary"],
)
def test_non_utf8(tmp_path, raw):
    exc = _refused(_write(tmp_path, raw))
    assert exc.field == "" and exc.message == "not UTF-8 text"


def test_unreadable(tmp_path):
    missing = tmp_path / "missing.yaml"
    exc = _refused(missing)
    assert exc.field == "" and exc.message.startswith("cannot read file")
    directory = tmp_path / "dir.yaml"
    directory.mkdir()
    assert _refused(directory).message.startswith("cannot read file")


def test_size_limit_is_exact(tmp_path):
    pad = MAX_FILE_BYTES - len(GOOD.encode()) - 2
    assert load_scheme(_write(tmp_path, GOOD + "#" + "é" * (pad // 2) + "x" * (pad % 2) + "\n")).name == "int8_token"
    exc = _refused(_write(tmp_path, GOOD + "#" + "é" * (pad // 2 + 1) + "\n"))  # one byte over, counted in UTF-8
    assert "larger than" in exc.message


def test_depth_limit_is_exact(tmp_path):
    # The document is level 1, key 2, codebook 3, so a centroid list may nest MAX_DEPTH - 3 more levels.
    deep = "[" * (MAX_DEPTH - 3) + "]" * (MAX_DEPTH - 3)
    text = GOOD.replace("bits: 8}", f"bits: 8, extra: {deep}}}", 1)
    exc = _refused(_write(tmp_path, text))
    assert exc.field == "key.codebook.extra"  # parsed: only then refused as an unknown field
    deeper = "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)
    exc = _refused(_write(tmp_path, GOOD.replace("bits: 8}", f"bits: 8, extra: {deeper}}}", 1)))
    assert exc.field == "" and "nesting deeper" in exc.message


def test_bom_and_crlf_are_fine(tmp_path):
    assert (load_scheme(_write(tmp_path, "\ufeff" + GOOD)).to_dict()
            == load_scheme(SCHEME_DIR / "int8_token.yaml").to_dict())
    assert load_scheme(_write(tmp_path, GOOD.replace("\n", "\r\n"))).name == "int8_token"


def test_unicode_description_is_kept(tmp_path):
    line = next(x for x in GOOD.splitlines() if x.startswith("description:"))
    text = GOOD.replace(line, 'description: "K\u00e9y \u2028 \u202e RTL \U0001f600 \\0 \\"\\"\\" os.system(1)"', 1)
    s = load_scheme(_write(tmp_path, text))
    assert "\U0001f600" in s.description and '"""' in s.description


def test_scheme_error_format():
    assert str(SchemeError("a.yaml", "key.codebook.bits", "expected x")) == "a.yaml: key.codebook.bits: expected x"
    assert str(SchemeError("a.yaml", "", "not UTF-8 text")) == "a.yaml: not UTF-8 text"
    assert isinstance(SchemeError("a", "", "b"), ValueError)


# --------------------------------------------------------------------------------------------------------------
# Property tests


@st.composite
def tensor_specs(draw):
    """Any legal K or V description, in a random mix of long and short spellings."""
    kind = draw(st.sampled_from(["lloyd_max", "uniform", "fp8"]))
    bits = 8 if kind == "fp8" else draw(st.integers(1, 8))
    codebook: dict = {"kind": kind, "bits": bits}
    extra: dict = {}  # optional scale fields
    if kind == "fp8":
        scale, residual = "absmax", "none"
        codebook["format"] = draw(st.sampled_from(["e4m3", "e5m2"]))
        if draw(st.booleans()):
            del codebook["bits"]
    elif kind == "uniform":
        scale, residual = draw(st.sampled_from(["minmax", "absmax"] if bits >= 2 else ["minmax"])), "none"
    else:
        scale = "norm"
        law = draw(st.sampled_from([None, "gaussian", "sphere"]))
        if law:
            codebook["law"] = law
        if bits <= 4 and draw(st.booleans()):
            levels = draw(st.lists(st.integers(-16000, 16000), min_size=2**bits, max_size=2**bits, unique=True))
            codebook["centroids"] = sorted(c / 1000 for c in levels)
        residual = draw(st.sampled_from(["none", "sign", "qjl"])) if bits < 8 else "none"
        if residual != "qjl" and draw(st.booleans()):
            extra["unbiased"] = draw(st.booleans())
    if scale != "norm" and draw(st.booleans()):
        extra["group_size"] = draw(st.sampled_from([2, 4, 8, 16, 32, 64]))
    code_bits = bits + (residual != "none")
    out: dict = {}
    rotation = draw(st.sampled_from(["omit", "none", "hadamard", "full"]))
    if rotation == "full":
        out["rotation"] = {"kind": "hadamard", "signs": draw(st.booleans()), "seed": draw(st.integers(0, 2**32 - 1))}
    elif rotation != "omit":
        out["rotation"] = rotation if draw(st.booleans()) else {"kind": rotation}
    out["scale"] = scale if not extra and draw(st.booleans()) else {"kind": scale, "axis": "token", **extra}
    out["codebook"] = codebook
    if residual == "qjl" and draw(st.booleans()):
        out["residual"] = {"kind": "qjl", "seed": draw(st.integers(0, 2**32 - 1))}
    elif residual != "none" or draw(st.booleans()):
        out["residual"] = residual
    packings = (["interleaved", "split"]
                if code_bits in (1, 2, 4, 8) and not (extra.get("group_size") and code_bits < 8)
                else [DEFAULT_PACKING])
    packing = draw(st.sampled_from(packings + ["omit"]))
    if packing != "omit":
        out["packing"] = packing
    return out


def _allows(tensor: dict, d: int) -> bool:
    """Whether a tensor spec can be built for head_dim d: its narrowest bit plane must give chunks of 16 or more
    columns, and each chunk must hold whole scale groups or each group whole chunks (and divide head_dim)."""
    residual = tensor.get("residual", "none")
    residual = residual["kind"] if isinstance(residual, dict) else residual
    bits = tensor["codebook"].get("bits", 8) + (residual != "none")
    narrowest = min(b for b in (1, 2, 4, 8) if bits & b)
    group = tensor["scale"].get("group_size", 1) if isinstance(tensor["scale"], dict) else 1
    chunk = d * narrowest // 8
    return chunk >= 16 and (chunk % group == 0 or (group % chunk == 0 and d % group == 0))


@st.composite
def scheme_specs(draw):
    name = st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True).filter(
        lambda n: n not in spec.SHADOWED_MODULES and not keyword.iskeyword(n)
    )
    data: dict = {"version": 1, "name": draw(name)}
    if draw(st.booleans()):
        data["description"] = draw(st.text(max_size=60))
    data["key"], data["value"] = draw(tensor_specs()), draw(tensor_specs())
    allowed = [d for d in SUPPORTED_HEAD_DIMS if _allows(data["key"], d) and _allows(data["value"], d)]
    if draw(st.booleans()) or not set(spec.DEFAULT_HEAD_DIMS) <= set(allowed):
        data["head_dims"] = draw(st.lists(st.sampled_from(allowed), min_size=1, unique=True))
    return data


def test_narrow_chunks_are_refused():
    data = copy.deepcopy(BASE["turbo_k4v2"])
    # K's codebook becomes V's 2-bit one (4 centroids): 2 + the sign bit = 3-bit codes, whose 1-bit plane gives
    # 8-column chunks at head_dim 64.
    data["key"]["codebook"] = copy.deepcopy(data["value"]["codebook"])
    with pytest.raises(SchemeError) as info:
        scheme_from_dict(data, "n.yaml")
    assert info.value.field == "head_dims"
    assert info.value.message == "key's 3-bit codes need head_dim >= 128 (a 1-bit plane); remove [64]"
    data["head_dims"] = [128, 256]
    assert scheme_from_dict(data, "n.yaml").head_dims == (128, 256)


def _grouped(bits: int, group_size: int, head_dims: list[int]) -> dict:
    data = copy.deepcopy(BASE["int4_token"])
    data["key"] = {"scale": {"kind": "absmax", "group_size": group_size}, "codebook": {"kind": "uniform", "bits": bits}}
    data["head_dims"] = head_dims
    return data


@pytest.mark.parametrize(
    "bits, group_size, head_dims, spans",
    [
        (5, 32, [128, 256], {128: 2, 256: 1}),  # q5_0: a 1-bit plane, 16-column chunks at 128
        (2, 32, [64, 128, 256], {64: 2, 128: 1, 256: 1}),  # KIVI's V at 64
        (3, 64, [128, 256], {128: 4, 256: 2}),
        (6, 128, [128], {128: 4}),  # one group covering the whole head
        (4, 8, [80, 96, 128], {80: 1, 96: 1, 128: 1}),  # inside the padded chunks (40 and 48 columns)
    ],
)
def test_scale_groups_may_span_whole_chunks(bits, group_size, head_dims, spans):
    from kvqc.compiler.layout import plan

    scheme = scheme_from_dict(_grouped(bits, group_size, head_dims), "g.yaml")
    key = plan(scheme).key
    assert {d: key.span(d) for d in head_dims} == spans
    assert key.spans == tuple(sorted(set(spans.values()) - {1}))


@pytest.mark.parametrize(
    "bits, group_size, head_dims, message",
    [
        (4, 16, [80, 128],
         "group_size 16 must divide the 40-column chunks that key's 4-bit codes unpack at head_dim 80, "
         "or be a multiple of them that divides head_dim; use a group_size that divides 40 or remove [80]"),
        (4, 32, [96, 128], "must divide the 48-column chunks that key's 4-bit codes unpack at head_dim 96"),
        (8, 64, [32, 64, 128], "group_size 64 is larger than head_dim 32; use a smaller group_size or remove [32]"),
        (4, 256, [128, 256], "group_size 256 is larger than head_dim 128; use a smaller group_size or remove [128]"),
    ],
)
def test_scale_groups_must_tile_the_chunks(bits, group_size, head_dims, message):
    with pytest.raises(SchemeError) as info:
        scheme_from_dict(_grouped(bits, group_size, head_dims), "g.yaml")
    assert info.value.field == "key.scale.group_size"
    assert message in info.value.message


def test_per_channel_groups_never_span_chunks():
    """KIVI's keys share a scale along group_size tokens: the channel-group rule and its kernels leave them alone."""
    from kvqc.compiler.layout import plan

    layout = plan(load_scheme(SCHEME_DIR / "kivi_k2v2.yaml"))
    assert 64 in layout.scheme.head_dims
    assert layout.key.group_size is None and layout.key.spans == () and layout.key.span(64) == 1
    assert layout.value.group_size == 32 and layout.value.spans == (2,)


@FUZZ
@given(data=scheme_specs())
def test_valid_schemes_round_trip(data):
    scheme = scheme_from_dict(data, "s.yaml")
    canonical = scheme.to_dict()
    assert scheme_from_dict(canonical, "s.yaml") == scheme
    assert scheme_from_dict(yaml.safe_load(yaml.safe_dump(canonical)), "t.yaml").content_hash == scheme.content_hash
    # YAML folds line-break characters such as U+0085 in a dumped description: compare all but the free text.
    reloaded = scheme_from_dict(yaml.safe_load(yaml.safe_dump(data, allow_unicode=True)), "s.yaml")
    assert dataclasses.replace(reloaded, description="") == dataclasses.replace(scheme, description="")
    assert scheme.head_dims == tuple(sorted(data.get("head_dims", spec.DEFAULT_HEAD_DIMS)))
    for side in ("key", "value"):
        t = getattr(scheme, side)
        assert 1 <= t.code_bits <= 8
        assert t.metadata in (("scale", "zero"), ("scale",), ("norm",), ("norm", "residual_rms"),
                              ("norm", "residual_norm"))


_keys = st.text(st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)), max_size=10)
_anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.sampled_from(["hadamard", "norm", "minmax", "absmax", "lloyd_max", "uniform", "fp8", "e4m3", "sign", "qjl",
                       "split", "gaussian", 64, 128, 1]),
    lambda c: st.lists(c, max_size=4)
    | st.dictionaries(_keys | st.sampled_from(["kind", "bits", "scale", "codebook"]), c, max_size=4),
    max_leaves=12,
)


@st.composite
def corrupted(draw):
    data = copy.deepcopy(BASE[draw(st.sampled_from(SCHEMES))])
    for _ in range(draw(st.integers(1, 3))):
        node, key = data, None
        while isinstance(node, dict) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node)))
            if not isinstance(node[key], dict):
                break
            node = node[key]
            key = None
        if not isinstance(node, dict):
            continue
        key = key if key is not None else draw(st.sampled_from(sorted(node) or ["x"]))
        action = draw(st.sampled_from(["replace", "delete", "rename"]))
        if action == "delete":
            node.pop(key, None)
        elif action == "rename":
            node[draw(_keys)] = node.pop(key, None)
        else:
            node[key] = draw(_anything)
    return data


@FUZZ
@given(data=corrupted())
def test_any_data_is_a_scheme_or_one_clean_error(data):
    try:
        scheme = scheme_from_dict(data, "fuzz.yaml", default_name="fuzz")
    except SchemeError as exc:
        _assert_one_line(exc, "fuzz.yaml")
        event("refused")
        return
    event("accepted")
    assert scheme_from_dict(scheme.to_dict(), "fuzz.yaml") == scheme


# --------------------------------------------------------------------------------------------------------------
# Bugs found by these tests and fixed: each stays as a regression test.


def test_float_head_dims_are_refused():
    data = copy.deepcopy(BASE["turbo_k4v2"])
    data["head_dims"] = [64.0, 128]
    with pytest.raises(SchemeError) as info:
        scheme_from_dict(data, "f.yaml")
    assert info.value.field == "head_dims"


def test_float_version_is_refused():
    data = copy.deepcopy(BASE["turbo_k4v2"])
    data["version"] = 1.0
    with pytest.raises(SchemeError) as info:
        scheme_from_dict(data, "f.yaml")
    assert info.value.field == "version"


def test_unknown_key_with_line_break_is_one_line(tmp_path):
    data = copy.deepcopy(BASE["int8_token"])
    data["x\nimport os"] = 1
    exc = _refused(_write(tmp_path, yaml.safe_dump(data)))
    assert exc.field.startswith("'x") and "\n" not in str(exc)




@pytest.mark.parametrize(
    "value",
    [
        pytest.param("0x" + "f" * 4000, id="hex-int-repr"),  # built fine, then repr() in _show fails
        pytest.param("0b" + "1" * 20000, id="binary-int-repr"),
        pytest.param("1" + "0" * 4400, id="decimal-int-over-4300-digits"),  # PyYAML's int() fails: file-level
        pytest.param("1" + "0" * 4000, id="decimal-int-4001-digits"),
    ],
)
def test_huge_ints_are_clean_errors(tmp_path, value):
    exc = _refused(_write(tmp_path, GOOD.replace("bits: 8}", f"bits: {value}}}", 1)))
    if len(value) > 4300 and value.isdigit():  # PyYAML itself cannot build it: refused as invalid YAML
        assert exc.field == "" and exc.message.startswith("invalid YAML")
    else:
        assert exc.field == "key.codebook.bits" and "expected an integer 1..8" in exc.message


def test_huge_int_centroid_is_a_clean_error(tmp_path):
    text = (SCHEME_DIR / "turbo_k4v2.yaml").read_text().replace("2.1519456]", "1" + "0" * 400 + "]", 1)
    exc = _refused(_write(tmp_path, text))
    assert exc.field == "key.codebook.centroids"


@pytest.mark.parametrize(
    "name", ["torch", "triton", "os", "kvqc", "generated", "numpy", "yaml", "sitecustomize", "distutils"]
)
def test_names_that_shadow_modules_are_refused(name):
    """generated/<name>.py would be imported in place of the module by code run from generated/."""
    data = copy.deepcopy(BASE["int8_token"]) | {"name": name}
    with pytest.raises(SchemeError) as info:
        scheme_from_dict(data, "x.yaml")
    assert info.value.field == "name"
    assert str(info.value) == (
        f"x.yaml: name: '{name}' would build {name}.py, which code run from its folder imports in place of the module "
        f"{name}; choose another name, e.g. {name}_kv"
    )


@pytest.mark.parametrize("name", ["class", "import", "def", "lambda", "if"])
def test_keyword_names_are_refused(name):
    data = copy.deepcopy(BASE["int8_token"]) | {"name": name}
    with pytest.raises(SchemeError, match=rf"^x\.yaml: name: '{name}' is a Python keyword, so {name}\.py cannot be "
                                          rf"imported by name; choose another name, e\.g\. {name}_kv$"):
        scheme_from_dict(data, "x.yaml")


def test_a_file_named_like_a_module_needs_a_name(tmp_path):
    """Without `name:`, the file's stem names the scheme: os.yaml would build os.py."""
    data = copy.deepcopy(BASE["int8_token"])
    del data["name"]
    path = tmp_path / "os.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SchemeError, match=r"name: 'os' would build os\.py"):
        load_scheme(path)
