"""A small emulator of the PTX instructions decode's unpacking helpers use, so that their instructions are checked
where no GPU runs them: 32-bit integer operations, prmt and lop3, fp16 pairs, the 16-bit loads and stores of the
codebook gather and of its copy into shared memory (one dict of byte addresses stands for both state spaces), one
thread at a time (%tid.x, predicates; barriers are no-ops).
"""

import inspect
import re

import numpy as np

MASK = 0xFFFFFFFF


def prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32's default mode: byte i of the result is byte (nibble i & 7) of {b, a}, or, with the nibble's bit 3
    set, that byte's sign bit in all eight bits."""
    pool = a | b << 32
    out = 0
    for i in range(4):
        nibble = selector >> 4 * i & 0xF
        byte = pool >> 8 * (nibble & 7) & 0xFF
        out |= (0xFF if byte & 0x80 else 0) << 8 * i if nibble & 8 else byte << 8 * i
    return out


def lop3(a: int, b: int, c: int, table: int) -> int:
    return sum((table >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1)) & 1) << i for i in range(32))


def halves(word: int) -> list[int]:
    return [word & 0xFFFF, word >> 16]


def _f16x2(a: int, b: int, op) -> int:
    x = np.array(halves(a), np.uint16).view(np.float16)
    y = np.array(halves(b), np.uint16).view(np.float16)
    out = op(x, y).astype(np.float16).view(np.uint16)
    return int(out[0]) | int(out[1]) << 16


def run(asm: str, registers: dict, memory: dict | None = None, symbols: dict | None = None, tid: int = 0) -> dict:
    """Run a helper's instructions from its operand registers (`$n`: int); `memory` maps byte addresses to bytes,
    `symbols` a shared array's name to its address; `tid` is the thread's %tid.x."""
    env = {**registers, **(symbols or {}), "%tid.x": tid}
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith((".reg", ".shared", "{", "}")) or line == "bar.sync 0":
            continue
        guard = re.match(r"@(!?)(\w+) ", line)
        if guard:
            line = line[guard.end():]
            if bool(env[guard.group(2)]) == bool(guard.group(1)):
                continue
        op, rest = line.split(None, 1)
        kind = op.split(".")[0]
        if kind == "ld":
            dest, base, offset = re.fullmatch(r"(\w+), \[(\w+)(?:\+(\d+))?\]", rest).groups()
            at = env[base] + int(offset or 0)
            env[dest] = memory[at] | memory[at + 1] << 8
            continue
        if kind == "st":
            base, offset, value = re.fullmatch(r"\[(\w+)(?:\+(\d+))?\], (\w+)", rest).groups()
            at = env[base] + int(offset or 0)
            memory[at], memory[at + 1] = env[value] & 0xFF, env[value] >> 8
            continue
        if kind == "setp":
            dest, a, b = [a.strip() for a in rest.split(",")]
            assert op == "setp.lt.u32", op
            env[dest] = env[a] < int(b, 0)
            continue
        if kind == "mov" and "{" in rest:
            dest, low, high = re.fullmatch(r"(\$?\w+), \{(\w+), (\w+)\}", rest).groups()
            env[dest] = env[low] | env[high] << 16
            continue
        dest, *args = [a.strip() for a in rest.split(",")]
        v = [env[a] if a in env else int(a, 0) & MASK for a in args]
        if kind == "mov":
            env[dest] = v[0]
        elif kind == "sub" and op.endswith("f16x2"):
            env[dest] = _f16x2(v[0], v[1], np.subtract)
        elif kind == "add" and op.endswith("f16x2"):
            env[dest] = _f16x2(v[0], v[1], np.add)
        elif kind == "sub":
            env[dest] = (v[0] - v[1]) & MASK
        elif kind == "shl":
            env[dest] = v[0] << v[1] & MASK if v[1] < 32 else 0
        elif kind == "shr":
            env[dest] = v[0] >> v[1] if v[1] < 32 else 0
        elif kind == "and":
            env[dest] = v[0] & v[1]
        elif kind == "or":
            env[dest] = v[0] | v[1]
        elif kind == "prmt":
            env[dest] = prmt(*v)
        elif kind == "lop3":
            env[dest] = lop3(*v)
        elif op == "mad.wide.u32":
            env[dest] = v[0] * v[1] + v[2]
        elif op == "mad.lo.u32":
            env[dest] = (v[0] * v[1] + v[2]) & MASK
        else:
            raise AssertionError(f"the emulator lacks {op}")
    return env


def helper(source: str) -> tuple[str, dict[str, int]]:
    """A helper's PTX and the register each argument starts at (a byte operand takes one register for four elements,
    an fp16 one two, an int32 or int64 one four), from its @triton.jit source."""
    asm = re.search(r'asm="""(.*?)"""', source, re.DOTALL).group(1)
    constraints = re.search(r'constraints="([^"]*)"', source).group(1).split(",")
    args = [a.strip() for a in re.search(r"args=\[([^\]]*)\]", source, re.DOTALL).group(1).split(",") if a.strip()]
    at = sum(c.startswith("=") for c in constraints)
    first = {}
    for arg in args:
        first[arg] = at
        at += 1 if arg.startswith("plane") or arg == "upper" else 2 if arg == "rms" else 4
    assert at == len(constraints), (constraints, args)
    return asm, first


def module_helper(module, name: str) -> tuple[str, dict[str, int]]:
    return helper(inspect.getsource(getattr(module, name).fn))
