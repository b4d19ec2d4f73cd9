"""Shared test setup: which device the generated kernels run on, and hypothesis profiles.

On a machine with a GPU the kernels are compiled and run there; elsewhere they run on CPU tensors under Triton's
interpreter, which must be switched on before triton decorates any kernel.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, settings  # noqa: E402

# ci: what CI affords under the interpreter, derandomized so that a submission's CI run is reproducible (each
# example still draws its own data); deep: a longer, randomized run (KVQC_PROFILE=deep), e.g. on a GPU.
settings.register_profile(
    "ci", max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "deep", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# smoke: one example per test, enough to compile every kernel on a GPU and check it once (KVQC_PROFILE=smoke).
settings.register_profile(
    "smoke", max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("KVQC_PROFILE", "ci"))
DEEP = os.environ.get("KVQC_PROFILE", "ci") == "deep"

ALL_SCHEMES = sorted(p.stem for p in (ROOT / "kvqc" / "schemes").glob("*.yaml"))
# Schemes with a recent-token window take positions and ring rows in their kernels' signatures: test_window.py
# checks them; the kernel tests elsewhere take the windowless ones.
WINDOW_SCHEMES = [n for n in ALL_SCHEMES if "\nwindow:" in (ROOT / "kvqc" / "schemes" / f"{n}.yaml").read_text()]
# Schemes with a channel split need calibrate() before their first fill: test_kernels.py and test_split.py take
# them; the edge-case suites elsewhere build caches without it.
SPLIT_SCHEMES = [n for n in ALL_SCHEMES if "\n  outliers:" in (ROOT / "kvqc" / "schemes" / f"{n}.yaml").read_text()]
SCHEMES = [n for n in ALL_SCHEMES if n not in WINDOW_SCHEMES and n not in SPLIT_SCHEMES]

from kvqc.modules import load as generated  # noqa: E402, F401  generated/<name>.py, imported once (tests import it)


def slot_rows(cache, t: torch.Tensor) -> torch.Tensor:
    """A cache tensor's entries as [num_slots, num_kv_heads, width], slot = block * block_size + offset, whatever
    the cache's layout (a copy for 'bhsd' blocks: for reading only)."""
    if cache.layout == "bhsd":
        t = t.transpose(1, 2)
    return t.reshape(-1, cache.num_kv_heads, t.shape[-1])
