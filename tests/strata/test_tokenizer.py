"""strata.tokenizer against llama.cpp: golden ids from scripts/golden_tokenizer.py, and where
llama-cpp-python is installed, the same ids for any text."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.gguf import open_gguf
from strata.gguf.reader import GGUFError
from strata.hub import pull_smollm2
from strata.tokenizer import (EOG_TEXTS, StreamDecoder, Tokenizer, TokenizerError, _byte_decoder,
                              _byte_level_bytes)

GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "tokenizer_golden.json").read_text())
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<filename>", "<|im", "end|>"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(pull_smollm2(quiet=True))


@pytest.fixture(scope="module")
def llama():
    # a broken build skips too; CI holds the tokenizer to llama.cpp's own vocab test vectors
    # instead (test_tokenizer_vocabs.py), which need no llama.cpp
    llama_cpp = pytest.importorskip("llama_cpp", exc_type=ImportError,
                                    reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh); "
                                           "test_tokenizer_vocabs.py checks llama.cpp's test vectors")
    return llama_cpp.Llama(str(pull_smollm2(quiet=True)), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def encodable(tok):
    # SmolLM2 has no token for a few bytes (some C0 controls, 0xF1/0xF2, so U+40000..U+BFFFF);
    # llama.cpp drops them, so text holding them cannot come back from its ids.
    single = {tok.token_bytes(i) for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1}
    missing = {b for b in range(256) if bytes([b]) not in single}
    assert missing  # else the filter is moot and can go
    return lambda text: "".join(c for c in text if not missing.intersection(c.encode()))


# -- ids ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", GOLDEN["texts"], ids=lambda c: repr(c["text"][:24]))
def test_ids_equal_llama_cpp(tok, case):
    assert tok.encode(case["text"], add_bos=False) == case["ids"]
    assert tok.encode(case["text"], add_bos=False, parse_special=False) == case["ids_no_special"]


def test_metadata(tok):
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (49152, 1, 2)
    assert tok.token_to_piece(1) == "<|im_start|>" and tok.token_to_piece(2) == "<|im_end|>"
    # <|im_end|> is the eos; llama.cpp ends generation at <|endoftext|> as well
    assert tok.eot_ids == {0, 2}


def test_bos_follows_the_gguf(tok):
    assert tok.encode("Hi") == tok.encode("Hi", add_bos=False)  # add_bos_token is false
    assert tok.encode("Hi", add_bos=True) == [1] + tok.encode("Hi", add_bos=False)


def test_special_tokens_only_with_parse_special(tok):
    assert tok.encode("<|im_start|>user", add_bos=False)[0] == 1
    ids = tok.encode("<|im_start|>user", add_bos=False, parse_special=False)
    assert 1 not in ids and tok.decode(ids) == "<|im_start|>user"


@given(st.text(max_size=64))
def test_ids_equal_llama_cpp_any_text(tok, llama, text):
    assert tok.encode(text, add_bos=False, parse_special=False) == \
        llama.tokenize(text.encode(), add_bos=False, special=False)


@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(SPECIALS)), max_size=10).map("".join))
def test_ids_equal_llama_cpp_with_specials(tok, llama, text):
    assert tok.encode(text, add_bos=False) == llama.tokenize(text.encode(), add_bos=False, special=True)


# -- decoding -----------------------------------------------------------------------------------

@given(st.text(max_size=200))
def test_round_trip(tok, encodable, text):
    text = encodable(text)
    assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_decode_special(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "user\nhi"


@given(st.text(max_size=100))
def test_stream_never_splits_a_character(tok, encodable, text):
    text = encodable(text).replace("\ufffd", "")
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    pieces = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


@given(st.lists(st.integers(0, 49151), max_size=40), st.booleans())
def test_stream_equals_decode_for_any_ids(tok, ids, skip_special):
    stream = tok.stream(skip_special)
    assert "".join([stream.feed(i) for i in ids] + [stream.flush()]) == tok.decode(ids, skip_special)


def test_stream_holds_back_partial_utf8(tok):
    ids = tok.encode("é😀")
    assert len(ids) > 2  # the emoji's bytes come in more than one token
    stream = tok.stream()
    out = [stream.feed(i) for i in ids]
    assert out[-1] == "😀" and all(p in ("", "é") for p in out[:-1])


# -- building -----------------------------------------------------------------------------------

BYTE_DECODER = _byte_decoder()


def spelt_one_by_one(text: str) -> bytes:
    """The bytes of a byte-level token text, a character at a time (what the tokenizer's
    bulk lookup, _byte_level_bytes, must give)."""
    return b"".join(bytes([BYTE_DECODER[c]]) if c in BYTE_DECODER else c.encode() for c in text)


def test_token_bytes_are_spelt_as_one_by_one(tok):
    g = open_gguf(pull_smollm2(quiet=True))
    texts, types = g.require("tokenizer.ggml.tokens"), g.require("tokenizer.ggml.token_type")
    byte_level = [i for i, t in enumerate(types) if t in (1, 6) and texts[i] not in EOG_TEXTS]  # normal, byte
    assert len(byte_level) > 49000
    assert [tok.token_bytes(i) for i in byte_level] == [spelt_one_by_one(texts[i]) for i in byte_level]


_byte_level_text = st.text(st.one_of(st.sampled_from(sorted(BYTE_DECODER)),
                                     st.characters(blacklist_categories=("Cs",))), max_size=6)


@given(st.lists(_byte_level_text, max_size=20))
def test_byte_level_bytes_of_any_texts(texts):
    assert _byte_level_bytes(texts) == [spelt_one_by_one(t) for t in texts]


def test_merges_split_at_the_first_space_after_the_first_character():
    # a merge starting with a space (no byte-level vocabulary has one) splits after it, as
    # llama.cpp splits; one without a space is refused
    kw = dict(pre="smollm", bos_id=None, eos_id=None, add_bos=False, chat_template=None)
    t = Tokenizer(["a", "b", " ", "ab", " a", " ab"], [1] * 6, ["a b", "  a"], **kw)
    assert t.encode("ab") == [3]
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.merges entry 'ab' has no space"):
        Tokenizer(["a", "b", "ab"], [1] * 3, ["a b", "ab"], **kw)


# -- chat ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", GOLDEN["chat"],
                         ids=lambda c: f"{c['messages'][0]['role']}-{c['add_generation_prompt']}")
def test_chat_template_equals_llama_cpp_python(tok, case):
    prompt = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert prompt == case["prompt"]
    assert tok.encode(prompt) == case["ids"]


def test_chat_template_two_turns(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_fallback_is_chatml(tok):
    bare = copy.copy(tok)
    bare.chat_template = None
    assert bare.apply_chat_template([{"role": "user", "content": "Hi"}]) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_helpers_and_sandbox(tok):
    from jinja2.exceptions import SecurityError, TemplateError

    t = copy.copy(tok)
    t.chat_template = "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == \
        '<|im_start|>[{"role": "user", "content": "é"}]<|im_end|>'
    t.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(TemplateError, match="roles must alternate"):
        t.apply_chat_template([])
    t.chat_template = "{{ messages.append(1) }}"
    with pytest.raises(SecurityError):
        t.apply_chat_template([])


# -- errors -------------------------------------------------------------------------------------

def write_gguf(path: Path, **kv) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(path, "llama")
    for key, value in kv.items():
        w.add_key_value(key, value[0], value[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_model_and_pre(tmp_path):
    from gguf import GGUFValueType as T

    tokens = {"tokenizer.ggml.tokens": (["a", "b"], T.ARRAY), "tokenizer.ggml.merges": (["a b"], T.ARRAY)}
    spm = write_gguf(tmp_path / "spm.gguf", **{"tokenizer.ggml.model": ("llama", T.STRING)}, **tokens)
    with pytest.raises(TokenizerError, match=r"spm\.gguf: tokenizer\.ggml\.model = 'llama' is not supported"):
        Tokenizer.from_gguf(spm)
    qwen = write_gguf(tmp_path / "qwen.gguf", **{"tokenizer.ggml.model": ("gpt2", T.STRING),
                                                 "tokenizer.ggml.pre": ("not-a-pre", T.STRING)}, **tokens)
    with pytest.raises(TokenizerError, match=r"qwen\.gguf: tokenizer\.ggml\.pre = 'not-a-pre' is not supported"):
        Tokenizer.from_gguf(qwen)
    bare = write_gguf(tmp_path / "bare.gguf")
    with pytest.raises(GGUFError, match=r"bare\.gguf: metadata key 'tokenizer\.ggml\.model' is missing"):
        Tokenizer.from_gguf(bare)


def test_bad_token_id(tok):
    with pytest.raises(IndexError, match="token id 49152 is outside the vocabulary"):
        tok.decode([49152])
