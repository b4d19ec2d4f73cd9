"""The static part of every generated module, as plain Python: argument checks, the cache's base class and its
checks, launch shapes and launching, the pieces only window or channel-split schemes carry, and the kernels' Triton
and PTX helpers (helpers.py, ptx.py, which a module carries a function at a time: those its plan names).

Each file is ordinary Python that ruff lints and a reader opens, in two parts split by the marker line

    # ---- generated modules carry the rest of this file verbatim ----


Above it: a docstring and the imports that let the file stand alone. A generated module has the same imports
(module.py.j2), and defines the names imported under TYPE_CHECKING itself: from another runtime file, or per scheme
(scope.pyi lists those). Below it: the text that codegen renders into each module unchanged, where a template says
`{{ runtime("checks") }}` (codegen.runtime_source). Nothing here is imported at build or run time: codegen reads the
files as text, and generated modules never import kvqc.
"""
