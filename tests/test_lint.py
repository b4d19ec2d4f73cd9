"""Pyflakes' checks (ruff's F rules) over the package, the tests, the benchmark scripts and every generated module:
no unused or undefined names and no unused imports, so a template that renders dead code fails here; and no kernel
parameter a kernel never reads, which pyflakes does not check."""

import ast
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


def unread_kernel_parameters(source: str) -> list[str]:
    """`kernel:parameter` for each parameter of a @triton.jit or @gluon.jit function that its body never reads;
    `_decode_kernel_gluon` aside, which takes `_decode_kernel`'s arguments so that one launch serves either."""
    unread = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or node.name == "_decode_kernel_gluon":
            continue
        if not any(ast.unparse(d).endswith(".jit") for d in node.decorator_list):
            continue
        read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        for arg in node.args.args + node.args.kwonlyargs:
            if arg.arg not in read:
                unread.append(f"{node.name}:{arg.arg}")
    return unread


def test_unread_kernel_parameters_are_found():
    """The check above finds a parameter nothing reads, and only that one."""
    source = "import triton\n\n\n@triton.jit\ndef _k(x_ptr, y_ptr, N: tl.constexpr):\n    tl.store(x_ptr, N)\n"
    assert unread_kernel_parameters(source) == ["_k:y_ptr"]


def test_kernels_read_every_parameter():
    """Each generated module's kernels take only what they read: a table or a constexpr a kernel does not use is a
    launch argument bound for nothing (Layout's *_params decide each kernel's list)."""
    unread = {path.stem: found for path in sorted((ROOT / "generated").glob("*.py"))
              if (found := unread_kernel_parameters(path.read_text(encoding="utf-8")))}
    assert unread == {}


def test_no_unused_or_undefined_names():
    ruff("--select", "F", "kvqc", "tests", "benchmarks", "generated")


def test_generated_lines_fit_120_columns():
    """The package, the tests, the benchmarks and the generated modules fit 120 columns. Modules are wrapped at
    render time (kvqc/compiler/wrap.py), so templates keep one statement a line."""
    ruff("--select", "E501", "--line-length", "120", "kvqc", "tests", "benchmarks", "generated")


def test_every_test_scheme_renders_lint_clean(tmp_path):
    """The test schemes reach the template branches the shipped catalogue does not (padded heads, fixed outlier
    channels, scale groups wider than a chunk, split QJL parts): their modules too have no unused or undefined
    names, no unread kernel parameter and no line over 120 columns, as a scheme a user writes would; so do the
    benchmark inputs of benchmarks/schemes."""
    schemes = sorted((ROOT / "tests" / "schemes").rglob("*.yaml"))
    schemes += sorted((ROOT / "benchmarks" / "schemes").glob("*.yaml"))
    assert len(schemes) > 10
    unread = {}
    for path in schemes:
        source = render(load_scheme(path))
        (tmp_path / f"{path.stem}.py").write_text(source, encoding="utf-8")
        if found := unread_kernel_parameters(source):
            unread[path.stem] = found
    ruff("--select", "F,E501", "--line-length", "120", "--no-cache", str(tmp_path))
    assert unread == {}


def test_templates_stay_short():
    """A template a newcomer can read whole: each piece of kvqc/compiler/templates under 400 lines (the kernels
    split their named variants into files of their own, e.g. kernels/decode/ beside kernels/decode.py.j2)."""
    templates = ROOT / "kvqc" / "compiler" / "templates"
    lengths = {str(p.relative_to(templates)): len(p.read_text().splitlines()) for p in templates.rglob("*.j2")}
    assert len(lengths) > 20, lengths
    assert {name: n for name, n in lengths.items() if n > 400} == {}


def test_templates_bind_rather_than_decide():
    """Templates place what the plan and kvqc/compiler/pieces decided: at most a fifth of their lines are Jinja
    statements ({% ... %}: branches, loops, sets), the rest the text they render."""
    templates = ROOT / "kvqc" / "compiler" / "templates"
    lines = [line for p in templates.rglob("*.j2") for line in p.read_text().splitlines()]
    statements = [line for line in lines if line.lstrip().startswith("{%") or "{%-" in line]
    assert len(statements) <= len(lines) / 5, f"{len(statements)} of {len(lines)} template lines are statements"
