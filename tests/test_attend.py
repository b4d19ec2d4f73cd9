"""attend (several new query tokens per sequence, causal) against float64 attention over the reference's K and V.

Token j of a sequence's q_len new tokens is cached position seq_len - q_len + j and sees positions up to it; the
cases mix a whole prefill (q_len = seq_len), a chunk after cached tokens, a single token (decode through attend)
and a sequence with no new tokens.
"""

import math

import pytest
import torch
from conftest import DEVICE, SCHEMES, generated

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
GROUP = 2
RTOL = 2e-3  # fp16 K/V and output, float32 softmax


def build(name, seq_lens, seed=0):
    m = generated(name)
    head_dim = m.HEAD_DIMS[0]  # the smallest each scheme is built for
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    order = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32)
    slots, at = [], 0
    for b, (n, k) in enumerate(zip(seq_lens, blocks)):
        block_tables[b, :k] = order[at:at + k]
        at += k
        p = torch.arange(n)
        slots.append(block_tables[b, p // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + p % BLOCK_SIZE)
    slot_mapping = torch.cat(slots)
    cache = m.allocate_cache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim, device=DEVICE, dtype=torch.float16)
    key = torch.randn(len(slot_mapping), NUM_KV_HEADS, head_dim, generator=g).half()
    value = torch.randn(len(slot_mapping), NUM_KV_HEADS, head_dim, generator=g).half()
    m.fill(cache, key.to(DEVICE), value.to(DEVICE), slot_mapping.to(DEVICE))
    return m, cache, block_tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def reference_attend(m, cache, block_tables, seq_lens, query, starts, scale):
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        rows = slice(starts[b], starts[b + 1])
        q_len = starts[b + 1] - starts[b]
        if not q_len:
            continue
        k = m.reference.gather(cache, "key", block_tables[b], n).repeat_interleave(GROUP, dim=1)
        v = m.reference.gather(cache, "value", block_tables[b], n).repeat_interleave(GROUP, dim=1)
        logits = torch.einsum("qhd,nhd->hqn", query[rows].cpu().double(), k) * scale
        position = torch.arange(n - q_len, n)
        logits = logits.masked_fill(torch.arange(n)[None, None, :] > position[None, :, None], float("-inf"))
        out[rows] = torch.einsum("hqn,nhd->qhd", torch.softmax(logits, dim=-1), v)
    return out


def rel_err(got, want):
    return float((got.cpu().double() - want).norm() / want.norm())


@pytest.mark.parametrize("name", SCHEMES)
def test_attend_matches_causal_reference(name):
    seq_lens = [40, 37, 5, 20]
    q_lens = [40, 9, 1, 0]  # whole prefill, chunk after 28 cached tokens, one token, nothing new
    m, cache, block_tables, lens = build(name, seq_lens)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    g = torch.Generator().manual_seed(1)
    # Peaked logits (std about 8), so a token that wrongly sees its successors moves the output.
    d = cache.head_dim
    query = (torch.randn(starts[-1], NUM_KV_HEADS * GROUP, d, generator=g) * 8 / math.sqrt(d)).half()
    query = query.to(DEVICE)
    loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(d)
    out = m.attend(query, cache, block_tables, lens, loc)
    assert out.shape == query.shape and out.dtype == query.dtype
    want = m.reference.attend(query, cache, block_tables, lens, loc)
    # The reference's attend is the causal definition written out here.
    assert rel_err(want, reference_attend(m, cache, block_tables, lens, query, starts, scale)) < 1e-12
    assert rel_err(out, want) < RTOL
    # The check has teeth: attention that lets every new token see the whole sequence must fail it.
    full = torch.zeros_like(want)
    for b, n in enumerate(seq_lens):
        rows = slice(starts[b], starts[b + 1])
        if starts[b + 1] > starts[b]:
            k = m.reference.gather(cache, "key", block_tables[b], n).repeat_interleave(GROUP, dim=1)
            v = m.reference.gather(cache, "value", block_tables[b], n).repeat_interleave(GROUP, dim=1)
            p = torch.softmax(torch.einsum("qhd,nhd->hqn", query[rows].cpu().double(), k) * scale, dim=-1)
            full[rows] = torch.einsum("hqn,nhd->qhd", p, v)
    assert rel_err(full, want) > 10 * RTOL
    # A single new token is decode: attend and decode agree.
    one = slice(starts[2], starts[3])
    dec = m.decode(query[one], cache, block_tables[2:3], lens[2:3])
    assert rel_err(out[one], dec.cpu().double()) < RTOL


@pytest.mark.parametrize(
    "starts, match",
    [([0, 40, 49, 50], "query_start_loc"),
     ([1, 40, 49, 50, 50], "query_start_loc"),
     ([0, 30, 20, 50, 50], "query_start_loc"),
     ([0, 1, 49, 50, 50], "sequence 1 has 48")],
)
def test_attend_refuses_bad_offsets(starts, match):
    m, cache, block_tables, lens = build(SCHEMES[0], [40, 37, 5, 20])
    query = torch.zeros(50, NUM_KV_HEADS * GROUP, cache.head_dim, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        m.attend(query, cache, block_tables, lens, torch.tensor(starts, dtype=torch.int32, device=DEVICE))
