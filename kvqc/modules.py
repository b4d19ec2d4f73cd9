"""Load a generated module from a scheme name, a generated .py file or a scheme .yaml.

    kv = kvqc.modules.load("turbo_k4v2")                 # ./generated/turbo_k4v2.py, else the shipped scheme
    kv = kvqc.modules.load("path/to/generated/x.py")     # any generated module
    kv = kvqc.modules.load("my_scheme.yaml")             # rendered on the fly into the cache directory

A bare name is the module `kvqc build` wrote under the working directory (`generated/<name>.py`) when there is one,
else the shipped scheme of that name (kvqc/schemes/<name>.yaml), rendered as any .yaml is. A .yaml is validated and
rendered with kvqc.compiler.codegen.render, then written once to
`$KVQC_CACHE_DIR/<name>-<sha256 of the source, 12 hex>.py` (default `~/.cache/kvqc`): Triton reads a kernel's
source back from its file, so a module must live in a real file. Modules are imported by file path (never by
package name) and cached: a second load of the same file returns the same module object.

Whether Triton compiles or interprets a module's kernels is fixed when the module is imported (`TRITON_INTERPRET`
is read as the kernels are decorated, and the module records it in `_INTERPRET`), so the cache is keyed on that
setting too: setting TRITON_INTERPRET=1 later and loading again gives a fresh, interpreted instance.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from kvqc.files import read_regular
from kvqc.compiler.spec import NAME_RE

# The shipped catalogue, inside the package so that any install can build it.
SCHEMES = Path(__file__).resolve().parent / "schemes"
# Where `kvqc build` writes by default, relative to the working directory.
GENERATED = Path("generated")

_lock = threading.Lock()
_loaded: dict[tuple[Path, bool], ModuleType] = {}


def cache_dir() -> Path:
    """Where modules rendered from a .yaml are written: $KVQC_CACHE_DIR, else ~/.cache/kvqc."""
    return Path(os.environ.get("KVQC_CACHE_DIR") or Path.home() / ".cache" / "kvqc").expanduser()


def interpreting() -> bool:
    """Whether modules imported now get interpreted kernels (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_library_interpreted() -> bool | None:
    """Whether the imported triton decorated its own library (tl.min, ...) for the interpreter; None: not imported.

    Triton reads TRITON_INTERPRET when it decorates a function, and its language library is decorated when triton
    is first imported: a generated module can only run under the interpreter if that import happened with
    TRITON_INTERPRET=1 too (and only compiled if it happened without).
    """
    if "triton" not in sys.modules:
        return None
    try:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a triton without these internals: trust the environment
        return interpreting()
    return isinstance(standard.max, InterpretedFunction)


def resolve(scheme: str | Path) -> Path:
    """The generated .py file for a scheme name, a .py path or a .yaml path (rendering the .yaml if needed)."""
    text = str(scheme)
    path = Path(text).expanduser()
    if path.suffix in (".yaml", ".yml"):
        return _render(path)
    if path.suffix == ".py":
        if not path.is_file():
            raise FileNotFoundError(f"{text}: no such generated module")
        return path.resolve()
    if isinstance(scheme, Path) or os.sep in text or (os.altsep and os.altsep in text):
        raise ValueError(f"{text}: expected a scheme name, a generated .py file or a scheme .yaml file")
    if not NAME_RE.match(text):
        raise ValueError(f"{text!r}: not a scheme name ([a-z][a-z0-9_]*), a .py file or a .yaml file")
    target = GENERATED / f"{text}.py"
    if target.is_file():
        return target.resolve()
    if (SCHEMES / f"{text}.yaml").is_file():
        return _render(SCHEMES / f"{text}.yaml")
    known = sorted(p.stem for p in SCHEMES.glob("*.yaml"))
    raise FileNotFoundError(f"{text}: no {target} here and no shipped scheme of that name "
                            f"(shipped: {', '.join(known)}); pass a .yaml or .py path")


def _render(path: Path) -> Path:
    from kvqc.compiler.codegen import render, write_atomic
    from kvqc.compiler.spec import load_scheme

    scheme = load_scheme(path)  # raises SchemeError (one line) for a bad file
    source = render(scheme)
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()[:12]
    target = cache_dir() / f"{scheme.name}-{digest}.py"
    try:
        current = read_regular(target, 2 * len(source)).decode("utf-8")
    except (OSError, UnicodeDecodeError):  # absent, unreadable, or not a regular file: written afresh
        current = None
    if current != source:
        write_atomic(target, source)
    return target.resolve()


def load(scheme: str | Path) -> ModuleType:
    """Import the generated module for `scheme` (a name, a generated .py or a scheme .yaml), once per file."""
    path = resolve(scheme)
    key = (path, interpreting())
    with _lock:
        module = _loaded.get(key)
        if module is None:
            digest = hashlib.sha256(f"{path}|{key[1]}".encode()).hexdigest()[:10]
            name = f"kvqc_generated_{path.stem.replace('-', '_')}_{digest}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"{path}: cannot be imported as a module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses and Triton's source lookup resolve names through sys.modules
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
            for attr in ("allocate_cache", "fill", "flatten", "decode", "bytes_per_token", "SCHEME"):
                if not hasattr(module, attr):
                    sys.modules.pop(name, None)
                    raise ImportError(f"{path}: not a kvqc generated module (no {attr})")
            _loaded[key] = module
        return module


def bits_per_coordinate(module: ModuleType, head_dim: int, metadata_bytes: int = 2) -> tuple[float, float]:
    """Stored K and V bits per coordinate of a generated module's cache (both parts of a channel split), read off
    the scheme it embeds."""
    from kvqc.compiler.spec import scheme_from_dict

    return scheme_from_dict(module.SCHEME, source="<generated module>").bits_per_coordinate(head_dim, metadata_bytes)


def meta_width(module: ModuleType, side: str, head_dim: int) -> int:
    """Metadata values per token and KV head of a generated module's K (side='key') or V: fields times groups."""
    fields = len(getattr(module, f"{side.upper()}_METADATA"))
    group_size = getattr(module, f"{side.upper()}_GROUP_SIZE", None)
    return fields * (head_dim // group_size if group_size else 1)
