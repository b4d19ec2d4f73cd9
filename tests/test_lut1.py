"""lut1, decode's PTX lookup of 1-bit Lloyd-Max codes (kernels/unpack.py.j2), checked where no GPU runs it: its
words, numbers in the kernel's source, are the fp16 entries the tables hold, and its instructions, run by a small
emulator of the PTX they use, decode every code byte and field as the select trees do.
"""

import inspect
import random
import re

import pytest
import ptx
import torch
from conftest import ROOT, generated

from kvqc.compiler.layout import plan
from kvqc.compiler.spec import load_scheme

NAME = "sign1_window"


def _helper(m, name: str) -> tuple[str, list[int]]:
    asm, first = ptx.module_helper(m, name)
    return asm, list(first.values())


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
                assert ptx.halves(word) == [bits[int(i)]] * 2, (side.name, d, i, hex(word))


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
        env = ptx.run(asm, registers)
        got = ptx.halves(env["$0"]) + ptx.halves(env["$1"])
        want = [entries[codes >> 8 * k + field + (ups >> k & 1) & 1] for k in range(4)]
        assert got == want, (hex(codes), field, ups, [hex(g) for g in got], [hex(w) for w in want])
