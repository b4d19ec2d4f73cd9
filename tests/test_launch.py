"""The generated modules' _launch: its launch key must tell apart every argument Triton would compile differently
(checked against Triton's own specialization, on CPU), and on a GPU its direct launches must write what Triton's
own launches write, for every kernel a scheme has."""

import itertools

import pytest
import torch

from conftest import DEVICE
from kvqc.tools import bench
from kvqc.modules import load

INTS = [0, 1, 2, 15, 16, 17, 32, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, (1 << 32) + 16, -1, -16, (1 << 63),
        (1 << 63) + 1]


def _samples() -> list:
    buffers = {dtype: torch.zeros(64, dtype=dtype)
               for dtype in (torch.float16, torch.float32, torch.uint8, torch.int32)}
    tensors = [t[start:] for t in buffers.values() for start in (0, 1, 4, 16)]
    return tensors + INTS + [0.5, 1.0, True, False, None]


def test_launch_key_is_at_least_as_fine_as_tritons_specialization():
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    m = load("int4_token")
    samples = _samples()
    ours = [m._specialization(a) for a in samples]
    tritons = [native(backend, a, False, True, True) for a in samples]
    assert len(set(tritons)) > 10  # the samples do reach Triton's different cases
    for (a, ka, ta), (b, kb, tb) in itertools.combinations(zip(samples, ours, tritons), 2):
        if ka == kb:
            assert ta == tb, f"same launch key for {a!r:.40} and {b!r:.40}, but Triton compiles {ta} and {tb}"


def test_host_helpers_match_triton():
    import triton

    m = load("int4_token")
    for a in range(0, 300):
        assert m._pow2(a) == triton.next_power_of_2(a)
        for b in (1, 3, 16, 64):
            assert m._cdiv(a, b) == triton.cdiv(a, b)


def test_the_interpreter_keeps_tritons_launch():
    m = load("int4_token")
    assert (m._KNOBS is None) == (DEVICE.type == "cpu")


GPU_SCHEMES = ["int4_token", "turbo_k4v2", "kivi_k2v2", "sign1_window", "turbo_outlier_2p5", "fp8_e4m3"]


def _everything(m, head_dim: int, block_size: int, lens: list, dtype: torch.dtype) -> list:
    """fill, decode (an aligned and a misaligned query), flatten and attend where it exists: every output and the
    cache's bytes."""
    torch.manual_seed(0)
    batch, kv_heads, q_heads = len(lens), 4, 8
    blocks = max(lens) // block_size + 1
    block_tables = torch.arange(batch * blocks, device=DEVICE, dtype=torch.int32).flip(0).view(batch, blocks)
    cache = bench._allocate(m, batch * blocks, block_size, kv_heads, head_dim, batch)
    slots = torch.cat([bench.slot_mapping(block_tables[i:i + 1], n, block_size) for i, n in enumerate(lens)])
    key = torch.randn(slots.numel(), kv_heads, head_dim, dtype=dtype, device=DEVICE)
    value = torch.randn_like(key)
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in lens])
    rows = torch.cat([torch.full((n,), i, device=DEVICE) for i, n in enumerate(lens)])
    m.fill(cache, key, value, slots, positions=positions, window_index=rows)  # a windowless scheme ignores them
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ring = torch.arange(batch, device=DEVICE)
    buffer = torch.randn(batch * q_heads * head_dim + 1, dtype=dtype, device=DEVICE)
    out = [m.decode(q.view(batch, q_heads, head_dim), cache, block_tables, seq_lens, window_index=ring)
           for q in (buffer[:-1], buffer[1:])]
    out += list(m.flatten(cache, block_tables, seq_lens, window_index=ring))
    return out + [getattr(cache, field) for field in bench._fields(cache)]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="direct launches exist on compiled CUDA only")
@pytest.mark.parametrize("name", GPU_SCHEMES)
def test_direct_launches_write_what_tritons_write(name):
    m = load(name)
    knobs = m._launch_knobs()
    assert knobs is not None
    head_dim = 128 if 128 in m.HEAD_DIMS else m.HEAD_DIMS[0]
    for block_size, lens, dtype in ((32, [1, 37, 300], torch.float16), (64, [700, 64], torch.bfloat16)):
        try:
            m._KNOBS = None
            want = _everything(m, head_dim, block_size, lens, dtype)
            m._KNOBS = knobs
            _everything(m, head_dim, block_size, lens, dtype)  # each key's first launch: Triton's
            keys = len(m._LAUNCHES)
            got = _everything(m, head_dim, block_size, lens, dtype)  # direct
        finally:
            m._KNOBS = knobs
        assert len(m._LAUNCHES) == keys, "the same calls found new launch keys"
        assert all(entry is not None for entry in m._LAUNCHES.values()), "a launch stayed on Triton's path"
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"{name}: output {i} differs between direct and Triton launches"
