"""Edge cases of the generated wrappers and kernels: validation, degenerate data, degenerate shapes, paging.

Shapes are small (head_dim 64, a few tokens, one or two KV heads) so that the file stays cheap under Triton's
interpreter; every kernel is still exercised per scheme. Cache contents are compared as raw bytes (uint8 views),
so that NaN metadata compares equal to itself and a stray write to any bit shows.
"""

import dataclasses
import importlib.util
import math
import re
import types

import pytest
import torch
from conftest import ALL_SCHEMES, DEVICE, ROOT, SCHEMES, WINDOW_SCHEMES, generated

D = 128  # head_dim in every test here; a scheme not built for 128 uses its largest (the fixture below)
FIELDS = ("key_codes", "key_meta", "value_codes", "value_meta")
OUT_RTOL = {torch.float16: 2e-3, torch.float32: 2e-5}
NAN, INF = float("nan"), float("inf")

# turbo_qjl_k3v3's decode at head_dim 64 was wrong when compiled (8-column chunks); the spec now refuses chunks
# narrower than 16 columns, so every scheme here runs at head_dim 128 and needs no mark.
QJL_GPU_DECODE = ()


def schemes_marked(mark, names=("turbo_qjl_k3v3",)):
    return list(SCHEMES)


@pytest.fixture(autouse=True)
def head_dim_of_the_scheme(request):
    """D for a test parametrized by scheme `name`: 128, or the scheme's largest head_dim if it lacks 128."""
    global D
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    dims = generated(params["name"]).HEAD_DIMS if "name" in params else (128,)
    D = 128 if 128 in dims else dims[-1]
    yield
    D = 128


# -- helpers ---------------------------------------------------------------------------------------------------


def raw(cache) -> dict:
    """The four cache tensors as host bytes, token-major ([num_blocks, block_size, num_kv_heads, bytes] whatever the
    cache's layout, so that slot_rows can index slots): NaN-safe, bit-exact comparisons."""
    tensors = {f: getattr(cache, f) for f in FIELDS}
    if cache.layout == "bhsd":
        tensors = {f: t.transpose(1, 2) for f, t in tensors.items()}
    return {f: t.cpu().contiguous().view(torch.uint8).clone() for f, t in tensors.items()}


def assert_same_bytes(a: dict, b: dict, what: str = "cache"):
    for f in FIELDS:
        assert torch.equal(a[f], b[f]), f"{what}: {f} differs"


def slot_rows(raw_cache: dict, field: str, num_kv_heads: int) -> torch.Tensor:
    """A raw tensor viewed as [num_slots, num_kv_heads, bytes]."""
    t = raw_cache[field]
    return t.view(-1, num_kv_heads, t.shape[-1])


def poison(cache, seed: int):
    """Random bytes in all four tensors (metadata included, so NaN and inf bit patterns too)."""
    g = torch.Generator().manual_seed(seed)
    for f in FIELDS:
        b = getattr(cache, f).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def paging(lens, block_size, seed, spare=2):
    """Scattered blocks for sequences of the given lengths: (num_blocks, block_tables, slots per sequence).

    block_tables carries one padding column of -1 beyond the longest sequence (never read)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + spare
    order = torch.randperm(num_blocks, generator=g)
    width = max(need + [1]) + 1
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    slots, at = [], 0
    for b, (n, k) in enumerate(zip(lens, need)):
        tables[b, :k] = order[at : at + k].to(torch.int32)
        at += k
        p = torch.arange(n)
        slots.append(tables[b, p // block_size].to(torch.int64) * block_size + p % block_size)
    return num_blocks, tables, slots


def randn(*shape, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def dev(*tensors):
    return [t.to(DEVICE) for t in tensors]


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def flatten_all(m, cache):
    """Every slot of the cache, in slot order, as one pseudo-sequence: [num_slots, num_kv_heads, head_dim]."""
    table = torch.arange(cache.num_blocks, dtype=torch.int32, device=DEVICE)[None]
    return m.flatten(cache, table, i32([cache.num_blocks * cache.block_size]))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.cpu().to(torch.float64), want.cpu().to(torch.float64)
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


class Tripwire:
    """Stands in for a kernel: any launch (kernel[grid]) fails the test."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"{self.name} was launched")


def no_launches(monkeypatch, m):
    for k in ("_fill_kernel", "_flatten_kernel", "_decode_kernel", "_decode_reduce_kernel", "_rotate_query_kernel"):
        if k != "_rotate_query_kernel" or hasattr(m, k):  # only where decode rotates the query in a kernel
            monkeypatch.setattr(m, k, Tripwire(k))


# -- 1. validation ---------------------------------------------------------------------------------------------

ARG_NAMES = (
    "cache", "key", "value", "slot_mapping", "query", "block_tables", "seq_lens",
    "head_dim", "num_blocks", "block_size", "num_kv_heads", "dtype", "scale", "query_start_loc", "device",
)


def first_argument_named(message: str):
    """The wrapper argument the message names first (whole words only)."""
    hits = [(mt.start(), n) for n in ARG_NAMES for mt in [re.search(rf"\b{n}\b", message)] if mt]
    return min(hits)[1] if hits else None


H1, BS1, NB1 = 2, 4, 6  # the validation cache: 2 KV heads, 4 slots a block, 6 blocks (24 slots)
OTHER_DEVICE = "meta" if DEVICE.type == "cpu" else "cpu"


def _ok(T=3):
    """Well-formed arguments; each case breaks exactly one."""
    return dict(
        key=randn(T, H1, D, seed=1).to(DEVICE),
        value=randn(T, H1, D, seed=2).to(DEVICE),
        slot_mapping=torch.tensor([0, 5, 9], dtype=torch.int64, device=DEVICE)[:T],
        query=randn(2, 2 * H1, D, seed=3).to(DEVICE),
        block_tables=i32([[1, 2, -1], [3, -1, -1]]),
        seq_lens=i32([6, 3]),
    )


def _fill(m, c, **kw):
    a = _ok() | kw
    m.fill(a.pop("cache", c), a["key"], a["value"], a["slot_mapping"])


def _flatten(m, c, **kw):
    a = _ok() | kw
    m.flatten(a.pop("cache", c), a["block_tables"], a["seq_lens"])


def _decode(m, c, **kw):
    a = _ok() | kw
    m.decode(a["query"], a.pop("cache", c), a["block_tables"], a["seq_lens"], scale=a.get("scale"))


def _attend(m, c, **kw):
    a = _ok() | dict(query=randn(3, 2 * H1, D, seed=4).to(DEVICE), query_start_loc=i32([0, 2, 3])) | kw
    m.attend(a["query"], a.pop("cache", c), a["block_tables"], a["seq_lens"], a["query_start_loc"],
             scale=a.get("scale"))


def _transposed(*shape):  # the right shape, but the last dimension has stride != 1
    return torch.zeros(*reversed(shape), device=DEVICE).permute(*reversed(range(len(shape))))


def _other_scheme_cache(m, c):
    other = generated(next(s for s in SCHEMES if s != m.SCHEME["name"]))
    return other.KVCache(c.key_codes, c.key_meta, c.value_codes, c.value_meta, c.head_dim, c.layout)


def _namespace(c):
    return types.SimpleNamespace(**{f: getattr(c, f) for f in FIELDS}, head_dim=c.head_dim)


def z(*shape, dtype=torch.float32, device=None):
    return torch.zeros(*shape, dtype=dtype, device=device or DEVICE)


def t64(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


# Block tables for seq_lens [6, 3] (2 and 1 blocks used): transposed storage, and a used entry out of range.
TABLE_T = [[1, 3], [2, -1], [-1, -1]]
TABLE_BIG, TABLE_BIG_1 = [[1, NB1, -1], [3, -1, -1]], [[1, 2, -1], [NB1 + 7, -1, -1]]
TABLE_NEG, TABLE_NEG_0 = [[1, -1, -1], [3, -1, -1]], [[-3, 2, -1], [3, -1, -1]]

# (id, argument the error must name, call(m, cache), needs the index checks: KVQC_DEBUG on a GPU)
VALIDATION = [
    ("fill-key-ndim", "key", lambda m, c: _fill(m, c, key=z(3, H1 * D)), False),
    ("fill-key-heads", "key", lambda m, c: _fill(m, c, key=z(3, H1 + 1, D)), False),
    ("fill-key-head-dim", "key", lambda m, c: _fill(m, c, key=z(3, H1, 2 * D)), False),
    ("fill-value-heads", "value", lambda m, c: _fill(m, c, value=z(3, 1, D)), False),
    ("fill-key-int", "key", lambda m, c: _fill(m, c, key=z(3, H1, D, dtype=torch.int32)), False),
    ("fill-key-float64", "key", lambda m, c: _fill(m, c, key=z(3, H1, D, dtype=torch.float64)), False),
    ("fill-value-int8", "value", lambda m, c: _fill(m, c, value=z(3, H1, D, dtype=torch.int8)), False),
    ("fill-key-device", "key", lambda m, c: _fill(m, c, key=z(3, H1, D, device=OTHER_DEVICE)), False),
    ("fill-key-not-tensor", "key", lambda m, c: _fill(m, c, key=[[0.0] * D] * 3), False),
    ("fill-slot-float", "slot_mapping", lambda m, c: _fill(m, c, slot_mapping=t64([0, 5, 9], torch.float32)), False),
    ("fill-slot-int16", "slot_mapping", lambda m, c: _fill(m, c, slot_mapping=t64([0, 5, 9], torch.int16)), False),
    ("fill-slot-length", "slot_mapping", lambda m, c: _fill(m, c, slot_mapping=t64([0, 5])), False),
    ("fill-slot-2d", "slot_mapping", lambda m, c: _fill(m, c, slot_mapping=t64([[0, 5, 9]])), False),
    ("fill-slot-strided", "slot_mapping", lambda m, c: _fill(m, c, slot_mapping=t64(list(range(6)))[::2]), False),
    ("fill-value-tokens", "value", lambda m, c: _fill(m, c, value=z(2, H1, D)), False),
    ("fill-key-transposed", "key", lambda m, c: _fill(m, c, key=_transposed(3, H1, D)), False),
    ("fill-value-transposed", "value", lambda m, c: _fill(m, c, value=_transposed(3, H1, D)), False),
    ("fill-slot-too-big", "slot_mapping", lambda m, c: _fill(m, c, slot_mapping=t64([0, NB1 * BS1, 1])), True),
    ("fill-not-kvcache", "cache", lambda m, c: _fill(m, c, cache=_namespace(c)), False),
    ("fill-other-scheme-cache", "cache", lambda m, c: _fill(m, c, cache=_other_scheme_cache(m, c)), False),
    ("decode-not-kvcache", "cache", lambda m, c: _decode(m, c, cache=_namespace(c)), False),
    ("decode-other-scheme-cache", "cache", lambda m, c: _decode(m, c, cache=_other_scheme_cache(m, c)), False),
    ("flatten-tuple-cache", "cache", lambda m, c: _flatten(m, c, cache=tuple(getattr(c, f) for f in FIELDS)), False),
    ("decode-query-ndim", "query", lambda m, c: _decode(m, c, query=z(2, 2 * H1 * D)), False),
    ("decode-query-head-dim", "query", lambda m, c: _decode(m, c, query=z(2, 2 * H1, D // 2)), False),
    ("decode-query-gqa", "query", lambda m, c: _decode(m, c, query=z(2, 2 * H1 + 1, D)), False),
    ("decode-query-int", "query", lambda m, c: _decode(m, c, query=z(2, 2 * H1, D, dtype=torch.int32)), False),
    ("decode-query-float64", "query", lambda m, c: _decode(m, c, query=z(2, 2 * H1, D, dtype=torch.float64)), False),
    ("decode-query-transposed", "query", lambda m, c: _decode(m, c, query=_transposed(2, 2 * H1, D)), False),
    ("decode-tables-batch", "block_tables", lambda m, c: _decode(m, c, query=z(3, 2 * H1, D)), False),
    ("decode-tables-float", "block_tables", lambda m, c: _decode(m, c, block_tables=z(2, 3)), False),
    ("decode-tables-1d", "block_tables", lambda m, c: _decode(m, c, block_tables=i32([1, 3])), False),
    ("decode-tables-transposed", "block_tables", lambda m, c: _decode(m, c, block_tables=i32(TABLE_T).t()), False),
    ("decode-seq-lens-length", "seq_lens", lambda m, c: _decode(m, c, seq_lens=i32([6, 3, 1])), False),
    ("decode-seq-lens-float", "seq_lens", lambda m, c: _decode(m, c, seq_lens=t64([6, 3], torch.float32)), False),
    ("decode-seq-lens-strided", "seq_lens", lambda m, c: _decode(m, c, seq_lens=i32([6, 0, 3, 0])[::2]), False),
    ("decode-seq-lens-over-capacity", "seq_lens", lambda m, c: _decode(m, c, seq_lens=i32([13, 3])), True),
    ("decode-seq-lens-negative", "seq_lens", lambda m, c: _decode(m, c, seq_lens=i32([6, -1])), True),
    ("decode-table-entry-too-big", "block_tables", lambda m, c: _decode(m, c, block_tables=i32(TABLE_BIG)), True),
    ("decode-table-entry-negative", "block_tables", lambda m, c: _decode(m, c, block_tables=i32(TABLE_NEG)), True),
    ("flatten-tables-1d", "block_tables", lambda m, c: _flatten(m, c, block_tables=i32([1, 3])), False),
    ("flatten-seq-lens-length", "seq_lens", lambda m, c: _flatten(m, c, seq_lens=i32([6])), False),
    ("flatten-seq-lens-over-capacity", "seq_lens", lambda m, c: _flatten(m, c, seq_lens=i32([6, 13])), True),
    ("flatten-seq-lens-negative", "seq_lens", lambda m, c: _flatten(m, c, seq_lens=i32([-2, 3])), True),
    ("flatten-table-entry-too-big", "block_tables", lambda m, c: _flatten(m, c, block_tables=i32(TABLE_BIG_1)), True),
    ("flatten-table-entry-negative", "block_tables", lambda m, c: _flatten(m, c, block_tables=i32(TABLE_NEG_0)), True),
    ("allocate-head-dim", "head_dim", lambda m, c: m.allocate_cache(1, 1, 1, 48, device=DEVICE), False),
    ("allocate-head-dim-512", "head_dim", lambda m, c: m.allocate_cache(1, 1, 1, 512, device=DEVICE), False),
    ("allocate-block-size", "block_size", lambda m, c: m.allocate_cache(1, 0, 1, D, device=DEVICE), False),
    ("allocate-num-blocks-float", "num_blocks", lambda m, c: m.allocate_cache(2.0, 1, 1, D, device=DEVICE), False),
    ("allocate-num-kv-heads-bool", "num_kv_heads", lambda m, c: m.allocate_cache(1, 1, True, D, device=DEVICE), False),
    ("allocate-dtype", "dtype", lambda m, c: m.allocate_cache(1, 1, 1, D, device=DEVICE, dtype=torch.int8), False),
    ("bytes-per-token-head-dim", "head_dim", lambda m, c: m.bytes_per_token(48), False),
    # Values of the right type but no meaning: refused by value, before any launch.
    ("allocate-head-dim-float", "head_dim", lambda m, c: m.allocate_cache(1, 1, 1, float(D), device=DEVICE), False),
    ("bytes-per-token-head-dim-float", "head_dim", lambda m, c: m.bytes_per_token(float(D)), False),
    ("bytes-per-token-dtype", "dtype", lambda m, c: m.bytes_per_token(D, dtype="float16"), False),
    ("allocate-num-blocks-huge", "num_blocks", lambda m, c: m.allocate_cache(1 << 40, 1, 1, D, device=DEVICE), False),
    ("allocate-device", "device", lambda m, c: m.allocate_cache(1, 1, 1, D, device="gpu0"), False),
    ("decode-cache-head-dim-float", "cache", lambda m, c: _decode(m, dataclasses.replace(c, head_dim=float(D))), False),
    ("decode-scale-nan", "scale", lambda m, c: _decode(m, c, scale=NAN), False),
    ("decode-scale-inf", "scale", lambda m, c: _decode(m, c, scale=INF), False),
    ("decode-scale-zero", "scale", lambda m, c: _decode(m, c, scale=0.0), False),
    ("decode-scale-negative", "scale", lambda m, c: _decode(m, c, scale=-0.1), False),
    ("decode-scale-str", "scale", lambda m, c: _decode(m, c, scale="0.1"), False),
    ("decode-scale-bool", "scale", lambda m, c: _decode(m, c, scale=True), False),
    ("attend-scale-nan", "scale", lambda m, c: _attend(m, c, scale=NAN), False),
    ("attend-seq-lens-negative", "seq_lens", lambda m, c: _attend(m, c, seq_lens=i32([6, -1])), False),
]


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("case", VALIDATION, ids=[v[0] for v in VALIDATION])
def test_validation_names_the_argument_before_any_launch(name, case, monkeypatch):
    _, argument, call, index_check = case
    m = generated(name)
    if index_check:
        # Range checks cost a sync on a GPU and run there only with KVQC_DEBUG=1 (on CPU tensors always).
        monkeypatch.setattr(m, "DEBUG", True)
    cache = m.allocate_cache(NB1, BS1, H1, D, device=DEVICE)
    poison(cache, 0)
    before = raw(cache)
    no_launches(monkeypatch, m)
    with pytest.raises(ValueError) as info:
        call(m, cache)
    message = str(info.value)
    assert first_argument_named(message) == argument, f"message names the wrong argument: {message!r}"
    assert_same_bytes(raw(cache), before)


@pytest.mark.parametrize("name", SCHEMES)
def test_validation_accepts_padding_and_unused_garbage(name, monkeypatch):
    """The well-formed arguments above pass, including -1 / out-of-range entries past a sequence's last block."""
    m = generated(name)
    monkeypatch.setattr(m, "DEBUG", True)
    cache = m.allocate_cache(NB1, BS1, 1, D, device=DEVICE)
    a = _ok()
    # Entries past the blocks a sequence reaches are never read and may hold anything.
    tables = i32([[1, 2, 99], [3, -7, NB1]])
    k, v = m.flatten(cache, tables, a["seq_lens"])
    assert k.shape == (9, 1, D)
    out = m.decode(a["query"], cache, tables, a["seq_lens"])
    assert out.shape == a["query"].shape


# -- 2. zero vectors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", schemes_marked(QJL_GPU_DECODE))
def test_zero_vectors_read_back_as_exact_zeros(name):
    m = generated(name)
    H, BS, lens = 2, 8, [15]
    nb, tables, slots = paging(lens, BS, seed=11)
    slot_mapping = torch.cat(slots)
    key, value = randn(15, H, D, seed=12), randn(15, H, D, seed=13)
    zero_rows = [(2, 0), (2, 1), (6, 1), (14, 0), (14, 1)]  # (token, head) pairs with K and V all zeros
    for t, h in zero_rows:
        key[t, h] = 0
        value[t, h] = 0
    minmax = m.SCHEME["key"]["scale"]["kind"] == "minmax" and m.SCHEME["key"]["rotation"]["kind"] == "none"
    if minmax:  # an affine grid stores the row minimum as `zero`: an unrotated constant row also comes back exactly
        key[8, 0], value[8, 1] = 0.75, -1.5
    cache = m.allocate_cache(nb, BS, H, D, device=DEVICE)
    poison(cache, 14)
    m.fill(cache, *dev(key, value, slot_mapping))
    seq_lens = i32(lens)
    tables = tables.to(DEVICE)
    k, v = m.flatten(cache, tables, seq_lens)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    for t, h in zero_rows:
        assert torch.equal(k[t, h].cpu(), torch.zeros(D, dtype=k.dtype)), f"K token {t} head {h}"
        assert torch.equal(v[t, h].cpu(), torch.zeros(D, dtype=v.dtype)), f"V token {t} head {h}"
    if minmax:
        assert torch.equal(k[8, 0].cpu(), torch.full((D,), 0.75, dtype=k.dtype))
        assert torch.equal(v[8, 1].cpu(), torch.full((D,), -1.5, dtype=v.dtype))
    want_k, want_v = m.reference.flatten(cache, tables, seq_lens)
    assert rel_err(k, want_k) < OUT_RTOL[torch.float16] and rel_err(v, want_v) < OUT_RTOL[torch.float16]
    query = randn(1, 2 * H, D, seed=15).to(DEVICE)
    out = m.decode(query, cache, tables, seq_lens)
    assert rel_err(out, m.reference.decode(query, cache, tables, seq_lens)) < OUT_RTOL[torch.float16]


# -- 3. NaN and inf inputs -------------------------------------------------------------------------------------

# Five sequences in blocks of 4 over 2 KV heads; four of them get one poisoned (token, head, side) each.
# (sequence, position, kv head, side, value); sequence 4 stays clean.
POISONS = [(0, 1, 0, "key", NAN), (1, 4, 1, "key", INF), (2, 0, 0, "value", NAN), (3, 5, 1, "value", INF)]
P_LENS, P_BS, P_H, P_GROUP = [3, 5, 4, 6, 2], 4, 2, 2


def poisoned_behaviour(m, side: str, value: float):
    """What the interpreter was measured to give for the poisoned (token, head): (flatten row, own decode rows).

    'nonfinite': every element NaN or inf; 'finite': every element finite; 'sign': depends on the query (below).

    Affine (scale: minmax) schemes: tl.min / tl.max skip NaN, so a NaN coordinate leaves scale and zero finite;
    its code is NaN cast to an integer and clamped (0 here), i.e. it reads back as the row minimum. The row is
    finite and the NaN is silently replaced; decode over it is finite. An inf gives scale = inf, every code 0,
    and code * scale = 0 * inf = NaN: the whole row reads back NaN, and decode of that sequence's query heads
    for that KV head is all NaN.

    Norm (scale: norm) schemes: NaN gives a NaN norm (metadata NaN), a NaN row and NaN decode. inf gives
    norm = inf and unit = inf * 0 = NaN, so every code is 0: the row reads back non-finite (measured: 64 NaN
    for K with a residual stage, whose residual scale is NaN too; otherwise 63 NaN and one inf, the rotation of
    an all-equal vector). A poisoned V gives NaN (and inf) decode rows. A poisoned K with a residual stage gets a NaN
    residual scale, so decode is NaN; without one (turbo_k4mse_v2) every code is 0, the score is
    inf * c0 * sqrt(d) * q[0] (the rotated all-c0 vector only sees q's first coordinate): +inf where q[0] < 0
    gives NaN, -inf where q[0] > 0 drops the token and the output is finite.

    These are fp16 inputs. A rotated scheme's fill multiplies fp16 rows by the -1/0/1 rotation as they stand, but
    divides rows of other dtypes by their largest magnitude first (pieces/rotate.py): there an inf makes the
    whole row NaN, so the 'sign' case below becomes 'nonfinite'.

    The same classes held compiled on an H100 (the finiteness asserts below ran there; the row-minimum one is
    interpreter-only, since NaN-to-integer casts are not specified).

    Symmetric (scale: absmax) unrotated schemes: max |x| skips NaN too, so a NaN reads back as some finite
    code; inf gives scale = inf and a non-finite row, and a K's scores are +-inf by the sign of <q, level>
    ('sign'). Any rotation spreads the bad coordinate over the whole row before scales are taken: rotated
    schemes read back non-finite rows and decode to non-finite rows, except the norm-scaled K without a
    residual stage above ('sign').
    """
    s = m.SCHEME[side]
    rotated = s["rotation"]["kind"] != "none"
    if s["scale"]["kind"] != "norm" and not rotated:
        if math.isnan(value):
            return "finite", "finite"
        if s["scale"]["kind"] == "minmax":
            return "nonfinite", "nonfinite"
        return "nonfinite", "sign" if side == "key" else "nonfinite"
    if side == "key" and math.isinf(value) and s["scale"]["kind"] == "norm" and s["residual"]["kind"] == "none":
        return "nonfinite", "sign"
    return "nonfinite", "nonfinite"


def check_finiteness(x: torch.Tensor, want: str, what: str):
    x = x.cpu().float()
    if want == "finite":
        assert torch.isfinite(x).all(), f"{what}: expected finite, got {x}"
    else:
        assert not torch.isfinite(x).any(), f"{what}: expected every element non-finite, got {x}"


@pytest.mark.parametrize("name", SCHEMES)
def test_nan_and_inf_stay_in_their_token(name):
    m = generated(name)
    nb, tables, slots = paging(P_LENS, P_BS, seed=21, spare=0)
    starts = [sum(P_LENS[:i]) for i in range(len(P_LENS))]
    slot_mapping = torch.cat(slots)
    T = len(slot_mapping)
    key, value = randn(T, P_H, D, seed=22), randn(T, P_H, D, seed=23)
    bad_key, bad_value = key.clone(), value.clone()
    for s, p, h, side, x in POISONS:
        (bad_key if side == "key" else bad_value)[starts[s] + p, h, 7] = x
    poisoned_tokens = torch.tensor([starts[s] + p for s, p, *_ in POISONS])

    caches = {}
    for label, (k, v, sm) in {
        "poisoned": (bad_key, bad_value, slot_mapping),
        "clean": (key, value, slot_mapping),  # the same tokens, finite
        "without": (key, value, slot_mapping.clone().index_fill_(0, poisoned_tokens, -1)),  # the tokens skipped
    }.items():
        caches[label] = m.allocate_cache(nb, P_BS, P_H, D, device=DEVICE)
        poison(caches[label], 24)
        m.fill(caches[label], *dev(k, v, sm))
    got, clean, without = (raw(caches[k]) for k in ("poisoned", "clean", "without"))

    # Codes and metadata: against the clean fill, only the poisoned (slot, head) of the poisoned side may differ
    # (the token's other head and its other side included); against the fill without those tokens, every other
    # token is byte-identical.
    for side in ("key", "value"):
        for f in (f"{side}_codes", f"{side}_meta"):
            keep = torch.ones(nb * P_BS, P_H, dtype=torch.bool)
            for s, p, h, poisoned_side, _ in POISONS:
                if poisoned_side == side:
                    keep[slot_mapping[starts[s] + p], h] = False
            a, b = slot_rows(got, f, P_H), slot_rows(clean, f, P_H)
            assert torch.equal(a[keep], b[keep]), f"{f}: a non-finite input changed another token or head"
            others = torch.ones(nb * P_BS, dtype=torch.bool)
            others[slot_mapping[poisoned_tokens]] = False
            assert torch.equal(a[others], slot_rows(without, f, P_H)[others]), f"{f}: differs from the fill without it"

    # The poisoned rows themselves, read back through flatten (every slot, in slot order).
    fk, fv = flatten_all(m, caches["poisoned"])
    for s, p, h, side, x in POISONS:
        slot = int(slot_mapping[starts[s] + p])
        want_row, _ = poisoned_behaviour(m, side, x)
        row = (fk if side == "key" else fv)[slot, h]
        check_finiteness(row, want_row, f"flatten {side} row with {x}")
        minmax = m.SCHEME[side]["scale"]["kind"] == "minmax"
        if want_row == "finite" and minmax and DEVICE.type == "cpu":  # the NaN coordinate reads back as the row minimum
            assert float(row[7]) == float(row.min())
        other_side = (fv if side == "key" else fk)[slot, h]
        assert torch.isfinite(other_side).all(), "the other side of the poisoned token"

    # Decode: every (sequence, query head) outside the poisoned (sequence, KV head) is bit-identical to decode
    # over the clean cache; inside, the documented behaviour above.
    query = randn(len(P_LENS), P_H * P_GROUP, D, seed=25)
    # One query head of each group with q[0] > 0 and one with q[0] < 0 (see poisoned_behaviour's 'sign').
    query[:, 0::2, 0], query[:, 1::2, 0] = 1.0, -1.0
    tables, seq_lens, query = tables.to(DEVICE), i32(P_LENS), query.to(DEVICE)
    out = m.decode(query, caches["poisoned"], tables, seq_lens).cpu()
    ref = m.decode(query, caches["clean"], tables, seq_lens).cpu()
    keep = torch.ones(out.shape[:2], dtype=torch.bool)
    for s, p, h, side, x in POISONS:
        keep[s, h * P_GROUP : (h + 1) * P_GROUP] = False
        rows = out[s, h * P_GROUP : (h + 1) * P_GROUP]
        _, want = poisoned_behaviour(m, side, x)
        if want == "sign":  # of the two query heads, of opposite q[0], one drops the token and one gets NaN
            finite = [bool(torch.isfinite(r.float()).all()) for r in rows[:2]]
            assert sorted(finite) == [False, True], f"decode with {side} {x}: finite rows {finite}"
            check_finiteness(rows[finite.index(False)], "nonfinite", f"decode with {side} {x}")
        else:
            check_finiteness(rows, want, f"decode with {side} {x}")
    assert torch.equal(out[keep], ref[keep]), "a non-finite input changed another sequence's (or head's) decode"


# -- 4. empty batches and empty sequences ----------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMES)
def test_empty_batch(name, monkeypatch):
    m = generated(name)
    cache = m.allocate_cache(3, 4, 2, D, device=DEVICE, dtype=torch.float32)
    poison(cache, 31)
    before = raw(cache)
    no_launches(monkeypatch, m)
    tables = torch.zeros(0, 3, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    query = torch.zeros(0, 4, D, dtype=torch.float16, device=DEVICE)
    out = m.decode(query, cache, tables, seq_lens)
    assert out.shape == (0, 4, D) and out.dtype == torch.float16 and out.device.type == DEVICE.type
    k, v = m.flatten(cache, tables, seq_lens)
    assert k.shape == v.shape == (0, 2, D) and k.dtype == torch.float32
    # All sequences empty: flatten returns empty tensors without launching.
    k, v = m.flatten(cache, i32([[0], [2]]), i32([0, 0]))
    assert k.shape == v.shape == (0, 2, D)
    assert_same_bytes(raw(cache), before)


@pytest.mark.parametrize("name", SCHEMES)
def test_all_sequences_empty_decode_zeros(name):
    m = generated(name)
    cache = m.allocate_cache(3, 4, 2, D, device=DEVICE)
    poison(cache, 32)  # nothing may be read: poisoned metadata would show as NaN
    query = randn(3, 4, D, seed=33).to(DEVICE)
    out = m.decode(query, cache, i32([[0, 1], [2, -1], [-1, -1]]), i32([0, 0, 0]))
    assert torch.equal(out.cpu(), torch.zeros(3, 4, D, dtype=torch.float16))


# Regression (found by this file, fixed): a zero-column block table once crashed the reduce kernel.
@pytest.mark.parametrize("name", SCHEMES)
def test_zero_column_block_table(name):
    m = generated(name)
    cache = m.allocate_cache(2, 4, 1, D, device=DEVICE)
    tables, seq_lens = torch.zeros(2, 0, dtype=torch.int32, device=DEVICE), i32([0, 0])
    k, v = m.flatten(cache, tables, seq_lens)  # this part works
    assert k.shape == (0, 1, D)
    query = randn(2, 2, D, seed=34).to(DEVICE)
    out = m.decode(query, cache, tables, seq_lens)
    assert torch.equal(out.cpu(), torch.zeros(2, 2, D, dtype=torch.float16))


@pytest.mark.parametrize("name", schemes_marked(QJL_GPU_DECODE))
def test_empty_and_single_token_sequences(name):
    m = generated(name)
    lens, BS = [0, 1, 7, 0], 4
    nb, tables, slots = paging(lens, BS, seed=35)
    slot_mapping = torch.cat(slots)
    key, value = randn(8, 1, D, seed=36), randn(8, 1, D, seed=37)
    cache = m.allocate_cache(nb, BS, 1, D, device=DEVICE)
    poison(cache, 38)
    m.fill(cache, *dev(key, value, slot_mapping))
    tables, seq_lens = tables.to(DEVICE), i32(lens)
    k, v = m.flatten(cache, tables, seq_lens)
    want_k, want_v = m.reference.flatten(cache, tables, seq_lens)
    assert k.shape == want_k.shape == (8, 1, D)
    assert rel_err(k, want_k) < OUT_RTOL[torch.float16] and rel_err(v, want_v) < OUT_RTOL[torch.float16]
    query = randn(4, 3, D, seed=39).to(DEVICE)
    out = m.decode(query, cache, tables, seq_lens).cpu()
    assert torch.equal(out[0], torch.zeros(3, D, dtype=out.dtype)) and torch.equal(out[3], torch.zeros_like(out[3]))
    assert rel_err(out, m.reference.decode(query, cache, tables, seq_lens)) < OUT_RTOL[torch.float16]
    # One token: softmax over one score is 1, so decode returns that token's dequantized V for every query head.
    assert rel_err(out[1], want_v[0, 0].expand(3, D)) < OUT_RTOL[torch.float16]


# -- 5. skipped slots, empty fills -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMES)
def test_negative_slots_are_skipped(name, monkeypatch):
    m = generated(name)
    H, BS, nb = 1, 4, 4
    slot_mapping = torch.tensor([3, -1, 7, -7, 12, -1, 0])
    keep = slot_mapping >= 0
    key, value = randn(7, H, D, seed=41), randn(7, H, D, seed=42)
    key[1], value[3] = NAN, INF  # skipped tokens' data must not matter
    a = m.allocate_cache(nb, BS, H, D, device=DEVICE)
    b = m.allocate_cache(nb, BS, H, D, device=DEVICE)
    poison(a, 43)
    poison(b, 43)
    before = raw(a)
    m.fill(a, *dev(key, value, slot_mapping))
    m.fill(b, *dev(key[keep], value[keep], slot_mapping[keep]))
    assert_same_bytes(raw(a), raw(b), "fill with skipped tokens vs fill without them")
    # Untouched slots keep their bytes.
    untouched = torch.ones(nb * BS, dtype=torch.bool)
    untouched[slot_mapping[keep]] = False
    for f in FIELDS:
        assert torch.equal(slot_rows(raw(a), f, H)[untouched], slot_rows(before, f, H)[untouched]), f
    # Only skipped tokens: nothing changes.
    c = m.allocate_cache(nb, BS, H, D, device=DEVICE)
    poison(c, 44)
    before = raw(c)
    m.fill(c, *dev(key[:2], value[:2], torch.tensor([-1, -2])))
    assert_same_bytes(raw(c), before, "all-skipped fill")
    # No tokens at all: a no-op that launches nothing.
    no_launches(monkeypatch, m)
    empty = torch.zeros(0, H, D, dtype=torch.float16, device=DEVICE)
    m.fill(c, empty, empty, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert_same_bytes(raw(c), before, "empty fill")


# -- 6. block sizes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
@pytest.mark.parametrize("name", schemes_marked(QJL_GPU_DECODE))
def test_block_sizes_match_reference(name, block_size, dtype):
    m = generated(name)
    lens = [1, 20]  # a partial first block; several blocks for block sizes 1, 3 and 16
    nb, tables, slots = paging(lens, block_size, seed=51 + block_size)
    slot_mapping = torch.cat(slots)
    T = len(slot_mapping)
    key, value = randn(T, 1, D, seed=52, dtype=dtype), randn(T, 1, D, seed=53, dtype=dtype)
    cache = m.allocate_cache(nb, block_size, 1, D, device=DEVICE, dtype=dtype)
    poison(cache, 54)
    m.fill(cache, *dev(key, value, slot_mapping))
    tables, seq_lens = tables.to(DEVICE), i32(lens)
    k, v = m.flatten(cache, tables, seq_lens)
    want_k, want_v = m.reference.flatten(cache, tables, seq_lens)
    assert k.dtype == dtype and k.shape == want_k.shape
    assert rel_err(k, want_k) < OUT_RTOL[dtype]
    assert rel_err(v, want_v) < OUT_RTOL[dtype]
    query = (randn(len(lens), 2, D, seed=55, dtype=torch.float32) * 2).to(dtype).to(DEVICE)
    out = m.decode(query, cache, tables, seq_lens)
    assert out.dtype == dtype
    assert rel_err(out, m.reference.decode(query, cache, tables, seq_lens)) < OUT_RTOL[dtype]


@pytest.mark.parametrize("slope", [0.02, 0.1], ids=["creeping", "climbing"])
@pytest.mark.parametrize("name", SCHEMES)
def test_running_max_growing_along_the_context(name, slope, monkeypatch):
    """The running max of the online softmax: scores that creep up along the context (0.02 log2 units a token) or
    climb (0.1 a token, 30 at the end), so every tile brings a new max, with values near 300 (norm ~3400), still
    match the reference. One split holds the whole context, so the accumulators are rescaled inside the loop on a
    GPU too (its default splits would give each tile a program of its own). Steeper climbs fail on the GPU for
    want of precision, not logic: fp16 tiles carry a relative error near 2**-11, which a score of 150 log2 units
    (slope 0.5) turns into weights off by several percent (output error 2e-3 .. 7e-3 for the metal and turbo
    schemes, H100)."""
    m = generated(name)
    monkeypatch.setattr(m, "_DECODE_CONFIGS", {**m._DECODE_CONFIGS, D: (*m._decode_config(D)[:4], 1)})
    n, block_size = 300, 16
    nb, tables, slots = paging([n], block_size, seed=61)
    g = torch.Generator().manual_seed(62)
    direction = torch.randn(D, generator=g)
    direction /= direction.norm()
    # score in log2 units = <q, k> / sqrt(D) * log2(e): keys along the query's direction, growing with position
    q_norm = 4.0
    along = slope * torch.arange(n, dtype=torch.float32) * math.sqrt(D) / (q_norm * math.log2(math.e))
    key = along[:, None] * direction + 0.3 * torch.randn(n, D, generator=g)
    value = 300 * torch.randn(n, D, generator=g)
    cache = m.allocate_cache(nb, block_size, 1, D, device=DEVICE, dtype=torch.float16)
    m.fill(cache, *dev(key[:, None].half(), value[:, None].half(), slots[0]))
    query = (q_norm * direction).expand(1, 2, D).half().to(DEVICE)
    tables, seq_lens = tables.to(DEVICE), i32([n])
    out = m.decode(query, cache, tables, seq_lens)
    assert rel_err(out, m.reference.decode(query, cache, tables, seq_lens)) < OUT_RTOL[torch.float16]


# -- 7. incremental fills and overwrites -----------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMES)
def test_token_by_token_fill_equals_one_fill(name):
    m = generated(name)
    BS, n = 8, 10  # prefill 6 tokens, then 4 decode steps that cross into the second block
    _, tables, slots = paging([n], BS, seed=61)
    slot_mapping = slots[0]
    key, value = randn(n, 1, D, seed=62), randn(n, 1, D, seed=63)
    whole = m.allocate_cache(4, BS, 1, D, device=DEVICE)
    steps = m.allocate_cache(4, BS, 1, D, device=DEVICE)
    poison(whole, 64)
    poison(steps, 64)
    m.fill(whole, *dev(key, value, slot_mapping))
    m.fill(steps, *dev(key[:6], value[:6], slot_mapping[:6]))
    for t in range(6, n):
        m.fill(steps, *dev(key[t : t + 1], value[t : t + 1], slot_mapping[t : t + 1]))
    assert_same_bytes(raw(steps), raw(whole), "token-by-token vs one fill")


@pytest.mark.parametrize("name", SCHEMES)
def test_overwrite_replaces_codes_and_metadata(name):
    m = generated(name)
    H, BS, nb = 1, 4, 3
    slot_mapping = torch.tensor([5, 0, 11, 6, 2])
    a_key, a_value = randn(5, H, D, seed=71) * 3, randn(5, H, D, seed=72) * 3
    b_key, b_value = randn(5, H, D, seed=73), randn(5, H, D, seed=74)
    b_key[1], b_value[2] = 0, 0  # zero rows must clear every bit the earlier codes set
    twice = m.allocate_cache(nb, BS, H, D, device=DEVICE)
    poison(twice, 75)
    m.fill(twice, *dev(a_key, a_value, slot_mapping))
    m.fill(twice, *dev(b_key, b_value, slot_mapping))
    fresh = m.allocate_cache(nb, BS, H, D, device=DEVICE)
    m.fill(fresh, *dev(b_key, b_value, slot_mapping))
    got, want = raw(twice), raw(fresh)
    for f in FIELDS:
        assert torch.equal(slot_rows(got, f, H)[slot_mapping], slot_rows(want, f, H)[slot_mapping]), f


# -- 8. nothing lost -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMES)
def test_fill_touches_only_its_slots(name):
    m = generated(name)
    H, BS, nb = 2, 8, 5
    g = torch.Generator().manual_seed(81)
    # 12 random distinct slots and the very last one.
    written = torch.cat([torch.randperm(nb * BS - 1, generator=g)[:12], torch.tensor([nb * BS - 1])])
    # K and V as views into a fused [tokens, 2 * H, D] projection: strided tokens, as engines pass them.
    fused = randn(13, 2 * H, D, seed=82).to(DEVICE)
    key, value = fused[:, :H], fused[:, H:]
    assert not key.is_contiguous()
    cache = m.allocate_cache(nb, BS, H, D, device=DEVICE)
    poison(cache, 83)
    before = raw(cache)
    m.fill(cache, key, value, written.to(DEVICE))
    after = raw(cache)
    untouched = torch.ones(nb * BS, dtype=torch.bool)
    untouched[written] = False
    for f in FIELDS:
        assert torch.equal(slot_rows(after, f, H)[untouched], slot_rows(before, f, H)[untouched]), f"{f}: lost bytes"
    # The strided views quantize exactly like contiguous copies.
    copy = m.allocate_cache(nb, BS, H, D, device=DEVICE)
    poison(copy, 83)
    m.fill(copy, key.contiguous(), value.contiguous(), written.to(DEVICE))
    assert_same_bytes(raw(copy), after, "strided vs contiguous K/V")


# -- 9. bytes per token ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMES)
def test_misaligned_code_tensors_are_refused_or_read_alike(name):
    """An engine may build a cache from tensors that start at any byte. Decode reads the V codes of the uniform
    4-bit schemes as 32-bit words: there a misaligned value_codes must be refused by name; every other code tensor
    must decode exactly as an aligned copy does."""
    m = generated(name)
    cache = m.allocate_cache(NB1, BS1, H1, D, device=DEVICE)
    a = _ok()
    m.fill(cache, a["key"], a["value"], a["slot_mapping"])
    want = m.decode(a["query"], cache, a["block_tables"], a["seq_lens"])
    words = hasattr(m, "_unpack_u4_words")
    for field, offset in (("key_codes", 1), ("value_codes", 1), ("value_codes", 4)):
        t = getattr(cache, field)
        # 4 bytes off is word-aligned but not 16-byte aligned: a compiled variant without the divisibility hint
        shifted = torch.empty(t.numel() + offset, dtype=t.dtype, device=DEVICE)[offset:].view(t.shape)
        shifted.copy_(t)
        odd = dataclasses.replace(cache, **{field: shifted})
        if words and field == "value_codes" and offset % 4:
            with pytest.raises(ValueError, match=rf"^cache\.{field}: must start at a 4-byte aligned address"):
                m.decode(a["query"], odd, a["block_tables"], a["seq_lens"])
        else:
            assert torch.equal(m.decode(a["query"], odd, a["block_tables"], a["seq_lens"]), want), (field, offset)


@pytest.mark.parametrize("name", SCHEMES)
def test_bytes_per_token_is_the_whole_cache(name):
    m = generated(name)
    # Nothing hidden beside the four tensors.
    assert [f.name for f in dataclasses.fields(m.KVCache)] == list(FIELDS) + ["head_dim", "layout"]
    for side, bits, metadata in (
        ("key", m.KEY_CODE_BITS, m.KEY_METADATA), ("value", m.VALUE_CODE_BITS, m.VALUE_METADATA)
    ):
        s = m.SCHEME[side]
        assert bits == s["codebook"]["bits"] + (s["residual"]["kind"] != "none")
        assert len(metadata) == (2 if s["scale"]["kind"] == "minmax" else 1) + (s["residual"]["kind"] != "none")
        group_size = s["scale"].get("group_size")
        for head_dim in m.HEAD_DIMS:
            groups = head_dim // group_size if group_size else 1
            meta = getattr(m.allocate_cache(1, 1, 1, head_dim, device=DEVICE), f"{side}_meta")
            assert meta.shape[-1] == len(metadata) * groups  # one set of fields per scale group
    for head_dim in m.HEAD_DIMS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            nb, bs, h = 3, 5, 2
            layout = "bshd" if dtype == torch.bfloat16 else "bhsd"
            cache = m.allocate_cache(nb, bs, h, head_dim, device=DEVICE, dtype=dtype, layout=layout)
            assert (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.layout) == (nb, bs, h, layout)
            per_token = 0
            for f in FIELDS:
                t = getattr(cache, f)
                assert t.shape[:3] == ((nb, h, bs) if layout == "bhsd" else (nb, bs, h)) and t.is_contiguous()
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
                per_token += t.shape[-1] * t.element_size()
            assert cache.key_codes.shape[-1] == head_dim * m.KEY_CODE_BITS // 8
            assert cache.value_codes.shape[-1] == head_dim * m.VALUE_CODE_BITS // 8
            assert m.bytes_per_token(head_dim, dtype) == per_token
            total = sum(getattr(cache, f).untyped_storage().nbytes() for f in FIELDS)
            assert total == nb * bs * h * m.bytes_per_token(head_dim, dtype)
    assert m.bytes_per_token(D) == m.bytes_per_token(D, torch.float16)  # the default dtype
    if name == "turbo_k4v2":
        assert m.bytes_per_token(128) == 102  # README


# -- 10. index checks: KVQC_DEBUG and the device ---------------------------------------------------------------


def load_fresh(name: str, debug: str, monkeypatch):
    """A private copy of generated/<name>.py imported with KVQC_DEBUG set as given."""
    monkeypatch.setenv("KVQC_DEBUG", debug)
    spec = importlib.util.spec_from_file_location(f"kvqc_edges_{name}_{debug}", ROOT / "generated" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", SCHEMES)
def test_checking_always_on_cpu_and_on_gpu_only_with_kvqc_debug(name, monkeypatch):
    # generated modules: DEBUG = os.environ["KVQC_DEBUG"] == "1" at import; _checking(device) = DEBUG or cpu.
    off, on = load_fresh(name, "0", monkeypatch), load_fresh(name, "1", monkeypatch)
    assert off.DEBUG is False and on.DEBUG is True
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert off._checking(cpu) and on._checking(cpu)
    assert not off._checking(cuda) and on._checking(cuda)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU tensors run only under the interpreter")
@pytest.mark.parametrize("name", SCHEMES)
def test_cpu_checks_run_without_kvqc_debug(name, monkeypatch):
    m = generated(name)
    monkeypatch.setattr(m, "DEBUG", False)
    cache = m.allocate_cache(NB1, BS1, H1, D, device=DEVICE)
    poison(cache, 91)
    before = raw(cache)
    no_launches(monkeypatch, m)
    a = _ok()
    with pytest.raises(ValueError, match="^slot_mapping"):
        m.fill(cache, a["key"], a["value"], torch.tensor([0, 1, NB1 * BS1]))
    with pytest.raises(ValueError, match="^block_tables"):
        m.decode(a["query"], cache, i32([[1, NB1, -1], [3, -1, -1]]), a["seq_lens"])
    with pytest.raises(ValueError, match="^block_tables"):
        m.flatten(cache, i32([[1, -1, -1], [3, -1, -1]]), a["seq_lens"])
    with pytest.raises(ValueError, match="^seq_lens"):
        m.decode(a["query"], cache, a["block_tables"], i32([13, 3]))
    with pytest.raises(ValueError, match="^seq_lens"):
        m.decode(a["query"], cache, a["block_tables"], i32([-1, 3]))
    assert_same_bytes(raw(cache), before)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the unchecked path is the GPU's default")
@pytest.mark.parametrize("name", SCHEMES)
def test_gpu_checks_only_with_kvqc_debug(name, monkeypatch):
    m = generated(name)
    cache = m.allocate_cache(NB1, BS1, H1, D, device=DEVICE)
    poison(cache, 92)
    before = raw(cache)
    a = _ok()
    bad = torch.tensor([NB1 * BS1, 2**40, NB1 * BS1 + 3], device=DEVICE)
    monkeypatch.setattr(m, "DEBUG", True)
    with pytest.raises(ValueError, match="^slot_mapping"):
        m.fill(cache, a["key"], a["value"], bad)
    monkeypatch.setattr(m, "DEBUG", False)
    m.fill(cache, a["key"], a["value"], bad)  # unchecked: the kernel drops the out-of-range slots
    torch.cuda.synchronize()
    assert_same_bytes(raw(cache), before)


@pytest.mark.parametrize("name", SCHEMES)
def test_kernels_mask_bad_indices_when_unchecked(name, monkeypatch):
    """With the host checks off (the GPU default), out-of-range slots and block ids are masked in the kernels."""
    m = generated(name)
    monkeypatch.setattr(m, "_checking", lambda device: False)
    BS, nb = 4, 4
    key, value = randn(8, 1, D, seed=93), randn(8, 1, D, seed=94)
    slot_mapping = torch.tensor([nb * BS, 1, 2**40, 6, nb * BS + 5])  # three out of range, never written
    cache = m.allocate_cache(nb, BS, 1, D, device=DEVICE)
    poison(cache, 95)
    before = raw(cache)
    m.fill(cache, *dev(key[:5], value[:5], slot_mapping))
    good = slot_mapping < nb * BS
    want = m.allocate_cache(nb, BS, 1, D, device=DEVICE)
    poison(want, 95)
    m.fill(want, *dev(key[:5][good], value[:5][good], slot_mapping[good]))
    assert_same_bytes(raw(cache), raw(want), "out-of-range slots")
    assert not torch.equal(raw(cache)["key_codes"], before["key_codes"])

    # Blocks 0 and 1 (slots 0..7) filled. Each sequence's second column is out of range: its two tokens read
    # as zeros in flatten and are left out of decode's softmax.
    cache = m.allocate_cache(nb, BS, 1, D, device=DEVICE)
    m.fill(cache, *dev(key, value, torch.arange(8)))
    every_k, every_v = flatten_all(m, cache)
    tables = i32([[0, nb], [1, -1]])
    k, v = m.flatten(cache, tables, i32([6, 6]))
    for b, block in enumerate((0, 1)):
        rows = slice(6 * b, 6 * b + 4)
        assert torch.equal(k[rows].cpu(), every_k[4 * block : 4 * block + 4].cpu()), f"sequence {b}"
        assert torch.equal(v[rows].cpu(), every_v[4 * block : 4 * block + 4].cpu()), f"sequence {b}"
        tail = slice(6 * b + 4, 6 * b + 6)
        assert torch.equal(k[tail].cpu(), torch.zeros(2, 1, D, dtype=k.dtype)), f"sequence {b}: bad block id"
        assert torch.equal(v[tail].cpu(), torch.zeros(2, 1, D, dtype=v.dtype)), f"sequence {b}: bad block id"
    query = randn(2, 2, D, seed=96).to(DEVICE)
    out = m.decode(query, cache, tables, i32([6, 6]))
    without = m.decode(query, cache, tables, i32([4, 4]))  # the same sequences without the unreadable block
    torch.testing.assert_close(out.cpu(), without.cpu())


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("name", SCHEMES)
def test_flatten_strides_past_the_grid_limit(name, layout, monkeypatch):
    """CUDA takes at most 65535 programs along a grid's axis 1, where flatten puts a sequence's tiles: a sequence with
    more tiles launches that many and each program strides over the rest. With the limit set to one program, every
    row comes out as with a program per tile, on either cache layout (whose grids differ)."""
    m = generated(name)
    BS, tokens = 4, 3 * m._FLATTEN_BLOCK_T + 5
    nb = math.ceil(tokens / BS)
    cache = m.allocate_cache(nb, BS, 2, D, device=DEVICE, layout=layout)
    m.fill(cache, *dev(randn(tokens, 2, D, seed=99), randn(tokens, 2, D, seed=100), torch.arange(tokens)))
    table, lens = torch.arange(nb, dtype=torch.int32, device=DEVICE)[None], torch.tensor([tokens], dtype=torch.int32)
    want = m.flatten(cache, table, lens)
    grids, launch = [], m._launch

    def recorded(kernel, grid, *args, **constexprs):
        grids.append(grid)
        return launch(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(m, "_launch", recorded)
    monkeypatch.setattr(m, "_MAX_GRID_YZ", 1)
    got = m.flatten(cache, table, lens)
    assert [g[1] for g in grids] == [1], grids
    for w, g in zip(want, got):
        assert torch.equal(w.cpu(), g.cpu())


@pytest.mark.skipif(DEVICE.type == "cpu", reason="host seq_lens differ from device ones only beside a GPU cache")
@pytest.mark.parametrize("name", SCHEMES)
def test_flatten_takes_host_seq_lens(name):
    """seq_lens on the CPU (engines keep it there; nothing then waits for the GPU) gives the same bytes as on the
    cache's device, in either index dtype; any other device is refused in one line."""
    m = generated(name)
    BS, nb = 4, 6
    cache = m.allocate_cache(nb, BS, 2, D, device=DEVICE)
    m.fill(cache, *dev(randn(nb * BS, 2, D, seed=97), randn(nb * BS, 2, D, seed=98), torch.arange(nb * BS)))
    tables = i32([[4, 0, 2], [1, 5, 3]])
    want = m.flatten(cache, tables, i32([9, 12]))
    for host in (torch.tensor([9, 12], dtype=torch.int32), torch.tensor([9, 12])):
        got = m.flatten(cache, tables, host)
        for g, w in zip(got, want):
            assert g.device == w.device and torch.equal(g, w)
    with pytest.raises(ValueError, match="seq_lens: expected a tensor on cuda.* or on the CPU, got meta"):
        m.flatten(cache, tables, torch.tensor([9, 12], device="meta"))


# Regression (found by this file, fixed): positions past a row's capacity once read the next row.
@pytest.mark.parametrize("name", SCHEMES)
def test_unchecked_seq_len_past_table_capacity_stays_in_its_row(name, monkeypatch):
    m = generated(name)
    monkeypatch.setattr(m, "_checking", lambda device: False)
    BS = 4
    cache = m.allocate_cache(6, BS, 1, D, device=DEVICE)
    key, value = randn(12, 1, D, seed=97), randn(12, 1, D, seed=98)
    m.fill(cache, *dev(key, value, torch.cat([torch.arange(0, 4), torch.arange(12, 20)])))
    tables = i32([[0], [3]])  # one column each: capacity 4; sequence 1's block 3 follows in memory
    query = randn(2, 2, D, seed=99).to(DEVICE)
    over = m.decode(query, cache, tables, i32([8, 4]))
    at_capacity = m.decode(query, cache, tables, i32([4, 4]))
    torch.testing.assert_close(over[0].cpu(), at_capacity[0].cpu())


@pytest.mark.parametrize("name", SCHEMES)
def test_assembled_cache_with_wrong_layout_is_refused(name):
    """An engine may build a KVCache from its own tensors: a wrong shape, dtype or layout must not reach a kernel."""
    m = generated(name)
    good = m.allocate_cache(4, 16, 2, D, device=DEVICE)
    key = randn(3, 2, D, seed=120).to(DEVICE)
    slots = torch.arange(3, device=DEVICE)
    bad_caches = {
        "key_codes": dataclasses.replace(good, key_codes=good.key_codes[..., :-1].contiguous()),
        "value_meta": dataclasses.replace(good, value_meta=good.value_meta.float()),
        "value_codes": dataclasses.replace(good, value_codes=good.value_codes.transpose(0, 1)),
        "cache.head_dim": dataclasses.replace(good, head_dim=D + 8),
        "cache.layout": dataclasses.replace(good, layout="nhd"),
    }
    for field, cache in bad_caches.items():
        with pytest.raises(ValueError, match=field):
            m.fill(cache, key, key, slots)
    m.fill(good, key, key, slots)  # the untouched cache still works
    # A cache that passed is not checked again on every call, but is once a field is set to another object.
    tables, lens = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int32, device=DEVICE)
    for field, cache in bad_caches.items():
        attr = field.removeprefix("cache.")
        original = getattr(good, attr)
        setattr(good, attr, getattr(cache, attr))
        with pytest.raises(ValueError, match=field):
            m.decode(key[:1], good, tables, lens)
        setattr(good, attr, original)
    m.fill(good, key, key, slots)


def _resize_storage(t):
    t.untyped_storage().resize_(t.untyped_storage().nbytes() // 2)


# A tensor keeps its Python object while its memory changes under it: each of these after a passing call.
IN_PLACE = {
    ".data": lambda t: setattr(t, "data", t.new_zeros(1, *t.shape[1:])),
    "resize_": lambda t: t.resize_(1, *t.shape[1:]),
    "set_": lambda t: t.set_(t.new_zeros(1, *t.shape[1:])),
    "storage-resize_": _resize_storage,
    "as_strided_": lambda t: t.as_strided_((t.shape[0], *t.shape[1:]), (0, *t.stride()[1:])),
}


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("change", IN_PLACE, ids=list(IN_PLACE))
def test_memory_changed_in_place_is_refused(name, change, monkeypatch):
    """The check that a cache passed once is repeated when a tensor's memory or layout changes in place, not only
    when a field becomes another object: the next fill must not write past the end of value_codes."""
    m = generated(name)
    cache = m.allocate_cache(4, 4, 1, D, device=DEVICE)
    key, slots = randn(1, 1, D, seed=5).to(DEVICE), t64([15])
    m.fill(cache, key, key, slots)
    IN_PLACE[change](cache.value_codes)
    no_launches(monkeypatch, m)
    with pytest.raises(ValueError, match=r"^cache\.value_codes: "):
        m.fill(cache, key, key, slots)


@pytest.mark.parametrize("name", SCHEMES[:1])
def test_head_dim_of_another_integer_type(name):
    """numpy integers (a model config's arithmetic) become ints; a float head_dim is refused, never compared as
    a float with tensor sizes (where the comparison used to be skipped)."""
    np = pytest.importorskip("numpy")
    m = generated(name)
    cache = m.allocate_cache(np.int64(2), np.int32(4), np.int64(1), np.int64(D), device=DEVICE)
    assert type(cache.head_dim) is int and cache.num_blocks == 2
    assert m.bytes_per_token(np.int64(D)) == m.bytes_per_token(D)
    assembled = m.KVCache(cache.key_codes, cache.key_meta, cache.value_codes, cache.value_meta, np.int64(D), "bhsd")
    assert type(assembled.head_dim) is int
    query, tables, lens = randn(1, 1, 2 * D, seed=6).to(DEVICE), i32([[0]]), i32([1])
    for bad in (float(D // 2), np.float64(D // 2), True):
        with pytest.raises(ValueError, match=r"^cache\.head_dim: expected an int"):
            m.decode(query, dataclasses.replace(cache, head_dim=bad), tables, lens)
    m.decode(query[..., :D], cache, tables, lens)
    cache.head_dim = np.int64(D // 2)  # set after a passing call: checked again
    with pytest.raises(ValueError, match=r"^cache\.head_dim: expected an int"):
        m.decode(query[..., : D // 2], cache, tables, lens)


@pytest.mark.parametrize("name", SCHEMES[:1])
def test_cache_tensors_without_their_own_memory_are_refused(name):
    """Two cache tensors over the same bytes, a broadcast (stride 0) tensor, a sparse one, one with no memory."""
    m = generated(name)
    c = m.allocate_cache(2, 4, 1, D, device=DEVICE)
    key, slots = randn(1, 1, D, seed=7).to(DEVICE), t64([0])
    # One pool under both code tensors, each from byte 0 (an engine carving regions with a wrong offset).
    pool = torch.zeros(max(c.key_codes.numel(), c.value_codes.numel()), dtype=torch.uint8, device=DEVICE)
    shared = dataclasses.replace(
        c, key_codes=pool[: c.key_codes.numel()].view(c.key_codes.shape),
        value_codes=pool[: c.value_codes.numel()].view(c.value_codes.shape),
    )
    cases = [
        ("cache.value_codes: shares memory with cache.key_codes", shared),
        ("cache.value_meta: expected a contiguous",
         dataclasses.replace(c, value_meta=c.value_meta[:1].expand(c.value_meta.shape))),
        ("cache.value_codes: expected a contiguous", dataclasses.replace(c, value_codes=c.value_codes.to_sparse())),
        ("cache: expected tensors on a GPU",
         m.KVCache(*(t.to("meta") for t in (c.key_codes, c.key_meta, c.value_codes, c.value_meta)), D, "bhsd")),
    ]
    for message, cache in cases:
        with pytest.raises(ValueError, match=message):
            m.fill(cache, key, key, slots)


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_dependently_launched_kernels_wait_before_their_first_load(name):
    """A kernel launched with programmatic dependent launch may start while the kernel before it still runs: it must
    wait (griddepcontrol.wait) before it reads anything that kernel may write. On the CPU no launch asks for it."""
    import inspect

    m = generated(name)
    kernels = ("_decode_kernel", "_decode_reduce_kernel", "_rotate_query_kernel", "_query_parts_kernel",
               "_merge_parts_kernel")
    gated = [k for k in kernels if hasattr(m, k) and "PDL" in getattr(m, k).arg_names]
    # A channel split merges its parts in _merge_parts_kernel, every other layout in _decode_reduce_kernel.
    assert "_decode_kernel" in gated and ("_decode_reduce_kernel" in gated) != ("_merge_parts_kernel" in gated)
    for k in gated:
        body = inspect.getsource(getattr(m, k).fn).split('"""')[-1]  # past the docstring
        wait, load = body.find("tl.extra.cuda.gdc_wait()"), body.find("tl.load(")
        assert 0 <= wait < load, f"{k}: the first load comes before the wait"
    assert m._dependent_launch(torch.device("cpu")) is False


@pytest.mark.parametrize("name", WINDOW_SCHEMES)
def test_the_window_kernel_waits_for_the_splits_before_it_merges(name):
    """A window's kernel may start once the split kernel's programs have passed their own wait (they let it,
    gdc_launch_dependents): before its wait it writes only the window's split, the last, which no split program
    writes, and it waits on every path (a reduce launched after it waits for it alone) before the merge reads
    the splits' partials."""
    import inspect

    m = generated(name)
    split = inspect.getsource(m._decode_kernel.fn).split('"""')[-1]
    wait, early = split.find("tl.extra.cuda.gdc_wait()"), split.find("tl.extra.cuda.gdc_launch_dependents()")
    assert 0 <= wait < early < split.find("tl.load("), "the split kernel lets its dependents start before its wait"
    window = inspect.getsource(m._window_decode_kernel.fn).split('"""')[-1]
    wait = window.find("tl.extra.cuda.gdc_wait()")
    before, after = window[:wait], window[wait:]
    gate = [line for line in before.splitlines() if line.strip() and not line.strip().startswith("#")][-1]
    assert wait >= 0 and gate == "    if PDL:", "the window kernel's wait is missing or depends on more than PDL"
    assert "part = q_row * num_splits + num_splits - 1\n" in before
    stores = re.findall(r"tl\.store\(\s*([^,]+),", before)  # each store's address
    assert len(stores) == 3 and all(re.match(r"partial_\w+_ptr \+ part\b", s) for s in stores)
    assert "_merge_splits(" in after and "_merge_splits(" not in before


# -- 11. cache layouts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMES)
def test_both_layouts_hold_the_same_bytes_and_read_the_same(name):
    """A head-major ('bhsd') cache is a token-major ('bshd') one with block_size and num_kv_heads swapped: the same
    fill writes the same bytes at the transposed places, and flatten and decode read the same values back."""
    m = generated(name)
    lens, bs, h = [5, 13, 9], 4, 3
    nb, tables, slots = paging(lens, bs, seed=130)
    slot_mapping = torch.cat(slots + [torch.tensor([-1])])
    key, value = randn(len(slot_mapping), h, D, seed=131), randn(len(slot_mapping), h, D, seed=132)
    caches = {}
    for layout in ("bhsd", "bshd"):
        cache = m.allocate_cache(nb, bs, h, D, device=DEVICE, layout=layout)
        assert (cache.block_size, cache.num_kv_heads) == (bs, h)
        poison(cache, 133)  # the same garbage at the same slots
        if layout == "bshd":
            for f in FIELDS:
                getattr(cache, f).copy_(getattr(caches["bhsd"], f).transpose(1, 2))
        m.fill(cache, *dev(key, value, slot_mapping))
        caches[layout] = cache
    assert_same_bytes(raw(caches["bhsd"]), raw(caches["bshd"]), "bhsd vs bshd")
    assert not torch.equal(caches["bhsd"].key_codes.cpu(),
                           caches["bshd"].key_codes.cpu().view_as(caches["bhsd"].key_codes))
    paging_args = dev(tables, i32(lens))
    k_hnd, v_hnd = m.flatten(caches["bhsd"], *paging_args)
    k_nhd, v_nhd = m.flatten(caches["bshd"], *paging_args)
    assert torch.equal(k_hnd.cpu(), k_nhd.cpu()) and torch.equal(v_hnd.cpu(), v_nhd.cpu())
    query = randn(len(lens), 2 * h, D, seed=134).to(DEVICE)
    torch.testing.assert_close(m.decode(query, caches["bhsd"], *paging_args).cpu(),
                               m.decode(query, caches["bshd"], *paging_args).cpu(), rtol=0, atol=0)
