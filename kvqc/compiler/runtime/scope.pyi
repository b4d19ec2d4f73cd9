"""The names a generated module defines per scheme (module.py.j2, wrappers.py.j2) that the runtime files read.

Runtime files import them from here under TYPE_CHECKING only, to be linted and read on their own; in a generated
module they are the module's own constants, class and functions.
"""

import torch

from kvqc.compiler.runtime.cache import _PagedCache

HEAD_DIMS: tuple[int, ...]  # the head sizes the scheme is built for
SCHEME: dict  # the scheme as data
_DECODE_CONFIGS: dict[int, tuple]  # decode's launch settings per head_dim
_DECODE_DEFAULT: tuple  # ... for a head_dim the table does not name

class KVCache(_PagedCache):  # a dataclass of the scheme's cache tensors
    head_dim: int
    layout: str
    key_codes: torch.Tensor
    key_meta: torch.Tensor
    max_seqs: int  # window schemes only

def _check_cache_fields(cache: KVCache) -> bool: ...  # the scheme's tensors, shapes and alignment
