"""Pyflakes' checks (ruff's F rules) over the package, the tests, the benchmark scripts and every generated module:
no unused or undefined names and no unused imports, so a template that renders dead code fails here."""

import subprocess
import sys

from conftest import ROOT


def test_no_unused_or_undefined_names():
    paths = ["kvqc", "tests", "benchmarks", "generated"]
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--output-format", "concise", *paths],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
