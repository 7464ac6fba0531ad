"""Reading GGUF files into quantized tensors, with one clear error per kind of bad file.

gguf-py's `GGUFReader` parses the header, metadata and tensor infos; on a bad file it fails
with whatever numpy says (a dtype view or reshape error), so the reader here checks the
magic and version first, turns a read past the end of the file into a "truncated" error,
and validates every tensor info (type, shape, byte range) itself before viewing any data.
"""
from __future__ import annotations

import difflib
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

import quant
from strata.tensors import QTensor

MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses tensors with more
_VALUE_TYPES = {int(t) for t in GGUFValueType}


class GGUFError(ValueError):
    """A GGUF file Strata cannot use; the message names the file and what is wrong."""


class _Truncated(Exception):
    def __init__(self, section: str, end: int):
        self.section, self.end = section, end


class _Corrupt(Exception):
    pass


class _Reader(GGUFReader):
    """GGUFReader that reports a read past the end of the file as truncation of the part
    being parsed, and leaves the tensor data to GGUFFile (its own tensor views compute
    sizes with numpy integers that can overflow, and fail with reshape errors)."""

    section = "header"

    def __init__(self, path, mode="r"):
        try:
            super().__init__(path, mode)
        except (_Truncated, _Corrupt):
            raise
        except Exception as e:  # duplicate keys, unknown value types, bad alignment, bad UTF-8
            raise _Corrupt(f"corrupt {self.section}: {type(e).__name__}: {e}") from e

    def _get(self, offset, dtype, count=1, override_order=None):
        # numpy slicing past the end returns a short array silently; catch it here
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > self.data.shape[0]:
            raise _Truncated(self.section, end)
        return super()._get(offset, dtype, count, override_order)

    def _get_str(self, offset):
        # remembered so that a bad value type can name its key, read just before it
        self._last_str = out = super()._get_str(offset)
        return out

    def _get_field_parts(self, orig_offs, raw_type):
        if int(raw_type) not in _VALUE_TYPES:
            key = bytes(self._last_str[1]).decode("utf-8", "replace")
            raise _Corrupt(f"metadata key {key!r} has unknown value type {int(raw_type)} "
                           f"(at byte {orig_offs})")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs, count):
        self.section = "metadata"
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs, count):
        self.section = "tensor infos"
        return super()._build_tensor_info(offs, count)

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
            raise GGUFError(f"{self.path}: truncated file: the {e.section} run past the end "
                            f"(they need at least {e.end} bytes, the file has {self.size})") from None
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

    def typed_metadata(self) -> dict[str, tuple[Any, GGUFValueType]]:
        """Metadata as (value, type) pairs (the element type for arrays), which `write_gguf`
        takes to write the same types back."""
        return {k: (v, self.metadata_types[k]) for k, v in self.metadata.items()}

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.get('general.architecture')}, {len(self.tensors)} tensors)"


def _near(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)
