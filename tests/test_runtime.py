"""The runtime files (kvqc/compiler/runtime/*.py): plain Python that every generated module carries verbatim below
each file's marker line, with the imports above it and none of them repeated in the module."""

import ast
import inspect
from types import SimpleNamespace

import pytest
from conftest import ALL_SCHEMES, ROOT, SPLIT_SCHEMES, WINDOW_SCHEMES, generated

from kvqc.compiler.codegen import RUNTIME, RUNTIME_MARKER, helper_sources, runtime_source
from kvqc.compiler.layout import plan
from kvqc.compiler.spec import load_scheme

NAMES = sorted(p.stem for p in RUNTIME.glob("*.py") if p.stem != "__init__")
WHOLE = [name for name in NAMES if name not in ("helpers", "ptx")]  # these two are carried a function at a time
# Carried only by some modules: window schemes, channel-split schemes, and those whose flatten takes out=.
ONLY = {"window": set(WINDOW_SCHEMES), "channels": set(SPLIT_SCHEMES),
        "flatten_out": set(ALL_SCHEMES) - set(SPLIT_SCHEMES)}


def _imports(tree: ast.Module) -> set:
    """The module-level imports, as source lines (TYPE_CHECKING blocks aside)."""
    return {ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))}


@pytest.mark.parametrize("name", NAMES)
def test_a_runtime_file_has_one_marker_and_its_imports_above_it(name):
    text = (RUNTIME / f"{name}.py").read_text()
    assert text.count(RUNTIME_MARKER) == 1
    head, body = text.split(RUNTIME_MARKER)
    assert not _imports(ast.parse(body)), "imports belong above the marker: the module has its own"
    assert body.strip("\n") == runtime_source(name)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_every_module_carries_its_runtime_verbatim_and_each_import_once(scheme):
    source = (ROOT / "generated" / f"{scheme}.py").read_text()
    module = ast.parse(source)
    for name in WHOLE:
        carried = runtime_source(name) in source
        assert carried == (scheme in ONLY.get(name, {scheme})), name
        if carried:
            head = (RUNTIME / f"{name}.py").read_text().split(RUNTIME_MARKER)[0]
            assert _imports(ast.parse(head)) - {"from typing import TYPE_CHECKING"} <= _imports(module), name
    lines = [ast.unparse(n) for n in module.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(lines) == len(set(lines))


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_every_module_carries_the_helpers_its_kernels_call(scheme):
    """runtime/helpers.py's and runtime/ptx.py's functions reach a module as they stand, those its plan names
    (Layout.jit_helpers, Layout.ptx_helpers), and no other: a helper left out fails at the first compile, one carried
    for nothing is dead code."""
    source = (ROOT / "generated" / f"{scheme}.py").read_text()
    layout = plan(load_scheme(ROOT / "kvqc" / "schemes" / f"{scheme}.yaml"))
    for name, wanted in (("helpers", layout.jit_helpers), ("ptx", layout.ptx_helpers)):
        if wanted:
            assert helper_sources(wanted, name) in source
        defined = {node.name for node in ast.parse(runtime_source(name)).body if isinstance(node, ast.FunctionDef)}
        carried = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)} & defined
        assert carried == set(wanted), name


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_reference_takes_the_modules_arguments(name):
    """`module.reference.<f>` takes exactly `module.<f>`'s parameters (names, kinds, defaults), so a call written for
    the module runs the oracle as it stands, keywords and positions alike."""
    m = generated(name)
    functions = ["fill", "flatten", "decode", "attend"] + (["calibrate"] if hasattr(m, "calibrate") else [])
    for f in functions:
        module = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(m, f)).parameters.values()]
        oracle = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(m.reference, f)).parameters.values()]
        assert oracle == module, f


@pytest.mark.parametrize("version, interpret, hip, rows", [
    ("3.6.0", "0", None, 1), ("3.5.0+git1234", "0", None, 1), ("3.4.0", "0", None, 16), ("3.10.1", "0", None, 1),
    ("nightly", "0", None, 16), ("3.4.0", "1", None, 1), ("3.6.0", "0", "6.2", 16),
])
def test_query_rows_follow_the_installed_triton(version, interpret, hip, rows, monkeypatch):
    """_DOT_ROWS, what decode pads its query heads to at least: any count where Triton's NVIDIA dots pad for the
    tensor cores themselves (3.5 on) and under the interpreter; 16 before 3.5, on HIP and for a version it cannot
    read."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    scope = {"os": __import__("os"), "re": __import__("re"),
             "torch": SimpleNamespace(version=SimpleNamespace(hip=hip)), "triton": SimpleNamespace(__version__=version)}
    exec(runtime_source("environment"), scope)
    assert scope["_DOT_ROWS"] == rows
