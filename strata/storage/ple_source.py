"""Where a PLE table is: `find_ple` gives the `PleSource` (file, byte offset, rows, format,
scale) of the table in a GGUF (or in another shard of its set) or a safetensors file.

Layout: GGUF `per_layer_token_embd.weight`, [160, 320001536] in GGUF's order (here rows
first: (320001536, 160)), IQ4_NL (90 B a row, 26.8 GiB) or Q8_0; or a safetensors table
of FP8 e4m3 rows with one global bf16 `weight_scale`.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import quant
from strata.names.qwen4exp import PLE_TABLE
from strata.gguf.shards import shard_files
from strata.storage.io import gib

PLE_TENSOR = PLE_TABLE
PLE_FORMATS = ("F32", "F16", "BF16", "FP8_E4M3", "Q8_0", "Q4_0", "IQ4_NL")


@dataclass(frozen=True)
class PleSource:
    """Where a PLE table's rows sit: `rows` rows of `row_bytes` bytes from `offset` on."""
    path: Path
    tensor: str
    offset: int
    rows: int
    row_dim: int
    fmt: quant.Format
    scale: float | None = None  # FP8 tables: one global scale; None: none

    @property
    def row_bytes(self) -> int:
        return self.fmt.row_bytes(self.row_dim)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def describe(self) -> str:
        return f"{self.path} tensor {self.tensor!r} ({self.rows:,} rows of {self.row_dim} {self.fmt.name}, {gib(self.nbytes)})"


def _ple_format(path: Path, tensor: str, fmt: quant.Format) -> quant.Format:
    if fmt.name not in PLE_FORMATS:
        raise ValueError(f"{path}: tensor {tensor!r} is {fmt.name}; a PLE table is one of "
                         f"{', '.join(PLE_FORMATS)}: requantize it to IQ4_NL or Q8_0")
    return fmt


def _gguf_source(path: Path, tensor: str, opened=None) -> PleSource:
    from strata.gguf import open_gguf
    # the file first, then the rest of its shard set: the released files keep the table
    # alone in shard 2 (REFERENCE §3)
    others = [p for p in shard_files(path) if p != path]
    for p in [path, *others]:
        if not p.is_file():
            continue
        # a file already open is not parsed again (a large vocabulary takes seconds)
        gf = opened if opened is not None and Path(opened.path) == p else open_gguf(p)
        if tensor not in gf.tensors:
            continue
        qt = gf.tensors[tensor]
        if len(qt.shape) != 2:
            raise ValueError(f"{p}: tensor {tensor!r} has shape {qt.shape}; a PLE table is 2-D "
                             f"(rows, row dim)")
        # QTensor.data is a view into the reader's memmap of the whole file: its address
        # less the map's is the tensor's byte offset in the file
        offset = qt.data.ctypes.data - gf._reader.data.ctypes.data
        rows, row_dim = qt.shape
        fmt = _ple_format(p, tensor, qt.fmt)
        del qt, gf
        return PleSource(p, tensor, offset, rows, row_dim, fmt)
    where = " or its other shards" if others else ""
    raise ValueError(f"{path}: no tensor {tensor!r} in this GGUF{where}; pass the file that holds "
                     f"the PLE table with --ple-gguf")


def _fp8_format(path: Path) -> quant.Format:
    try:
        return quant.get("FP8_E4M3")
    except ValueError:
        raise ValueError(f"{path}: an FP8 e4m3 PLE table needs the FP8_E4M3 format in quant/, "
                         f"which this install lacks; convert the table to a GGUF (IQ4_NL or "
                         f"Q8_0) or update Strata") from None


_ST_DTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F8_E4M3": "FP8_E4M3"}


def _safetensors_source(path: Path, tensor: str | None) -> PleSource:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file: shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file: its header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    tables = {k: v for k, v in header.items() if len(v.get("shape", ())) == 2 and v["dtype"] in _ST_DTYPES}
    if tensor is None or tensor not in tables:
        if tensor in header:
            raise ValueError(f"{path}: tensor {tensor!r} is {header[tensor]['dtype']} of shape "
                             f"{header[tensor]['shape']}; a PLE table is a 2-D F32/F16/BF16/F8_E4M3 tensor")
        # by name first, else the one FP8 table (the releases' format), else the only 2-D one
        named = [k for k in tables if k.endswith(PLE_TENSOR)]
        fp8 = [k for k in tables if tables[k]["dtype"] == "F8_E4M3"]
        pick = next((c for c in (named, fp8, list(tables)) if len(c) == 1), None)
        if pick:
            tensor = pick[0]
        else:
            raise ValueError(f"{path}: cannot tell which tensor is the PLE table (2-D candidates: "
                             f"{', '.join(tables) or 'none'}); name it ({PLE_TENSOR!r} is looked for)")
    info = tables[tensor]
    rows, row_dim = info["shape"]
    dtype = _ST_DTYPES[info["dtype"]]
    fmt = _fp8_format(path) if dtype == "FP8_E4M3" else quant.get(dtype)
    start, end = info["data_offsets"]
    if end - start != rows * fmt.row_bytes(row_dim):
        raise ValueError(f"{path}: tensor {tensor!r} holds {end - start} bytes, not the "
                         f"{rows * fmt.row_bytes(row_dim)} its shape {info['shape']} needs")
    scale = None
    stem = tensor[: -len("weight")] if tensor.endswith("weight") else tensor + "."
    for key in (tensor + "_scale", stem + "weight_scale", "weight_scale"):
        if key in header:
            scale = _read_scale(path, 8 + n, key, header[key])
            break
    else:
        if dtype == "FP8_E4M3":
            raise ValueError(f"{path}: FP8 table {tensor!r} has no global scale tensor "
                             f"({tensor + '_scale'!r} or 'weight_scale')")
    return PleSource(path, tensor, 8 + n + start, rows, row_dim, fmt, scale)


def _read_scale(path: Path, data_start: int, key: str, info: dict) -> float:
    start, end = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(data_start + start)
        raw = f.read(end - start)
    kinds = {"BF16": None, "F16": np.float16, "F32": np.float32}
    if info["dtype"] not in kinds or len(raw) != np.dtype(kinds[info["dtype"]] or np.uint16).itemsize:
        raise ValueError(f"{path}: scale {key!r} must be one BF16, F16 or F32 value, got "
                         f"{info['dtype']} of shape {info['shape']}")
    if info["dtype"] == "BF16":
        return float(quant.BF16.dequantize(np.frombuffer(raw, np.uint8))[0])
    return float(np.frombuffer(raw, kinds[info["dtype"]])[0])


def find_ple(path: str | os.PathLike, tensor: str | None = None, opened=None) -> PleSource:
    """The PLE table in a GGUF (or in another shard of its set) or a safetensors file;
    `opened`: that GGUF, already open (a GGUFFile), to read instead of parsing it again."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file (the PLE table's file: --ple-gguf)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _gguf_source(path, tensor or PLE_TENSOR, opened)
    return _safetensors_source(path, tensor)
