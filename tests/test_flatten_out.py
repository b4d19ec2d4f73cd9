"""flatten into an engine's buffers (out=, start_loc=) and in the rotated basis (rotated=True).

Engines such as LMDeploy hand flatten a [num_kv_heads, rows, head_dim] buffer and a start row per sequence and read
nothing back on the host; the results must equal flatten's own packed output, placed at those rows, with every
other row untouched. Tiny shapes: the kernels run under Triton's interpreter on CPU.
"""

import re

import pytest
import torch
from conftest import DEVICE, generated

BLOCK_SIZE, HEADS = 32, 2  # 32: kivi_k2v2's key groups of 32 tokens must not straddle blocks
SEQ_LENS = [5, 0, 37]
# One scheme per kernel family: Hadamard blocks (rotated basis offered), affine codes, a window ring.
CASES = ["turbo_k4v2", "int8_token", "kivi_k2v2"]


def filled(name: str, head_dim: int = 64, seed: int = 0):
    kv = generated(name)
    torch.manual_seed(seed)
    window = hasattr(kv, "WINDOW")
    extra = {"max_seqs": len(SEQ_LENS)} if window else {}
    cache = kv.allocate_cache(8, BLOCK_SIZE, HEADS, head_dim, device=DEVICE, dtype=torch.float16, **extra)
    tables = torch.randperm(8, device=DEVICE)[:6].view(3, 2).to(torch.int32)
    slots, positions, rows = [], [], []
    for b, n in enumerate(SEQ_LENS):
        p = torch.arange(n, device=DEVICE)
        slots.append(tables[b, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE)
        positions.append(p)
        rows.append(torch.full((n,), b, device=DEVICE))
    slot_mapping, positions, rows = torch.cat(slots), torch.cat(positions), torch.cat(rows)
    key = torch.randn(len(slot_mapping), HEADS, head_dim, device=DEVICE, dtype=torch.float16)
    value = torch.randn_like(key)
    kv.fill(cache, key, value, slot_mapping, positions=positions, window_index=rows)  # ignored without a window
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=DEVICE)
    return kv, cache, (tables, seq_lens), torch.arange(3, device=DEVICE) if window else None, head_dim


@pytest.mark.parametrize("name", CASES)
def test_out_buffers_match_packed_flatten(name):
    kv, cache, paging, ring, d = filled(name)
    key, value = kv.flatten(cache, *paging, window_index=ring)
    rows = 64
    start_loc = torch.tensor([3, 20, 24], dtype=torch.int64, device=DEVICE)  # sequence 1 is empty at row 20
    k_out = torch.full((HEADS, rows, d), 7.0, dtype=torch.float16, device=DEVICE)  # LMDeploy's 'hsd'
    v_out = torch.full_like(k_out, 7.0)
    got = kv.flatten(cache, *paging, window_index=ring, out=(k_out.transpose(0, 1), v_out.transpose(0, 1)),
                     start_loc=start_loc)
    assert got[0].data_ptr() == k_out.data_ptr()
    placed = torch.zeros(rows, dtype=torch.bool)
    at = 0
    for b, n in enumerate(SEQ_LENS):
        s = int(start_loc[b])
        torch.testing.assert_close(k_out[:, s : s + n].transpose(0, 1), key[at : at + n], rtol=0, atol=0)
        torch.testing.assert_close(v_out[:, s : s + n].transpose(0, 1), value[at : at + n], rtol=0, atol=0)
        placed[s : s + n] = True
        at += n
    assert bool((k_out[:, ~placed] == 7).all()) and bool((v_out[:, ~placed] == 7).all())  # other rows untouched


@pytest.mark.parametrize("name", CASES)
def test_reference_writes_out_buffers_as_the_module_does(name):
    """reference.flatten takes out= and start_loc= with the module's meaning: the same rows written, the rest kept,
    rows past the buffers' end dropped."""
    kv, cache, paging, ring, d = filled(name)
    start_loc = torch.tensor([3, 20, 24], dtype=torch.int64, device=DEVICE)
    got, want = [], []
    for flatten, buffers in ((kv.flatten, got), (kv.reference.flatten, want)):
        buffers.extend(torch.full((50, HEADS, d), 7.0, dtype=torch.float16, device=DEVICE) for _ in range(2))
        returned = flatten(cache, *paging, window_index=ring, out=tuple(buffers), start_loc=start_loc)
        assert returned[0] is buffers[0] and returned[1] is buffers[1]
    for g, w in zip(got, want):
        assert bool((w[:3] == 7).all()) and bool((w[3:8] != 7).any()) and bool((w[24:50] != 7).any())
        assert float((g.double() - w.double()).abs().max()) < 0.05 * float(w.double().abs().max())


@pytest.mark.parametrize("name", CASES)
def test_out_default_start_is_packed_and_rows_past_the_end_are_not_written(name):
    kv, cache, paging, ring, d = filled(name)
    key, _ = kv.flatten(cache, *paging, window_index=ring)
    short = 20  # sequence 2's 37 tokens would start at row 5 and run past row 20
    k_out = torch.full((short, HEADS, d), 7.0, dtype=torch.float16, device=DEVICE)
    v_out = torch.full_like(k_out, 7.0)
    kv.flatten(cache, *paging, window_index=ring, out=(k_out, v_out))
    torch.testing.assert_close(k_out, key[:short], rtol=0, atol=0)


def test_rotated_basis_is_the_rotation_of_the_input_basis():
    kv, cache, paging, ring, d = filled("turbo_k4v2")
    key, value = kv.flatten(cache, *paging, window_index=ring)
    k_rot, v_rot = (torch.empty(key.shape[0], HEADS, d, dtype=torch.float32, device=DEVICE) for _ in range(2))
    kv.flatten(cache, *paging, window_index=ring, out=(k_rot, v_rot), rotated=True)
    for x, r, side in ((key, k_rot, "key"), (value, v_rot, "value")):
        want = x.float() @ kv.rotation(side, d, DEVICE).t()
        torch.testing.assert_close(r, want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))
    # The reference's rotated basis is its own rotation (signs, then the Walsh-Hadamard transform) of its values.
    ref_rot = kv.reference.flatten(cache, *paging, window_index=ring, rotated=True)
    for r, want in zip((k_rot, v_rot), ref_rot):
        assert float((r.double().cpu() - want).norm() / want.norm()) < 2e-3


def test_rotation_is_offered_only_where_flatten_can_skip_the_way_back():
    assert "rotated" not in generated("int8_token").flatten.__kwdefaults__
    assert not hasattr(generated("kivi_k2v2"), "rotation")


@pytest.mark.parametrize(
    "out, start_loc, message",
    [
        ("pair", None, "out: expected a (key, value) pair"),
        ("overlap", None, "out: rows overlap"),
        ("heads", None, "out[0]: expected shape"),
        ("ok", "wrong", "start_loc: expected shape"),
        (None, "given", "start_loc: places sequences in out's rows"),
    ],
)
def test_bad_out_arguments_are_refused_by_name(out, start_loc, message):
    kv, cache, paging, ring, d = filled("int8_token")
    good = torch.zeros(64, HEADS, d, dtype=torch.float16, device=DEVICE)
    outs = {
        None: None,
        "pair": good,
        "overlap": (torch.zeros(64, d, dtype=torch.float16, device=DEVICE)[:, None].expand(64, HEADS, d),) * 2,
        "heads": (torch.zeros(64, HEADS + 1, d, dtype=torch.float16, device=DEVICE),) * 2,
        "ok": (good, good.clone()),
    }
    starts = {None: None, "wrong": torch.zeros(2, dtype=torch.int64, device=DEVICE),
              "given": torch.zeros(3, dtype=torch.int64, device=DEVICE)}
    with pytest.raises(ValueError, match=re.escape(message)):
        kv.flatten(cache, *paging, window_index=ring, out=outs[out], start_loc=starts[start_loc])
