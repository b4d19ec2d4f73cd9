"""lut1, decode's PTX lookup of 1-bit Lloyd-Max codes (kernels/unpack.py.j2), checked where no GPU runs it: its
words, numbers in the kernel's source, are the fp16 entries the tables hold, and its instructions, run by a small
emulator of the PTX they use, decode every code byte and field as the select trees do.
"""

import inspect
import random
import re

import pytest
import torch
from conftest import ROOT, generated

from kvqc.compiler.layout import plan
from kvqc.compiler.spec import load_scheme

NAME = "sign1_window"
MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32's default mode: byte i of the result is byte (nibble i & 7) of {b, a}, or, with the nibble's bit 3
    set, that byte's sign bit in all eight bits."""
    pool = a | b << 32
    out = 0
    for i in range(4):
        nibble = selector >> 4 * i & 0xF
        byte = pool >> 8 * (nibble & 7) & 0xFF
        out |= (0xFF if byte & 0x80 else 0) << 8 * i if nibble & 8 else byte << 8 * i
    return out


def _lop3(a: int, b: int, c: int, table: int) -> int:
    return sum((table >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1)) & 1) << i for i in range(32))


def _run(asm: str, registers: dict) -> dict:
    """Run the helper's instructions (sub, shl, prmt, lop3 on 32-bit registers) from its operand registers."""
    env = dict(registers)
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith((".reg", "{", "}")):
            continue
        op, rest = line.split(None, 1)
        dest, *args = [a.strip() for a in rest.split(",")]
        v = [env[a] if a in env else int(a, 0) & MASK for a in args]
        kind = op.split(".")[0]
        if kind == "sub":
            env[dest] = (v[0] - v[1]) & MASK
        elif kind == "shl":
            env[dest] = v[0] << v[1] & MASK if v[1] < 32 else 0
        elif kind == "prmt":
            env[dest] = _prmt(*v)
        elif kind == "lop3":
            env[dest] = _lop3(*v)
        else:
            raise AssertionError(f"the emulator lacks {op}")
    return env


def _helper(m, name: str) -> tuple[str, list[int]]:
    """A helper's PTX and the register numbers its operands start at (outputs $0 and $1, a byte operand one
    register for four elements, an int32 one four)."""
    source = inspect.getsource(getattr(m, name).fn)
    asm = re.search(r'asm="""(.*?)"""', source, re.DOTALL).group(1)
    constraints = re.search(r'constraints="([^"]*)"', source).group(1).split(",")
    args = re.search(r"args=\[([^\]]*)\]", source).group(1).split(", ")
    first, at = [], constraints.count("=r")
    for arg in args:
        first.append(at)
        at += 1 if arg in ("plane0", "upper") else 4
    assert at == len(constraints), (name, constraints, args)
    return asm, first


def _halves(word: int) -> list[int]:
    return [word & 0xFFFF, word >> 16]


def test_lut1_words_are_the_tables_fp16_entries():
    """The words decode's source holds per head_dim are the fp16 entries of `_tables`' float32 centroids, which
    the portable select trees use: the build-time rounding and the run-time one agree."""
    m = generated(NAME)
    layout = plan(load_scheme(ROOT / "kvqc" / "schemes" / f"{NAME}.yaml"))
    source = inspect.getsource(m._decode_kernel.fn)
    for side in layout.sides:
        assert side.fast_unpack == "lut1" and not side.lut_table
        words = dict(re.findall(rf"{side.name}_lut_(\d) = tl\.full\(\[\], (.*), tl\.uint32\)", source))
        assert sorted(words) == ["0", "1"], words
        for d in layout.head_dims:
            entries = m._tables(d, torch.device("cpu"))[f"{side.name}_centroids"].to(torch.float16)
            bits = [int(b) & 0xFFFF for b in entries.view(torch.int16)]
            for i, expr in words.items():
                word = eval(expr, {"HEAD_DIM": d})  # the rendered `A if HEAD_DIM == 128 else B`
                assert _halves(word) == [bits[int(i)]] * 2, (side.name, d, i, hex(word))


@pytest.mark.parametrize("pairs", [False, True])
def test_lut1_helpers_decode_each_byte_bit_to_its_entry(pairs):
    """Element k of a call is entry (bit `field` of byte k) or, in a pairs call where byte k's `upper` lane is
    0xff, entry (bit field + 1): over random bytes, every field and every `upper` pattern."""
    m = generated(NAME)
    asm, (plane, *rest) = _helper(m, "_unpack_lut1_pairs" if pairs else "_unpack_lut1")
    upper_at, field_at, lut0_at, lut1_at = rest if pairs else [None, *rest]
    rng = random.Random(0)
    for _ in range(500):
        entries = (rng.getrandbits(16), rng.getrandbits(16))  # any two fp16 entries, not only a symmetric pair
        codes = rng.getrandbits(32)
        field = rng.randrange(0, 7, 2) if pairs else rng.randrange(8)
        ups = rng.getrandbits(4) if pairs else 0
        registers = {f"${plane}": codes, f"${field_at}": field, f"${lut0_at}": entries[0] * 0x10001,
                     f"${lut1_at}": entries[1] * 0x10001}
        if pairs:
            registers[f"${upper_at}"] = sum(0xFF << 8 * k for k in range(4) if ups >> k & 1)
        env = _run(asm, registers)
        got = _halves(env["$0"]) + _halves(env["$1"])
        want = [entries[codes >> 8 * k + field + (ups >> k & 1) & 1] for k in range(4)]
        assert got == want, (hex(codes), field, ups, [hex(g) for g in got], [hex(w) for w in want])
