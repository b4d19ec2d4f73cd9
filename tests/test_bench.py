"""kvqc bench's pure parts on CPU: the table row and the speedup plot (no timing here; timing needs a GPU)."""

import argparse

import pytest
from kvqc.tools import bench


def row(scheme, context, speedup, **extra):
    return {"scheme": scheme, "batch": 8, "context": context, "head_dim": 128, "status": "ok", "peer_ms": 0.25,
            "kvqc_ms": 0.25 / speedup, "speedup": speedup, **extra}


def test_row_shows_attend_and_scratch():
    line = bench.format_row(row("int4_token", 8192, 2.0, scratch_mib=1.5, attend_ms=0.123, attend_scratch_mib=640.0,
                                rel_err=1e-3))
    assert "0.123" in line and "640" in line and "1.50" in line
    assert len(bench.table_header().split()) >= 14


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [row(s, n, x) for s, base in (("a", 1.0), ("b", 2.0)) for n, x in ((1024, base), (8192, 2 * base))]
    rows.append({"scheme": "a", "batch": 8, "context": 32768, "head_dim": 128, "status": "error", "note": "x"})
    path = tmp_path / "speedup.png"
    bench.plot(rows, str(path), "test device")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_refuses_nothing_measured(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError):
        bench.plot([{"scheme": "a", "status": "error"}], str(tmp_path / "x.png"))


def test_layout_takes_one_or_both():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([]).layout == ["bhsd"]
    assert parser.parse_args(["--layout", "bshd", "bhsd"]).layout == ["bshd", "bhsd"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--layout", "hsd"])


def test_plot_draws_a_line_per_scheme_and_layout(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    labels = []
    draw = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **kw: labels.append(kw.get("label"))
                        or draw(ax, *a, **kw))
    rows = [row("a", n, 2.0, layout=layout) for layout in ("bhsd", "bshd") for n in (1024, 8192)]
    bench.plot(rows, str(tmp_path / "both.png"))
    assert {"a bhsd (eager)", "a bshd (eager)"} <= set(labels)
    labels.clear()
    bench.plot(rows[:2], str(tmp_path / "one.png"))
    assert "a (eager)" in labels


def test_fill_and_flatten_shares_take_graph_times_where_measured():
    assert bench._kernel_ms({"flatten_ms": 0.3, "flatten_graph_ms": 0.2}, "flatten") == 0.2
    assert bench._kernel_ms({"flatten_ms": 0.3, "flatten_graph_ms": None}, "flatten") == 0.3
    assert bench._kernel_ms({"fill_ms": 0.4}, "fill") == 0.4


def test_a_flatten_that_takes_no_buffers_keeps_its_eager_time_with_a_note(monkeypatch):
    """A channel split's flatten refuses out= buffers: no graph time, and the row says why."""
    import torch
    from conftest import generated

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    m = generated("turbo_outlier_2p5")
    cache = m.allocate_cache(2, 16, 1, 128, device="cpu")
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    row = {}
    assert bench._flatten_graph_ms(m, row, [cache], tables, lens, {}) is None
    assert row["note"].startswith("flatten graph: ValueError: out: turbo_outlier_2p5 splits channels into parts")
