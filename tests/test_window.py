"""Schemes with a recent-token window (and per-channel scales, which need one) against the float64 reference.

Sequences are filled the way an engine does it: a prefill chunk per sequence, then more chunks and single decode
tokens, with each sequence's tokens consecutive in a call, ring rows that are not the batch order, and padding
tokens (slot -1, position 0, ring row 0) at the end of every call. Fill must write the same rings as the reference
(exactly) and the same codes (up to a level's rounding tie); flatten and decode must match the reference read of
the same cache, whose last `window` tokens are the ring's.
"""

import math

import pytest
import torch
from conftest import DEEP, DEVICE, ROOT, WINDOW_SCHEMES, generated
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import META_RTOL, OUT_RTOL, check_lazy_matches_eager, rel_err

EXTRA = sorted(str(p) for p in (ROOT / "tests" / "schemes" / "window").glob("*.yaml"))
ALL = WINDOW_SCHEMES + EXTRA
SINKS = WINDOW_SCHEMES + [n for n in EXTRA if "\nsinks:" in open(n).read()]  # every scheme with attention sinks


def group_tokens(m) -> int:
    """The block size must be a multiple of every per-channel token group."""
    g = [m.SCHEME[s]["scale"].get("group_size", 1)
         for s in ("key", "value") if m.SCHEME[s]["scale"]["axis"] == "channel"]
    return max(g, default=1)


class Engine:
    """Paged blocks, ring rows and fill calls, laid out as an engine lays out a batch."""

    def __init__(self, m, head_dim, block_size, num_kv_heads, lens, dtype, seed, layout="bhsd"):
        self.m, self.d, self.bs, self.h, self.lens, self.dtype = m, head_dim, block_size, num_kv_heads, lens, dtype
        self.layout = layout
        g = torch.Generator().manual_seed(seed)
        self.g = g
        blocks = [max(math.ceil(n / block_size), 1) for n in lens]
        self.num_blocks = sum(blocks) + 1
        order = torch.randperm(self.num_blocks, generator=g)
        self.block_tables = torch.full((len(lens), max(blocks) + 1), -1, dtype=torch.int32)
        at = 0
        for b, k in enumerate(blocks):
            self.block_tables[b, :k] = order[at : at + k]
            at += k
        self.rows = torch.randperm(len(lens) + 1, generator=g)[: len(lens)]  # ring rows, not the batch order
        channel_scale = 1 + 4 * (torch.rand(head_dim, generator=g) < 0.1)  # outlier channels, as real keys have
        # A centered key gets keys with a per-channel offset, as real keys have, to take away.
        self.offset = 3 * torch.randn(num_kv_heads, head_dim, generator=g) if m.SCHEME["key"].get("center") else 0
        self.key = [torch.randn(n, num_kv_heads, head_dim, generator=g) * channel_scale + self.offset for n in lens]
        # A centered key's mean comes from other tokens than the filled ones (a calibration text's).
        centered = m.SCHEME["key"].get("center")
        self.sample = ((torch.randn(40, num_kv_heads, head_dim, generator=g) + self.offset).to(dtype).to(DEVICE)
                       if centered else None)
        self.value = [torch.randn(n, num_kv_heads, head_dim, generator=g) for n in lens]
        self.done = [0] * len(lens)

    def allocate(self):
        cache = self.m.allocate_cache(
            self.num_blocks, self.bs, self.h, self.d, device=DEVICE, dtype=self.dtype, max_seqs=len(self.lens) + 1,
            layout=self.layout,
        )
        if self.m.SCHEME["key"].get("center"):
            self.m.calibrate(cache, self.sample, self.sample)
        return cache

    def call(self, chunk: int):
        """The next `chunk` tokens of every unfinished sequence, then two padding tokens."""
        k, v, slots, positions, rows = [], [], [], [], []
        for b, n in enumerate(self.lens):
            take = min(chunk, n - self.done[b])
            p = torch.arange(self.done[b], self.done[b] + take)
            self.done[b] += take
            k.append(self.key[b][p])
            v.append(self.value[b][p])
            slots.append(self.block_tables[b, p // self.bs].to(torch.int64) * self.bs + p % self.bs)
            positions.append(p)
            rows.append(torch.full((take,), int(self.rows[b])))
        k.append(torch.randn(2, self.h, self.d, generator=self.g) * 100)
        v.append(torch.randn(2, self.h, self.d, generator=self.g) * 100)
        slots.append(torch.full((2,), -1))
        positions.append(torch.zeros(2, dtype=torch.int64))
        rows.append(torch.zeros(2, dtype=torch.int64))
        dev = lambda x: x.to(DEVICE)  # noqa: E731
        return (
            dev(torch.cat(k).to(self.dtype)), dev(torch.cat(v).to(self.dtype)), dev(torch.cat(slots)),
            dev(torch.cat(positions)), dev(torch.cat(rows)),
        )

    def paging(self):
        return (self.block_tables.to(DEVICE), torch.tensor(self.done, dtype=torch.int32, device=DEVICE),
                self.rows.to(DEVICE))


def fill(target, cache, call: tuple) -> None:
    """target.fill (a module's or its reference's) with the tokens of an Engine.call."""
    key, value, slot_mapping, positions, rows = call
    target.fill(cache, key, value, slot_mapping, positions=positions, window_index=rows)


def check_same_cache(m, got, want, head_dim):
    for side in ("key", "value"):
        ring_got, ring_want = getattr(got, f"{side}_window").cpu(), getattr(want, f"{side}_window").cpu()
        assert torch.equal(ring_got, ring_want), f"{side}: the ring differs from the reference's"
        ref = m.reference.side(side, head_dim)
        codes_got = getattr(got, f"{side}_codes").cpu().reshape(-1, getattr(got, f"{side}_codes").shape[-1])
        codes_want = getattr(want, f"{side}_codes").cpu().reshape(codes_got.shape)
        differ = ref.unpack(codes_got) - ref.unpack(codes_want)
        # float32 against float64 may round a value on a level's midpoint either way: one level, rarely.
        assert differ.abs().max() <= 1, f"{side}: codes differ by more than one level"
        assert (differ != 0).double().mean() < 2e-3, f"{side}: {int((differ != 0).sum())} codes differ"
        meta_got = getattr(got, f"{side}_meta").cpu().to(torch.float64).reshape(codes_got.shape[0], -1)
        meta_want = getattr(want, f"{side}_meta").cpu().to(torch.float64).reshape(meta_got.shape)
        # Scales and zeros come from minima and maxima, not from rounding; a residual's RMS moves with a flipped
        # code, so rows whose codes differ are left out (not for per-channel sides: a slot's metadata belongs to
        # other channels than its codes, and no flipped code moves a minimum or a maximum).
        per_channel = m.SCHEME[side]["scale"]["axis"] == "channel"
        clean = torch.ones(len(differ), dtype=torch.bool) if per_channel else (differ == 0).all(dim=1)
        rtol = META_RTOL[getattr(got, f"{side}_meta").dtype]
        torch.testing.assert_close(meta_got[clean], meta_want[clean], rtol=rtol, atol=1e-6, msg=f"{side} metadata")


cases = st.fixed_dictionaries(
    {
        "head_dim": st.integers(0, 7),
        "block_mult": st.sampled_from([1, 2, 4]),
        "num_kv_heads": st.sampled_from([1, 2]),
        "group": st.sampled_from([1, 4, 7]),
        # The first sequence is `sinks + window` tokens longer than drawn, so that every example quantizes some.
        "lens": st.lists(st.integers(0, 300 if DEEP else 100), min_size=1, max_size=3),
        "chunks": st.lists(st.sampled_from([1, 2, 13, 40, 100]), min_size=1, max_size=4),
        "dtype": st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
        "seed": st.integers(0, 2**31 - 1),
        "layout": st.sampled_from(["bhsd", "bshd"]),
    }
)


@pytest.mark.parametrize("name", ALL, ids=[n.rsplit("/", 1)[-1].removesuffix(".yaml") for n in ALL])
@settings(max_examples=20 if DEEP else 4)
@given(c=cases)
def test_window_kernels_match_reference(name, c):
    m = generated(name)
    dims = [d for d in m.HEAD_DIMS if DEEP or d <= 128]
    head_dim = dims[c["head_dim"] % len(dims)]
    block_size = max(16, group_tokens(m)) * c["block_mult"]
    lens = [c["lens"][0] + getattr(m, "SINKS", 0) + m.WINDOW] + c["lens"][1:]
    e = Engine(m, head_dim, block_size, c["num_kv_heads"], lens, c["dtype"], c["seed"], c["layout"])
    cache, want = e.allocate(), e.allocate()
    # A first chunk as long as the longest sequence would be one prefill; the drawn chunks, then single tokens.
    for chunk in c["chunks"] + [1, 1] + [max(lens)]:
        args = e.call(chunk)
        fill(m, cache, args)
        fill(m.reference, want, args)
    check_same_cache(m, cache, want, head_dim)
    block_tables, seq_lens, rows = e.paging()

    key, value = m.flatten(cache, block_tables, seq_lens, window_index=rows)
    want_key, want_value = m.reference.flatten(cache, block_tables, seq_lens, window_index=rows)
    assert key.shape == want_key.shape and key.dtype == c["dtype"]
    if key.numel():
        assert rel_err(key, want_key) < OUT_RTOL[c["dtype"]]
        assert rel_err(value, want_value) < OUT_RTOL[c["dtype"]]

    g = torch.Generator().manual_seed(c["seed"] + 1)
    k_rms = float(torch.cat(e.key).pow(2).mean().sqrt())
    query = (torch.randn(len(lens), c["group"] * c["num_kv_heads"], head_dim, generator=g) * 4 / k_rms)
    query = query.to(c["dtype"]).to(DEVICE)
    out = m.decode(query, cache, block_tables, seq_lens, window_index=rows)
    want_out = m.reference.decode(query, cache, block_tables, seq_lens, window_index=rows)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert rel_err(out, want_out) < OUT_RTOL[c["dtype"]]


@pytest.mark.parametrize("name", SINKS, ids=[n.rsplit("/", 1)[-1].removesuffix(".yaml") for n in SINKS])
def test_tokens_in_the_window_come_back_as_given(name):
    m = generated(name)
    d = m.HEAD_DIMS[0]
    sinks = getattr(m, "SINKS", 0)
    e = Engine(m, d, 64, 2, [m.WINDOW, 5, sinks + m.WINDOW + 37], torch.float16, 0)
    cache = e.allocate()
    fill(m, cache, e.call(1000))
    block_tables, seq_lens, rows = e.paging()
    key, value = m.flatten(cache, block_tables, seq_lens, window_index=rows)
    # seq_lens on the host (as engines keep it) reads the same.
    host_key, host_value = m.flatten(cache, block_tables, seq_lens.cpu(), window_index=rows)
    assert torch.equal(host_key, key) and torch.equal(host_value, value)
    n = m.WINDOW + 5
    # Sequences within the window: exactly the input. The third: its last WINDOW tokens exactly, the rest not.
    assert torch.equal(key[:n].cpu(), torch.cat(e.key[:2]).half())
    assert torch.equal(value[:n].cpu(), torch.cat(e.value[:2]).half())
    assert torch.equal(key[-m.WINDOW:].cpu(), e.key[2][-m.WINDOW:].half())
    # Its first SINKS (the attention sinks) exactly too, the 37 between them not.
    assert torch.equal(key[n : n + sinks].cpu(), e.key[2][:sinks].half())
    assert torch.equal(value[n : n + sinks].cpu(), e.value[2][:sinks].half())
    assert not torch.equal(key[n + sinks : n + sinks + 37].cpu(), e.key[2][sinks : sinks + 37].half())
    # Decode over the first two is fp16 attention over the raw tokens.
    query = torch.randn(3, 4, d).half().to(DEVICE)
    out = m.decode(query, cache, block_tables, seq_lens, window_index=rows)
    for b in range(2):
        k = e.key[b].half().float().repeat_interleave(2, dim=1).transpose(0, 1)
        v = e.value[b].half().float().repeat_interleave(2, dim=1).transpose(0, 1)
        want = torch.softmax(query[b].cpu().float()[:, None, :] @ k.transpose(1, 2) / math.sqrt(d), dim=-1) @ v
        assert rel_err(out[b], want[:, 0].double()) < 2e-3


@pytest.mark.parametrize("name", ALL, ids=[n.rsplit("/", 1)[-1].removesuffix(".yaml") for n in ALL])
def test_token_by_token_fill_equals_one_fill(name):
    """A group completed from the ring (decode steps) gets the bytes of one completed from the input (prefill)."""
    m = generated(name)
    d = m.HEAD_DIMS[0]
    lens = [3 * m.WINDOW + 11, 50]
    one, steps = Engine(m, d, 64, 1, lens, torch.float16, 7), Engine(m, d, 64, 1, lens, torch.float16, 7)
    a, b = one.allocate(), steps.allocate()
    fill(m, a, one.call(10_000))
    fill(m, b, steps.call(m.WINDOW // 2 + 1))
    for _ in range(m.WINDOW + 3):
        fill(m, b, steps.call(1))
    fill(m, b, steps.call(10_000))
    for field in ("key_codes", "key_meta", "value_codes", "value_meta", "key_window", "value_window"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


PER_CHANNEL = [n for n in ALL if group_tokens(generated(n)) > 1]


@pytest.mark.parametrize("name", PER_CHANNEL, ids=[n.rsplit("/", 1)[-1].removesuffix(".yaml") for n in PER_CHANNEL])
def test_a_call_where_every_token_completes_a_group(name):
    """A decode step of 40 sequences each at a group's last position: 40 groups quantized in one call, more than one
    group program's run of tokens, each group's earlier tokens from the ring."""
    m = generated(name)
    d = m.HEAD_DIMS[0]
    g = group_tokens(m)
    e = Engine(m, d, g * 2, 1, [g] * 40, torch.float16, 3)
    cache, want = e.allocate(), e.allocate()
    for chunk in (g - 1, 1):
        args = e.call(chunk)
        fill(m, cache, args)
        fill(m.reference, want, args)
    check_same_cache(m, cache, want, d)


@pytest.mark.parametrize("name", WINDOW_SCHEMES)
def test_window_arguments_are_checked(name, monkeypatch):
    m = generated(name)
    monkeypatch.setattr(m, "DEBUG", True)  # data-dependent checks sync the GPU: on by default only for CPU tensors
    d = m.HEAD_DIMS[0]
    with pytest.raises(ValueError, match="^max_seqs: "):
        m.allocate_cache(4, 64, 1, d, device=DEVICE)
    e = Engine(m, d, 64, 1, [40, 30], torch.float16, 1)
    cache = e.allocate()
    k, v, slots, positions, rows = e.call(10)
    with pytest.raises(ValueError, match="^window_index: "):
        m.fill(cache, k, v, slots, positions=positions, window_index=torch.full_like(rows, 99))
    swap = torch.arange(len(slots), device=slots.device)
    swap[:2] = swap[:2].flip(0)
    with pytest.raises(ValueError, match="^positions: "):
        m.fill(cache, k, v, slots[swap], positions=positions[swap], window_index=rows)
    with pytest.raises(ValueError, match="^slot_mapping: "):
        m.fill(cache, k, v, slots, positions=positions + 1, window_index=rows)
    with pytest.raises(ValueError, match="^window_index: "):
        shuffled = torch.cat([rows[:3], rows[10:13], rows[3:10], rows[13:]])
        m.fill(cache, k, v, torch.cat([slots[:3], slots[10:13], slots[3:10], slots[13:]]),
               positions=torch.cat([positions[:3], positions[10:13], positions[3:10], positions[13:]]),
               window_index=shuffled)
    with pytest.raises(ValueError, match="^positions: "):
        m.fill(cache, k, v, slots, positions=positions.to(torch.float32), window_index=rows)
    for target in (m, m.reference):  # the keywords a window needs: one line naming the call and the keyword
        with pytest.raises(ValueError, match=f"^fill: {name} keeps each sequence's last {m.WINDOW} tokens in a ring: "
                                             "pass the positions keyword$"):
            target.fill(cache, k, v, slots, window_index=rows)
    m.fill(cache, k, v, slots, positions=positions, window_index=rows)
    block_tables, seq_lens, rows = e.paging()
    query = torch.zeros(2, 1, d, dtype=torch.float16, device=DEVICE)
    for call, run in [("flatten", lambda: m.flatten(cache, block_tables, seq_lens)),
                      ("decode", lambda: m.decode(query, cache, block_tables, seq_lens, scale=0.5)),
                      ("plan_decode", lambda: m.plan_decode(cache, block_tables, seq_lens, 1)),
                      ("attend",
                       lambda: m.attend(query, cache, block_tables, seq_lens, seq_lens.new_tensor([0, 1, 2]))),
                      ("decode", lambda: m.reference.decode(query, cache, block_tables, seq_lens))]:
        with pytest.raises(ValueError, match=f"^{call}: {name} keeps .* pass the window_index keyword$"):
            run()
    with pytest.raises(ValueError, match="^window_index: "):
        m.decode(torch.zeros(2, 1, d, dtype=torch.float16, device=DEVICE), cache, block_tables, seq_lens,
                 window_index=rows[:1])
    with pytest.raises(ValueError, match="^window_index: "):
        m.flatten(cache, block_tables, seq_lens, window_index=rows + 5)
    groups = group_tokens(m)
    if groups > 1:
        with pytest.raises(ValueError, match="^block_size: "):
            m.allocate_cache(4, groups // 2, 1, d, device=DEVICE, max_seqs=2)


def test_lazy_rescale_matches_eager(monkeypatch):
    # kivi_k2v2's V group dots keep an accumulator per unit and a shift per group, which the rescaling must all
    # reach; LAZY_RESCALE must not change its result either.
    m = generated("kivi_k2v2")
    e = Engine(m, m.HEAD_DIMS[0], max(16, group_tokens(m)), 2, [m.WINDOW + 150, 40], torch.float32, 5)
    cache = e.allocate()
    fill(m, cache, e.call(m.WINDOW + 150))
    block_tables, seq_lens, rows = e.paging()
    g = torch.Generator().manual_seed(6)
    k_rms = float(torch.cat(e.key).pow(2).mean().sqrt())
    query = (torch.randn(2, 8, m.HEAD_DIMS[0], generator=g) * 4 / k_rms).to(DEVICE)
    want = m.reference.decode(query, cache, block_tables, seq_lens, window_index=rows)
    check_lazy_matches_eager(m, monkeypatch, lambda: m.decode(query, cache, block_tables, seq_lens, window_index=rows),
                             want)
