"""`kvqc resources`: compile a module's kernels for an H100 (sm_90) on any machine, GPU or not, and print what each
needs of an SM: shared memory against the 227 KiB a block may have, registers and stack (spills) per thread.

A kernel that asks for more shared memory than an SM has fails at its first launch ("out of resource: shared
memory"), on the GPU only: the interpreter that checks kernels on CPU has no such limit. This finds it before then.

Two steps, each in a process of its own, because Triton reads TRITON_INTERPRET once, when it is imported:
  1. record: fill, decode and flatten run a small cache under the interpreter (TRITON_INTERPRET=1), head-major or
     token-major blocks; every kernel launch is recorded with its argument types, constexprs and launch options,
     the settings the module's own wrappers choose for that head_dim and layout (whose grids and strides differ);
     fill also as a long prefill launches it, for fp16, bf16 and fp32 inputs.
  2. compile: each recorded launch is compiled for sm_90 (triton.compile with a CUDA target, no device needed) with
     what differs on compiled CUDA: fp16 dots and the PTX unpack paths (FAST_UNPACK, FAST_CELL), tf32x3 products,
     and pointers and strides aligned to 16 as Triton specializes them on a GPU.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SM90_SHARED = 232448  # bytes of shared memory one block may use on an H100 (227 KiB)
# What cuobjdump's SHARED counts for every sm_90 block on top of the arrays a kernel declares: the driver's reserve.
RESERVED_SHARED = 1024
BLOCK_SIZE = 64
# Constexprs as compiled CUDA sets them for fp16 inputs where the interpreter sets others.
COMPILED = {"FAST_UNPACK": True, "FAST_CELL": True, "DOT_DTYPE": "fp16", "DOT_PRECISION": "tf32x3"}
TYPES = {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16", "uint8": "u8", "int8": "i8", "int16": "i16",
         "int32": "i32", "int64": "i64", "bool": "i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")
SPLIT_KERNELS = ("_decode_kernel", "_decode_kernel_gluon")  # decode's split-K kernels: the estimate reads their loop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("schemes", nargs="+", metavar="SCHEME", help="scheme names or files")
    parser.add_argument("--head-dim", type=int, nargs="+", help="default: every head_dim the scheme is built for")
    parser.add_argument("--layout", choices=("bhsd", "bshd"), nargs="+", default=["bhsd", "bshd"],
                        help="cache layouts whose launches to compile (default: both)")
    parser.add_argument("--json", metavar="FILE", help="also write every kernel's numbers here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvqc resources", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    rows = []
    for scheme in args.schemes:
        for head_dim in args.head_dim or _head_dims(scheme):
            for layout in dict.fromkeys(args.layout):
                rows += measure(scheme, head_dim, layout=layout)
    print(f"{'scheme':<20} {'D':>4} {'layout':<6} {'kernel':<32} {'shared':>8} {'of sm_90':>8} {'regs':>5} "
          f"{'stack':>6}")
    for row in rows:
        where = f"{row['scheme']:<20} {row['head_dim']:>4} {row['layout']:<6} {row['kernel']:<32}"
        if "error" in row:
            print(f"{where} error: {row['error']}")
            continue
        flag = "  too large" if row["shared"] > SM90_SHARED else ""
        print(f"{where} {row['shared']:>8} "
              f"{row['shared'] / SM90_SHARED:>8.0%} {row['registers'] or '-':>5} {row['stack'] or 0:>6}{flag}")
    _print_estimates([row for row in rows if "estimate" in row])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 1 if any("error" in r or r["shared"] > SM90_SHARED for r in rows) else 0


def measure(scheme: str, head_dim: int, launches: list[dict] | None = None, layout: str = "bhsd") -> list[dict]:
    """Every kernel fill, decode and flatten launch for this scheme, head_dim and cache layout, compiled for sm_90:
    one dict each (scheme, head_dim, layout, kernel, shared bytes, registers, stack bytes; or error). `launches`:
    those `record` gave already, where the caller has them."""
    if launches is None:
        launches = _step("record", scheme, f"{head_dim} {layout}", interpret=True)
    rows = _step("compile", scheme, json.dumps(launches), interpret=False)
    return [{"scheme": scheme, "head_dim": head_dim, "layout": layout, **row} for row in rows]


def _step(step: str, scheme: str, arg: str, interpret: bool) -> list:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-m", "kvqc.tools.resources", f"--{step}", scheme], input=arg, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"kvqc resources: {step} {scheme}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _head_dims(scheme: str) -> tuple[int, ...]:
    from kvqc.compiler.spec import load_scheme
    from kvqc.modules import resolve

    path = Path(scheme)
    if path.suffix in (".yaml", ".yml"):
        return tuple(load_scheme(path).head_dims)
    text = resolve(scheme).read_text(encoding="utf-8")
    line = next(line for line in text.splitlines() if line.startswith("HEAD_DIMS = "))
    return tuple(ast.literal_eval(line.split("=", 1)[1].strip()))


def record(scheme: str, head_dim: int, layout: str = "bhsd") -> list[dict]:
    """Run fill, decode and flatten on a small CPU cache with `layout` blocks under the interpreter; return every
    launch."""
    import torch
    from triton.runtime import interpreter

    import kvqc.modules

    launches = []
    plain_run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        values = dict(zip(self.arg_names, args))
        values.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        launches.append({
            "kernel": self.fn.__name__,
            "head_dim": head_dim,  # a channel split's kernels take part widths, not always HEAD_DIM
            "args": {k: ("tensor", str(v.dtype).removeprefix("torch.")) if isinstance(v, torch.Tensor)
                     else ("value", v if v is None or isinstance(v, (bool, int, float, str)) else str(v))
                     for k, v in values.items()},
            "options": {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS and v is not None},
        })
        return plain_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    kv = kvqc.modules.load(scheme)
    torch.manual_seed(0)
    batch, q_heads, kv_heads, tokens, blocks = 2, 8, 2, 80, 2
    window = getattr(kv, "WINDOW", 0)
    extra = {"max_seqs": batch} if window else {}
    cache = kv.allocate_cache(batch * blocks, BLOCK_SIZE, kv_heads, head_dim, device="cpu", dtype=torch.float16,
                              layout=layout, **extra)
    key = torch.randn(batch * tokens, kv_heads, head_dim, dtype=torch.float16)
    value = torch.randn_like(key)
    block_tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    slot_mapping = torch.cat([torch.arange(tokens) + i * blocks * BLOCK_SIZE for i in range(batch)])
    seq_lens = torch.full((batch,), tokens, dtype=torch.int32)
    rows = {"window_index": torch.arange(batch)} if window else {}
    if hasattr(kv, "calibrate"):
        kv.calibrate(cache, key, value)
    tokens_at = {"positions": torch.arange(tokens).repeat(batch),
                 "window_index": torch.arange(batch).repeat_interleave(tokens)} if window else {}
    kv.fill(cache, key, value, slot_mapping, **tokens_at)
    # A long prefill's fill too: programs that loop over several tiles (where the module's fill loops) with the
    # launch options its wrapper gives them, for every input dtype a model hands it (bf16 and fp32 rows are split
    # into fp16 halves, which takes more shared memory). Those launches are labelled `kernel[loop,bf16]` and so on.
    target = kv._target_programs
    kv._target_programs = lambda device, per_sm: 1
    loops = hasattr(kv, "_FILL_PROGRAMS_PER_SM")
    try:
        for dtype in (torch.float16, torch.bfloat16, torch.float32)[0 if loops else 1:]:
            first = len(launches)
            kv.fill(cache, key.to(dtype), value.to(dtype), slot_mapping, **tokens_at)
            short = TYPES[str(dtype).removeprefix("torch.")]
            for launch in launches[first:]:
                # The window and group kernels take no loop, nor a fill whose loop has one stage (one tile a program).
                looped = loops and launch["kernel"] == "_fill_kernel" and launch["args"]["tiles"][1] > 1
                launch["label"] = f"{launch['kernel']}[{'loop,' * looped}{short}]"
    finally:
        kv._target_programs = target
    first = len(launches)
    kv.decode(torch.randn(batch, q_heads, head_dim, dtype=torch.float16), cache, block_tables, seq_lens, **rows)
    launches += _gluon_twins(kv, cache, q_heads // kv_heads, launches[first:])
    kv.flatten(cache, block_tables, seq_lens, **rows)
    return launches


def _gluon_twins(kv, cache, group: int, decode_launches: list[dict]) -> list[dict]:
    """_decode_kernel_gluon's launches, where decode takes it for fp16 queries on an H100: the module's own rule
    (_gluon_decode), asked with its device checks (compiled CUDA, mma.sync) taken as met. It takes
    _decode_kernel's arguments, on one warp with 32-token tiles, as decode launches it."""
    import torch

    if getattr(kv, "_decode_kernel_gluon", None) is None:
        return []
    saved = kv._GLUON, kv._mma_sync
    kv._GLUON, kv._mma_sync = True, lambda device: True
    try:
        taken = kv._gluon_decode(torch.zeros(1, dtype=torch.float16), cache, group)
    finally:
        kv._GLUON, kv._mma_sync = saved
    return [{"kernel": "_decode_kernel_gluon", "head_dim": launch["head_dim"],
             "args": {**launch["args"], "BLOCK_N": ("value", 32)},
             "options": {"num_warps": 1, "num_stages": launch["options"].get("num_stages", 3)}}
            for launch in decode_launches if taken and launch["kernel"] == "_decode_kernel"]


def compiled_value(module, name: str, value):
    """What compiled CUDA passes for a parameter the interpreter recorded as `value`: COMPILED's constexprs, and the
    query rows padded to at least what the installed Triton's dots take (the interpreter's take any)."""
    value = COMPILED.get(name, value)
    if name == "GROUP_PAD":
        value = max(value, getattr(module, "_DOT_ROWS", 1))
    return value


def compile_launch(module, launch: dict) -> dict:
    """One recorded launch compiled for sm_90: its shared memory, registers and spills (or the error)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(module, launch["kernel"])
    label = launch.get("label", launch["kernel"])
    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        kind, value = launch["args"].get(name, ("value", None))
        value = compiled_value(module, name, value)
        if name in constexprs or value is None:
            signature[name] = "constexpr"
            constants[name] = tl.dtype(value) if value in ("fp16", "fp32", "bf16") else value
            continue
        if kind == "tensor":
            signature[name] = "*" + TYPES[value]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
        else:
            signature[name] = "fp32"
        if kind == "tensor" or (isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        if launch["kernel"].endswith("_gluon"):
            from triton.experimental.gluon._runtime import GluonASTSource

            source = GluonASTSource(kernel, signature, constants, attrs)
        else:
            source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as exc:  # a kernel that does not compile is a finding, reported like the others
        return {"kernel": label, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"}
    registers, stack, declared = _usage(_cuobjdump("-res-usage", compiled.asm["cubin"]))
    # Triton's own shared memory, plus arrays the module's PTX declares (a codebook's copy, planes.to_shared_source)
    shared = compiled.metadata.shared + declared
    row = {"kernel": label, "shared": shared, "registers": registers, "stack": stack,
           "options": launch["options"]}
    if launch["kernel"] in SPLIT_KERNELS:
        sass = _cuobjdump("-sass", compiled.asm["cubin"])
        row["loop_instructions"] = loop_instructions(sass)
        row["skipped_instructions"] = skipped_instructions(sass)
        row["block_n"] = constants["BLOCK_N"]
        row["num_warps"] = launch["options"].get("num_warps", 4)  # Triton's default
    return row


def loop_instructions(sass: str) -> int | None:
    """SASS instructions in the innermost loop that holds tensor-core instructions (a backward branch's span with an
    MMA in it): a split kernel's tile, one warp's share; None where no loop has one."""
    loop = _tile_loop(sass)
    return len(loop) if loop else None


def skipped_instructions(sass: str) -> int:
    """Of loop_instructions' loop, the instructions of the lazy rescale (LAZY_RESCALE), which a tile runs only where
    it raises a row's maximum and the estimate counts at estimate.SKIPPED_WEIGHT: a block that a conditional branch
    inside the loop jumps forward over, holding the rescale's exp2 and no branch of its own (so an if without an
    else, where one of two paths would always run, and not a jump out of the loop, past its backward branch)."""
    loop = _tile_loop(sass) or []
    skipped = set()
    for at, text in loop:
        branch = re.match(r"@!?P\d\s+BRA\b.*?0x([0-9a-f]+)", text)  # on a predicate (@P0, @!P3): not @PT's always
        block = [(a, t) for a, t in loop if branch and at < a < int(branch.group(1), 16)]
        rescale = any("MUFU.EX2" in t for _, t in block)
        if rescale and not any(re.search(r"\bBRA\b", t) for _, t in block):
            skipped.update(a for a, _ in block)
    return len(skipped)


def _tile_loop(sass: str) -> list[tuple[int, str]] | None:
    """The innermost loop that holds tensor-core instructions: its (address, instruction) lines, or None."""
    lines = [(int(at, 16), text.strip()) for at, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for at, text in lines:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) <= at:
            body = [(a, t) for a, t in lines if int(branch.group(1), 16) <= a <= at]
            opcodes = [t.split()[1 if t.startswith("@") else 0] for _, t in body]  # past a predicate (@P0)
            if any("MMA" in opcode for opcode in opcodes):
                loops.append(body)
    return min(loops, key=len) if loops else None


def _cuobjdump(flag: str, cubin: bytes) -> str:
    """cuobjdump's output for a cubin (it ships with Triton's CUDA backend)."""
    import tempfile

    from triton.backends.nvidia import compiler as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(tool), flag, file.name], capture_output=True, text=True).stdout


def _usage(res_usage: str) -> tuple[int | None, int | None, int]:
    """Registers per thread, stack bytes per thread (spills, or arrays ptxas could not keep in registers) and the
    shared bytes the kernel's PTX declares beyond the driver's reserve, from cuobjdump's -res-usage output."""
    fields = dict(item.split(":", 1) for line in res_usage.splitlines() if "REG:" in line for item in line.split())
    if not fields:
        return None, None, 0
    return int(fields["REG"]), int(fields["STACK"]), max(0, int(fields.get("SHARED", 0)) - RESERVED_SHARED)


def _print_estimates(rows: list[dict]) -> None:
    """Decode's estimated share of its floor on an H100 (kvqc/tools/estimate.py), per scheme, head_dim and layout."""
    from kvqc.tools import estimate

    if not rows:
        return
    shapes = [f"{b}x{n}" for b, n in estimate.SHAPES]
    labels = [f"{b}x{n // 1024}k" for b, n in estimate.SHAPES]
    print(f"\ndecode estimated for an H100 (a model, not a measurement: fp16 queries, {estimate.Q_HEADS} query / "
          f"{estimate.KV_HEADS} KV heads; % of the byte floor, kvqc bench's measure; 'skipped': the tile's "
          f"lazy rescale, which a branch jumps over on most tiles, counted at {estimate.SKIPPED_WEIGHT:.0%})")
    print(f"{'scheme':<20} {'D':>4} {'layout':<6} {'split kernel':<21} {'instr/tile':>10} {'skipped':>7} {'tokens':>6} "
          f"{'warps/SM':>8} " + " ".join(f"{label:>8}" for label in labels) + f"  bound at {labels[-1]}")
    for row in rows:
        est = row["estimate"]
        cells = " ".join(f"{est['shapes'][shape]['fraction']:>8.0%}" for shape in shapes)
        print(f"{row['scheme']:<20} {row['head_dim']:>4} {row['layout']:<6} {row['kernel']:<21} "
              f"{est['loop_instructions']:>10} {est['skipped_instructions']:>7} {est['block_n']:>6} "
              f"{est['warps_per_sm']:>8} {cells}  {est['shapes'][shapes[-1]]['bound']}")


def _worker(step: str, scheme: str) -> None:
    arg = sys.stdin.read()
    if step == "record":
        head_dim, layout = arg.split()
        print(json.dumps(record(scheme, int(head_dim), layout)))
        return
    import kvqc.modules

    module = kvqc.modules.load(scheme)
    launches = json.loads(arg)
    rows = [compile_launch(module, launch) for launch in launches]
    _attach_estimate(module, launches, rows)
    print(json.dumps(rows))


def _attach_estimate(module, launches: list[dict], rows: list[dict]) -> None:
    """The decode estimate (kvqc/tools/estimate.py) on the row of the split kernel decode takes for fp16 queries:
    the Gluon kernel where it was recorded (none where that one failed to compile: its row says why), else
    _decode_kernel. That kernel is compiled once more as a long context launches it on the estimate's heads: the
    longest split chunk, dependent launch and the in-kernel merge, where the recording's small cache had others."""
    import torch

    from kvqc.tools import estimate

    taken = [(launch, row) for launch, row in zip(launches, rows) if launch["kernel"] in SPLIT_KERNELS]
    taken.sort(key=lambda pair: pair[0]["kernel"] != "_decode_kernel_gluon")
    if not taken or "error" in taken[0][1]:
        return
    launch, row = taken[0]
    args = launch["args"]
    # record() decodes 8 query heads over 2 KV heads: the estimate's 32 over 8 keep that group.
    assert args["GROUP"][1] == estimate.Q_HEADS // estimate.KV_HEADS, args["GROUP"]
    head_dim = launch["head_dim"]
    long_context = {"SPLIT_CHUNK": module._SPLIT_CHUNK_MAX, "PDL": True, "NUM_KV_HEADS": estimate.KV_HEADS}
    if "MERGE" in args:
        long_context["MERGE"] = True
    long_context = {name: ("value", value) for name, value in long_context.items() if name in args}
    compiled = compile_launch(module, {**launch, "args": {**args, **long_context}})
    if "error" in compiled:
        return
    kernel = estimate.SplitKernel(
        loop_instructions=compiled["loop_instructions"], block_n=compiled["block_n"],
        num_warps=compiled["num_warps"], registers=compiled["registers"], shared=compiled["shared"],
        programs_per_sm=module._decode_config(head_dim)[3], skipped_instructions=compiled["skipped_instructions"],
    )
    row["estimate"] = {
        "loop_instructions": kernel.loop_instructions, "skipped_instructions": kernel.skipped_instructions,
        "block_n": kernel.block_n, "num_warps": kernel.num_warps,
        "registers": kernel.registers, "shared": kernel.shared, "warps_per_sm": kernel.warps_per_sm,
        "shapes": estimate.estimates(kernel, module.bytes_per_token(head_dim, torch.float16),
                                     getattr(module, "WINDOW", 0), head_dim),
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--record", "--compile"):
        _worker(sys.argv[1][2:], sys.argv[2])
    else:
        sys.exit(main())
