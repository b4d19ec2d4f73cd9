"""LMDeploy 0.18's PyTorch engine end to end, with its own KV caches and with kvqc's.

Each run is one (cache, mode, batch, prompt length) in its own process, so CUDA context, peak memory and the KV
pool LMDeploy sizes from free memory belong to that run alone. Caches: LMDeploy fp16 (quant_policy 0), LMDeploy
TurboQuant (quant_policy 42), and kvqc's turbo_k4v2 (42), int4_token (4), int8_token (8) put in with
`kvqc.engines.lmdeploy.install` before `pipeline(...)`. Modes: CUDA graphs (LMDeploy's default) and eager_mode=True.
The model is a random-weight Hugging Face Llama built once into --model-cache (throughput does not depend on the
weights); prompts are random token ids of exact length, passed to the engine as input_ids.

Per run: prefill_s (submit until every request has its first token), decode_tok_s (all requests' tokens from
that moment until the first request finishes, over decode_steps >= 100 steps), e2e_tok_s (output tokens over
submit-to-last-token), kv_tokens (LMDeploy's usable num_gpu_blocks x block_size once the engine has sized its
pool), kv_bytes_per_token (the pool's bytes over its slots), peak_gib (torch.cuda.max_memory_allocated in the
engine process, where LMDeploy's tp=1 executor runs the model; the pool, cache_max_entry_count of free memory,
dominates it, so peak_non_kv_gib subtracts it), used_gib (cudaMemGetInfo at the end: CUDA context and graph pools
included), clocks (nvidia-smi's SM clock, power and throttle reasons over the steady decode window, sampled
every 50 ms), and for a failed run its exception as one line (the matrix goes on).

--agreement: greedy tokens and prompt logits of every cache against LMDeploy fp16, and of turbo_k4v2 against
quant_policy 42 (same bytes). LMDeploy's PyTorch engine returns logits only for the prompt (output_logits='all'
with max_new_tokens=0), computed by prefill attention over K/V flattened from the quantized cache; the decode
kernels show in the tokens. A random-weight model's logits are nearly flat, so a few percent of logit error
already flips greedy tokens: read token agreement next to the logit error.

--host-times: the host time of every fill_kv_cache and flash_attn_with_kvcache call (kvqc's adapter, or LMDeploy's
own kernels for its caches), perf_counter around the Python call, summed over the timed batch's steady decode window:
per step and per call, in the run's "host_times" field. Eager steps are host-bound; this says how much of a step the
KV-cache calls take.

--profile N: after the timed batch, a batch of the same shape runs again and, once every request has its first
token, torch.profiler (CUDA activities) records a few more than N decode steps. CUPTI traces the kernels a CUDA-graph
replay launches, each carrying its cudaGraphLaunch's correlation id, so graph mode's steps are told apart by their
replays. Per step: GPU time by kernel category (kvqc's attention and fill kernels, LMDeploy's attention kernels,
GEMMs, the rest), the step's period (one replay's first kernel to the next's: 32 tokens at batch 32), its span
(first kernel start to last kernel end) and the GPU's idle share of the period; in the run's "profile" field, with
the trace's path (Chrome trace, gzip) and the most expensive kernels. Eager steps launch no graph: not split.

On the GPU machine (LMDeploy from ../shared/engines/lmdeploy-kit.sh, carried as .lmdeploy-kit):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .lmdeploy-kit/*.whl
    export PYTHONPATH=/tmp/site:$PWD TVM_FFI_DISABLE_TORCH_C_DLPACK=1
    python3 benchmarks/lmdeploy_engine.py --batch 32 --prompts 4096 16384 --out lmdeploy-engine.json
    python3 benchmarks/lmdeploy_engine.py --agreement --out lmdeploy-agreement.json
A run is its engine's start (30-60 s: import, weights, CUDA-graph capture), a warm-up batch of the timed shape
and the timed batch. Where one command may only run minutes, build the matrix in pieces into one file:
    python3 benchmarks/lmdeploy_engine.py --prompts 4096 --modes graph --merge --out lmdeploy-engine.json
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from itertools import pairwise
from pathlib import Path

# cache name -> (LMDeploy quant_policy, kvqc scheme or None for LMDeploy's own kernels)
CACHES = {
    "lmdeploy-fp16": (0, None),
    "lmdeploy-q42": (42, None),
    "kvqc-turbo_k4v2": (42, "turbo_k4v2"),
    "kvqc-int4_token": (4, "int4_token"),
    "kvqc-int8_token": (8, "int8_token"),
}
MODES = {"graph": False, "eager": True}  # mode -> PytorchEngineConfig.eager_mode
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2; prompts draw from the words after them
LMDEPLOY_PREFILL_TOKENS = 8192  # LMDeploy's default max_prefill_token_num
MIN_DECODE_STEPS = 100
LOGIT_POSITIONS = 256  # last prompt positions compared against fp16 (the longest contexts)
WARMUP_TOKENS = 16  # a warm-up batch of the timed shape compiles every Triton specialization first
SEED = 0
# kernel name (prefix) -> category in --profile's per-step table; first match wins. kvqc's names are the @triton.jit
# functions of the generated modules and of kvqc/engines/lmdeploy.py; LMDeploy's those of its kernels/cuda attention,
# fill and flatten files (and FA3's, where installed).
KERNEL_CATEGORIES = {
    "kvqc attention": r"_(decode_kernel|decode_reduce_kernel|rotate_query_kernel|window_decode_kernel|"
                      r"query_parts_kernel|merge_parts_kernel|map_rows_kernel)",
    "kvqc fill": r"_(fill_kernel|slot_mapping_kernel|hadamard_kernel|window_store_kernel|key_group_kernel|"
                 r"flatten_kernel|take_kernel)",
    "lmdeploy attention": r"_(fill_kv_cache|fill_page_quant|flatten_kv_cache|fwd_grouped_split|reduce_split|"
                          r"fused_reduce_hadamard|flash_prefill_fwd)|.*flash_fwd|.*flash::",
    "gemm": r"(?i).*(gemm|gemv|cutlass|cublas|nvjet|xmma)",
}
HOST_TIMED = ("fill_kv_cache", "flash_attn_with_kvcache")  # --host-times: the calls timed, kvqc's or LMDeploy's
HOST_COLUMNS = (*HOST_TIMED, "slot_mapping")  # and the adapter's slot mapping, inside kvqc's fill_kv_cache
PROFILE_WARM_STEPS = 1  # replays skipped at the window's start: the profiler's start can stall the first one


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive count, got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--batch", nargs="+", type=int, default=None, help="batch sizes (default 32; 8 with --agreement)")
    p.add_argument("--prompts", nargs="+", type=int, default=None,
                   help="prompt lengths in tokens (default 4096 16384; 1024 with --agreement)")
    p.add_argument("--new-tokens", type=int, default=None, help="output tokens (default 128; 64 with --agreement)")
    p.add_argument("--agreement", action="store_true", help="greedy-token agreement and logit error mode")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--model-cache", default=os.path.expanduser("~/.cache/kvqc/lmdeploy-models"))
    p.add_argument("--cache-frac", type=float, default=0.8, help="PytorchEngineConfig.cache_max_entry_count")
    p.add_argument("--run-timeout", type=int, default=900, help="seconds before a run is killed and recorded failed")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also record N steady decode steps per run with torch.profiler: GPU time per step by kernel "
                        "category (graph mode)")
    p.add_argument("--host-times", action="store_true",
                   help="time the host side of every fill_kv_cache / flash_attn_with_kvcache call in the decode "
                        "window")
    p.add_argument("--repeats", type=positive, default=1, metavar="N",
                   help="run every cache N times, the caches interleaved (eager mode's host-bound steps vary from run "
                        "to run): each run is a row, numbered by its `repeat`")
    p.add_argument("--merge", action="store_true",
                   help="keep --out's earlier runs (same model) and replace those run again: a matrix in pieces")
    p.add_argument("--child", help=argparse.SUPPRESS)  # JSON spec of one run, for the worker process
    args = p.parse_args(argv)
    if args.agreement and args.repeats > 1:
        p.error("--repeats: the agreement compares one run of each cache (leave --repeats at 1)")
    args.batch = args.batch or ([8] if args.agreement else [32])
    args.prompts = args.prompts or ([1024] if args.agreement else [4096, 16384])
    args.new_tokens = args.new_tokens or (64 if args.agreement else 128)
    return args


# -- the model (built in a worker process so the parent never holds GPU memory)

def model_dir(args) -> Path:
    name = f"llama-L{args.layers}-h{args.hidden}-q{args.heads}-kv{args.kv_heads}-i{args.intermediate}-v{args.vocab}"
    return Path(args.model_cache) / name


def build_model(spec: dict) -> dict:
    """Random-weight fp16 LlamaForCausalLM plus a word-level tokenizer (word i <-> token id i) in spec['model']."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(spec["model"])
    tmp = out.with_name(out.name + ".partial")
    words = SPECIAL_TOKENS + [f"w{i}" for i in range(len(SPECIAL_TOKENS), spec["vocab"])]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    config = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                         num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["kv_heads"], head_dim=spec["hidden"] // spec["heads"],
                         max_position_embeddings=131072, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(SEED)
    with torch.device("cuda"):  # random init of ~2B parameters is minutes on the CPU, seconds here
        model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    tmp.rename(out)  # a folder that exists is complete
    return {"model": str(out)}


# -- one run (worker process)

def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(f"{seed}-{batch}-{length}")  # same prompts for every cache and mode
    return [[rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(length)] for _ in range(batch)]


async def generate(engine, prompts: list[list[int]], gen_config, counts: list[int] | None = None
                   ) -> tuple[float, list[list[tuple[float, int]]], list]:
    """Submit every prompt at once; per request, (arrival time, tokens in that chunk) of each streamed output.
    counts, where given, holds each request's tokens so far while the batch runs (--profile watches it)."""
    async def one(i, ids):
        request = await engine.preprocess(messages=None, session_id=engine.session_mgr.get(), input_ids=ids,
                                          gen_config=gen_config, do_preprocess=False)
        stamps, tokens = [], []
        async for out in engine.generate(request, stream_response=True):
            if out.finish_reason == "error":
                raise RuntimeError(f"request failed in the engine: {out.response!r}")
            if out.token_ids:
                stamps.append((time.perf_counter(), len(out.token_ids)))
                tokens += out.token_ids
                if counts is not None:
                    counts[i] += len(out.token_ids)
        return stamps, tokens

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return start, [r[0] for r in results], [r[1] for r in results]


class ClockSampler:
    """nvidia-smi's SM clock, power draw and active throttle reasons every 50 ms while the timed batch runs, each
    sample stamped on arrival with time.perf_counter (the clock of the token stamps), so that the steady decode
    window's clocks can be told apart from prefill's: a kernel bound by instruction throughput slows with the SM
    clock, one bound by memory bandwidth hardly does."""

    FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"

    def __enter__(self) -> "ClockSampler":
        import threading

        self.samples: list[tuple[float, list[str]]] = []
        index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--id={index}", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                 "-lms", "50"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return self

        def read():
            for line in self.proc.stdout:
                self.samples.append((time.perf_counter(), [f.strip() for f in line.split(",")]))

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.reader.join(timeout=5)

    def summary(self, begin: float, end: float) -> dict | None:
        """Median and minimum SM MHz, median W and the largest temperature over [begin, end], and the throttle
        reasons (bit masks, nvidia-smi's clocks_throttle_reasons) seen there."""
        rows = []
        for t, fields in self.samples:
            try:
                if begin <= t <= end:
                    rows.append((float(fields[0]), float(fields[1]), float(fields[2]), fields[3]))
            except (ValueError, IndexError):
                continue
        if not rows:
            return None
        sm, watts, temp, reasons = zip(*rows)
        return {"samples": len(rows), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
                "power_w_median": statistics.median(watts), "temp_c_max": max(temp),
                "throttle_reasons": sorted(set(reasons))}


def timings(start: float, stamps: list[list[tuple[float, int]]]) -> dict:
    """Prefill, steady-state decode and end-to-end rates from each request's token arrival times."""
    all_first = max(s[0][0] for s in stamps)  # every request has its first token: the batch is decoding
    first_done = min(s[-1][0] for s in stamps)  # after this the batch shrinks
    last = max(s[-1][0] for s in stamps)
    in_window = [sum(n for t, n in s if all_first < t <= first_done) for s in stamps]
    latest = max(range(len(stamps)), key=lambda i: stamps[i][0][0])
    total = sum(n for s in stamps for _, n in s)
    window = first_done - all_first
    return {
        "prefill_s": all_first - start,
        "decode_tok_s": sum(in_window) / window if window > 0 else None,
        "decode_steps": in_window[latest],  # one token per step for the request that started last
        "e2e_tok_s": total / (last - start),
        "e2e_s": last - start,
        "output_tokens": total,
    }


def kernel_category(name: str) -> str:
    return next((c for c, pattern in KERNEL_CATEGORIES.items() if re.match(pattern, name)), "other")


def step_profile(events: list[dict], steps: int) -> dict:
    """Per decode step, from a Chrome trace's events: GPU ms by kernel category, period, span and idle share.

    Every kernel of a CUDA-graph replay carries its cudaGraphLaunch's correlation id. One replay of the decode
    graph runs per step; a step runs from its replay's first kernel to the next replay's first kernel, so it holds
    the eager work between replays (sampling, copies) and the GPU's idle time while the host prepares the next."""
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in e.get("name", "")}
    gpu = sorted((float(e["ts"]), float(e["dur"]), e["name"], e.get("args", {}).get("correlation"))
                 for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    first, size = {}, Counter()  # graph launch -> its first kernel's start, its kernel count
    for ts, _, _, corr in gpu:
        if corr in launches:
            first.setdefault(corr, ts)
            size[corr] += 1
    result = {"graph_launches": len(launches), "graph_kernels_traced": bool(first)}
    if not first:
        return result
    decode = max(size.values())  # the decode graph's replays; a smaller graph in the window would not mark a step
    starts = sorted(ts for corr, ts in first.items() if size[corr] > decode / 2)[PROFILE_WARM_STEPS:]
    bounds = list(pairwise(starts))[:steps]
    if not bounds:
        return dict(result, steps=0)
    by_category, by_name = Counter(), Counter()
    busy = span = kernels = 0.0
    for lo, hi in bounds:
        end = last = lo
        for ts, dur, name, _ in gpu:
            if lo <= ts < hi:
                by_category[kernel_category(name)] += dur
                by_name[name] += dur
                kernels += 1
                busy += max(0.0, min(ts + dur, hi) - max(ts, end))  # union of busy time (streams may overlap)
                end, last = max(end, min(ts + dur, hi)), max(last, ts + dur)
        span += last - lo
    n, ms = len(bounds), lambda us: us / len(bounds) / 1000
    period = sum(hi - lo for lo, hi in bounds)
    return dict(result, steps=n, graph_kernels=decode, kernels_per_step=kernels / n, period_ms=ms(period),
                span_ms=ms(span), busy_ms=ms(busy), idle_share=1 - busy / period,
                ms={c: ms(by_category[c]) for c in [*KERNEL_CATEGORIES, "other"]},
                top_kernels=[[name, ms(t)] for name, t in by_name.most_common(12)])


def profile_decode(pipe, prompts: list[list[int]], gen_config, steps: int, trace: str) -> dict:
    """Run the batch again and profile `steps` (plus a few) decode steps once every request has its first token."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]):  # CUPTI's first start is slow: pay it before the batch
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    counts = [0] * len(prompts)  # the engine's thread adds each request's tokens as they stream back
    future = asyncio.run_coroutine_threadsafe(generate(pipe.async_engine, prompts, gen_config, counts),
                                              pipe.internal_thread.loop)

    def wait_for(tokens):  # until every request has that many tokens (or the batch ended); rare wake-ups leave
        while min(counts) < tokens and not future.done():  # the engine's thread the GIL
            time.sleep(0.005)

    wait_for(1)
    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.start()
    wait_for(min(counts) + steps + PROFILE_WARM_STEPS + 3)  # + 3: replays cut at the window's ends, streaming lag
    prof.stop()
    future.result()  # the engine's error, if any
    prof.export_chrome_trace(trace)  # .gz: gzipped
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    return dict(step_profile(events, steps), trace=trace)


def prompt_logits(pipe, prompts: list[list[int]]):
    """The last LOGIT_POSITIONS prompt logits per prompt [batch, positions, vocab] (fp16, CPU)."""
    import torch
    future = asyncio.run_coroutine_threadsafe(pipe.async_engine.async_get_logits(input_ids=prompts),
                                              pipe.internal_thread.loop)
    return torch.stack([torch.as_tensor(x).squeeze()[-LOGIT_POSITIONS:].float().cpu().half()
                        for x in future.result()])


def kv_pool_bytes(pipe) -> int | None:
    """Bytes of the KV pool LMDeploy allocated (every layer's cache tensors, shared storage counted once)."""
    try:  # tp=1 runs the 'uni' executor: the model agent and its cache engine live in this process
        layers = pipe.async_engine.engine.executor.model_agent.cache_engine.gpu_cache
    except AttributeError:
        return None
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in layers for t in layer}
    return sum(storages.values())


def environment() -> dict:
    import importlib.metadata as md

    import torch
    versions = {}
    for package in ("torch", "triton", "lmdeploy", "transformers"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    return {"device": torch.cuda.get_device_name(), "versions": versions}


class HostTimes:
    """Host time of named calls: `wrap(owner, name)` replaces owner.name by a function that stamps each call's start
    and end (time.perf_counter, the clock of the token stamps) and calls the original."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float]] = []

    def wrap(self, owner, name: str) -> None:
        inner, calls = getattr(owner, name), self.calls

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                calls.append((name, start, time.perf_counter()))

        setattr(owner, name, timed)

    def summary(self, begin: float, end: float, layers: int) -> dict:
        """Per name, the calls that started in [begin, end]: how many, host us per call, calls and host ms per step,
        a step being `layers` calls of the first name timed (the window's calls belong to more forwards than the
        tokens it counts)."""
        totals: dict[str, list] = {}
        for name, start, stop in self.calls:
            if begin <= start <= end:
                entry = totals.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += stop - start
        if not totals:
            return {}
        steps = totals[self.calls[0][0]][0] / layers
        return {name: {"calls": calls, "us_per_call": 1e6 * seconds / calls, "calls_per_step": calls / steps,
                       "ms_per_step": 1e3 * seconds / steps} for name, (calls, seconds) in totals.items()}


def run_one(spec: dict) -> dict:
    """Build LMDeploy's pipeline for one cache and mode, warm it up, then time one batch."""
    import torch
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

    policy, scheme = CACHES[spec["cache"]]
    host_times = HostTimes() if spec.get("host_times") else None
    if scheme:
        from kvqc.engines import lmdeploy as kvqc_lmdeploy
        if host_times:  # before install, which binds the adapter's methods
            for name in HOST_TIMED:
                host_times.wrap(kvqc_lmdeploy.Kernels, name)
            host_times.wrap(kvqc_lmdeploy, "slot_mapping")  # once a step: the adapter maps for a step's first layer
        # kvqc's int caches share LMDeploy's shapes but not its bytes; only kvqc's kernels read them here
        kvqc_lmdeploy.install(scheme, quant_policy=policy,
                              allow_incompatible=policy not in kvqc_lmdeploy.BYTE_COMPATIBLE)
    elif host_times:  # LMDeploy's attention layers look its kernels up in the package when they are built
        import lmdeploy.pytorch.kernels.cuda as kernels
        for name in HOST_TIMED:
            host_times.wrap(kernels, name)
    length, batch, new = spec["prompt"], spec["batch"], spec["new_tokens"]
    block = 64  # LMDeploy's default block_size; session_len rounded up to whole blocks
    config = PytorchEngineConfig(
        dtype="float16", quant_policy=policy, eager_mode=MODES[spec["mode"]], max_batch_size=batch,
        session_len=-(-(length + new + 1) // block) * block, cache_max_entry_count=spec["cache_frac"],
        max_prefill_token_num=max(LMDEPLOY_PREFILL_TOKENS, length),  # a prompt is one prefill, never chunked
        block_size=block)
    result = {"env": environment()}
    pipe = pipeline(spec["model"], backend_config=config, log_level="WARNING")
    cache = pipe.async_engine.engine.cache_config  # sized from free memory while the engine was built
    result["kv_blocks"], result["block_size"] = cache.num_gpu_blocks, cache.block_size
    result["kv_tokens"] = (cache.num_gpu_blocks - cache.num_reserved_gpu_blocks) * cache.block_size
    result["kv_fits_batch"] = result["kv_tokens"] >= batch * (length + new)
    pool = kv_pool_bytes(pipe)
    if pool:
        result["kv_pool_gib"] = pool / 2**30
        result["kv_bytes_per_token"] = pool / (cache.num_gpu_blocks * cache.block_size)
    loop = pipe.internal_thread.loop

    def run(prompts, tokens):
        gen = GenerationConfig(max_new_tokens=tokens, ignore_eos=True, do_sample=False)
        return asyncio.run_coroutine_threadsafe(generate(pipe.async_engine, prompts, gen), loop).result()

    run(make_prompts(batch, length, spec["vocab"], SEED + 1), WARMUP_TOKENS)
    prompts = make_prompts(batch, length, spec["vocab"], SEED)
    with ClockSampler() as clocks:
        start, stamps, tokens = run(prompts, new)
    result.update(timings(start, stamps))
    window = max(s[0][0] for s in stamps), min(s[-1][0] for s in stamps)  # the steady decode window
    result["clocks"] = clocks.summary(*window)
    if host_times:
        result["host_times"] = host_times.summary(*window, layers=spec["layers"])
    if spec.get("profile"):
        gen = GenerationConfig(max_new_tokens=new, ignore_eos=True, do_sample=False)
        try:  # a failed profile leaves the run's timings standing
            result["profile"] = profile_decode(pipe, make_prompts(batch, length, spec["vocab"], SEED + 2), gen,
                                               spec["profile"], spec["trace"])
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["profile"] = {"error": error_line(e), "trace": spec["trace"]}
    if spec.get("logits"):
        torch.save(prompt_logits(pipe, prompts), spec["logits"])
        result["tokens"] = tokens
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["peak_non_kv_gib"] = result["peak_gib"] - result.get("kv_pool_gib", 0.0)
    free, total = torch.cuda.mem_get_info()
    result["used_gib"] = (total - free) / 2**30
    return result


def error_line(e: BaseException) -> str:
    """'Type: first line of the message', plus the CUDA error name where the message carries one."""
    message = str(e).strip()
    line = f"{type(e).__name__}: {message.splitlines()[0] if message else ''}"
    cuda = re.search(r"cudaError\w+", message)
    return f"{line} ({cuda.group(0)})" if cuda else line


def worker(spec: dict) -> None:
    """Run one spec and write its JSON; a failure is written too, with the exception's last line."""
    try:
        result = build_model(spec) if spec.get("build") else run_one(spec)
    except BaseException as e:  # noqa: BLE001 - everything, including SystemExit from inside LMDeploy, is a result
        traceback.print_exc()
        result = {"failed": True, "error": error_line(e)}
    Path(spec["result"]).write_text(json.dumps(result))
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # LMDeploy's engine threads can keep a normal exit waiting


# -- the matrix (parent process: no CUDA)

def spawn(spec: dict, work: Path, timeout: int) -> dict:
    """Run spec in a fresh Python process; its result, or a failure with the last line it printed."""
    spec = dict(spec, result=str(work / f"{spec['name']}.json"))
    log = work / f"{spec['name']}.log"
    began = time.perf_counter()
    with open(log, "w") as f:
        try:
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--out", "-", "--child", json.dumps(spec)],
                           stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"failed": True, "error": f"timed out after {timeout} s", "log": str(log)}
    result_path = Path(spec["result"])
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:  # killed before it could write (out of memory, a crash in native code)
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        result = {"failed": True, "error": lines[-1] if lines else "no output"}
    result.update(wall_s=time.perf_counter() - began, log=str(log))
    return result


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Position-by-position agreement: overall, and up to each request's first divergence."""
    same = total = prefix = 0
    for a, b in zip(ours, theirs):
        n = min(len(a), len(b))
        matches = [x == y for x, y in zip(a[:n], b[:n])]
        same, total = same + sum(matches), total + n
        prefix += matches.index(False) if False in matches else n
    return {"overall": same / total if total else None, "until_divergence": prefix / total if total else None}


def compare_logits(ours: str, theirs: str) -> dict:
    import torch
    a, b = torch.load(ours).float(), torch.load(theirs).float()
    return {"rel_rms": float((a - b).norm() / b.norm()), "max_abs": float((a - b).abs().max()),
            "top1": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


def agreement(runs: list[dict]) -> list[dict]:
    """Each cache's greedy tokens and prompt logits against LMDeploy fp16 and, for turbo_k4v2, quant_policy 42."""
    rows = []
    by_key = {(r["cache"], r["mode"], r["batch"], r["prompt"]): r for r in runs if "tokens" in r}  # this call's
    for (cache, mode, batch, prompt), run in by_key.items():
        for ref in ("lmdeploy-fp16", "lmdeploy-q42"):
            other = by_key.get((ref, mode, batch, prompt))
            if other is None or cache == ref or (ref == "lmdeploy-q42" and cache != "kvqc-turbo_k4v2"):
                continue
            row = {"cache": cache, "against": ref, "mode": mode, "batch": batch, "prompt": prompt,
                   "tokens": compare_tokens(run["tokens"], other["tokens"])}
            row["logits"] = compare_logits(run["logits_path"], other["logits_path"])
            rows.append(row)
    return rows


def clock_cell(c: dict | None) -> str:
    return "-" if not c else f"{fmt(c['sm_mhz_median'])} ({fmt(c['sm_mhz_min'])}), {fmt(c['power_w_median'])}"


def fmt(x, digits=0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def print_tables(runs: list[dict], rows: list[dict]) -> None:
    print("\n| cache | mode | batch | prompt | repeat | prefill s | decode tok/s (steps) | e2e tok/s | KV tokens "
          "| KV B/token | peak GiB (non-KV) | decode SM MHz (min), W |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        head = f"| {r['cache']} | {r['mode']} | {r['batch']} | {r['prompt']} | {r.get('repeat', 0)} |"
        if r.get("failed"):
            print(f"{head} failed: `{r['error'][:160]}` | | | | | | |")
            continue
        fits = "" if r["kv_fits_batch"] else " (batch does not fit)"
        print(f"{head} {fmt(r['prefill_s'], 2)} | {fmt(r['decode_tok_s'])} ({r['decode_steps']}) | "
              f"{fmt(r['e2e_tok_s'])} | {fmt(r['kv_tokens'])}{fits} | {fmt(r.get('kv_bytes_per_token'))} | "
              f"{fmt(r['peak_gib'], 1)} ({fmt(r['peak_non_kv_gib'], 1)}) | {clock_cell(r.get('clocks'))} |")
    profiled = [r for r in runs if r.get("profile", {}).get("steps")]
    if profiled:
        cats = [*KERNEL_CATEGORIES, "other"]
        print("\n| cache | mode | batch | prompt | repeat | step ms (timed) | span ms | " + " | ".join(cats)
              + " | GPU idle |")
        print("| --- " * (len(cats) + 8) + "|")
        for r in profiled:
            p = r["profile"]
            timed = r["batch"] / r["decode_tok_s"] * 1000 if r.get("decode_tok_s") else None  # the timed batch's step
            print(f"| {r['cache']} | {r['mode']} | {r['batch']} | {r['prompt']} | {r.get('repeat', 0)} | "
                  f"{fmt(p['period_ms'], 2)} "
                  f"({fmt(timed, 2)}) | {fmt(p['span_ms'], 2)} | " + " | ".join(fmt(p['ms'][c], 2) for c in cats)
                  + f" | {fmt(100 * p['idle_share'], 1)}% |")
    timed = [r for r in runs if r.get("host_times")]
    if timed:
        print("\n| cache | mode | batch | prompt | repeat | decode step ms | "
              + " | ".join(f"{name} ms/step (us/call, calls/step)" for name in HOST_COLUMNS) + " |")
        print("| --- " * (6 + len(HOST_COLUMNS)) + "|")
        for r in timed:
            cells = [f"{fmt(h['ms_per_step'], 2)} ({fmt(h['us_per_call'])}, {fmt(h['calls_per_step'], 1)})" if h
                     else "-" for h in (r["host_times"].get(name) for name in HOST_COLUMNS)]
            print(f"| {r['cache']} | {r['mode']} | {r['batch']} | {r['prompt']} | {r.get('repeat', 0)} | "
                  f"{fmt(r['batch'] / r['decode_tok_s'] * 1000, 2)} | " + " | ".join(cells) + " |")
    for r in runs:
        if "profile" in r and not r["profile"].get("steps"):
            print(f"profile of {r['cache']} {r['mode']}: no steps split ({r['profile']})")
    if rows:
        print("\n| cache | against | mode | tokens same | same until divergence | logits rel RMS | max abs | top-1 |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for a in rows:
            lg = a.get("logits", {})
            print(f"| {a['cache']} | {a['against']} | {a['mode']} | {fmt(a['tokens']['overall'], 3)} | "
                  f"{fmt(a['tokens']['until_divergence'], 3)} | {fmt(lg.get('rel_rms'), 4)} | "
                  f"{fmt(lg.get('max_abs'), 3)} | {fmt(lg.get('top1'), 3)} |")


def merge(old: dict, new: dict) -> dict:
    """new's runs replace old's of the same (cache, mode, batch, prompt, repeat); old's others stay, in order."""
    if old.get("model") != new["model"]:
        sys.exit(f"--merge: {old.get('model')} in the existing file is another model than {new['model']}")
    key = lambda r: (r["cache"], r["mode"], r["batch"], r["prompt"], r.get("repeat", 0))
    fresh = {key(r) for r in new["runs"]}
    merged = dict(old, **{k: v for k, v in new.items() if k not in ("commands", "runs") and v})
    merged["commands"] = old.get("commands", []) + new["commands"]
    runs = [r for r in old["runs"] if key(r) not in fresh] + new["runs"]
    order = lambda r: (r["batch"], r["prompt"], list(MODES).index(r["mode"]), r.get("repeat", 0),
                       list(CACHES).index(r["cache"]))
    merged["runs"] = sorted(runs, key=order)
    return merged


def main(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvqc-lmdeploy-"))
    model = model_dir(args)
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")}
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        print(f"building the random-weight model in {model}", flush=True)
        built = spawn(dict(shape, name="build-model", build=True, model=str(model)), work, args.run_timeout)
        if built.get("failed"):
            sys.exit(f"building the model failed: {built['error']} (log: {built['log']})")
    runs, env = [], {}
    for batch in args.batch:
        for prompt in args.prompts:
            for mode in args.modes:
                for repeat, cache in ((r, c) for r in range(args.repeats) for c in args.caches):
                    name = f"{cache}-{mode}-b{batch}-p{prompt}-r{repeat}"
                    spec = dict(shape, name=name, cache=cache, mode=mode, batch=batch, prompt=prompt,
                                new_tokens=args.new_tokens, model=str(model), cache_frac=args.cache_frac)
                    if args.agreement:
                        spec["logits"] = str(work / f"{name}.logits.pt")
                    if args.profile:
                        spec.update(profile=args.profile, trace=str(work / f"{name}.trace.json.gz"))
                    if args.host_times:
                        spec["host_times"] = True
                    print(f"run {name}", flush=True)
                    result = spawn(spec, work, args.run_timeout)
                    env = env or result.pop("env", {})
                    result.pop("env", None)
                    result.update(cache=cache, mode=mode, batch=batch, prompt=prompt, repeat=repeat,
                                  new_tokens=args.new_tokens, logits_path=spec.get("logits"))
                    if result.get("failed"):
                        print(f"  failed: {result['error']} (log: {result['log']})", flush=True)
                    elif result["decode_steps"] < MIN_DECODE_STEPS and not args.agreement:
                        print(f"  only {result['decode_steps']} steps with the whole batch decoding "
                              f"(raise --new-tokens)", flush=True)
                    runs.append(result)
    command = shlex.join([Path(sys.executable).name] + sys.argv)
    report = dict(env, commands=[command], model=shape, runs=runs,
                  peak_gib_source="torch.cuda.max_memory_allocated in the engine process")
    if args.merge and Path(args.out).exists():
        report = merge(json.loads(Path(args.out).read_text()), report)
    rows = agreement(report["runs"]) if args.agreement else []
    report["agreement"] = rows or report.get("agreement", [])
    print_tables(report["runs"], report["agreement"])
    for r in report["runs"]:  # tokens and logits only serve the comparison above
        r.pop("tokens", None)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    arguments = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvqc from this checkout
    if arguments.child:
        worker(json.loads(arguments.child))
    else:
        main(arguments)
