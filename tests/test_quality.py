"""`kvqc quality` on the random source only (fast, no model): ordering of schemes, ranges, JSON, n/a rows."""

from __future__ import annotations

import argparse
import json

import pytest

from kvqc.tools import quality

SCHEMES = ["int4_token", "int8_token"]


@pytest.fixture(scope="module")
def report():
    return quality.evaluate(SCHEMES, ["random"], tokens=256, log=lambda _msg: None)


def rows(report):
    return {r["scheme"]: r for r in report["results"]}


def test_int8_far_below_int4(report):
    r = rows(report)
    i4, i8 = r["int4_token"], r["int8_token"]
    # 15 vs 255 grid steps: squared errors ~ (255/15)^2 = 289x apart, norms ~17x
    assert i8["k_rel_err"] < i4["k_rel_err"] / 100
    assert i8["v_rel_err"] < i4["v_rel_err"] / 100
    assert i8["score_rel_err"] < i4["score_rel_err"] / 8
    assert i8["attn_out_rel_err"] < i4["attn_out_rel_err"] / 8


def test_errors_in_unit_interval(report):
    assert len(report["results"]) == len(SCHEMES)
    for r in report["results"]:
        assert r["status"] == "ok" and r["head_dim"] == quality.RANDOM_HEAD_DIM
        for metric in quality.METRICS:
            assert 0 <= r[metric] < 1, (r["scheme"], metric, r[metric])


def test_json_and_markdown(tmp_path):
    args = argparse.Namespace(schemes=SCHEMES, model=None, tokens=64, source="random",
                              json=str(tmp_path / "q.json"), markdown=str(tmp_path / "q.md"))
    assert quality.run(args) == 0
    data = json.loads((tmp_path / "q.json").read_text())
    for key in ("command", "date", "versions", "machine", "tokens", "metadata_dtype", "sources", "results",
                "total_seconds"):
        assert key in data, key
    assert data["sources"]["random"]["status"] == "ok"
    assert [r["scheme"] for r in data["results"]] == SCHEMES
    for r in data["results"]:
        for key in ("scheme", "source", "head_dim", "status", "bits_per_coordinate", *quality.METRICS):
            assert key in r, key
    text = (tmp_path / "q.md").read_text()
    assert "| int8_token | random | 128 |" in text


def test_scheme_without_the_head_dim_is_na():
    # turbo_qjl_k3v3 is built for head_dims [128, 256] only
    report = quality.evaluate(["turbo_qjl_k3v3", "int8_token"], ["random"], tokens=32, random_head_dim=64,
                              log=lambda _msg: None)
    r = rows(report)
    assert r["turbo_qjl_k3v3"]["status"] == quality.NA_HEAD_DIM == "n/a (head_dim)"
    assert all(r["turbo_qjl_k3v3"][m] is None for m in quality.METRICS)
    assert r["int8_token"]["status"] == "ok"
    assert "turbo_qjl_k3v3   random    64 n/a (head_dim)" in quality.table(report["results"])
    assert "| turbo_qjl_k3v3 | random | 64 | n/a (head_dim) |" in quality.markdown(report)
