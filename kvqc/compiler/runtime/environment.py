"""What a module reads from its environment when imported: KVQC_DEBUG, TRITON_INTERPRET, whether its kernels are
compiled for CUDA (where inline PTX and griddepcontrol exist) and what the installed Triton's dots take.

Every generated module carries this text (see kvqc/compiler/runtime/__init__.py), before its launch settings.
"""

import os
import re

import torch
import triton

# ---- generated modules carry the rest of this file verbatim ----


DEBUG = os.environ.get("KVQC_DEBUG", "0") == "1"
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Codes must land in the same Lloyd-Max cell as the float64 reference: no plain tf32 products (float32 dots: QJL's
# projection, float32 queries; the rotations go through fp16 halves, pieces/rotate.py).
_DOT_PRECISION = "ieee" if _INTERPRET else "tf32x3"
# Compiled CUDA, not the interpreter or HIP: where inline PTX and griddepcontrol exist.
_COMPILED_CUDA = not _INTERPRET and torch.version.hip is None
# The fewest query rows decode's dots may hold: on NVIDIA, Triton pads fewer than 16 for the tensor cores itself from
# 3.5 on (the interpreter takes any); earlier releases, other backends and a version it cannot read want 16.
_TRITON_RELEASE = re.match(r"(\d+)\.(\d+)", triton.__version__)
_DOT_ROWS = 1 if _INTERPRET or (
    _COMPILED_CUDA and _TRITON_RELEASE is not None and tuple(map(int, _TRITON_RELEASE.groups())) >= (3, 5)
) else 16
