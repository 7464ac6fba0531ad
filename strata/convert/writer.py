"""A GGUF writer that streams: tensor infos first, then each tensor's data as it is made.

strata.gguf.write_gguf holds every tensor in memory until it writes; a checkpoint of
hundreds of GB cannot be held, so here the header, metadata and tensor infos (names,
shapes, types, sizes, planned beforehand) are written first and the data follows one
tensor at a time, a large tensor (the PLE table) even one piece at a time. The bytes are
the ones gguf-py's GGUFWriter writes for the same tensors, padding included.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState

from strata.gguf.writer import MAX_NAME_BYTES, complete_or_absent, typed_value


class Progress:
    """One line on stderr: tensors done, MB written, the current tensor. Rewritten in place
    on a terminal; elsewhere (logs, CI) one line per tensor."""

    def __init__(self, label: str, n_tensors: int, total_bytes: int, stream=None, enabled: bool = True):
        self.label, self.n, self.total = label, n_tensors, total_bytes
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = self.written = 0
        self.t0 = time.perf_counter()

    def tensor(self, name: str, fmt: str, nbytes: int) -> None:
        self.done += 1
        self.written += nbytes
        if not self.enabled:
            return
        mb, total = self.written / 1e6, self.total / 1e6
        line = (f"{self.label}: [{self.done:{len(str(self.n))}d}/{self.n}] {mb:9.1f}/{total:.1f} MB  "
                f"{fmt:5s} {name}")
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if self.done == self.n:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, path: Path) -> None:
        if self.enabled:
            dt = time.perf_counter() - self.t0
            self.stream.write(f"{self.label}: wrote {path} ({self.written / 1e6:.1f} MB of tensors, "
                              f"{self.n} tensors) in {dt:.1f} s\n")
            self.stream.flush()


def write_streamed(path: str | os.PathLike, arch: str, metadata: Iterable[tuple[str, Any, GGUFValueType]],
                   infos: list[tuple[str, tuple[int, ...], Any]],
                   data: Callable[[int], Iterator[np.ndarray]], progress: Progress | None = None) -> Path:
    """Write `path`: `metadata` as (key, value, type) (an array's element type), `infos` as
    (name, logical shape in torch order, quant.Format), and for tensor i the uint8 pieces
    `data(i)` yields, which must add up to its size. The file appears complete or not at all."""
    path = Path(path)
    where = f"writing {path}"
    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(tmp, arch)
    for key, value, vtype in metadata:
        value, vtype, sub = typed_value(f"{where}: metadata key {key!r}", (value, vtype))
        w.add_key_value(key, value, vtype, sub)
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
