"""Generated kernels against the float64 reference, on shapes and data drawn by hypothesis.

Each example builds a paged cache with scattered blocks, poisons it, fills several sequences whose lengths are
not multiples of the block size (in shuffled token order, with skipped -1 slots mixed in), then checks:
fill's codes and metadata against the reference's, every other byte of the cache untouched, flatten against
reference dequantization, and decode against reference attention on peaked (not near-uniform) scores.
"""

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from conftest import DEEP, DEVICE, ROOT, SCHEMES, SPLIT_SCHEMES, generated, slot_rows
from hypothesis import given, settings
from hypothesis import strategies as st

# Metadata is rounded to the model dtype: one unit in the last place of fp16 / bf16 may differ where the kernel's
# float32 norm and the reference's float64 norm fall on either side of a rounding tie.
META_RTOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}
# Relative L2 error of whole outputs: float32 arithmetic, then rounding to the output dtype.
OUT_RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# A coordinate whose decision (cell, residual sign, rounding) sits this close to flipping, in N(0,1) units or
# grid steps, may legitimately get another code from float32 arithmetic than from float64.
MARGIN = 1e-3


@dataclass
class Case:
    module: object
    cache: object
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    dtype: torch.dtype


def cache_fields(cache) -> list[str]:
    """The cache's per-slot tensors: codes and metadata of every side, and of both parts of a split side."""
    return [f.name for f in dataclasses.fields(cache) if f.name.endswith(("_codes", "_meta"))]


def poison(cache, generator):
    for name in cache_fields(cache):
        t = getattr(cache, name)
        if name.endswith("_codes"):
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=generator))
        else:
            t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))


def make_case(name, head_dim, block_size, num_kv_heads, seq_lens, dtype, seed, skipped=3, layout="bhsd") -> Case:
    m = generated(name)
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=g)  # scattered, not contiguous, blocks
    width = max(max(blocks, default=0), 1) + 1  # a spare column of padding the kernels must not read
    block_tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    at = 0
    slots = []
    for b, (n, k) in enumerate(zip(seq_lens, blocks)):
        block_tables[b, :k] = order[at : at + k]
        at += k
        p = torch.arange(n)
        slots.append(block_tables[b, p // block_size].to(torch.int64) * block_size + p % block_size)
    slot_mapping = torch.cat(slots + [torch.full((skipped,), -1, dtype=torch.int64)])
    slot_mapping = slot_mapping[torch.randperm(len(slot_mapping), generator=g)]
    t = len(slot_mapping)
    # Realistic K: a few outlier channels; V: plain Gaussian.
    channel_scale = 1 + 4 * (torch.rand(head_dim, generator=g) < 0.05)
    key = (torch.randn(t, num_kv_heads, head_dim, generator=g) * channel_scale).to(dtype)
    value = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    cache = m.allocate_cache(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE, dtype=dtype, layout=layout)
    poison(cache, g)
    if hasattr(m, "calibrate"):  # a channel split chooses each head's outlier channels from sample K/V
        m.calibrate(cache, key.to(DEVICE), value.to(DEVICE))
    return Case(
        m, cache, key.to(DEVICE), value.to(DEVICE), slot_mapping.to(DEVICE), block_tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), dtype,
    )


def snapshot(cache):
    return {f: getattr(cache, f).clone() for f in cache_fields(cache)}


def check_fill(case: Case, before: dict):
    ref = case.module.reference
    written = case.slot_mapping[case.slot_mapping >= 0].cpu()
    keep = (case.slot_mapping >= 0).cpu()
    d = case.key.shape[-1]
    for base, x in (("key", case.key), ("value", case.value)):
        x = x.cpu()[keep]
        # A split side is checked part by part, on each head's channels in the order the cache chose.
        parts = (ref.split(base, x, getattr(case.cache, f"{base}_channels")) if ref.layout.parts(base)[-1].split
                 else {base: x})
        for side, xp in parts.items():
            scheme = getattr(ref.layout, side).scheme
            flat_codes = slot_rows(case.cache, getattr(case.cache, f"{side}_codes").cpu())
            flat_meta = slot_rows(case.cache, getattr(case.cache, f"{side}_meta").cpu())
            # Nothing lost: every slot the fill was not given keeps its poisoned bytes.
            untouched = torch.ones(flat_codes.shape[0], dtype=torch.bool)
            untouched[written] = False
            old_codes = slot_rows(case.cache, before[f"{side}_codes"].cpu())
            old_meta = slot_rows(case.cache, before[f"{side}_meta"].cpu())
            assert torch.equal(flat_codes[untouched], old_codes[untouched]), (
                f"{side}: fill wrote a slot it was not given"
            )
            assert torch.equal(flat_meta[untouched], old_meta[untouched]), (
                f"{side}: fill wrote metadata it was not given"
            )

            want = ref.quantize(side, xp.reshape(-1, xp.shape[-1]), flat_meta.dtype, head_dim=d)
            got_codes = flat_codes[written].reshape(-1, flat_codes.shape[-1])
            got = ref.side(side, d).unpack(got_codes)
            differ = got != want.code
            allowed = want.margin < MARGIN
            if scheme.residual.kind == "qjl":
                # An index legitimately flipped at a boundary changes the residual r, and so every bit of sign(S r)
                # in that row: those rows may differ in their QJL bits anywhere.
                index_mask = 2 ** scheme.codebook.bits - 1
                index_flipped = (((got ^ want.code) & index_mask) != 0) & allowed
                qjl_only = ((got ^ want.code) & index_mask) == 0
                allowed = allowed | (index_flipped.any(dim=1, keepdim=True) & qjl_only)
            assert not (differ & ~allowed).any(), (
                f"{side}: {int((differ & ~allowed).sum())} codes differ from the reference "
                "away from any decision boundary"
            )
            clean = ~differ.any(dim=1)  # rows whose codes agree: their metadata must agree too
            got_meta = flat_meta[written].reshape(-1, flat_meta.shape[-1]).to(torch.float64)
            want_meta = want.meta.to(torch.float64)
            torch.testing.assert_close(
                got_meta[clean], want_meta[clean], rtol=META_RTOL[flat_meta.dtype], atol=1e-6, msg=f"{side} metadata"
            )


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.cpu().to(torch.float64), want.cpu().to(torch.float64)
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def check_flatten(case: Case):
    key, value = case.module.flatten(case.cache, case.block_tables, case.seq_lens)
    want_key, want_value = case.module.reference.flatten(case.cache, case.block_tables, case.seq_lens)
    assert key.shape == want_key.shape and value.shape == want_value.shape
    assert key.dtype == case.dtype
    if key.numel():
        assert rel_err(key, want_key) < OUT_RTOL[case.dtype]
        assert rel_err(value, want_value) < OUT_RTOL[case.dtype]
    return want_key, want_value


def peaked_query(case: Case, num_q_heads: int, seed: int) -> torch.Tensor:
    # Logits with a standard deviation of about 4: a few tokens dominate, so a wrong logit scale shows.
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(case.seq_lens), num_q_heads, case.key.shape[-1], generator=g) * 4
    k_rms = float(case.key.float().pow(2).mean().sqrt())
    return (q / k_rms).to(case.dtype).to(DEVICE)


def check_decode(case: Case, group: int, seed: int):
    query = peaked_query(case, group * case.cache.num_kv_heads, seed)
    out = case.module.decode(query, case.cache, case.block_tables, case.seq_lens)
    want = case.module.reference.decode(query, case.cache, case.block_tables, case.seq_lens)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert rel_err(out, want) < OUT_RTOL[case.dtype]
    # The check has teeth: LMDeploy's 1/sqrt(2d) centroid defect shrinks logits by 1/sqrt(2) and must fail it.
    shrunk = case.module.reference.decode(
        query, case.cache, case.block_tables, case.seq_lens, scale=0.5**0.5 / math.sqrt(query.shape[-1])
    )
    if int(case.seq_lens.max()) > 4:
        assert rel_err(shrunk, want) > 4 * OUT_RTOL[case.dtype]


cases = st.fixed_dictionaries(
    {
        "head_dim": st.integers(0, 7),  # an index into the scheme's head_dims (up to 128 unless deep)
        "block_size": st.sampled_from([16, 64] + ([1, 8, 32, 128, 256] if DEEP else [])),
        "num_kv_heads": st.sampled_from([1, 2]),
        "group": st.sampled_from([1, 3, 4, 8]),
        "seq_lens": st.lists(st.integers(0, 300 if DEEP else 90), min_size=1, max_size=4 if DEEP else 3),
        "dtype": st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
        "seed": st.integers(0, 2**31 - 1),
        "layout": st.sampled_from(["bhsd", "bshd"]),
    }
)


@pytest.mark.parametrize("name", SCHEMES + SPLIT_SCHEMES)
@given(c=cases)
def test_kernels_match_reference(name, c):
    dims = [d for d in generated(name).HEAD_DIMS if DEEP or d <= 128]
    head_dim = dims[c["head_dim"] % len(dims)]
    case = make_case(name, head_dim, c["block_size"], c["num_kv_heads"], c["seq_lens"], c["dtype"], c["seed"],
                     layout=c["layout"])
    before = snapshot(case.cache)
    case.module.fill(case.cache, case.key, case.value, case.slot_mapping)
    check_fill(case, before)
    check_flatten(case)
    check_decode(case, c["group"], c["seed"] + 1)


# Test-only schemes for template branches no shipped scheme takes (scale groups on V, padded chunks with groups,
# QJL or interleaved packing, V's QJL without a rotation, rotated fp8, per-token absmax, the unbiased scale with a
# sign residual).
EXTRA = sorted(str(p) for p in (ROOT / "tests" / "schemes").glob("*.yaml"))


@pytest.mark.parametrize("path", EXTRA, ids=[p.rsplit("/", 1)[-1][:-5] for p in EXTRA])
@settings(max_examples=12 if DEEP else 3)
@given(c=cases)
def test_other_branches_match_reference(path, c):
    test_kernels_match_reference.hypothesis.inner_test(path, c)


def test_qjl_fill_by_chunk_matches_reference():
    # Above head_dim 128 fill projects the QJL residual a chunk of positions at a time (S's halves would pass the
    # shared memory), a branch the cases above reach only when deep: one case at 256, fill and flatten.
    case = make_case("turbo_qjl_k3v3", 256, 16, 2, [37, 5], torch.float16, 3)
    before = snapshot(case.cache)
    case.module.fill(case.cache, case.key, case.value, case.slot_mapping)
    check_fill(case, before)
    check_flatten(case)


@pytest.mark.parametrize("name", ["int4_token", "turbo_k4v2", str(ROOT / "tests" / "schemes" / "split_qjl_rms.yaml")],
                         ids=["int4_token", "turbo_k4v2", "split_qjl_rms"])
def test_lazy_rescale_matches_eager(name, monkeypatch):
    # Skipping the rescale on tiles that raise no row's max (LAZY_RESCALE) must not change the result: both
    # settings against the reference and against each other, with splits of several tiles each.
    case = make_case(name, generated(name).HEAD_DIMS[0], 16, 2, [37, 90, 5], torch.float32, 11)
    case.module.fill(case.cache, case.key, case.value, case.slot_mapping)
    query = peaked_query(case, 4 * case.cache.num_kv_heads, 12)
    want = case.module.reference.decode(query, case.cache, case.block_tables, case.seq_lens)
    check_lazy_matches_eager(
        case.module, monkeypatch, lambda: case.module.decode(query, case.cache, case.block_tables, case.seq_lens), want
    )


def check_lazy_matches_eager(module, monkeypatch, decode, want: torch.Tensor):
    """`decode()` (float32) with LAZY_RESCALE off and on: both against `want`, and against each other."""
    outs = {}
    for lazy in (False, True):
        monkeypatch.setattr(module, "_LAZY_RESCALE", lazy)
        outs[lazy] = decode()
        assert rel_err(outs[lazy], want) < OUT_RTOL[torch.float32]
    assert rel_err(outs[True], outs[False]) < 1e-5
