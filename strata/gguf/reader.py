"""Reading GGUF files into quantized tensors, with one clear error per kind of bad file.

gguf-py's `GGUFReader` parses the header, metadata and tensor infos; on a bad file it fails
with whatever numpy says (a dtype view or reshape error), so the reader here checks the
magic and version first, turns a read past the end of the file into a "truncated" error
naming the metadata key or tensor being read, checks each count and length against the
bytes left in the file before looping over it, and validates every tensor info (type,
shape, byte range) itself before viewing any data. An array value is read in bulk (gguf-py
reads one item at a time, two numpy views a string: 13 s for a 150,000-token vocabulary):
numbers as one view, strings by one walk over their length prefixes and one UTF-8 decode.
"""
from __future__ import annotations

import difflib
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS, ReaderField

import quant
from strata.tensors import QTensor

MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses tensors with more
_VALUE_TYPES = {int(t) for t in GGUFValueType}
_ARRAY = int(GGUFValueType.ARRAY)


class GGUFError(ValueError):
    """A GGUF file Strata cannot use; the message names the file and what is wrong."""


class _Truncated(Exception):
    def __init__(self, section: str, end: int, item: str = "", detail: str = ""):
        self.section, self.end, self.item, self.detail = section, end, item, detail


class _Corrupt(Exception):
    pass


# The fewest bytes one of each can take: a count in the file that cannot fit in what is
# left of it is an error before anything loops over it or allocates for it.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, ggml type, data offset
_VALUE_BYTES = {t: np.dtype(d).itemsize for t, d in GGUFReader.gguf_scalar_to_np.items()}
_VALUE_BYTES[GGUFValueType.STRING] = 8  # its length
# numpy refuses a shape whose nonzero dimensions multiply past 2**63 bytes, even with no
# elements; 8-byte items cover every dtype a tensor is viewed or dequantized as.
MAX_ELEMENTS = 2**63 // 8


@dataclass(frozen=True)
class PackedArray:
    """A non-empty array value as a GGUF file holds it: the item type, the count and the
    items' bytes (each string with its u64 length prefix), little-endian. The writer copies
    the bytes as they are: a tokenizer's 100,000 strings are neither decoded nor encoded
    again (a quarter of a second of Python for SmolLM2's 98,000)."""
    item_type: GGUFValueType
    count: int
    data: np.ndarray  # uint8

    def __len__(self) -> int:
        return self.count


class _Array(ReaderField):
    """An array value read in bulk: `parts` are [key length, key, value type (ARRAY), item
    type, count, items], where items is one view of the whole array (for strings, its bytes:
    each string's u64 length prefix and text), and `offsets` (strings only) where each length
    prefix starts in items, and where items end. `contents` gives what gguf-py's does for the
    same bytes (its per-item parse): the same list of Python values, the same
    UnicodeDecodeError for a string that is not UTF-8."""

    offsets: np.ndarray | None = None

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        items = self.parts[-1]
        if self.offsets is None:  # numbers (or an empty array of anything)
            return items.tolist()[index_or_slice]
        if index_or_slice == slice(None):
            strings = _decode_strings(items, self.offsets)
            if strings is not None:
                return strings
        # one string, some, or all where one is not UTF-8: each decoded alone, in order
        spans = list(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist()))[index_or_slice]
        if isinstance(index_or_slice, int):
            return _utf8(items[spans[0] + 8:spans[1]])
        return [_utf8(items[a + 8:b]) for a, b in spans]


def _utf8(raw: np.ndarray) -> str:
    return str(raw.tobytes(), encoding="utf-8")  # as gguf-py's ReaderField.contents


def _decode_strings(items: np.ndarray, offsets: np.ndarray) -> list[str] | None:
    """Every string of a string array's bytes (`items`, with the length prefix of each at
    `offsets[:-1]`, and their end at `offsets[-1]`), by one decode of their texts joined;
    None where some string is not UTF-8 on its own (the caller decodes each to say which)."""
    n = len(offsets) - 1
    lens = np.diff(offsets) - 8
    keep = np.ones(len(items), dtype=bool)
    keep[(offsets[:-1, None] + np.arange(8)).ravel()] = False  # the length prefixes
    text_bytes = items[keep]
    try:
        text = text_bytes.tobytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=starts[1:])
    if len(text) == len(text_bytes):  # ASCII: a character a byte
        cuts = starts.tolist()
    else:
        # The joined texts decode, so each string is UTF-8 on its own exactly when each
        # starts a character (no string ends inside a character the next one completes).
        lead = (text_bytes & 0xC0) != 0x80
        if not lead[starts[:-1][lens > 0]].all():
            return None
        chars = np.zeros(len(text_bytes) + 1, dtype=np.int64)
        np.cumsum(lead, out=chars[1:])
        cuts = chars[starts].tolist()
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


class _Reader(GGUFReader):
    """GGUFReader that reports a read past the end of the file as truncation of the part
    being parsed, naming the metadata key or tensor info it was reading, checks every count
    against the bytes left before looping over it, and leaves the tensor data to GGUFFile
    (its own tensor views compute sizes with numpy integers that can overflow, and fail
    with reshape errors)."""

    section = "header"
    item = ""  # the metadata key or tensor info being parsed, for errors

    def __init__(self, path, mode="r"):
        try:
            super().__init__(path, mode)
        except (_Truncated, _Corrupt):
            raise
        except Exception as e:  # duplicate keys, and whatever else gguf-py refuses
            where = f" ({self.item})" if self.item else ""
            raise _Corrupt(f"corrupt {self.section}: {type(e).__name__}: {e}{where}") from e

    def _get(self, offset, dtype, count=1, override_order=None):
        # numpy slicing past the end returns a short array silently; catch it here
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > self.data.shape[0]:
            raise _Truncated(self.section, end, self.item)
        return super()._get(offset, dtype, count, override_order)

    def _get_str(self, offset):
        slen = self._get(offset, np.uint64)
        n = int(slen[0])
        if int(offset) + 8 + n > self.data.shape[0]:
            raise _Truncated(self.section, int(offset) + 8 + n, self.item,
                             f"a string of {n} bytes; the file is cut short, or that length is corrupt")
        return slen, GGUFReader._get(self, offset + 8, np.uint8, n)  # checked just above

    def _decode(self, raw, what: str) -> str:
        try:
            return str(bytes(raw), encoding="utf-8")
        except UnicodeDecodeError as e:
            raise _Corrupt(f"{self.item}: {what} is not UTF-8 ({e})") from None

    def _fit(self, offs: int, count: int, each: int, what: str) -> None:
        if offs + count * each > self.data.shape[0]:
            raise _Truncated(self.section, offs + count * each, "",
                             f"the header counts {count} {what}, of at least {each} bytes each; "
                             f"the file is cut short, or that count is corrupt")

    def _get_field_parts(self, orig_offs, raw_type):
        vtype = int(raw_type)
        if vtype not in _VALUE_TYPES:
            raise _Corrupt(f"{self.item} has unknown value type {vtype} (at byte {orig_offs})")
        if vtype == _ARRAY:  # _build_fields reads arrays with _get_array; this is gguf-py's loop
            self._array_header(orig_offs)
        return super()._get_field_parts(orig_offs, raw_type)

    def _array_header(self, orig_offs):
        """An array's item type and count, checked before anything loops over the items: an
        empty array's item type is read later (metadata_types), and a huge count would
        loop to the end. (raw item type, raw count, item type, count)."""
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = int(raw_itype[0]), int(alen[0])  # ints: an enum member looked up per item is slow
        if itype == _ARRAY:
            raise _Corrupt(f"{self.item} is an array of arrays (at byte {orig_offs}), which "
                           f"GGUF readers (llama.cpp, Strata) do not accept")
        if itype not in _VALUE_TYPES:
            raise _Corrupt(f"{self.item} is an array of unknown value type {itype} "
                           f"(at byte {orig_offs})")
        gtype = GGUFValueType(itype)
        end = orig_offs + 12 + n * _VALUE_BYTES[gtype]
        if end > self.data.shape[0]:
            raise _Truncated(self.section, end, self.item,
                             f"an array of {n} {gtype.name} items; the file "
                             f"is cut short, or that count is corrupt")
        return raw_itype, alen, gtype, n

    def _get_array(self, orig_offs):
        """An array value at orig_offs, read in bulk: (its size in bytes, parts [item type,
        count, items], types, and for strings the offsets in items of each length prefix
        and of the end, else None)."""
        raw_itype, alen, gtype, n = self._array_header(orig_offs)
        start = orig_offs + 12
        types = [GGUFValueType.ARRAY] + ([gtype] if n else [])  # as gguf-py: no item type when empty
        if gtype != GGUFValueType.STRING:
            items = self._get(start, GGUFReader.gguf_scalar_to_np[gtype], n)
            return 12 + int(items.nbytes), [raw_itype, alen, items], types, None
        offsets = self._string_offsets(start, n)
        items = np.asarray(self.data[start:start + int(offsets[-1])])  # no memmap: slices are cheap
        return 12 + len(items), [raw_itype, alen, items], types, offsets

    def _string_offsets(self, start: int, n: int) -> np.ndarray:
        """Where each of n strings from `start` has its u64 length prefix, and where the last
        ends, relative to `start`: one walk over the prefixes, checked against the file's
        end as gguf-py's per-string reads (the checked walk names the string cut short)."""
        unpack = struct.Struct("<Q" if (self.byte_order == "I") == (sys.byteorder == "little")
                               else ">Q").unpack_from
        size = self.data.shape[0]
        buf = memoryview(self.data)
        offsets = []
        at = offsets.append
        o = start
        try:
            for _ in range(n):
                at(o)
                o += 8 + unpack(buf, o)[0]
        except (struct.error, OverflowError):  # a length prefix past the end of the file
            o = size + 1
        if o > size:  # some string runs past the end: say which, as the per-string read did
            self._walk_checked(start, n)
        at(o)
        return np.array(offsets, dtype=np.int64) - start

    def _walk_checked(self, o: int, n: int) -> None:
        """The walk over n strings from o one at a time, through _get_str's checks: raises
        _Truncated naming the first string (or length prefix) that runs past the end."""
        for _ in range(n):
            _, text = self._get_str(o)
            o += 8 + len(text)
        raise _Truncated(self.section, o, self.item)  # not reached: the fast walk ran past the end

    def _build_fields(self, offs, count):
        # gguf-py's loop, naming each key for errors and decoding it here
        self.section = "metadata"
        count = int(count)
        self._fit(offs, count, _MIN_KV_BYTES, "metadata keys")
        for i in range(count):
            self.item = f"metadata key number {i}"
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            key = self._decode(kv_kdata, "its name")
            self.item = f"metadata key {key!r}"
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            parts = [kv_klen, kv_kdata, raw_kv_type]
            if int(raw_kv_type[0]) == _ARRAY:
                size, field_parts, field_types, offsets = self._get_array(offs)
                field = _Array(orig_offs, key, parts + field_parts, [len(parts) + 2], field_types)
                field.offsets = offsets
            else:
                size, field_parts, field_idxs, field_types = self._get_field_parts(offs, raw_kv_type[0])
                parts += field_parts
                field = ReaderField(orig_offs, key, parts, [k + 3 for k in field_idxs], field_types)
            self._push_field(field, skip_sum=True)
            offs += size
        self.item = ""
        return offs

    def _build_tensor_info(self, offs, count):
        self.section = "tensor infos"
        count = int(count)
        self._fit(offs, count, _MIN_TENSOR_INFO_BYTES, "tensors")
        fields = []
        for i in range(count):
            self.item = f"tensor info number {i}"
            orig_offs = offs
            name_len, name_data = self._get_str(offs)
            offs += int(name_len.nbytes + name_data.nbytes)
            name = self._decode(name_data, "its name")
            self.item = f"tensor {name!r}"
            n_dims = self._get(offs, np.uint32)
            offs += 4
            if int(n_dims[0]) > MAX_DIMS:  # before reading that many dims
                raise _Corrupt(f"tensor {name!r} has {int(n_dims[0])} dimensions; GGUF allows "
                               f"1 to {MAX_DIMS}")
            dims = self._get(offs, np.uint64, n_dims[0])
            offs += int(dims.nbytes)
            raw_dtype = self._get(offs, np.uint32)
            offset_tensor = self._get(offs + 4, np.uint64)
            offs += 12
            fields.append(ReaderField(orig_offs, name,
                                      [name_len, name_data, n_dims, dims, raw_dtype, offset_tensor],
                                      [1, 3, 4, 5]))
        self.item = ""
        self._check_alignment()
        return offs, fields

    def _check_alignment(self) -> None:
        # gguf-py checks it next, but as "corrupt tensor infos"; name the key instead
        field = self.fields.get("general.alignment")
        if field is None:
            return
        value = field.parts[-1].tolist()[0] if field.types == [GGUFValueType.UINT32] else None
        if not value or value & (value - 1):
            try:
                shown = repr(field.contents())
            except UnicodeDecodeError:
                shown = "a string that is not UTF-8"
            raise _Corrupt(f"metadata key 'general.alignment' is {shown} ({field.types[0].name}); "
                           f"it must be a UINT32 power of two")

    def _build_tensors(self, start_offs, fields):
        self.tensor_fields = fields


def _check_header(path: Path) -> None:
    """Magic, byte order and version, before gguf-py maps the file."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head:
        raise GGUFError(f"{path}: not a GGUF file: it is empty")
    if head[:4] != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file: it starts with {head[:4]!r}, not {MAGIC!r}")
    if len(head) < HEADER_BYTES:
        raise GGUFError(f"{path}: truncated file: the {HEADER_BYTES}-byte header is cut short "
                        f"at {len(head)} bytes")
    (version,) = struct.unpack("<I", head[4:8])
    supported = " and ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
    if version & 0xFFFF == 0 and version >> 16:
        # a version written big-endian reads as a multiple of 65536 here
        raise GGUFError(f"{path}: big-endian GGUF file (version {version >> 24}, stored "
                        f"big-endian); Strata reads little-endian GGUF only: convert it with "
                        f"gguf-py's gguf_convert_endian script")
    if version not in READER_SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported; Strata reads "
                        f"versions {supported}")


def _type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return "not a ggml type"


class GGUFFile:
    """A GGUF file, opened read-only: `metadata` (key -> Python value, in file order),
    `metadata_types` (key -> GGUFValueType; an array's element type), `tensors` (name ->
    QTensor whose data is a zero-copy, read-only view of the file)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        _check_header(self.path)
        self.size = self.path.stat().st_size
        try:
            self._reader = _Reader(self.path, "r")
        except _Truncated as e:
            where = ", ".join(filter(None, (e.item, e.detail)))
            raise GGUFError(f"{self.path}: truncated file: the {e.section} run past the end "
                            f"(they need at least {e.end} bytes, the file has {self.size})"
                            f"{': ' + where if where else ''}") from None
        except _Corrupt as e:
            raise GGUFError(f"{self.path}: {e}") from None
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, GGUFValueType] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):  # header entries gguf-py lists as fields
                continue
            try:
                self.metadata[key] = field.contents()
            except UnicodeDecodeError as e:
                raise GGUFError(f"{self.path}: metadata key {key!r} holds a string that is not "
                                f"UTF-8: {e}") from None
            vtype = field.types[0]
            if vtype == GGUFValueType.ARRAY:
                vtype = GGUFValueType(int(field.parts[3][0]))  # element type, even when empty
            self.metadata_types[key] = vtype
        self.tensors: dict[str, QTensor] = {}
        self._load_tensors()

    def _load_tensors(self) -> None:
        r = self._reader
        align = int(r.alignment)
        spans = []
        for field in r.tensor_fields:
            _, _, _, dims, raw_type, rel_offset = field.parts
            name = field.name
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice in the tensor infos")
            type_id = int(raw_type[0])
            try:
                fmt = quant.get(type_id)
            except ValueError:
                known = ", ".join(f"{f.name} ({f.type_id})" for f in quant.FORMATS.values())
                raise GGUFError(f"{self.path}: tensor {name!r} has ggml type {type_id} "
                                f"({_type_name(type_id)}), which Strata does not read; "
                                f"supported: {known}") from None
            shape = tuple(int(n) for n in reversed(dims.tolist()))  # ne reversed: torch order
            if not 1 <= len(shape) <= MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name!r} has {len(shape)} dimensions; "
                                f"GGUF allows 1 to {MAX_DIMS}")
            try:
                row_bytes = fmt.row_bytes(shape[-1])
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} ({fmt.name}, shape {shape}): rows of "
                                f"{shape[-1]} weights are not a whole number of {fmt.block_elems}-"
                                f"weight blocks; its shape does not match its data") from None
            rows = 1
            for n in shape[:-1]:
                rows *= n
            rel = int(rel_offset[0])
            if rel % align:
                raise GGUFError(f"{self.path}: tensor {name!r} data offset {rel} is not a "
                                f"multiple of the file's alignment ({align} bytes)")
            start = r.data_offset + rel
            end = start + rows * row_bytes
            if end > self.size:
                raise GGUFError(f"{self.path}: tensor {name!r} data at bytes [{start}, {end}) runs "
                                f"past the end of the file ({self.size} bytes): the file is "
                                f"truncated, or the tensor's offset or shape is corrupt")
            # Only a tensor with a zero dimension, so no bytes, gets here with a shape this
            # large; numpy refuses it all the same (the zero dimensions left out, its elements
            # must fit in MAX_ELEMENTS), and llama.cpp takes at most 2**63 - 1 elements.
            count = 1
            for n in shape:
                count *= n or 1
            if count >= MAX_ELEMENTS:
                raise GGUFError(f"{self.path}: tensor {name!r} ({fmt.name}) has shape {shape}: 2**60 "
                                f"or more elements, zero dimensions left out; its shape is corrupt")
            spans.append((start, end, name, fmt, shape))
            data = np.asarray(r.data[start:end]).reshape(rows, row_bytes)  # zero-copy view
            self.tensors[name] = QTensor(name, fmt, shape, data)
        # a shape too large for its data runs into the next tensor (or past the end, above)
        spans.sort()
        for (s0, e0, n0, fmt, shape), (s1, _, n1, _, _) in zip(spans, spans[1:]):
            if e0 > s1:
                raise GGUFError(f"{self.path}: tensor {n0!r} ({fmt.name}, shape {shape}) needs bytes "
                                f"[{s0}, {e0}) but tensor {n1!r} starts at {s1}: its shape does not "
                                f"match its data")

    @property
    def arch(self) -> str:
        return self.require("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing{_near(key, self.metadata)}")
        return self.metadata[key]

    def tensor(self, name: str) -> QTensor:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing{_near(name, self.tensors)}")
        return self.tensors[name]

    def typed_metadata(self, packed: bool = False) -> dict[str, tuple[Any, GGUFValueType]]:
        """Metadata as (value, type) pairs (the element type for arrays), which `write_gguf`
        takes to write the same types back; with `packed`, each non-empty array as the
        file's bytes (a PackedArray), for a writer that copies them."""
        out = {k: (v, self.metadata_types[k]) for k, v in self.metadata.items()}
        if packed:
            for k in out:
                arr = self._packed_array(k)
                if arr is not None:
                    out[k] = (arr, arr.item_type)
        return out

    def _packed_array(self, key: str) -> PackedArray | None:
        field = self._reader.fields[key]
        if not isinstance(field, _Array) or not len(self.metadata[key]):
            return None
        items = field.parts[-1]  # a view of the file: little-endian bytes whatever its dtype
        return PackedArray(self.metadata_types[key], len(self.metadata[key]), np.asarray(items).view(np.uint8))

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.get('general.architecture')}, {len(self.tensors)} tensors)"


def _near(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)
