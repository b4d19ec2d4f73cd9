"""Decode's time on an H100 estimated from the compiled split kernel, without a GPU (`kvqc resources` prints it).

A split program loops over its share of a sequence's tokens, BLOCK_N a tile. At long contexts its time is either the
bytes it reads (the scheme's floor: codes and metadata at the copy bandwidth) or the instructions its warps issue,
whichever is longer, plus a fixed cost a call (launch, the first loads, the merge):

    issue   = tiles x warps a program x instructions a tile x cycles an instruction / (warps an SM x SMs x clock)
              (at most ISSUE_PER_CYCLE instructions an SM a cycle)
    time    = FIXED_US + max(issue, floor / MEMORY_EFFICIENCY)

"Instructions a tile" is the SASS of the kernel's innermost loop that holds its tensor-core instructions (cuobjdump
reads the cubin that `kvqc resources` compiles for sm_90); the lazy rescale's, which a branch inside the loop jumps
over on most tiles, count at SKIPPED_WEIGHT. Warps an SM are what the grid gives it (the module's
split programs a multiprocessor, `_decode_config`), at most what its registers and shared memory let stay resident.
The cycles an instruction (CYCLES_PER_INSTRUCTION, or CYCLES_PER_INSTRUCTION_WIDE for programs of four warps or
more) and FIXED_US are fitted to the catalogue's benchmarks on an H100 (docs/benchmarks.md, "Kernel resources and a
decode estimate without a GPU", gives the fit and how far it lands from the measured times). A scheme whose loop
issues more instructions per byte than the memory can feed is instruction-bound: the estimate says so before any
run.
"""

from __future__ import annotations

from dataclasses import dataclass

# NVIDIA H100 80GB HBM3 (SXM) as kvqc bench measures it: SMs, the SM clock under load, device-to-device copy GB/s.
SMS = 132
CLOCK_HZ = 1.755e9
COPY_GBPS = 3000.0
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 233472  # 228 KiB: what resident blocks share
SHARED_RESERVED = 1024  # what the runtime keeps of it per block
ISSUE_PER_CYCLE = 4  # an SM's schedulers: at most one instruction each a cycle
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
# Fitted (see the module docstring): a warp's effective cycles per issued instruction, the SM's other resident warps
# interleaved (Nsight Compute measured 3.1-3.5 at 6.6-7.5 resident warps of the 8 counted here; the fit also carries
# that shortfall and each program's prologue and tail), in programs of one or two warps and of four or more (whose
# warps wait for one another at the layout conversions inside a tile: fitted on the three schemes whose head_dim 256
# kernels take four warps alone), and a call's fixed microseconds.
CYCLES_PER_INSTRUCTION = 3.9
CYCLES_PER_INSTRUCTION_WIDE = 6.5
FIXED_US = 13.0
# The share of tiles that run the code a conditional branch inside the tile loop jumps over. In the catalogue's split
# kernels that code is the lazy rescale alone (LAZY_RESCALE: an exp2, and a multiply for each accumulator register),
# which runs on a tile that raises some query row's running max. On the benchmark's random scores, 4 query heads a KV
# head, 20% of a 64-tile split's tiles do (a long context's 2048 tokens, 32 a tile): the sum over tiles t of
# 1 - (1 - 1/t)^4, over 64. Fewer where a model's maxima settle early; more in shorter splits: about half of a
# 16-tile split's (8 x 8k), 0.32 of sign1_window's 32 tiles of 64 tokens.
SKIPPED_WEIGHT = 0.2
MEMORY_EFFICIENCY = 0.97  # decode's reads against a copy's, at 32 x 32k (int8_token and fp8)
Q_HEADS, KV_HEADS = 32, 8
SHAPES = ((8, 8192), (8, 32768), (32, 32768))


@dataclass(frozen=True)
class SplitKernel:
    """What the estimate reads off a compiled split kernel and its module."""

    loop_instructions: int  # one warp's SASS instructions a tile
    block_n: int  # tokens a tile
    num_warps: int
    registers: int  # a thread's
    shared: int  # bytes a program
    programs_per_sm: int  # what the plan's grid gives an SM (_decode_config's splits a multiprocessor)
    skipped_instructions: int = 0  # of loop_instructions, the lazy rescale's (resources.skipped_instructions)

    @property
    def tile_instructions(self) -> float:
        """One warp's instructions issued a tile: the loop's, those it jumps over at SKIPPED_WEIGHT."""
        return self.loop_instructions - (1 - SKIPPED_WEIGHT) * self.skipped_instructions

    @property
    def warps_per_sm(self) -> int:
        """Resident warps an SM: the grid's programs, at most what registers (allocated 8 a thread at a time),
        shared memory and the SM's limits allow."""
        per_warp = -(-self.registers // 8) * 8 * 32
        by_registers = REGISTERS_PER_SM // per_warp // self.num_warps
        by_shared = SHARED_PER_SM // (self.shared + SHARED_RESERVED)
        programs = min(self.programs_per_sm, by_registers, by_shared, MAX_BLOCKS_PER_SM,
                       MAX_WARPS_PER_SM // self.num_warps)
        return max(programs, 1) * self.num_warps


def issue_us(kernel: SplitKernel, tokens: int, cycles: float | None = None) -> float:
    """The split programs' instruction issue for `tokens` cached (sequence, KV head) tokens, in microseconds, at
    `cycles` an instruction a warp (default: the fitted constant for the kernel's warps), at most ISSUE_PER_CYCLE
    instructions an SM a cycle."""
    if cycles is None:
        cycles = CYCLES_PER_INSTRUCTION if kernel.num_warps < 4 else CYCLES_PER_INSTRUCTION_WIDE
    instructions = tokens / kernel.block_n * kernel.num_warps * kernel.tile_instructions
    per_cycle = min(kernel.warps_per_sm / cycles, ISSUE_PER_CYCLE)
    return instructions / (per_cycle * SMS * CLOCK_HZ) * 1e6


def floor_us(floor_bytes: int) -> float:
    """The floor: `floor_bytes` at the copy bandwidth, in microseconds."""
    return floor_bytes / (COPY_GBPS * 1e3)


def decode_us(kernel: SplitKernel, tokens: int, floor_bytes: int, cycles: float | None = None,
              fixed: float | None = None) -> tuple[float, float, str]:
    """(estimated us, floor us, "instructions" or "memory": which bounds it) for a decode over `tokens` cached
    (sequence, KV head) tokens that reads `floor_bytes`; `cycles` and `fixed` stand in for the fitted constants."""
    issue, floor = issue_us(kernel, tokens, cycles), floor_us(floor_bytes)
    memory = floor / MEMORY_EFFICIENCY
    bound = "instructions" if issue > memory else "memory"
    return (FIXED_US if fixed is None else fixed) + max(issue, memory), floor, bound


def shape_us(kernel: SplitKernel, batch: int, context: int, bytes_per_token: int, window: int, head_dim: int,
             cycles: float | None = None, fixed: float | None = None) -> tuple[float, float, str]:
    """decode_us for `batch` sequences of `context` tokens on KV_HEADS heads. The split kernel reads the quantized
    tokens; a window scheme's ring (fp16) counts in the floor, as kvqc bench's."""
    from kvqc.tools.bench import decode_bytes

    quantized = batch * KV_HEADS * (context - min(window, context))
    floor_bytes = decode_bytes(batch, context, KV_HEADS, bytes_per_token, window, head_dim)
    return decode_us(kernel, quantized, floor_bytes, cycles, fixed)


def estimates(kernel: SplitKernel, bytes_per_token: int, window: int, head_dim: int) -> dict[str, dict]:
    """SHAPES' estimates (shape_us), keyed "<batch>x<context>": us, floor_us, fraction (of the floor reached) and
    bound."""
    out = {}
    for batch, context in SHAPES:
        us, floor, bound = shape_us(kernel, batch, context, bytes_per_token, window, head_dim)
        out[f"{batch}x{context}"] = {"us": round(us, 1), "floor_us": round(floor, 1),
                                     "fraction": round(floor / us, 3), "bound": bound}
    return out
