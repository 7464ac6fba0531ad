"""GGUF reader and writer: round trips, and one clear GGUFError per kind of bad file."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as T
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers import examples

import quant
from strata.gguf import GGUFError, open_gguf, write_gguf
from strata.tensors import QTensor

FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "IQ3_XXS", "IQ3_S"]


def quantized(name: str, fmt: str, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    f = quant.get(fmt)
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    q = f.quantize(w.reshape(-1, shape[-1]))
    return QTensor(name, f, shape, q)


def good_file(path: Path) -> Path:
    """Two Q8_0 tensors and an F32 one, and a little metadata."""
    tensors = [quantized("blk.0.w", "Q8_0", (2, 64)), quantized("blk.1.w", "Q8_0", (2, 64), 1),
               quantized("norm", "F32", (8,))]
    meta = {"test.n": 3, "test.name": "abc", "test.list": [1, 2, 3]}
    return write_gguf(path, "llama", meta, tensors)


def tensor_info_at(buf: bytes, name: str) -> int:
    """Offset of a tensor info's n_dims field (just after its name)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = buf.rindex(key)  # tensor infos follow the metadata
    return i + len(key)


def corrupt(path: Path, edit) -> Path:
    buf = bytearray(path.read_bytes())
    buf = edit(buf) or buf
    bad = path.with_name("bad.gguf")
    bad.write_bytes(bytes(buf))
    return bad


# --- round trips -------------------------------------------------------------------------

def test_round_trip_formats_and_metadata(tmp_path):
    tensors = [quantized(f"t.{n.lower()}", n, (3, 512), i) for i, n in enumerate(FORMATS)]
    tensors.append(quantized("t.3d", "Q4_0", (2, 3, 64), 9))
    meta = {
        "m.str": "héllo", "m.empty": "", "m.u32": 7, "m.neg": -5, "m.big": 2**40,
        "m.f32": 0.1, "m.bool": False, "m.strs": ["a", "", "ü"], "m.ints": [1, 2**33],
        "m.floats": [1.5, -2.25], "m.bools": [True, False], "m.i8": (-3, T.INT8),
        "m.f64": (0.1, T.FLOAT64), "m.i32s": ([1, -1], T.INT32), "m.np": np.arange(4, dtype=np.uint16),
        "m.npf": np.float32(0.5),
    }
    path = write_gguf(tmp_path / "m.gguf", "qwen4exp", meta, tensors)
    g = open_gguf(path)
    assert g.arch == "qwen4exp"
    assert list(g.metadata) == ["general.architecture", *meta]
    want_types = {
        "m.str": T.STRING, "m.empty": T.STRING, "m.u32": T.UINT32, "m.neg": T.INT64,
        "m.big": T.UINT64, "m.f32": T.FLOAT32, "m.bool": T.BOOL, "m.strs": T.STRING,
        "m.ints": T.UINT64, "m.floats": T.FLOAT32, "m.bools": T.BOOL, "m.i8": T.INT8,
        "m.f64": T.FLOAT64, "m.i32s": T.INT32, "m.np": T.UINT16, "m.npf": T.FLOAT32,
    }
    assert {k: g.metadata_types[k] for k in want_types} == want_types
    assert g.metadata["m.f32"] == float(np.float32(0.1)) and g.metadata["m.f64"] == 0.1
    assert g.metadata["m.i8"] == -3 and g.metadata["m.i32s"] == [1, -1]
    assert g.metadata["m.np"] == [0, 1, 2, 3] and g.metadata["m.strs"] == ["a", "", "ü"]
    for t in tensors:
        r = g.tensor(t.name)
        assert r.fmt is t.fmt and r.shape == t.shape
        assert r.data.dtype == np.uint8 and r.data.shape == (int(np.prod(t.shape[:-1])), t.data.shape[-1])
        assert np.array_equal(r.data, t.data.reshape(r.data.shape))
        assert not r.data.flags.owndata and not r.data.flags.writeable  # a view of the file
        np.testing.assert_array_equal(r.numpy(), t.numpy())


def test_rewrite_is_byte_identical_and_keeps_alignment(tmp_path):
    meta = {"general.alignment": (64, T.UINT32), "x.v": (1, T.INT32)}
    a = write_gguf(tmp_path / "a.gguf", "llama", meta, [quantized("w", "IQ3_S", (2, 256))])
    g = open_gguf(a)
    assert g._reader.alignment == 64 and g.metadata_types["x.v"] == T.INT32
    b = write_gguf(tmp_path / "b.gguf", g.arch, g.typed_metadata(), g.tensors)
    assert a.read_bytes() == b.read_bytes()


_key = st.from_regex(r"[a-z][a-z0-9_]{0,6}(\.[a-z0-9_]{1,6}){0,2}", fullmatch=True).map("k.".__add__)
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_f32 = st.floats(width=32, allow_nan=False)
_value = st.one_of(
    _text, st.integers(-2**63, 2**64 - 1), _f32, st.booleans(),
    st.lists(_text, min_size=1, max_size=4), st.lists(_f32, min_size=1, max_size=4),
    st.lists(st.booleans(), min_size=1, max_size=4),
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=4),
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4),
    st.tuples(st.integers(-2**15, 2**15 - 1), st.just(T.INT16)),
    st.tuples(st.integers(0, 255), st.just(T.UINT8)),
    st.tuples(st.floats(allow_nan=False), st.just(T.FLOAT64)),
)
_tensor = st.tuples(st.sampled_from(FORMATS), st.lists(st.integers(1, 3), max_size=2),
                    st.integers(1, 2), st.integers(0, 2**32 - 1))


def _expected(v):
    """What the reader gives back for a value the writer took."""
    if isinstance(v, tuple):  # an explicit type: UINT8, INT16 and FLOAT64 keep the value
        return v[0]
    if isinstance(v, float):
        return float(np.float32(v))
    if isinstance(v, list) and v and isinstance(v[0], float):
        return [float(np.float32(x)) for x in v]
    return v


@settings(max_examples=examples(25))
@given(meta=st.dictionaries(_key, _value, max_size=6), specs=st.lists(_tensor, max_size=4))
def test_property_round_trip_is_byte_exact(tmp_path_factory, meta, specs):
    tmp = tmp_path_factory.mktemp("prop")
    tensors = []
    for i, (fmt, lead, blocks, seed) in enumerate(specs):
        f = quant.get(fmt)
        shape = (*lead, blocks * f.block_elems)
        rows = int(np.prod(lead))
        data = np.random.default_rng(seed).integers(0, 256, (rows, f.row_bytes(shape[-1])), dtype=np.uint8)
        tensors.append(QTensor(f"t{i}", f, shape, data))
    a = write_gguf(tmp / "a.gguf", "arch", meta, tensors)
    g = open_gguf(a)
    assert {k: v for k, v in g.metadata.items() if k != "general.architecture"} == \
        {k: _expected(v) for k, v in meta.items()}
    assert list(g.tensors) == [t.name for t in tensors]
    for t in tensors:
        r = g.tensors[t.name]
        assert (r.fmt, r.shape) == (t.fmt, t.shape) and r.data.tobytes() == t.data.tobytes()
    b = write_gguf(tmp / "b.gguf", g.arch, g.typed_metadata(), g.tensors)
    assert a.read_bytes() == b.read_bytes()
    c = write_gguf(tmp / "c.gguf", g.arch, g.typed_metadata(packed=True), g.tensors)  # arrays as bytes
    assert a.read_bytes() == c.read_bytes()


def test_packed_arrays_are_the_files_bytes(tmp_path):
    meta = {"t.strs": ["a", "", "ü", "xyz"], "t.ids": ([3, 1, 2], T.INT32), "t.f": [0.5, 2.0], "t.n": 7}
    a = write_gguf(tmp_path / "a.gguf", "llama", meta, [])
    packed = open_gguf(a).typed_metadata(packed=True)
    strs, ids = packed["t.strs"][0], packed["t.ids"][0]
    assert (strs.item_type, strs.count, ids.item_type, len(ids)) == (T.STRING, 4, T.INT32, 3)
    assert strs.data.tobytes() == b"".join(len(e).to_bytes(8, "little") + e for e in (b"a", b"", "ü".encode(), b"xyz"))
    assert ids.data.tobytes() == np.array([3, 1, 2], "<i4").tobytes()
    assert packed["t.n"] == (7, T.UINT32)  # scalars as they are
    b = write_gguf(tmp_path / "b.gguf", "llama", packed, [])
    assert a.read_bytes() == b.read_bytes()
    with pytest.raises(ValueError, match="array of INT32 given as UINT8"):
        write_gguf(tmp_path / "c.gguf", "llama", {"t.ids": (ids, T.UINT8)}, [])


# --- bad files: one GGUFError each, naming the file and the problem ------------------------

def test_no_such_file(tmp_path):
    with pytest.raises(GGUFError, match=r"nope\.gguf: no such file"):
        open_gguf(tmp_path / "nope.gguf")


def test_empty_file(tmp_path):
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match=r"e\.gguf: not a GGUF file: it is empty"):
        open_gguf(tmp_path / "e.gguf")


def test_bad_magic(tmp_path):
    bad = corrupt(good_file(tmp_path / "g.gguf"), lambda b: b"GGML" + b[4:])
    with pytest.raises(GGUFError, match=r"bad\.gguf: not a GGUF file: it starts with b'GGML', not b'GGUF'"):
        open_gguf(bad)


@pytest.mark.parametrize("version", [1, 4])
def test_unsupported_version(tmp_path, version):
    bad = corrupt(good_file(tmp_path / "g.gguf"), lambda b: b[:4] + struct.pack("<I", version) + b[8:])
    with pytest.raises(GGUFError, match=rf"bad\.gguf: GGUF version {version} is not supported; "
                                        r"Strata reads versions 2 and 3"):
        open_gguf(bad)


def test_big_endian(tmp_path):
    bad = corrupt(good_file(tmp_path / "g.gguf"), lambda b: b[:4] + struct.pack(">I", 3) + b[8:])
    with pytest.raises(GGUFError, match=r"bad\.gguf: big-endian GGUF file \(version 3"):
        open_gguf(bad)


def test_truncated_header(tmp_path):
    bad = corrupt(good_file(tmp_path / "g.gguf"), lambda b: b[:10])
    with pytest.raises(GGUFError, match=r"bad\.gguf: truncated file: the 24-byte header is cut short at 10 bytes"):
        open_gguf(bad)


def test_truncated_metadata(tmp_path):
    good = good_file(tmp_path / "g.gguf")
    cut = good.read_bytes().index(b"test.name") + 2
    bad = corrupt(good, lambda b: b[:cut])
    with pytest.raises(GGUFError, match=rf"bad\.gguf: truncated file: the metadata run past the end "
                                        rf"\(they need at least \d+ bytes, the file has {cut}\)"):
        open_gguf(bad)


def test_truncated_tensor_infos(tmp_path):
    good = good_file(tmp_path / "g.gguf")
    cut = tensor_info_at(good.read_bytes(), "blk.1.w") + 6
    bad = corrupt(good, lambda b: b[:cut])
    with pytest.raises(GGUFError, match=rf"bad\.gguf: truncated file: the tensor infos run past the end "
                                        rf"\(they need at least \d+ bytes, the file has {cut}\)"):
        open_gguf(bad)


def test_tensor_data_past_end(tmp_path):
    good = good_file(tmp_path / "g.gguf")
    g = open_gguf(good)
    start = g._reader.data_offset + g.tensor("blk.0.w").nbytes  # blk.1.w follows blk.0.w (+padding)
    bad = corrupt(good, lambda b: b[:start + 10])
    with pytest.raises(GGUFError, match=rf"bad\.gguf: tensor 'blk.1.w' data at bytes \[\d+, \d+\) runs "
                                        rf"past the end of the file \({start + 10} bytes\)"):
        open_gguf(bad)


def test_tensor_offset_past_end(tmp_path):
    good = good_file(tmp_path / "g.gguf")

    def edit(b):
        at = tensor_info_at(b, "norm") + 4 + 8 + 4  # n_dims, one dim, type, then the offset
        b[at:at + 8] = struct.pack("<Q", 2**40)
    with pytest.raises(GGUFError, match=r"tensor 'norm' data at bytes \[\d+, \d+\) runs past the end"):
        open_gguf(corrupt(good, edit))


@pytest.mark.parametrize("type_id, shown", [(99, "not a ggml type"), (34, "TQ1_0")])
def test_unknown_tensor_type(tmp_path, type_id, shown):
    good = good_file(tmp_path / "g.gguf")

    def edit(b):
        at = tensor_info_at(b, "norm") + 4 + 8
        b[at:at + 4] = struct.pack("<I", type_id)
    with pytest.raises(GGUFError, match=rf"bad\.gguf: tensor 'norm' has ggml type {type_id} \({shown}\), "
                                        r"which Strata does not read; supported: F32 \(0\)"):
        open_gguf(corrupt(good, edit))


def test_row_not_whole_blocks(tmp_path):
    good = good_file(tmp_path / "g.gguf")

    def edit(b):
        at = tensor_info_at(b, "blk.0.w") + 4  # ne[0], the row length
        b[at:at + 8] = struct.pack("<Q", 48)
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor 'blk.0.w' \(Q8_0, shape \(2, 48\)\): rows of 48 "
                                        r"weights are not a whole number of 32-weight blocks"):
        open_gguf(corrupt(good, edit))


def test_shape_larger_than_its_data(tmp_path):
    good = good_file(tmp_path / "g.gguf")

    def edit(b):
        at = tensor_info_at(b, "blk.0.w") + 4 + 8  # ne[1], the row count
        b[at:at + 8] = struct.pack("<Q", 3)
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor 'blk.0.w' \(Q8_0, shape \(3, 64\)\) needs bytes "
                                        r"\[\d+, \d+\) but tensor 'blk.1.w' starts at \d+"):
        open_gguf(corrupt(good, edit))


def test_misaligned_tensor_offset(tmp_path):
    good = good_file(tmp_path / "g.gguf")

    def edit(b):
        at = tensor_info_at(b, "norm") + 4 + 8 + 4
        (off,) = struct.unpack("<Q", b[at:at + 8])
        b[at:at + 8] = struct.pack("<Q", off + 4)
    with pytest.raises(GGUFError, match=r"tensor 'norm' data offset \d+ is not a multiple of the file's "
                                        r"alignment \(32 bytes\)"):
        open_gguf(corrupt(good, edit))


def test_duplicate_tensor_name(tmp_path):
    good = good_file(tmp_path / "g.gguf")
    bad = corrupt(good, lambda b: b.replace(b"blk.1.w", b"blk.0.w"))
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor 'blk.0.w' appears twice"):
        open_gguf(bad)


def test_unknown_metadata_type(tmp_path):
    good = good_file(tmp_path / "g.gguf")

    def edit(b):
        at = b.index(b"test.n") + len(b"test.n")
        b[at:at + 4] = struct.pack("<I", 99)
    with pytest.raises(GGUFError, match=r"bad\.gguf: metadata key 'test.n' has unknown value type 99 \(at byte \d+\)"):
        open_gguf(corrupt(good, edit))


def test_duplicate_metadata_key(tmp_path):
    good = good_file(tmp_path / "g.gguf")
    bad = corrupt(good, lambda b: b.replace(b"test.list", b"test.name"))
    with pytest.raises(GGUFError, match=r"bad\.gguf: corrupt metadata: KeyError: .*test\.name"):
        open_gguf(bad)


def test_string_not_utf8(tmp_path):
    good = good_file(tmp_path / "g.gguf")
    bad = corrupt(good, lambda b: b.replace(b"abc", b"a\xffc"))
    with pytest.raises(GGUFError, match=r"bad\.gguf: metadata key 'test.name' holds a string that is not UTF-8"):
        open_gguf(bad)


def test_missing_key_and_tensor(tmp_path):
    g = open_gguf(good_file(tmp_path / "g.gguf"))
    with pytest.raises(GGUFError, match=r"g\.gguf: metadata key 'test.nam' is missing; did you mean 'test.name'"):
        g.require("test.nam")
    with pytest.raises(GGUFError, match=r"g\.gguf: tensor 'blk.2.w' is missing; did you mean"):
        g.tensor("blk.2.w")
    with pytest.raises(GGUFError, match=r"metadata key 'general.architecture' is missing"):
        g.metadata.pop("general.architecture") and g.arch


# --- arrays: read in bulk, as gguf-py reads them one item at a time --------------------------

def strings_file(path: Path, items: list[bytes], key: str = "test.strs") -> Path:
    """A GGUF of no tensors whose metadata are the architecture and `key`, an array of
    strings holding `items` as they are (any bytes: the writers take only str)."""
    def string(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    buf = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    buf += string(b"general.architecture") + struct.pack("<I", T.STRING) + string(b"llama")
    buf += string(key.encode()) + struct.pack("<IIQ", T.ARRAY, T.STRING, len(items))
    buf += b"".join(string(b) for b in items)
    path.write_bytes(buf + bytes(-len(buf) % 32))
    return path


def items_at(path: Path, key: str = "test.strs") -> int:
    """Offset of the first item of the array `key` (after its item type and count)."""
    return path.read_bytes().index(key.encode()) + len(key) + 4 + 4 + 8


def gguf_py(path: Path, key: str = "test.strs"):
    """gguf-py's own per-item parse of `key`: its value, or the UnicodeDecodeError it raises."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path).fields[key].contents()
    except UnicodeDecodeError as e:
        return e


AWKWARD = ["", "a", "", "ü", "日本語", "😀", "a b", " ", "\x00", "e\u0301", "\uffff", "\U0010ffff",
           "Ġhello", "x" * 1000, "é" * 300, ""]


def test_string_array_reads_as_gguf_py_reads_it(tmp_path):
    path = strings_file(tmp_path / "s.gguf", [t.encode() for t in AWKWARD])
    g = open_gguf(path)
    assert g.metadata["test.strs"] == gguf_py(path) == AWKWARD
    assert all(type(t) is str for t in g.metadata["test.strs"]) and g.metadata_types["test.strs"] == T.STRING
    # the reader's field answers an index or a slice as gguf-py's does
    from gguf import GGUFReader
    ours, theirs = g._reader.fields["test.strs"], GGUFReader(path).fields["test.strs"]
    assert ours.types == theirs.types == [T.ARRAY, T.STRING]
    for i in (0, 3, 5, -1, -4):
        assert ours.contents(i) == theirs.contents(i)
    for sl in (slice(2, 9), slice(None, None, 3), slice(-5, None)):
        assert ours.contents(sl) == theirs.contents(sl)
    with pytest.raises(IndexError):
        ours.contents(len(AWKWARD))


def test_number_arrays_read_as_gguf_py_reads_them(tmp_path):
    from gguf import GGUFReader

    meta = {"m.ints": ([3, -1, 2**31 - 1], T.INT32), "m.u8": ([0, 255], T.UINT8), "m.f": [0.5, -2.0],
            "m.f64": ([0.1, 1e300], T.FLOAT64), "m.b": [True, False, True], "m.big": [2**64 - 1, 0]}
    path = write_gguf(tmp_path / "n.gguf", "llama", meta, [])
    g, r = open_gguf(path), GGUFReader(path)
    for key in meta:
        want = r.fields[key].contents()
        assert g.metadata[key] == want and [type(v) for v in g.metadata[key]] == [type(v) for v in want]
        assert g._reader.fields[key].types == r.fields[key].types
        assert g._reader.fields[key].contents(-1) == r.fields[key].contents(-1)


@pytest.mark.parametrize("items", [
    [b"ok", b"\xff", b"x"],  # not UTF-8 at all
    [b"a\xc3", b"\xa9b"],  # a character cut across two strings: joined, they decode
    [b"\xc3", b"\xa9"],
    [b"", b"\x80"],  # a lone continuation byte
    [b"\xed\xa0\x80"],  # a surrogate
    [b"fine", b"\xf0\x9f\x98"],  # a character cut short at the end
], ids=["ff", "split", "split-bare", "continuation", "surrogate", "short"])
def test_string_array_not_utf8_fails_as_before(tmp_path, items):
    path = strings_file(tmp_path / "u.gguf", items)
    want = gguf_py(path)
    assert isinstance(want, UnicodeDecodeError)
    with pytest.raises(GGUFError) as got:
        open_gguf(path)
    assert str(got.value) == f"{path}: metadata key 'test.strs' holds a string that is not UTF-8: {want}"


@settings(max_examples=examples(100))
@given(items=st.lists(st.one_of(st.binary(max_size=6), _text.map(str.encode),
                                st.sampled_from([b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b""])), max_size=12))
def test_property_string_array_is_gguf_pys(tmp_path_factory, items):
    path = strings_file(tmp_path_factory.mktemp("strs") / "p.gguf", items)
    want = gguf_py(path)
    if isinstance(want, UnicodeDecodeError):
        with pytest.raises(GGUFError, match=f"holds a string that is not UTF-8: {re.escape(str(want))}$"):
            open_gguf(path)
    else:
        assert open_gguf(path).metadata["test.strs"] == want == [b.decode() for b in items]


TRUNCATED = (r"s\.gguf: truncated file: the metadata run past the end \(they need at least {} bytes, "
             r"the file has {}\)")


def test_truncated_string_array_names_the_string(tmp_path):
    items = [b"x" * 40, b"", b"y" * 40, b"zzz"]
    good = strings_file(tmp_path / "good.gguf", items)
    first = items_at(good)
    at, starts = first, []
    for b in items:
        starts.append(at)
        at += 8 + len(b)
    path = tmp_path / "s.gguf"
    # inside the third string's text: that string, its length, named
    cut = starts[2] + 8 + 10
    path.write_bytes(good.read_bytes()[:cut])
    with pytest.raises(GGUFError, match=TRUNCATED.format(starts[2] + 8 + 40, cut) +
                       r": metadata key 'test\.strs', a string of 40 bytes; the file is cut short, "
                       r"or that length is corrupt$"):
        open_gguf(path)
    # inside the fourth string's length
    cut = starts[3] + 3
    path.write_bytes(good.read_bytes()[:cut])
    with pytest.raises(GGUFError, match=TRUNCATED.format(starts[3] + 8, cut) + r": metadata key 'test\.strs'$"):
        open_gguf(path)
    # before the least the count's strings take (8 bytes each)
    cut = first + 20
    path.write_bytes(good.read_bytes()[:cut])
    with pytest.raises(GGUFError, match=TRUNCATED.format(first + 4 * 8, cut) +
                       r": metadata key 'test\.strs', an array of 4 STRING items; the file is cut short, "
                       r"or that count is corrupt$"):
        open_gguf(path)


@pytest.mark.parametrize("length", [41, 2**40, 2**64 - 1])
def test_corrupt_string_length_names_the_string(tmp_path, length):
    items = [b"x" * 40, b"", b"y" * 40, b"zzz"]
    good = strings_file(tmp_path / "good.gguf", items)
    at = items_at(good) + 8 + 40 + 8  # the third string's length
    buf = bytearray(good.read_bytes())
    buf[at:at + 8] = struct.pack("<Q", length)
    path = tmp_path / "s.gguf"
    path.write_bytes(bytes(buf))
    if length == 41:  # it takes the next string's length with it: that one is cut
        at, length = at + 8 + 41, int.from_bytes(buf[at + 8 + 41:at + 8 + 49], "little")
    with pytest.raises(GGUFError, match=TRUNCATED.format(at + 8 + length, len(buf)) +
                       rf": metadata key 'test\.strs', a string of {length} bytes; the file is cut short"):
        open_gguf(path)


# --- writer input errors -----------------------------------------------------------------

@pytest.mark.parametrize("meta, match", [
    ({"k": []}, r"metadata key 'k': empty arrays cannot be written"),
    ({"k": [1, "a"]}, r"metadata key 'k': array items must be all str"),
    ({"k": [[1]]}, r"nested lists are not supported"),
    ({"k": None}, r"metadata key 'k': cannot store a NoneType"),
    ({"k": (300, T.UINT8)}, r"metadata key 'k': 300 is not a valid UINT8"),
    ({"k": ("x", T.INT32)}, r"metadata key 'k': 'x' is not a valid INT32"),
    ({"k": 2**64}, r"metadata key 'k': \d+ is not a valid UINT64"),
    ({"k": [-1, 2**63]}, r"array item \d+ is not a valid INT64"),
    ({"general.architecture": "other"}, r"'general.architecture' is 'other' but arch is 'llama'"),
    ({"general.alignment": 24}, r"'general.alignment' must be a UINT32 power of two"),
])
def test_writer_rejects_bad_metadata(tmp_path, meta, match):
    with pytest.raises(ValueError, match=match):
        write_gguf(tmp_path / "w.gguf", "llama", meta, [])
    assert not list(tmp_path.iterdir())


def test_writer_rejects_bad_tensors(tmp_path):
    t = quantized("w", "Q8_0", (2, 64))
    p = tmp_path / "w.gguf"
    with pytest.raises(ValueError, match=r"tensor 'w' is given twice"):
        write_gguf(p, "llama", {}, [t, t])
    with pytest.raises(ValueError, match=r"tensor 'w' \(Q8_0, shape \(3, 64\)\) needs 204 bytes of uint8 "
                                         r"blocks, got 136 bytes of uint8"):
        write_gguf(p, "llama", {}, {"w": QTensor("w", t.fmt, (3, 64), t.data)})
    with pytest.raises(ValueError, match=r"tensor 'w': Q8_0: a row of 48 weights is not a whole number"):
        write_gguf(p, "llama", {}, [QTensor("w", t.fmt, (2, 48), t.data)])
    with pytest.raises(ValueError, match=r"is longer than 63 bytes"):
        write_gguf(p, "llama", {}, {"x" * 64: t})
    assert not list(tmp_path.iterdir())
