"""The PTX helpers that gather each code's bits from its planes (kvqc/compiler/pieces/planes.py), run by the emulator of
tests/ptx.py where no GPU runs them: for every uniform width and every Lloyd-Max index width, alone, with a sign
residual or (Lloyd-Max K) with its QJL bit, each element is what the code its bytes hold decodes to.
"""

import random
import re

import numpy as np
import ptx
import pytest

from kvqc.compiler.pieces import planes
from kvqc.compiler.layout import GATHER_BITS, WHOLE_BYTE_KINDS, plan
from kvqc.compiler.spec import scheme_from_dict


def side_of(codebook: str, bits: int, residual: str | None) -> dict:
    if codebook == "uniform":
        side = {"scale": "minmax", "codebook": {"kind": "uniform", "bits": bits}}
    else:
        side = {"rotation": "hadamard", "scale": "norm", "codebook": {"kind": "lloyd_max", "bits": bits,
                                                                      "law": "gaussian"}}
    if residual:
        side["residual"] = {"kind": "qjl", "seed": 3} if residual == "qjl" else residual
    return side


FORMATS = [("uniform", bits, residual) for bits in range(1, 9) for residual in (None, "sign", "qjl")
           if bits + bool(residual) <= 8]
FORMATS += [
    ("lloyd_max", bits, residual) for bits in range(1, 9) for residual in (None, "sign", "qjl")
    if bits + bool(residual) <= 8
]


def helpers(codebook: str, bits: int, residual: str | None):
    """Each plane helper a scheme of this format on both sides compiles (K with the residual, V with it unless QJL),
    as (side, pairs, its source); every side's PTX kind is hand-written (runtime/ptx.py) or among them."""
    data = {"version": 1, "name": "planes", "head_dims": [128], "key": side_of(codebook, bits, residual),
            "value": side_of(codebook, bits, residual if residual != "qjl" else None)}
    layout = plan(scheme_from_dict(data))
    made = {kind for kind, _, _ in layout.plane_helpers}
    assert all(side.fast_unpack in WHOLE_BYTE_KINDS or side.fast_unpack in made for side in layout.sides)
    return [(side, pairs, planes.helper_source(kind, pairs, side)) for kind, pairs, side in layout.plane_helpers]


def fp16(values) -> list[int]:
    return [int(v) for v in np.array(values, np.float16).view(np.uint16)]


def lut_words(entries: list[int]) -> list[int]:
    """`_lut_words`: the low bytes of every entry, then the high bytes, four a word."""
    pool = [e & 0xFF for e in entries] + [e >> 8 for e in entries]
    return [sum(b << 8 * i for i, b in enumerate(pool[w:w + 4])) for w in range(0, len(pool), 4)]


@pytest.mark.parametrize("codebook, bits, residual", FORMATS, ids=[f"{c}{b}{r or ''}" for c, b, r in FORMATS])
def test_plane_helpers_decode_each_code(codebook, bits, residual):
    rng = random.Random(bits)
    for side, pairs, source in helpers(codebook, bits, residual):
        asm, first = ptx.helper(source)
        for _ in range(60):
            registers, memory = {}, {}
            upper = [rng.random() < 0.5 if pairs else False for _ in range(4)]
            code = [0] * 4
            for p, plane in enumerate(side.planes):
                fields = range(0, 8 - plane.width if pairs and p == 0 else 8, plane.width)
                field = rng.choice(list(fields))
                data = rng.getrandbits(32)
                registers[f"${first[f'plane{p}']}"] = data
                for r in range(4):
                    registers[f"${first[f'field{p}'] + r}"] = field
                for k in range(4):
                    at = field + plane.width * (p == 0 and upper[k])
                    code[k] |= (data >> 8 * k + at & 2 ** plane.width - 1) << plane.shift
            if pairs:
                registers[f"${first['upper']}"] = sum(0xFF << 8 * k for k in range(4) if upper[k])
            if not side.lloyd_max:
                want = fp16([(c & side.levels - 1) - side.code_centre for c in code])
            else:
                entries = fp16([rng.uniform(-1, 1) for _ in range(side.levels)])
                index = [c & side.levels - 1 for c in code]
                want = [entries[i] for i in index]
                if side.lut_gather:  # the shared array's address, aligned as _<side>_entries_to_shared declares it
                    base = rng.randrange(0, 1 << 16, max(256, 2 * side.levels))
                    for i, e in enumerate(entries):
                        memory[base + 2 * i], memory[base + 2 * i + 1] = e & 0xFF, e >> 8
                    for r in range(4):
                        registers[f"${first['entries'] + r}"] = base
                words = lut_words(entries) if side.lut_words else []
                if side.fast_unpack == "lut1":
                    words = [e * 0x10001 for e in entries]  # lut1's words are its entries, each in both halves
                for w, word in enumerate(words):
                    for r in range(4):
                        registers[f"${first[f'lut{w}'] + r}"] = word
            if side.residual == "sign":
                rms = fp16([rng.uniform(0, 0.5) for _ in range(4)])
                registers[f"${first['rms']}"] = rms[0] | rms[1] << 16
                registers[f"${first['rms'] + 1}"] = rms[2] | rms[3] << 16
                signed = [r if c >> side.level_bits & 1 else r ^ 0x8000 for r, c in zip(rms, code)]
                want = [int(v) for v in (np.array(want, np.uint16).view(np.float16)
                                         + np.array(signed, np.uint16).view(np.float16)).view(np.uint16)]
            env = ptx.run(asm, registers, memory)
            got = ptx.halves(env["$0"]) + ptx.halves(env["$1"])
            assert got == want, (side.name, pairs, code, [hex(g) for g in got], [hex(w) for w in want])
            if side.qjl:
                signs = ptx.halves(env["$2"]) + ptx.halves(env["$3"])
                assert signs == [0x3C00 if c >> side.level_bits & 1 else 0xBC00 for c in code], (side.name, code)


@pytest.mark.parametrize("bits", range(GATHER_BITS, 9))
def test_codebook_copied_into_shared_memory_for_the_lookups(bits):
    """A gathering side's `_<side>_entries_to_shared`: the first warp's threads copy every fp16 entry from global
    memory into a shared array, declared in the PTX aligned to its size and to at least 256 bytes (the lookups' prmt
    writes index * 2 over its address's low byte), nothing past it, and every thread gets the array's address."""
    rng = random.Random(bits)
    data = {"version": 1, "name": "gather", "head_dims": [128], "key": side_of("lloyd_max", bits, None),
            "value": side_of("lloyd_max", bits, None)}
    for side in plan(scheme_from_dict(data)).sides:
        assert side.lut_gather
        asm = re.search(r'asm="""(.*?)"""', planes.to_shared_source(side), re.DOTALL).group(1)
        align, symbol, size = re.search(r"\.shared \.align (\d+) \.b8 (\w+)\[(\d+)\];", asm).groups()
        align, size = int(align), int(size)
        assert size == 2 * side.levels and align >= max(256, size) and align & (align - 1) == 0, (align, size)
        assert symbol == f"kvqc_{side.name}_entries"
        entries = fp16([rng.uniform(-1, 1) for _ in range(side.levels)])
        source = rng.randrange(1 << 20, 1 << 40, 2)
        memory = {source + 2 * i + b: e >> 8 * b & 0xFF for i, e in enumerate(entries) for b in range(2)}
        shared = 3 * align
        for tid in range(64):  # two warps' threads
            env = ptx.run(asm, {"$1": source}, memory, {symbol: shared}, tid)
            assert env["$0"] == shared
        assert [memory[shared + 2 * i] | memory[shared + 2 * i + 1] << 8 for i in range(side.levels)] == entries
        assert {a for a in memory if a < 1 << 20} == set(range(shared, shared + size))
