"""Decode's Gluon kernel (kernels/decode_gluon.py.j2): which modules carry it, that it compiles for sm_90 with every
layout conversion trivial, when decode takes it, and (on a GPU) that it decodes as _decode_kernel does.

Gluon has no interpreter: on CPU the kernel is compiled, not run. Its numbers are checked on the GPU, here and by
test_kernels (fp16 decode at head_dim 128 takes it there).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ALL_SCHEMES, DEVICE, ROOT
from kvqc.tools import bench
from kvqc.modules import load

GLUON_SCHEMES = ["turbo_eden_k4v2", "turbo_k4mse_v2", "turbo_k4v2", "turbo_k4v2_w8"]


def test_the_gluon_kernel_is_generated_for_its_formats_only():
    have = [name for name in ALL_SCHEMES if "_decode_kernel_gluon" in load(name).__dict__]
    assert have == GLUON_SCHEMES


# Compiled in a fresh process: under TRITON_INTERPRET=1 (CPU test runs) Gluon's own jit helpers are interpreter
# objects that its compiler cannot take.
COMPILE = ("""
import json, re, subprocess, sys, tempfile
from pathlib import Path
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvqc.modules import load

tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
out = {}
for name, block_size, layout in json.loads(sys.argv[1]):
    fn = load(name)._decode_kernel_gluon
    strides = dict(HEAD_STRIDE=block_size, TOKEN_STRIDE=1) if layout == "bhsd" else dict(HEAD_STRIDE=1, TOKEN_STRIDE=8)
    constexprs = dict(NUM_KV_HEADS=8, GROUP=4, GROUP_PAD=4, HEAD_DIM=128, BLOCK_SIZE=block_size, **strides, BLOCK_N=32,
                      DOT_DTYPE=tl.float16, DOT_PRECISION="tf32x3", LAZY_RESCALE=False,
                      FAST_UNPACK=True, MERGE=True, ROTATE=True, PDL=True)
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = ("*i32" if arg.split("_")[-2] in ("lut", "tables", "lens", "counters") """
                           """else "*u8" if "codes" in arg
                              else "*fp16" if "meta" in arg or "matrix" in arg or arg == "out_ptr" else "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "fp32" if arg == "sm_scale_log2" else "i32"
    source = GluonASTSource(fn, signature, {k: v for k, v in constexprs.items() if k in fn.arg_names}, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(tool), "-res-usage", cubin.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", cubin.name], capture_output=True, text=True).stdout
    # The main loop: the longest span that a backward branch closes.
    lines = re.findall(r"/\\*([0-9a-f]{4,6})\\*/\\s+(.*?);", sass)
    spans = [(int(m.group(1), 16), int(at, 16)) for at, text in lines
             for m in [re.search(r"BRA\\s.*?0x([0-9a-f]+)", text)] if m and int(m.group(1), 16) < int(at, 16)]
    first, last = max(spans, key=lambda span: span[1] - span[0])
    loop = " ".join(text for at, text in lines if first <= int(at, 16) <= last)
    out[f"{name}/{block_size}/{layout}"] = {
        "registers": int(re.search(r"REG:(\\d+)", usage).group(1)),
        "local": int(re.search(r"LOCAL:(\\d+)", usage).group(1)),
        "loop_ops": sorted(set(re.findall(r"\\b(HMMA|LDSM|STS|LDS|BAR)\\b", loop))),
    }
print(json.dumps(out))
""")


CASES = [[name, 64, "bhsd"] for name in GLUON_SCHEMES] + [["turbo_k4v2", 16, "bhsd"], ["turbo_k4v2", 64, "bshd"]]


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(CASES)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", ["/".join(map(str, case)) for case in CASES])
def test_the_gluon_kernel_compiles_for_sm90_without_spills_or_shared_memory_tiles(compiled, case):
    # convert_layout(..., assert_trivial=True) fails the compile if an operand layout needs data movement, and
    # the code words go from global memory to the mma operands in registers: the main loop has no ldmatrix and no
    # shared memory (the query's one conversion, before the loop, has).
    facts = compiled[case]
    assert facts["registers"] <= 255 and facts["local"] == 0, facts
    assert facts["loop_ops"] == ["HMMA"], facts


def test_decode_takes_the_gluon_kernel_only_on_compiled_cuda_with_fp16_queries():
    m = load("turbo_k4v2")
    cache = m.allocate_cache(2, 64, 8, 128, device=DEVICE, dtype=torch.float16)
    half = torch.zeros(1, 32, 128, dtype=torch.float16, device=DEVICE)
    if DEVICE.type == "cpu":
        assert not m._GLUON and not m._gluon_decode(half, cache, 4)
        return
    assert m._gluon_decode(half, cache, 4)
    assert not m._gluon_decode(half.bfloat16(), cache, 4)
    assert not m._gluon_decode(torch.zeros(1, 72, 128, dtype=torch.float16, device=DEVICE), cache, 9)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Gluon kernels run on the GPU only")
@pytest.mark.parametrize("name", GLUON_SCHEMES)
@pytest.mark.parametrize("block_size, q_heads, layout",
                         [(64, 32, "bhsd"), (64, 32, "bshd"), (16, 8, "bhsd"), (16, 64, "bshd"), (32, 24, "bhsd")])
def test_the_gluon_kernel_decodes_as_the_triton_kernel(name, block_size, q_heads, layout, monkeypatch):
    m = load(name)
    torch.manual_seed(0)
    batch, context, kv_heads = 3, 1000, 8
    blocks = -(-context // block_size)
    block_tables = bench._block_tables(batch, blocks)
    seq_lens = torch.tensor([context, 0, context - 37], dtype=torch.int32, device=DEVICE)
    cache = bench._allocate(m, batch * blocks, block_size, kv_heads, 128, batch, layout)  # a window: a ring row each
    bench._populate(m, cache, block_tables, context)
    rows = bench._rows(m, batch)
    query = torch.randn(batch, q_heads, 128, dtype=torch.float16, device=DEVICE)
    assert m._gluon_decode(query, cache, q_heads // kv_heads)
    got = m.decode(query, cache, block_tables, seq_lens, **rows).float()
    monkeypatch.setattr(m, "_gluon_decode", lambda *args: False)
    want = m.decode(query, cache, block_tables, seq_lens, **rows).float()
    assert torch.isfinite(got).all()
    assert (got - want).norm() <= 2e-3 * want.norm()
