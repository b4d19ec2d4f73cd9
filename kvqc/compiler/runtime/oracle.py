"""`module.reference`: the float64 oracle of the module's scheme, built on first use, the only thing in a module
that imports kvqc.

Every generated module carries this text (see kvqc/compiler/runtime/__init__.py).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvqc.compiler.runtime.scope import SCHEME

# ---- generated modules carry the rest of this file verbatim ----


def __getattr__(name: str):
    # The float64 reference lives in kvqc; importing it lazily keeps this module free of kvqc at run time.
    if name == "reference":
        from kvqc.oracle.reference import bind

        globals()["reference"] = bind(SCHEME)  # built once: later lookups find it without coming here
        return globals()["reference"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
