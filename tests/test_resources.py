"""kvqc resources without a GPU: kernels compiled for an H100 (sm_90) fit its shared memory. The interpreter that
checks kernels on CPU has no such limit, and a GPU refuses a kernel that asks for more at its first launch."""

import functools
import json
from types import SimpleNamespace

import pytest

from kvqc.compiler.layout import plan
from kvqc.compiler.spec import load_scheme
from kvqc.modules import SCHEMES
from kvqc.tools import resources


@pytest.mark.parametrize("scheme", ["turbo_qjl_k3v3", "turbo_outlier_2p5", "turbo_k4v2", "int8_token"])
def test_only_hadamard_block_fills_loop_and_none_loads_a_matrix_in_its_loop(scheme):
    # A dense rotation would be copied by every stage past the first of a looping fill (Layout.loop_stages); no
    # shipped fill loops over one. Hadamard blocks load no matrix; turbo_outlier_2p5's and turbo_qjl_k3v3's fills
    # take a tile a program (no loop), int8_token's too, and flatten always runs one stage.
    layout = plan(load_scheme(SCHEMES / f"{scheme}.yaml"))
    assert layout.fill_loops == (scheme == "turbo_k4v2")
    assert layout.loop_stages == {}


@functools.lru_cache(maxsize=None)
def launches_at_256(scheme: str) -> tuple:
    """The scheme's fill, decode and flatten launches at head_dim 256, recorded under the interpreter once for the
    tests below (recording the QJL scheme's takes most of their time)."""
    return tuple(resources._step("record", scheme, "256 bhsd", interpret=True))


@pytest.mark.parametrize("scheme", ["turbo_qjl_k3v3", "turbo_outlier_2p5", "metal_q8_0_q3_0"])
def test_kernels_fit_an_sm_at_head_dim_256(scheme):
    # The first two load d x d matrices in fill and flatten; metal_q8_0_q3_0's looping fill holds the widest tiles,
    # whose pipeline copies pass an SM at two stages for bf16 and fp32 inputs (fill_stages_split_inputs: one).
    rows = resources.measure(scheme, 256, launches=list(launches_at_256(scheme)))
    fills = {"_fill_kernel", "_fill_kernel[bf16]", "_fill_kernel[fp32]"}
    if scheme == "metal_q8_0_q3_0":
        fills = {"_fill_kernel", "_fill_kernel[loop,fp16]", "_fill_kernel[loop,bf16]", "_fill_kernel[loop,fp32]"}
    assert fills | {"_decode_kernel", "_flatten_kernel"} <= {row["kernel"] for row in rows}
    for row in rows:
        assert "error" not in row, row
        assert 0 < row["shared"] <= resources.SM90_SHARED, row
        assert row["registers"] and row["registers"] <= 255, row


def test_a_kernel_past_an_sm_is_reported():
    # The QJL flatten at head_dim 256 with Triton's own 3 stages: three copies of the 256 KiB projection.
    launches = launches_at_256("turbo_qjl_k3v3")
    flatten = next(dict(launch) for launch in launches if launch["kernel"] == "_flatten_kernel")
    assert flatten["options"] == {"num_stages": 1}
    flatten["options"] = {"num_stages": 3}
    (row,) = resources._step("compile", "turbo_qjl_k3v3", json.dumps([flatten]), interpret=False)
    assert row["shared"] > resources.SM90_SHARED


def test_token_major_launches_compile_with_their_own_grid():
    # On token-major blocks the kernels take HEADS_FASTEST and the rows' strides of that layout: compiled as such.
    rows = {layout: resources.measure("int4_token", 128, layout=layout) for layout in ("bhsd", "bshd")}
    assert [row["kernel"] for row in rows["bshd"]] == [row["kernel"] for row in rows["bhsd"]]
    for row in rows["bshd"]:
        assert "error" not in row and row["layout"] == "bshd", row
        assert 0 < row["registers"] <= 255, row
    launches = resources._step("record", "int4_token", "128 bshd", interpret=True)
    decode = next(launch for launch in launches if launch["kernel"] == "_decode_kernel")
    assert decode["args"]["HEADS_FASTEST"] == ["value", True] and decode["args"]["HEAD_STRIDE"] == ["value", 1]


def test_compiled_launches_pad_query_rows_as_the_installed_triton_needs():
    # The interpreter's dots take any rows; a Triton before 3.5 compiles NVIDIA dots of 16 rows at least.
    assert resources.compiled_value(SimpleNamespace(_DOT_ROWS=16), "GROUP_PAD", 4) == 16
    assert resources.compiled_value(SimpleNamespace(_DOT_ROWS=1), "GROUP_PAD", 4) == 4
    assert resources.compiled_value(SimpleNamespace(_DOT_ROWS=16), "GROUP_PAD", 32) == 32
    assert resources.compiled_value(SimpleNamespace(_DOT_ROWS=16), "FAST_UNPACK", False) is True
