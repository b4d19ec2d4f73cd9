"""kvqc/compiler/wrap.py: long lines broken as a person would, the program unchanged."""

import ast
import textwrap

import pytest

from kvqc.compiler import codegen
from kvqc.compiler.spec import load_scheme
from kvqc.compiler.wrap import same_tree, wrap
from kvqc.modules import SCHEMES

CASES = {
    "call": "x = tl.load(key_ptr + token[:, None].to(tl.int64) * stride_key_token + head * stride_key_head + key_chunk"
            "[None, :], mask=valid[:, None], other=0.0).to(tl.float32)\n",
    "sum": "row = block.to(tl.int64) * (BLOCK_SIZE * NUM_KV_HEADS) + position % BLOCK_SIZE * TOKEN_STRIDE + kv_head "
           "* HEAD_STRIDE + other_head * OTHER_STRIDE\n",
    "condition": "if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1 "
                 "or num_q_heads % cache.num_kv_heads:\n    pass\n",
    "message": "def f(x):\n    raise ValueError(f\"cache: expected tensors on a GPU "
               "(or on the CPU under TRITON_INTERPRET=1), got {x.device} and {x.dtype} which no kernel here takes\")\n",
    "comment": "x = 1  # " + "a trailing remark that makes this line far longer than the limit allows " * 2 + "\n",
    "table": "T = {128: (" + ", ".join(str(i % 3 - 1) for i in range(128)) + ")}\n",
    "product": "if x:\n    if y:\n        value_outlier_qjl_row = value_outlier_norm * value_outlier_residual_norm * "
               "1.2533141373155001 / VALUE_OUTLIER_DIM\n",
    "chain": "tensors['key_channels'] = _fixed_order(head_dim, KEY_OUTLIER_CHANNELS).expand(num_kv_heads, -1)"
             ".contiguous().to(device, non_blocking=True)\n",
    "nested": "f(a, g(b, c, dddddddddddddddddddddddddddddddddddddddddddddd, "
              "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee, fffffffffffffffffffffffffffffffffffff), h)\n",
}


@pytest.mark.parametrize("name", CASES)
def test_wrapped_lines_fit_and_mean_the_same(name):
    source = CASES[name]
    wrapped = wrap(source)
    assert same_tree(source, wrapped)
    assert all(len(line) <= 120 for line in wrapped.splitlines()), wrapped
    assert wrapped != source


def test_a_call_whose_arguments_fit_one_line_keeps_them_together():
    source = ("        key_bytes = tl.load(key_codes_ptr + row[:, None] * (HEAD_DIM // 2) + key_chunk[None, :], "
              "mask=valid[:, None], other=0)\n")
    wrapped = wrap(source)
    assert wrapped.splitlines() == [
        "        key_bytes = tl.load(",
        "            key_codes_ptr + row[:, None] * (HEAD_DIM // 2) + key_chunk[None, :], mask=valid[:, None], other=0",
        "        )",
    ]
    assert same_tree(textwrap.dedent(source), textwrap.dedent(wrapped))


def test_short_lines_and_strings_spanning_lines_are_left_alone():
    source = 'x = 1\ny = """' + "a" * 150 + '\n"""\n'
    assert wrap(source) == source


def test_a_split_string_keeps_its_fields():
    source = "def f(x):\n    raise ValueError(f\"" + "word " * 30 + "{x!r} and {x.shape} " + "word " * 10 + "\")\n"
    wrapped = wrap(source)
    assert same_tree(source, wrapped)
    strings = [n for n in ast.walk(ast.parse(wrapped)) if isinstance(n, ast.JoinedStr)]
    assert len(strings) == 1  # implicit concatenation: still one f-string


def test_an_f_string_wraps_the_same_on_every_python():
    """Python 3.12 tokenizes f-strings into parts (PEP 701): the wrapper still breaks between the literal's words,
    never inside a field's braces, so that `kvqc build --check` agrees across Python versions."""
    source = ("        raise ValueError(\n"
              "            f\"max_seqs: {SCHEME['name']} keeps each sequence's last {WINDOW} tokens in a ring; pass "
              "max_seqs, the most sequences alive at once\"\n"
              "        )\n")
    assert wrap(source).splitlines() == [
        "        raise ValueError(",
        "            f\"max_seqs: {SCHEME['name']} keeps each sequence's last {WINDOW} \"",
        "            \"tokens in a ring; pass max_seqs, the most sequences alive at once\"",
        "        )",
    ]


@pytest.mark.parametrize("step", ["fold", "wrap"])
def test_render_refuses_a_text_pass_that_changes_the_program(monkeypatch, step):
    # Folding and wrapping may change the source's text only as their contracts say; render checks the syntax tree
    # after each and refuses a module where either changed the program.
    original = getattr(codegen, step)
    monkeypatch.setattr(codegen, step, lambda source: original(source).replace("tl.arange(", "tl.arange_(", 1))
    with pytest.raises(AssertionError, match="folding" if step == "fold" else "wrapping"):
        codegen.render(load_scheme(SCHEMES / "int8_token.yaml"))
