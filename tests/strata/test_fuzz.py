"""Fuzzing the GGUF reader and the tokenizer: whatever bytes, text or token ids come in, the
only exception out is the documented one (GGUFError naming the file; TokenizerInputError
and TokenIdError naming the text or id), and what loads reads back whole."""
from __future__ import annotations

import itertools
import re
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as T
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.tiers import examples

import quant
from strata.gguf import GGUFError, open_gguf, write_gguf
from strata.tensors import QTensor
from strata.tokenizer import Tokenizer, TokenIdError, TokenizerInputError

# --- the base file: every metadata type, and tensors of several formats -------------------


def _tensor(name: str, fmt: str, shape: tuple[int, ...], seed: int) -> QTensor:
    f = quant.get(fmt)
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return QTensor(name, f, shape, f.quantize(w.reshape(-1, shape[-1])))


META = {
    "general.name": "fuzz", "m.empty": "", "m.utf8": "héllo ü", "m.u32": 7, "m.neg": -5,
    "m.u64": 2**40, "m.f32": 0.5, "m.f64": (0.25, T.FLOAT64), "m.bool": True, "m.u8": (3, T.UINT8),
    "m.i16": (-2, T.INT16), "m.strs": ["a", "", "ü"], "m.ints": [1, 2, 3], "m.floats": [1.5, -2.0],
    "m.bools": [True, False], "m.i32s": ([1, -1], T.INT32),
}
TENSORS = [_tensor("t.f32", "F32", (8,), 0), _tensor("t.q8", "Q8_0", (2, 32), 1),
           _tensor("t.f16", "F16", (2, 2, 4), 2), _tensor("t.q4", "Q4_0", (1, 32), 3)]


def _base() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return write_gguf(Path(d) / "base.gguf", "llama", META, TENSORS).read_bytes()


BASE = _base()


class Layout:
    """Where the header, metadata and tensor infos of a GGUF keep the numbers that say how to
    read what follows (`fields`: counts, lengths, type ids, dims, offsets, as (offset, width)),
    its strings (`strings`: (offset, length)), its arrays (`arrays`: the fields of the item
    type and count, and the byte range of the items), each tensor's dims (`dims`: field
    indices) and where the tensor infos end (`end`)."""

    def __init__(self, buf: bytes):
        self.buf, self.at = buf, 8
        self.fields: list[tuple[int, int]] = []
        self.strings: list[tuple[int, int]] = []
        self.arrays: list[tuple[int, int, int, int]] = []
        self.dims: list[list[int]] = []
        n_tensors, n_kv = self.num(8), self.num(8)
        for _ in range(n_kv):
            self.string()  # the key
            self.value(self.num(4))
        for _ in range(n_tensors):
            self.string()  # the name
            n_dims = self.num(4)
            self.dims.append([len(self.fields) + j for j in range(n_dims)])
            for _ in range(n_dims):
                self.num(8)
            self.num(4)  # ggml type
            self.num(8)  # data offset
        self.end = self.at

    def num(self, width: int) -> int:
        self.fields.append((self.at, width))
        (v,) = struct.unpack_from("<Q" if width == 8 else "<I", self.buf, self.at)
        self.at += width
        return v

    def string(self) -> None:
        n = self.num(8)
        self.strings.append((self.at, n))
        self.at += n

    def value(self, vtype: int) -> None:
        if vtype == T.STRING:
            self.string()
        elif vtype == T.ARRAY:
            itype_field, count_field = len(self.fields), len(self.fields) + 1
            itype, n = self.num(4), self.num(8)
            start = self.at
            for _ in range(n):
                self.value(itype)
            self.arrays.append((itype_field, count_field, start, self.at))
        else:
            self.at += {T.UINT8: 1, T.INT8: 1, T.BOOL: 1, T.UINT16: 2, T.INT16: 2, T.UINT32: 4,
                        T.INT32: 4, T.FLOAT32: 4, T.UINT64: 8, T.INT64: 8, T.FLOAT64: 8}[T(vtype)]


LAYOUT = Layout(BASE)
FIELDS = LAYOUT.fields

# Values a corrupt count, length, type or offset is likely to hold: small ones (an off-by-one,
# a type id just past the known ones), ones near the edges of 32 and 64 bits (a negative
# number read unsigned, an overflowing product).
_INTERESTING = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 31, 32, 33, 63, 64, 99, 255,
                256, 4095, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**60, 2**62, 2**63 - 1,
                2**63, 2**64 - 1]


def _number(width: int):
    top = 2 ** (8 * width) - 1
    return st.one_of(st.sampled_from([v for v in _INTERESTING if v <= top]),
                     st.integers(0, top), st.integers(-64, -1).map(lambda v: v % (top + 1)))


# Edits keep every offset in LAYOUT valid: they run first, then the array emptying (from the
# end back), then the damage, which moves bytes.
_set_field = st.integers(0, len(FIELDS) - 1).flatmap(
    lambda i: st.tuples(st.just("set"), st.just(i), _number(FIELDS[i][1])))
_nudge_field = st.tuples(st.just("nudge"), st.integers(0, len(FIELDS) - 1), st.integers(-40, 40))
_shape = st.tuples(st.just("shape"), st.sampled_from(LAYOUT.dims),
                   st.lists(st.sampled_from([0, 1, 2, 3, 32, 64, 2**31, 2**32, 2**60, 2**62, 2**63,
                                             2**64 - 1]), min_size=4, max_size=4))
_bad_utf8 = st.tuples(st.just("utf8"), st.sampled_from([s for s in LAYOUT.strings if s[1]]),
                      st.integers(0, 63), st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"]))
_empty_array = st.tuples(st.just("empty"), st.sampled_from(LAYOUT.arrays),
                         st.one_of(st.none(), _number(4)))
_flip = st.tuples(st.just("flip"), st.integers(0, LAYOUT.end - 1), st.integers(0, 7))
_overwrite = st.tuples(st.just("overwrite"), st.integers(0, LAYOUT.end - 1),
                       st.binary(min_size=1, max_size=8))
_truncate = st.tuples(st.just("truncate"), st.integers(0, len(BASE)))
_insert = st.tuples(st.just("insert"), st.integers(0, len(BASE)), st.binary(min_size=1, max_size=16))
_delete = st.tuples(st.just("delete"), st.integers(0, LAYOUT.end), st.integers(1, 16))
_pad = st.tuples(st.just("pad"), st.binary(min_size=1, max_size=64))
_mutation = st.one_of(_set_field, _nudge_field, _shape, _bad_utf8, _empty_array, _flip, _overwrite,
                      _truncate, _insert, _delete, _pad)
_PHASE = {"set": 0, "nudge": 0, "shape": 0, "utf8": 0, "empty": 1}


def _put(buf: bytearray, field: int, v: int) -> None:
    at, width = FIELDS[field]
    struct.pack_into("<Q" if width == 8 else "<I", buf, at, v % 2 ** (8 * width))


def _mutated(mutations: list[tuple]) -> bytes:
    buf = bytearray(BASE)
    order = sorted(mutations, key=lambda m: (_PHASE.get(m[0], 2), -m[1][2] if m[0] == "empty" else 0))
    for m in order:
        kind = m[0]
        if kind == "set":
            _put(buf, m[1], m[2])
        elif kind == "nudge":
            at, width = FIELDS[m[1]]
            _put(buf, m[1], struct.unpack_from("<Q" if width == 8 else "<I", buf, at)[0] + m[2])
        elif kind == "shape":
            for field, v in zip(m[1], m[2]):
                _put(buf, field, v)
        elif kind == "utf8":
            (start, n), at, bad = m[1], m[2], m[3]
            at = start + at % n
            buf[at:at + len(bad)] = bad[:start + n - at]
        elif kind == "empty":
            itype_field, count_field, start, end = m[1]
            _put(buf, count_field, 0)
            if m[2] is not None:
                _put(buf, itype_field, m[2])
            del buf[start:end]
        elif kind == "flip":
            if m[1] < len(buf):
                buf[m[1]] ^= 1 << m[2]
        elif kind == "overwrite":
            buf[m[1]:m[1] + len(m[2])] = m[2]
        elif kind == "truncate":
            del buf[m[1]:]
        elif kind == "insert":
            buf[m[1]:m[1]] = m[2]
        elif kind == "delete":
            del buf[m[1]:m[1] + m[2]]
        elif kind == "pad":
            buf += m[1]
    return bytes(buf)


_files = itertools.count()


def _check_file(path: Path) -> None:
    """open_gguf(path) loads, and everything in it reads, or a GGUFError names the file."""
    try:
        g = open_gguf(path)
        for key, v in g.metadata.items():
            repr(v), g.metadata_types[key]
        g.typed_metadata(), repr(g)
        for t in g.tensors.values():
            t.data.tobytes()
            assert t.numpy().shape == t.shape
    except GGUFError as e:
        assert str(path) in str(e), f"the error does not name the file: {e}"


@pytest.fixture(scope="module")
def fuzz_dir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def test_base_file_reads(fuzz_dir):
    path = fuzz_dir / "base.gguf"
    path.write_bytes(BASE)
    g = open_gguf(path)
    assert {k: g.metadata[k] for k in ("m.strs", "m.i32s", "m.u8")} == \
        {"m.strs": ["a", "", "ü"], "m.i32s": [1, -1], "m.u8": 3}
    assert [g.tensors[t.name].data.tobytes() for t in TENSORS] == [t.data.tobytes() for t in TENSORS]
    assert LAYOUT.end < len(BASE) and len(LAYOUT.arrays) == 5 and len(LAYOUT.dims) == len(TENSORS)


@settings(max_examples=examples(500))
@given(mutations=st.lists(_mutation, min_size=1, max_size=4))
# what it found: an empty array of an unknown item type (ValueError from GGUFValueType), a
# zero-weight tensor with a 2**62 dimension (numpy's "array is too big" from .numpy())
@example(mutations=[("empty", LAYOUT.arrays[0], 13)])
@example(mutations=[("shape", LAYOUT.dims[2], [0, 0, 2**62, 0])])
@example(mutations=[("empty", LAYOUT.arrays[1], 9)])  # an array of arrays: refused, as llama.cpp does
def test_mutated_gguf_loads_or_raises_gguf_error(fuzz_dir, mutations):
    # a new name each time: rewriting a file an earlier GGUFFile still maps would make any
    # later read of that mapping fault
    path = fuzz_dir / f"f{next(_files)}.gguf"
    path.write_bytes(_mutated(mutations))
    try:
        _check_file(path)
    finally:
        path.unlink()


# --- the tokenizer: any text, any ids --------------------------------------------------------

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<filename>", "<|im", "end|>"]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def untokenized(tok) -> bytes:
    """The bytes no token stands for alone, which encode drops as llama.cpp does."""
    single = {tok.token_bytes(i) for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1}
    missing = bytes(b for b in range(256) if bytes([b]) not in single)
    assert b"\x04" in missing and b"\xf1" in missing  # else the property below says less
    return missing


def _kept(text: str, untokenized: bytes) -> str:
    """What decode(encode(text)) gives back: text's UTF-8 less the bytes with no token."""
    return text.encode().translate(None, untokenized).decode("utf-8", errors="replace")


# Text from everywhere: any code point but surrogates, the special tokens and pieces of them,
# the characters SmolLM2 has no byte for, and the planes their lead byte starts.
_piece = st.one_of(
    st.text(max_size=24), st.sampled_from(SPECIALS),
    st.sampled_from(["\x04", "\x06", "\x13", "\x14", "\x16", "\x1d", "\U00040000", "\U000bffff",
                     "\ufffd"]),
    st.text(st.characters(min_codepoint=0x40000, max_codepoint=0xC0000), max_size=3),
    st.text(" \t\n\r0123456789'sa", max_size=8))
_any_text = st.lists(_piece, max_size=8).map("".join)


@settings(max_examples=examples(500))
@given(text=_any_text, parse_special=st.booleans())
def test_encode_any_text_and_decode_it_back(tok, untokenized, text, parse_special):
    ids = tok.encode(text, add_bos=False, parse_special=parse_special)
    assert all(type(i) is int and 0 <= i < tok.vocab_size for i in ids)
    # lossless but for the bytes with no token; special tokens decode to their own text
    assert tok.decode(ids) == _kept(text, untokenized)
    if not set(untokenized).intersection(text.encode()):
        assert tok.decode(ids) == text


_surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_surrogate_text = st.lists(st.one_of(st.text(max_size=8), _surrogate), max_size=6).map("".join)
_decoded_bytes = st.tuples(st.binary(max_size=64),
                           st.sampled_from(["replace", "surrogateescape", "ignore", "backslashreplace"]))


@settings(max_examples=examples(500))
@example(text="a\ud800b")  # what it found: `tokenizers` raised a TypeError about its input type
@given(text=st.one_of(_decoded_bytes.map(lambda b: b[0].decode("utf-8", errors=b[1])), _surrogate_text))
def test_encode_text_from_any_bytes(tok, untokenized, text):
    """Text with a lone surrogate (no UTF-8 form) is refused by a TokenizerInputError that
    names the first one; any other text encodes."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        with pytest.raises(TokenizerInputError, match=rf"U\+{ord(text[e.start]):04X}, a lone surrogate, "
                                                      rf"at index {e.start}"):
            tok.encode(text)
        return
    assert tok.decode(tok.encode(text, add_bos=False)) == _kept(text, untokenized)


_token_id = st.one_of(st.integers(0, 49151), st.integers(0, 16), st.integers(-2**70, 2**70),
                      st.sampled_from([-1, 49152, 2**63]))


@settings(max_examples=examples(500))
@given(ids=st.one_of(st.lists(_token_id, max_size=40), _any_text.map(lambda t: ("text", t))),
       skip_special=st.booleans())
def test_decode_and_stream_any_ids(tok, ids, skip_special):
    """decode of ids in range equals the streamed pieces joined; an id out of range raises a
    TokenIdError naming it, from decode and from the stream when it is fed, never a bare
    IndexError."""
    if isinstance(ids, tuple):  # the ids of some text, whose characters span tokens
        ids = tok.encode(ids[1])
    bad = next((i for i in ids if not 0 <= i < tok.vocab_size), None)
    stream = tok.stream(skip_special)
    if bad is None:
        text = tok.decode(ids, skip_special)
        assert "".join([stream.feed(i) for i in ids] + [stream.flush()]) == text
        return
    with pytest.raises(TokenIdError, match=rf"token id {bad} is outside the vocabulary \(0\.\.49151\)"):
        tok.decode(ids, skip_special)
    for i in ids:
        if i == bad:
            with pytest.raises(TokenIdError, match=rf"token id {bad} is outside"):
                stream.feed(i)
            break
        stream.feed(i)


# a float or str id used to fail with a TypeError from the range check or the list index,
# naming neither the id nor the vocabulary
@pytest.mark.parametrize("token_id", [1.0, "1", None, b"\x01"])
def test_decode_refuses_ids_that_are_not_integers(tok, token_id):
    shown = re.escape(repr(token_id))
    with pytest.raises(TokenIdError, match=rf"token id {shown} is a \w+, not an integer"):
        tok.decode([5, token_id])
    with pytest.raises(TokenIdError):
        tok.stream().feed(token_id)
    # numpy integers are integers
    assert tok.decode(np.array([1, 2])) == "<|im_start|><|im_end|>"


def test_encode_refuses_what_is_not_text(tok):
    with pytest.raises(TypeError, match="encode takes a str, got bytes; decode bytes first"):
        tok.encode(b"hi")
