"""Decode's PTX helpers that gather each code's bits from its bit planes, written per format: which planes a code
spans, where its index and residual bits lie and how many codebook entries it reads differ from one scheme to the
next, so each helper's instructions are laid out here, in Python, and a module carries the source they make
(templates/kernels/unpack.py.j2 places it).

A helper takes each plane's bytes (pack=4: four codes' bytes in one register), each plane's bit offset (fieldN,
where a chunk's field lies in its bytes), and for Lloyd-Max codes its lookup operands; it returns fp16 tiles. The
contract of the hand-written helpers (runtime/ptx.py: lane-wise, and what is_pure decides) holds for these too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvqc.compiler.layout import Layout

BYTES = 0x01010101  # a mask repeated in each byte of a register


class PlaneSide(Protocol):
    """What a helper needs of a side's plan (SideLayout)."""

    name: str
    fast_unpack: str
    planes: tuple
    qjl: bool
    residual: str
    lloyd_max: bool
    lut_gather: bool
    lut_words: int
    level_bits: int
    levels: int
    code_bits: int
    code_centre: int


def sources(layout: Layout) -> str:
    """Every helper the layout's bit-plane sides call (Layout.plane_helpers), and the copy of each gathering side's
    codebook into shared memory, two blank lines after each."""
    helpers = [helper_source(kind, pairs, side) for kind, pairs, side in layout.plane_helpers]
    helpers += [to_shared_source(side) for side in layout.sides if side.lut_gather]
    return "".join(helper + "\n\n\n" for helper in helpers)


def to_shared_source(side: PlaneSide) -> str:
    """`_<side>_entries_to_shared(entries_ptr)`: the side's fp16 codebook copied once a program into a shared array
    the PTX declares (Triton's own shared memory is untouched), whose address the lookups take. The array is aligned
    to its size, and to at least 256 bytes: an entry's address is the array's with index * 2 over its low bits, which
    prmt writes in one instruction up to 7 bits. The address is the helper's result, so every lookup depends on the
    copy and its barrier."""
    entries = 2 ** side.level_bits
    symbol = f"kvqc_{side.name}_entries"
    lines = ["@triton.jit", f"def _{side.name}_entries_to_shared(entries_ptr):"]
    lines += _wrap_docstring(f"The {entries} fp16 entries of {side.name}'s codebook into the shared array {symbol}, "
                             "copied by the first warp before a barrier: its address, for the lookups.")
    lines += _wrap_comment("Declared in the PTX, beside Triton's own shared memory, and aligned to its size (256 bytes "
                           "at least) so that a lookup's prmt writes index * 2 over the address's low byte. A scalar "
                           "operand: the asm runs once a thread, where a tensor's would repeat the declaration.")
    asm = [".reg .b32 t, s;", ".reg .b64 a;", ".reg .b16 e;", ".reg .pred p;", "mov.u32 t, %tid.x;",
           "setp.lt.u32 p, t, 32;", f"mov.u32 $0, {symbol};", "mad.lo.u32 s, t, 2, $0;", "mad.wide.u32 a, t, 2, $1;"]
    for k in range(entries // 32):
        asm += [f"@p ld.global.nc.b16 e, [a+{64 * k}];", f"@p st.shared.b16 [s+{64 * k}], e;"]
    asm.append("bar.sync 0;")
    declare = f".shared .align {max(256, 2 * entries)} .b8 {symbol}[{2 * entries}];"
    return _call(lines, asm, "=r,l", "entries_ptr.to(tl.int64)", "tl.int32", pure=False, pack=1, declare=declare)


def helper_source(kind: str, pairs: bool, side: PlaneSide) -> str:
    """The @triton.jit source of `_unpack_<kind>` (`_unpack_<kind>_pairs` where decode reads two chunks a call)."""
    if kind == "lut1":
        return _lut1(pairs)
    return _Helper(kind, pairs, side).source()


def _lut1(pairs: bool) -> str:
    upper = "upper, " if pairs else ""
    lines = ["@triton.jit", f"def _unpack_lut1{'_pairs' if pairs else ''}(plane0, {upper}field0, lut0, lut1):"]
    lines += _wrap_docstring("1-bit Lloyd-Max indices -> fp16 entries, one tile a call: each byte's bit at field0, "
                             "moved to bit 7, masks its half (prmt's sign replication), and lop3 takes lut1's half "
                             "under the mask, lut0's elsewhere (entry i, twice).")
    if pairs:
        lines += _wrap_comment("Two chunks side by side (decode's pairs): where `upper` is 0xff a byte takes its next "
                               "field. Impure: Triton cannot read V's bytes in tl.dot's layout (pairs along tokens), "
                               "and purity would only widen the probabilities'.")
    asm = [".reg .b32 k, t" + (", u" if pairs else "") + ", l, h;", f"sub.u32 k, 7, ${4 if pairs else 3};",
           "shl.b32 t, $2, k;"]
    if pairs:
        asm += ["sub.u32 k, k, 1;", "shl.b32 u, $2, k;", "lop3.b32 t, u, t, $3, 0xe4;"]
    lut0, lut1 = (8, 12) if pairs else (7, 11)
    asm += ["prmt.b32 l, t, t, 0x9988;", "prmt.b32 h, t, t, 0xbbaa;", f"lop3.b32 $0, l, ${lut1}, ${lut0}, 0xca;",
            f"lop3.b32 $1, h, ${lut1}, ${lut0}, 0xca;"]
    args = f"plane0, {upper}field0, lut0, lut1"
    constraints = "=r,=r" + ",r" * (14 if pairs else 13)
    return _call(lines, asm, constraints, args, "tl.float16", pure=not pairs)


class _Helper:
    """One generated helper: its operands in order (outputs, planes, `upper`, fields, a sign residual's rms, the
    lookup words or the fp16 codebook's address) and the instructions over them."""

    def __init__(self, kind: str, pairs: bool, side: PlaneSide):
        self.kind, self.pairs, self.side = kind, pairs, side
        self.sign = side.residual == "sign"
        self.outs = 4 if side.qjl else 2
        n = len(side.planes)
        self.first_field = self.outs + n + pairs
        self.rms = self.first_field + 4 * n  # pack=4 gives a 32-bit operand one register per element
        self.lut = self.rms + 2 * self.sign  # fp16 rms: two elements a register

    def source(self) -> str:
        side, n = self.side, len(self.side.planes)
        planes = [f"plane{p}" for p in range(n)] + (["upper"] if self.pairs else []) + [f"field{p}" for p in range(n)]
        lookup = (["rms"] if self.sign else []) + (["entries"] if side.lut_gather else [])
        lookup += [f"lut{i}" for i in range(side.lut_words)]
        args = ", ".join(planes + lookup)
        lines = ["@triton.jit", f"def _unpack_{self.kind}{'_pairs' if self.pairs else ''}({args}):"]
        lines += _wrap_docstring(self.doc())
        if self.pairs:
            lines += _wrap_comment("Two chunks side by side (decode's pairs): plane 0's bytes repeat, and where "
                                   "`upper` is 0xff a byte takes its next field (a select of the byte shifted once "
                                   "more).")
        constraints = ",".join(["=r"] * self.outs) + ",r" * (n + self.pairs + 4 * n + 2 * self.sign)
        constraints += ",r" * (4 * side.lut_words + 4 * side.lut_gather)
        dtype = "(tl.float16, tl.float16)" if side.qjl else "tl.float16"
        return _call(lines, self.registers() + self.gather_bits() + self.body(), constraints, args, dtype,
                     pure=not side.lloyd_max)

    def doc(self) -> str:
        side, n = self.side, len(self.side.planes)
        where = f", their bits in {n} planes," if n > 1 else ""
        gather = ("each plane's bits, at bit offset fieldN of its bytes, moved to their place in the "
                  + ("index" if side.lloyd_max and not (side.qjl or self.sign) else "code"))
        if side.qjl and not side.lloyd_max:
            return (f"{side.level_bits}-bit uniform codes and the QJL sign bit above them{where} -> fp16 code - "
                    f"{side.code_centre} (centred, see decode) and +-1 signs, two tiles a call: {gather}; the sign "
                    "bit, moved to bit 7 of its byte and then to bit 15 of a half, turns -1.0 into 1.0 (one lop3); "
                    "prmt writes 0x64 above each code byte (1024 + code in fp16), one subtraction per pair.")
        if side.qjl:
            return (f"{side.level_bits}-bit Lloyd-Max indices and the QJL sign bit above them{where} -> fp16 codebook "
                    f"entries and +-1 signs, two tiles a call: {gather}; the sign bit, moved to bit 7 of its byte and "
                    "then to bit 15 of a half, turns -1.0 into 1.0 (one lop3); the index bits alone "
                    f"{self.lookup_doc()}.")
        if self.sign and side.lloyd_max:
            return (f"{side.level_bits}-bit Lloyd-Max indices and the residual's sign above them{where} -> fp16 entry "
                    f"+ -rms, one tile a call: {gather}; the sign bit, moved to bit 15 of a half, flips rms's sign "
                    f"(one lop3) before a paired add; the index bits alone {self.lookup_doc()}.")
        if side.lloyd_max:
            return (f"{side.code_bits}-bit Lloyd-Max indices{where} -> fp16 codebook entries, one tile a call: "
                    f"{gather}; then the index bytes {self.lookup_doc()}.")
        if self.sign:
            return (f"{side.level_bits}-bit uniform codes and the residual's sign above them{where} -> fp16 code - "
                    f"{side.code_centre} + -rms (centred, see decode; rms in grid steps), one tile a call: {gather}; "
                    "the sign bit, moved to bit 15 of a half, flips rms's sign (one lop3); prmt writes 0x64 above "
                    "each code byte (1024 + code in fp16), one subtraction and one add per pair.")
        return (f"{side.code_bits}-bit uniform codes{where} -> fp16 code - {side.code_centre} (centred, see decode), "
                f"one tile a call: {gather}; prmt writes 0x64 above each code byte (1024 + code in fp16), one "
                "subtraction per pair.")

    def lookup_doc(self) -> str:
        if self.side.lut_gather:
            return ("read each entry from the fp16 codebook in shared memory at `entries` (one prmt and one "
                    "load each up to 7 bits)")
        return (f"make one prmt selector, and prmt reads the entries' low and high bytes (lut: {self.side.lut_words} "
                "words, as _lut_words packs them)")

    def registers(self) -> list[str]:
        side = self.side
        names = ["c", "t"] + (["u"] if self.pairs else [])
        if side.lloyd_max:
            groups = side.lut_words // 4
            lo, hi = _group_names(groups)
            names += ["i"] if side.lut_gather else ["s", *lo, *hi]
            names += ["z"] * self.zero + ["l", "h", "m"] * (side.qjl or self.sign) + ["m"] * (groups > 1)
            names += ["o"] * side.qjl + ["r0", "r1"] * self.sign
        else:
            names += ["e", "o"] + ["z", "l", "h", "m"] * (self.sign or side.qjl) + ["r0", "r1"] * self.sign
        out = [".reg .b32 " + ", ".join(dict.fromkeys(names)) + ";"]
        if side.lut_gather:
            out.append(".reg .b16 e0, e1, e2, e3;")
        return out

    @property
    def zero(self) -> bool:
        """A register of zeros for prmt: the bit above the index, prmt lookups and 8-bit gathers take one."""
        side = self.side
        return self.sign or side.qjl or (side.lloyd_max and not (side.lut_gather and side.level_bits < 8))

    def gather_bits(self) -> list[str]:
        """`c`: each code's bits from every plane, at their place in the code, one code a byte."""
        out = []
        for p, plane in enumerate(self.side.planes):
            into = "c" if p == 0 else "t"
            out.append(f"shr.b32 {into}, ${self.outs + p}, ${self.first_field + 4 * p};")
            if self.pairs and p == 0:
                n = len(self.side.planes)
                out += [f"shr.b32 u, c, {plane.width};", f"lop3.b32 c, u, c, ${self.outs + n}, 0xe4;"]
            out.append(f"and.b32 {into}, {into}, 0x{(2 ** plane.width - 1) * BYTES:08x};")
            if p:
                out += [f"shl.b32 t, t, {plane.shift};", "or.b32 c, c, t;"]
        return out

    def body(self) -> list[str]:
        side = self.side
        out = ["mov.b32 z, 0;"] if self.zero else []
        if side.qjl or self.sign:
            # The bit above the index, moved to bit 7 of its byte, then to bit 15 of its half.
            out += [f"shl.b32 t, c, {7 - side.level_bits};", "prmt.b32 l, t, z, 0x1404;", "prmt.b32 h, t, z, 0x3424;",
                    "mov.b32 m, 0x80008000;"]
            if side.qjl:
                out += ["mov.b32 o, 0xbc00bc00;", "lop3.b32 $2, l, m, o, 0x6a;", "lop3.b32 $3, h, m, o, 0x6a;"]
            else:
                out += [f"lop3.b32 r0, l, m, ${self.rms}, 0xa6;", f"lop3.b32 r1, h, m, ${self.rms + 1}, 0xa6;"]
            out.append(f"and.b32 c, c, 0x{(side.levels - 1) * BYTES:08x};")
        if not side.lloyd_max:
            out += ["mov.b32 e, 0x64646464;", f"mov.b32 o, 0x{(25600 + side.code_centre) * 65537:08x};",
                    "prmt.b32 $0, c, e, 0x4140;", "prmt.b32 $1, c, e, 0x4342;", "sub.f16x2 $0, $0, o;",
                    "sub.f16x2 $1, $1, o;"]
        else:
            out += self.gather_entries() if side.lut_gather else self.prmt_entries()
        if self.sign:
            out += ["add.f16x2 $0, $0, r0;", "add.f16x2 $1, $1, r1;"]
        return out

    def gather_entries(self) -> list[str]:
        """Each index's fp16 entry by one load from the codebook's shared array (_<side>_entries_to_shared), two
        halves a register. The array is aligned to its size: up to 7 bits, prmt writes index * 2 over the address's
        low byte; 8-bit indices take a multiply-add."""
        out = []
        if self.side.level_bits < 8:
            out.append("shl.b32 c, c, 1;")  # index * 2 stays inside its byte
            for k in range(4):
                out += [f"prmt.b32 i, c, ${self.lut}, 0x{0x7650 + k:x};", f"ld.shared.b16 e{k}, [i];"]
        else:
            for k in range(4):
                out += [f"prmt.b32 i, c, z, 0x{0x4440 + k:x};", f"mad.lo.u32 i, i, 2, ${self.lut};",
                        f"ld.shared.b16 e{k}, [i];"]
        return out + ["mov.b32 $0, {e0, e1};", "mov.b32 $1, {e2, e3};"]

    def prmt_entries(self) -> list[str]:
        """Four indices' low 3 bits make one prmt selector (a nibble each); prmt reads the low and the high bytes of
        8 entries at a time, each further index bit picks between two such bytes (a 0x00 / 0xff mask per byte, one
        lop3), and two prmt interleave low and high bytes into fp16 pairs."""
        lut, words, bits = self.lut, self.side.lut_words, self.side.level_bits
        index = "c"
        if bits > 3:
            out, index = ["and.b32 s, c, 0x07070707;"], "s"
        else:
            out = []
        out += [f"shr.b32 t, {index}, 4;", f"or.b32 t, t, {index};", "prmt.b32 s, t, z, 0x0020;"]
        if words == 2:
            return out + [f"prmt.b32 l, ${lut}, ${lut}, s;", f"prmt.b32 h, ${lut + 4}, ${lut + 4}, s;",
                          "prmt.b32 $0, l, h, 0x5140;", "prmt.b32 $1, l, h, 0x7362;"]
        if words == 1:
            return out + [f"prmt.b32 l, ${lut}, ${lut}, s;", "or.b32 s, s, 0x2222;", f"prmt.b32 h, ${lut}, ${lut}, s;",
                          "prmt.b32 $0, l, h, 0x5140;", "prmt.b32 $1, l, h, 0x7362;"]
        groups, high = words // 4, words // 2  # 8 entries a group: two words of low bytes, two of high
        lo, hi = _group_names(groups)
        for g in range(groups):
            out += [f"prmt.b32 {lo[g]}, ${lut + 8 * g}, ${lut + 8 * g + 4}, s;",
                    f"prmt.b32 {hi[g]}, ${lut + 4 * (high + 2 * g)}, ${lut + 4 * (high + 2 * g) + 4}, s;"]
        for level, bit in enumerate(range(3, bits)):
            step = 2 ** level
            out += [f"shl.b32 t, c, {7 - bit};", "prmt.b32 m, t, t, 0xba98;"]  # the bit's sign, per byte
            for g in range(0, groups, 2 * step):
                out += [f"lop3.b32 {lo[g]}, {lo[g]}, {lo[g + step]}, m, 0xd8;",
                        f"lop3.b32 {hi[g]}, {hi[g]}, {hi[g + step]}, m, 0xd8;"]
        return out + [f"prmt.b32 $0, {lo[0]}, {hi[0]}, 0x5140;", f"prmt.b32 $1, {lo[0]}, {hi[0]}, 0x7362;"]


def _group_names(groups: int) -> tuple[list[str], list[str]]:
    """The registers of each group of 8 entries' low and high bytes (l and h where there is one group)."""
    if groups <= 1:
        return ["l"], ["h"]
    return [f"l{g}" for g in range(groups)], [f"h{g}" for g in range(groups)]


def _wrap_docstring(text: str) -> list[str]:
    return _wrap('"""' + text + '"""', "    ")


def _wrap_comment(text: str) -> list[str]:
    return _wrap(text, "    # ")


def _wrap(text: str, prefix: str, width: int = 120) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(prefix) + len(line) + 1 + len(word) > width:
            lines.append(prefix + line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [prefix + line]


def _call(lines: list[str], asm: list[str], constraints: str, args: str, dtype: str, pure: bool, pack: int = 4,
          declare: str = "") -> str:
    """The helper's return statement after `lines`: `asm` in a block of its own, after `declare` (a declaration at
    the kernel's scope, outside the block)."""
    body = "\n".join(f"        {instruction}" for instruction in asm)
    start = f"\n        {declare}\n        {{" if declare else "{"
    return "\n".join(lines + [
        "    return tl.inline_asm_elementwise(",
        f'        asm="""{start}\n{body}\n        }}""",',
        f'        constraints="{constraints}",',
        f"        args=[{args}],",
        f"        dtype={dtype},",
        f"        is_pure={pure},",
        f"        pack={pack},",
        "    )",
    ])
