"""Pyflakes' checks (ruff's F rules) over the package, the tests, the benchmark scripts and every generated module:
no unused or undefined names and no unused imports, so a template that renders dead code fails here."""

import subprocess
import sys

from conftest import ROOT

from kvqc.compiler.codegen import render
from kvqc.compiler.spec import load_scheme


def ruff(*args: str) -> None:
    """`ruff check` from the repository's root with these rules and paths; fails with its findings."""
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", *args], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_no_unused_or_undefined_names():
    ruff("--select", "F", "kvqc", "tests", "benchmarks", "generated")


def test_generated_lines_fit_120_columns():
    """The package, the tests, the benchmarks and the generated modules fit 120 columns. Modules are wrapped at
    render time (kvqc/compiler/wrap.py), so templates keep one statement a line."""
    ruff("--select", "E501", "--line-length", "120", "kvqc", "tests", "benchmarks", "generated")


def test_every_test_scheme_renders_lint_clean(tmp_path):
    """The test schemes reach the template branches the shipped catalogue does not (padded heads, fixed outlier
    channels, scale groups wider than a chunk, split QJL parts): their modules too have no unused or undefined
    names and no line over 120 columns, as a scheme a user writes would."""
    schemes = sorted((ROOT / "tests" / "schemes").rglob("*.yaml"))
    assert len(schemes) > 10
    for path in schemes:
        (tmp_path / f"{path.stem}.py").write_text(render(load_scheme(path)), encoding="utf-8")
    ruff("--select", "F,E501", "--line-length", "120", "--no-cache", str(tmp_path))


def test_templates_stay_short():
    """A template a newcomer can read whole: each piece of kvqc/compiler/templates under 400 lines (the kernels
    split their named pieces into files of their own, e.g. kernels/tiles.j2 beside kernels/decode.py.j2)."""
    templates = ROOT / "kvqc" / "compiler" / "templates"
    lengths = {str(p.relative_to(templates)): len(p.read_text().splitlines()) for p in templates.rglob("*.j2")}
    assert len(lengths) > 20, lengths
    assert {name: n for name, n in lengths.items() if n > 400} == {}
