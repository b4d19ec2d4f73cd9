"""kvqc bench's pure parts on CPU: the table row and the speedup plot (no timing here; timing needs a GPU)."""

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
