"""kvqc tune's pure parts on CPU: the candidate list, the choice of a winner and the table it writes."""

import json

import pytest

from kvqc.compiler import codegen
from kvqc.compiler.spec import load_scheme
from kvqc.modules import SCHEMES
from kvqc.tools import tune


def rows(times):
    """One row per (variant, batch) with the given ms; status ok unless the time is None."""
    out = []
    for variant, per_batch in times.items():
        for batch, ms in per_batch.items():
            row = {"variant": list(variant), "batch": batch, "context": 8192}
            row.update({"status": "ok", "ms": ms} if ms is not None else {"status": "wrong"})
            out.append(row)
    return out


def test_variants_start_with_the_default_once():
    got = tune.variants()
    assert got[0] == tune.DEFAULT and got.count(tune.DEFAULT) == 1 and len(set(got)) == len(got)


def test_a_register_cap_goes_last_in_the_setting(monkeypatch):
    monkeypatch.setattr(tune, "TILES", ((32, 1, 2), (32, 1, 2, 168)))
    monkeypatch.setattr(tune, "SPLITS", ((16, 128),))
    got = tune.variants()
    assert (32, 1, 2, 16, 128) in got and (32, 1, 2, 16, 128, 168) in got
    assert tune.fmt_variant((32, 1, 2, 16, 128, 168)).endswith(" reg168")


class LaunchSpy:
    """Stands in for a kernel: records each launch's arguments by name (positional ones too), then launches the real
    one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({**dict(zip(self.kernel.arg_names, args)), **kwargs})
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_decode_takes_a_setting_with_a_register_cap(monkeypatch):
    """The sixth field reaches the launch as maxnreg (the interpreter drops it; a GPU compiles with it)."""
    import torch
    from conftest import DEVICE, generated

    m = generated("int4_token")
    monkeypatch.setattr(m, "_DECODE_CONFIGS", {128: (32, 1, 2, 16, 128, 168)})
    spy = LaunchSpy(m._decode_kernel)
    monkeypatch.setattr(m, "_decode_kernel", spy)
    g = torch.Generator().manual_seed(3)
    n, bs = 70, 16
    cache = m.allocate_cache(5, bs, 1, 128, device=DEVICE)
    slots = torch.arange(n, device=DEVICE)
    key, value = (torch.randn(n, 1, 128, generator=g).half().to(DEVICE) for _ in range(2))
    m.fill(cache, key, value, slots)
    tables = torch.arange(5, dtype=torch.int32, device=DEVICE)[None]
    seq_lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    query = torch.randn(1, 4, 128, generator=g).half().to(DEVICE)
    out = m.decode(query, cache, tables, seq_lens)
    want = m.reference.decode(query, cache, tables, seq_lens).float().cpu()  # the reference answers on CPU
    assert float((out.float().cpu() - want).norm() / want.norm()) < 2e-3
    assert [launch["maxnreg"] for launch in spy.launches] == [168]
    monkeypatch.setattr(m, "_DECODE_CONFIGS", {128: (32, 1, 2, 16, 128)})
    m.decode(query, cache, tables, seq_lens)
    assert spy.launches[-1]["maxnreg"] is None


def test_settings_with_the_wrong_shape_are_refused_in_one_line(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    forms = ("BN,WARPS,STAGES", "BN,WARPS,STAGES,MAXNREG")
    assert tune.parse_settings(["32,1,2", "32,1,2,168"], "--tiles", forms) == ((32, 1, 2), (32, 1, 2, 168))
    assert tune.run(parser.parse_args(["--tiles", "32,1"])) == 2
    assert capsys.readouterr().err == (
        "kvqc tune: --tiles: '32,1' is not BN,WARPS,STAGES or BN,WARPS,STAGES,MAXNREG (positive integers)\n"
    )
    assert tune.run(parser.parse_args(["--splits", "16,x"])) == 2
    assert "--splits: '16,x' is not PER_SM,MOST" in capsys.readouterr().err


def test_best_takes_the_geometric_mean_and_skips_wrong_variants():
    fast, wrong, close = (32, 1, 3, 16, 128), (16, 1, 3, 8, 64), (64, 2, 3, 8, 64)
    data = rows({tune.DEFAULT: {1: 1.0, 8: 1.0}, fast: {1: 0.5, 8: 1.0}, wrong: {1: 0.1, 8: None},
                 close: {1: 0.99, 8: 0.99}})
    winner, score, scores = tune.best(data, [tune.DEFAULT, fast, wrong, close])
    assert winner == fast and abs(score - 0.5 ** 0.5) < 1e-9 and wrong not in scores


def test_best_keeps_the_default_within_two_percent():
    close = (64, 2, 3, 8, 64)
    winner, _, _ = tune.best(rows({tune.DEFAULT: {1: 1.0}, close: {1: 0.99}}), [tune.DEFAULT, close])
    assert winner == tune.DEFAULT


def test_written_table_renders_into_the_module_constants(tmp_path, monkeypatch):
    path = tmp_path / "decode_tuning.json"
    path.write_text(codegen.DECODE_TUNING.read_text(encoding="utf-8"), encoding="utf-8")
    header = {"device": "Test GPU", "torch": "t", "triton": "x", "shapes": "batch 1"}
    # Schemes tuned before per-scheme sweep notes (int4_token) keep the table's own note through later sweeps.
    shipped_note = codegen.decode_tuning("int4_token")["comment"]
    tune.write_table(path, {("some_scheme", 128): (32, 1, 2, 16, 128)}, header)
    tune.write_table(path, {("some_scheme", 64): (64, 1, 3, 16, 128)}, header)
    table = json.loads(path.read_text(encoding="utf-8"))
    assert table["schemes"]["some_scheme"] == {"128": [32, 1, 2, 16, 128], "64": [64, 1, 3, 16, 128]}
    monkeypatch.setattr(codegen, "DECODE_TUNING", path)
    got = codegen.decode_tuning("some_scheme")
    assert (got["configs"] == "{64: (64, 1, 3, 16, 128), 128: (32, 1, 2, 16, 128)}"
            and "Test GPU (batch 1)" in got["comment"])
    # A later sweep of another scheme on other shapes leaves this scheme's note alone.
    tune.write_table(path, {("later", 128): (32, 1, 2, 16, 128)},
                     {**header, "device": "Other GPU", "shapes": "batch 8"})
    assert "Test GPU (batch 1)" in codegen.decode_tuning("some_scheme")["comment"]
    assert "Other GPU (batch 8)" in codegen.decode_tuning("later")["comment"]
    assert codegen.decode_tuning("other")["configs"] == "{}"
    # Small heads the table does not name take the small-head default; a named one keeps its entry.
    small = codegen.decode_tuning("other", (64, 128))
    assert small["configs"] == "{64: (64, 1, 3, 8, 128)}" and "small-head default" in small["comment"]
    # So do wide ones theirs; the head dims between take the default at run time (_decode_config).
    wide = codegen.decode_tuning("other", (128, 256))
    assert wide["configs"] == "{256: (64, 4, 3, 8, 64)}" and "wide-head default" in wide["comment"]
    assert wide["default"] == repr(tuple(tune.DEFAULT))
    assert codegen.decode_tuning("some_scheme", (64, 128))["configs"] == got["configs"]
    assert codegen.decode_tuning("int4_token")["comment"] == shipped_note


def test_lazy_rescale_list_renders_into_the_module(tmp_path, monkeypatch):
    path = tmp_path / "decode_tuning.json"
    table = json.loads(codegen.DECODE_TUNING.read_text(encoding="utf-8"))
    table["lazy_rescale"] = ["some_scheme"]
    path.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.setattr(codegen, "DECODE_TUNING", path)
    assert codegen.decode_tuning("some_scheme")["lazy"] is True
    assert codegen.decode_tuning("int4_token")["lazy"] is False
    # A sweep leaves the list alone.
    tune.write_table(path, {("other", 128): (32, 1, 2, 16, 128)},
                     {"device": "G", "torch": "t", "triton": "x", "shapes": "s"})
    assert json.loads(path.read_text(encoding="utf-8"))["lazy_rescale"] == ["some_scheme"]


def test_fill_register_caps_render_and_survive_a_sweep(tmp_path, monkeypatch):
    path = tmp_path / "decode_tuning.json"
    table = json.loads(codegen.DECODE_TUNING.read_text(encoding="utf-8"))
    table["fill_registers"] = {"some_scheme": {"128": 144}}
    path.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.setattr(codegen, "DECODE_TUNING", path)
    assert codegen.decode_tuning("some_scheme")["fill_registers"] == "{128: 144}"  # the head_dim it was measured at
    assert codegen.decode_tuning("int4_token")["fill_registers"] == "{}"
    tune.write_table(path, {("other", 128): (32, 1, 2, 16, 128)},
                     {"device": "G", "torch": "t", "triton": "x", "shapes": "s"})
    assert json.loads(path.read_text(encoding="utf-8"))["fill_registers"] == {"some_scheme": {"128": 144}}


def test_fill_warps_and_stages_render_per_scheme_and_survive_a_sweep(tmp_path, monkeypatch):
    """fill_warps and fill_stages_split_inputs belong to the scheme and head_dim they were measured at."""
    path = tmp_path / "decode_tuning.json"
    table = json.loads(codegen.DECODE_TUNING.read_text(encoding="utf-8"))
    table["fill_warps"] = {"turbo_k4v2": {"256": 8}}
    table["fill_stages_split_inputs"] = {"turbo_k4v2": {"256": 1}}
    path.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.setattr(codegen, "DECODE_TUNING", path)
    assert codegen.decode_tuning("turbo_k4v2")["fill_warps"] == "{256: 8}"
    assert codegen.decode_tuning("turbo_eden_k4v2")["fill_warps"] == "{}"
    source = codegen.render(load_scheme(SCHEMES / "turbo_k4v2.yaml"))
    assert "\n_SPLIT_INPUT_STAGES = {256: 1}\n" in source and "\n_FILL_WARPS = {256: 8}\n" in source
    tune.write_table(path, {("other", 128): (32, 1, 2, 16, 128)},
                     {"device": "G", "torch": "t", "triton": "x", "shapes": "s"})
    kept = json.loads(path.read_text(encoding="utf-8"))
    assert kept["fill_warps"] == {"turbo_k4v2": {"256": 8}}
    assert kept["fill_stages_split_inputs"] == {"turbo_k4v2": {"256": 1}}


def test_query_rows_render_per_head_dim_and_survive_a_sweep(tmp_path, monkeypatch):
    """query_rows belongs to the scheme and head_dim it was measured at; a count that is not a power of two (no
    query tile) stops the build with the table's path and entry."""
    path = tmp_path / "decode_tuning.json"
    table = json.loads(codegen.DECODE_TUNING.read_text(encoding="utf-8"))
    table["query_rows"] = {"int8_token": {"64": 16}}
    path.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.setattr(codegen, "DECODE_TUNING", path)
    source = codegen.render(load_scheme(SCHEMES / "int8_token.yaml"))
    assert "\n_QUERY_ROWS = {64: 16}\n" in source
    assert "GROUP_PAD=max(_DOT_ROWS, _pow2(group), _QUERY_ROWS.get(head_dim, 1))" in source
    assert codegen.decode_tuning("int4_token")["query_rows"] == "{}"
    tune.write_table(path, {("other", 128): (32, 1, 2, 16, 128)},
                     {"device": "G", "torch": "t", "triton": "x", "shapes": "s"})
    assert json.loads(path.read_text(encoding="utf-8"))["query_rows"] == {"int8_token": {"64": 16}}
    table["query_rows"] = {"int8_token": {"64": 12}}
    path.write_text(json.dumps(table), encoding="utf-8")
    with pytest.raises(ValueError, match=r"decode_tuning.json: query_rows.int8_token.64: expected a power of two"):
        codegen.decode_tuning("int8_token")


def test_fill_programs_follow_the_register_cap_unless_the_table_names_them(tmp_path, monkeypatch):
    """As many looping fill programs per SM as fit under the cap (one wave), the table's count where it names one,
    per head_dim; the module takes 8 at head dims without either. A sweep keeps the table's counts."""
    path = tmp_path / "decode_tuning.json"
    table = json.loads(codegen.DECODE_TUNING.read_text(encoding="utf-8"))
    table["fill_registers"] = {"capped": {"128": 168, "64": 255}, "named": {"128": 128}}
    table["fill_programs"] = {"named": {"128": 6}}
    path.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.setattr(codegen, "DECODE_TUNING", path)
    assert codegen.decode_tuning("capped")["fill_programs"] == "{64: 2, 128: 3}"  # 65536 // (cap * 128)
    assert codegen.decode_tuning("named")["fill_programs"] == "{128: 6}"
    assert codegen.decode_tuning("int4_token")["fill_programs"] == "{}"
    tune.write_table(path, {("other", 128): (32, 1, 2, 16, 128)},
                     {"device": "G", "torch": "t", "triton": "x", "shapes": "s"})
    assert json.loads(path.read_text(encoding="utf-8"))["fill_programs"] == {"named": {"128": 6}}


def _looping_fill(head_dim: int, monkeypatch):
    """turbo_k4v2's module and its fill's launches at head_dim: 193 tokens (4 tiles of 64) over 2 programs, checked
    against the reference, then a one-tile fill of 5 skipped tokens."""
    import torch
    from conftest import DEVICE
    from test_kernels import check_fill, make_case, snapshot

    case = make_case("turbo_k4v2", head_dim, 16, 1, [100, 90], torch.float16, seed=7)
    m = case.module
    spy = LaunchSpy(m._fill_kernel)
    monkeypatch.setattr(m, "_fill_kernel", spy)
    monkeypatch.setattr(m, "_target_programs", lambda device, per_sm: 2)  # the interpreter's count, on a GPU too
    before = snapshot(case.cache)
    m.fill(case.cache, case.key, case.value, case.slot_mapping)
    check_fill(case, before)
    one = case.key[:5]
    m.fill(case.cache, one, one, torch.full((5,), -1, dtype=torch.int64, device=DEVICE))
    return m, spy.launches


def test_looping_fill_launches_with_the_register_cap(monkeypatch):
    """A fill of several tiles a program passes the module's cap as maxnreg (with 2 stages) and writes what the
    reference writes; a one-tile fill, as a decode step's, launches without either."""
    m, (looping, single) = _looping_fill(128, monkeypatch)
    assert repr(m._FILL_MAX_REGISTERS) == codegen.decode_tuning("turbo_k4v2")["fill_registers"]
    # 2 programs: 4 tiles make 2 a program.
    assert looping["tiles"] == 2 and looping["maxnreg"] == m._FILL_MAX_REGISTERS[128] and looping["num_stages"] == 2
    assert single["tiles"] == 1 and "maxnreg" not in single and single["num_stages"] == 3  # Triton's own
    assert looping["num_warps"] == single["num_warps"] == 4


def test_looping_fill_is_uncapped_where_no_cap_was_measured(monkeypatch):
    """The cap belongs to the head_dim it was measured at: a wider head needs more registers (turbo_k4v2's fill at
    head_dim 256 does not compile under 168), so a fill there launches with the compiler's count."""
    m, (looping, single) = _looping_fill(256, monkeypatch)
    assert 256 not in m._FILL_MAX_REGISTERS
    assert looping["tiles"] == 2 and looping["maxnreg"] is None and looping["num_stages"] == 2
    assert looping["num_warps"] == single["num_warps"] == m._FILL_WARPS[256] == 8  # fill_warps, measured there


def test_best_replaces_a_default_that_fails():
    # At a head_dim whose tiles do not fit the default (shared memory), any variant right everywhere wins.
    slow, fast = (64, 2, 3, 8, 64), (32, 1, 3, 8, 64)
    data = rows({tune.DEFAULT: {1: None, 8: 1.0}, slow: {1: 2.0, 8: 2.0}, fast: {1: 1.0, 8: 1.0}})
    winner, score, scores = tune.best(data, [tune.DEFAULT, slow, fast])
    assert winner == fast and score != score and tune.DEFAULT not in scores
    assert abs(scores[slow] - 2.0) < 1e-9 and abs(scores[fast] - 1.0) < 1e-9
    winner, score, scores = tune.best(rows({tune.DEFAULT: {1: None}, slow: {1: None}}), [tune.DEFAULT, slow])
    assert (winner, score, scores) == (tune.DEFAULT, 1.0, {})
