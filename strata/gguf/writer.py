"""Writing GGUF v3 files from metadata and quantized tensors, through gguf-py's GGUFWriter.

Metadata types follow the Python value unless given as `(value, GGUFValueType)`:

    str -> STRING, bool -> BOOL, float -> FLOAT32,
    int -> UINT32, or INT64 when negative, or UINT64 when at least 2**32,
    numpy scalars and 1-D arrays -> their own dtype,
    list/tuple -> ARRAY of one of the above (ints typed by the list's range).

For an array the override names the element type: `([1, 2], GGUFValueType.INT32)`.
llama.cpp checks the type of each key it reads, so give the type it expects where the
default differs (`GGUFFile.typed_metadata()` keeps the types a file was written with).
"""
from __future__ import annotations

import os
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState

from strata.tensors import QTensor

from .reader import MAX_DIMS, PackedArray

MAX_NAME_BYTES = 63  # GGML_MAX_NAME less the terminating NUL

_BY_DTYPE = {
    np.dtype(np.uint8): GGUFValueType.UINT8, np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16, np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32, np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.uint64): GGUFValueType.UINT64, np.dtype(np.int64): GGUFValueType.INT64,
    np.dtype(np.float32): GGUFValueType.FLOAT32, np.dtype(np.float64): GGUFValueType.FLOAT64,
    np.dtype(np.bool_): GGUFValueType.BOOL,
}
_INTS = {t for t in _BY_DTYPE.values() if t.name[:3] in ("UIN", "INT")}
_FLOATS = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


def _int_type(lo: int, hi: int) -> GGUFValueType:
    if lo >= 0 and hi < 2**32:
        return GGUFValueType.UINT32
    if lo < 0:
        return GGUFValueType.INT64
    return GGUFValueType.UINT64


def _scalar_type(v: Any) -> GGUFValueType | None:
    if isinstance(v, np.generic):
        return _BY_DTYPE.get(v.dtype)
    if isinstance(v, bool):  # before int: bool is an int
        return GGUFValueType.BOOL
    if isinstance(v, int):
        return _int_type(v, v)
    if isinstance(v, float):
        return GGUFValueType.FLOAT32
    if isinstance(v, str):
        return GGUFValueType.STRING
    return None


def _fits(v: Any, t: GGUFValueType) -> bool:
    if t == GGUFValueType.STRING:
        return isinstance(v, str)
    if t == GGUFValueType.BOOL:
        return isinstance(v, (bool, np.bool_))
    ok = (int, np.integer) if t in _INTS else (int, float, np.integer, np.floating)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, ok):
        return False
    try:  # the range check gguf-py would otherwise fail on mid-write
        struct.pack("<" + GGUFWriter._simple_value_packing[t], v.item() if isinstance(v, np.generic) else v)
    except (struct.error, OverflowError):
        return False
    return True


def _fits_fast(v: Any, t: GGUFValueType) -> bool:
    """The type check of `_fits` without the range check (done at an array's extremes)."""
    if t == GGUFValueType.STRING:
        return isinstance(v, str)
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


class _Writer(GGUFWriter):
    """GGUFWriter, packing an array of strings or numbers in one join or one struct.pack
    where gguf-py packs item by item (a tokenizer's arrays: a second of Python), and a
    PackedArray by copying its bytes; the same bytes."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:
        if isinstance(val, PackedArray) and vtype == GGUFValueType.ARRAY:
            head = (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", val.item_type, val.count)
            return head + val.data.tobytes()
        if (vtype == GGUFValueType.ARRAY and sub_type is not None and isinstance(val, (list, tuple)) and val
                and self.endianess == GGUFEndian.LITTLE):
            head = (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", sub_type, len(val))
            if sub_type == GGUFValueType.STRING:
                enc = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
                return head + b"".join(struct.pack("<Q", len(e)) + e for e in enc)
            fmt = self._simple_value_packing.get(sub_type)
            if fmt is not None and sub_type != GGUFValueType.BOOL:
                return head + struct.pack(f"<{len(val)}{fmt}", *val)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def typed_value(where: str, value: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """(value, type, element type for arrays) for GGUFWriter.add_key_value."""
    vtype = None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        value, vtype = value
        if vtype == GGUFValueType.ARRAY:
            raise ValueError(f"{where}: give an array's element type, not ARRAY")
    if isinstance(value, PackedArray):  # a file's bytes: read and checked there
        if vtype not in (None, value.item_type):
            raise ValueError(f"{where}: an array of {value.item_type.name} given as {vtype.name}")
        return value, GGUFValueType.ARRAY, value.item_type
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"{where}: numpy arrays must be 1-D, got shape {value.shape}")
        vtype = _BY_DTYPE.get(value.dtype) if vtype is None else vtype
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        items = list(value)
        if not items:
            raise ValueError(f"{where}: empty arrays cannot be written (gguf-py refuses them); "
                             f"leave the key out")
        if vtype is None:
            types = {_scalar_type(v) for v in items}
            if types <= _INTS and not any(isinstance(v, np.generic) for v in items):
                vtype = _int_type(min(items), max(items))
            elif len(types) == 1 and None not in types:
                vtype = types.pop()
            else:
                kinds = sorted({type(v).__name__ for v in items})
                raise ValueError(f"{where}: array items must be all str, all bool, all int or all "
                                 f"float, got {', '.join(kinds)}; nested lists are not supported")
        bad = None
        if vtype == GGUFValueType.STRING or vtype in _INTS:  # a tokenizer's 49k strings or ids, cheaply
            if not set(map(type, items)) <= ({str} if vtype == GGUFValueType.STRING else {int}):
                bad = next((v for v in items if not _fits_fast(v, vtype)), None)
        if vtype in _INTS and bad is None:  # every item an int: the range at the extremes
            bad = next((v for v in (min(items), max(items)) if not _fits(v, vtype)), None)
        elif vtype != GGUFValueType.STRING and bad is None:
            bad = next((v for v in items if not _fits(v, vtype)), None)
        if bad is not None:
            raise ValueError(f"{where}: array item {bad!r} is not a valid {vtype.name}")
        if vtype in _INTS:
            items = [int(v) for v in items]
        return items, GGUFValueType.ARRAY, vtype
    vtype = _scalar_type(value) if vtype is None else vtype  # UINT8 is 0: test for None
    if vtype is None:
        raise ValueError(f"{where}: cannot store a {type(value).__name__} in GGUF metadata; use "
                         f"str, int, float, bool or a list of one of them")
    if not _fits(value, vtype):
        raise ValueError(f"{where}: {value!r} is not a valid {vtype.name}")
    if isinstance(value, np.generic):
        value = value.item()
    return (int(value) if vtype in _INTS else value), vtype, None


def _check_tensor(where: str, name: str, t: QTensor) -> np.ndarray:
    """The data as contiguous uint8 (rows, row bytes), checked against the shape and format."""
    shape = tuple(int(n) for n in t.shape)
    if not 1 <= len(shape) <= MAX_DIMS or min(shape) < 1:
        raise ValueError(f"{where}: tensor {name!r} has shape {shape}; GGUF takes 1 to "
                         f"{MAX_DIMS} dimensions, each at least 1")
    try:
        row_bytes = t.fmt.row_bytes(shape[-1])
    except ValueError as e:
        raise ValueError(f"{where}: tensor {name!r}: {e}") from None
    data = np.asarray(t.data)
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if data.dtype != np.uint8 or data.nbytes != rows * row_bytes:
        raise ValueError(f"{where}: tensor {name!r} ({t.fmt.name}, shape {shape}) needs "
                         f"{rows * row_bytes} bytes of uint8 blocks, got {data.nbytes} bytes of "
                         f"{data.dtype}")
    return np.ascontiguousarray(data).reshape(rows, row_bytes)


def write_gguf(path: str | os.PathLike, arch: str, metadata: Mapping[str, Any],
               tensors: Iterable[QTensor] | Mapping[str, QTensor]) -> Path:
    """Write a GGUF v3 file: `general.architecture` = `arch`, then `metadata` in order,
    then the tensors' raw blocks in order (a mapping's keys name its tensors). The file
    appears complete or not at all: it is written beside `path` and renamed into place."""
    where = f"write_gguf({path})"
    items = list(tensors.items()) if isinstance(tensors, Mapping) else [(t.name, t) for t in tensors]
    seen, data = set(), []
    for name, t in items:
        if name in seen:
            raise ValueError(f"{where}: tensor {name!r} is given twice")
        seen.add(name)
        data.append(_check_tensor(where, name, t))
    infos = [(name, t.shape, t.fmt) for name, t in items]
    return _write(Path(path), where, arch, metadata.items(), infos, lambda i: iter((data[i],)))


def write_streamed(path: str | os.PathLike, arch: str, metadata: Iterable[tuple[str, Any, GGUFValueType]],
                   infos: list[tuple[str, tuple[int, ...], Any]],
                   data: Callable[[int], Iterator[np.ndarray]], progress=None) -> Path:
    """Write `path` as it is made: the header, metadata and tensor infos first, then the
    tensors one by one, so that none needs to be held beyond its own writing. `metadata` is
    (key, value, type) (an array's element type), `infos` (name, logical shape in torch
    order, quant.Format), and tensor i is the uint8 pieces `data(i)` yields (asked for in
    order), which must add up to its size. `progress`, if given, is told of each tensor
    written (`.tensor(name, format name, bytes)`) and of the end (`.finish(path)`). The
    file appears complete or not at all, its bytes those gguf-py's GGUFWriter writes."""
    return _write(Path(path), f"writing {path}", arch, ((k, (v, t)) for k, v, t in metadata),
                  infos, data, progress)


def _add_metadata(w: GGUFWriter, where: str, arch: str, items: Iterable[tuple[str, Any]]) -> None:
    """Each (key, value or (value, type)) in order; general.architecture is written first by
    GGUFWriter (from `arch`, which it must agree with), general.alignment also pads the data."""
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"{where}: arch must be a non-empty string, got {arch!r}")
    for key, value in items:
        at = f"{where}: metadata key {key!r}"
        if not isinstance(key, str) or not key:
            raise ValueError(f"{where}: metadata key {key!r} must be a non-empty string")
        value, vtype, sub = typed_value(at, value)
        if key == "general.architecture":
            if value != arch:
                raise ValueError(f"{at} is {value!r} but arch is {arch!r}; drop the key or make "
                                 f"them agree")
            continue
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32 or value < 1 or value & (value - 1):
                raise ValueError(f"{at} must be a UINT32 power of two, got {value!r} ({vtype.name})")
            w.add_custom_alignment(value)  # also pads the tensor data to it
            continue
        w.add_key_value(key, value, vtype, sub)


def _write(path: Path, where: str, arch: str, metadata: Iterable[tuple[str, Any]],
           infos: list[tuple[str, tuple[int, ...], Any]], data: Callable[[int], Iterator[np.ndarray]],
           progress=None) -> Path:
    """write_gguf and write_streamed: everything but the data checked before the file opens."""
    tmp = path.with_name(path.name + ".partial")
    w = _Writer(tmp, arch)
    _add_metadata(w, where, arch, metadata)
    sizes = []
    for name, shape, fmt in infos:
        if len(name.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"{where}: tensor name {name!r} is longer than {MAX_NAME_BYTES} bytes")
        row = fmt.row_bytes(shape[-1])
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row
        w.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8), nbytes,
                          raw_dtype=GGMLQuantizationType(fmt.type_id))
        sizes.append(nbytes)
    with complete_or_absent(w, tmp, path):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        for i, (name, _, fmt) in enumerate(infos):
            w.tensors[0].pop(name)
            w.write_padding(fout, fout.tell())  # as GGUFWriter.write_tensor_data, around each tensor
            n = 0
            for piece in data(i):
                piece = np.ascontiguousarray(piece).view(np.uint8)
                piece.tofile(fout)
                n += piece.nbytes
            if n != sizes[i]:
                raise AssertionError(f"{where}: tensor {name!r} produced {n} bytes, planned {sizes[i]}")
            w.write_padding(fout, n)
            w.state = WriterState.WEIGHTS
            if progress is not None:
                progress.tensor(name, fmt.name, n)
    if progress is not None:
        progress.finish(path)
    return path


@contextmanager
def complete_or_absent(w: GGUFWriter, tmp: Path, path: Path):
    """The block writes `w` to `tmp`; on success it becomes `path`, on any error `tmp` goes:
    a reader never meets a half-written file at `path`."""
    try:
        yield
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
