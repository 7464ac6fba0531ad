"""A model's GGUF held in memory, not in a file: what the loaders read of a GGUFFile
(metadata with its types, tensors by name), with each tensor's blocks made when a loader
asks for them and not kept here, so that a model larger than the host's RAM can be built
where its parts will live, a tensor at a time (strata.convert.flash_shape_memory)."""
from __future__ import annotations

import mmap
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

import quant
from strata.tensors import QTensor, stand_in

from .reader import GGUFFile


def _untouched_zeros(shape: tuple[int, int]) -> np.ndarray:
    """uint8 zeros in pages never touched: anonymous memory mapped without reserving it, so
    that a table larger than the host's RAM (the PLE table, under a trace) costs nothing."""
    n = max(1, shape[0] * shape[1])
    # MAP_NORESERVE: Linux's 0x4000 (Python's mmap names it from 3.13 on)
    noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | noreserve
    return np.frombuffer(mmap.mmap(-1, n, flags=flags), np.uint8)[:shape[0] * shape[1]].reshape(shape)


class MemoryGGUF(GGUFFile):
    """`metadata`: (key, value, type) as a writer takes them (an array's element type);
    `shapes`: tensor name -> (format name, logical shape in torch order); `make(name)`:
    its blocks, uint8 (rows, row bytes), made at each `tensor(name)`. `tensors` gives every
    tensor's format, shape and size with a zero-stride stand-in for its data; a loader reads
    the blocks through `tensor`. Under a fake device (strata.runtime.trace) nothing reads the
    blocks: `tensor` gives zeros of their size (pages never touched, nor reserved) instead.
    `path` names the model; no file lies there."""

    def __init__(self, name: str, metadata: list[tuple], shapes: dict[str, tuple[str, tuple[int, ...]]],
                 make: Callable[[str], np.ndarray]):
        self.path, self.size = Path(name), 0
        # a FLOAT32 value as a file gives it back: rounded to float32
        self.metadata = {k: np.asarray(v, np.float32).tolist() if t == GGUFValueType.FLOAT32 else v
                         for k, v, t in metadata}
        self.metadata_types = {k: t for k, _, t in metadata}
        self._make = make
        self.tensors = {}
        for tname, (fmt_name, shape) in shapes.items():
            fmt = quant.get(fmt_name)
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            self.tensors[tname] = QTensor(tname, fmt, tuple(shape), stand_in((rows, fmt.row_bytes(shape[-1]))))

    def tensor(self, name: str) -> QTensor:
        t = super().tensor(name)  # a missing name: GGUFFile's error
        from triton_kernels import backend  # torch: at first use, not on import
        data = _untouched_zeros(t.data.shape) if backend.faking() else self._make(name)
        if data.shape != t.data.shape or data.dtype != np.uint8:
            raise ValueError(f"{self.path}: tensor {name!r} was made as {data.dtype} {data.shape}, "
                             f"not uint8 {t.data.shape}")
        return QTensor(name, t.fmt, t.shape, data)

    def __repr__(self) -> str:
        return f"MemoryGGUF({str(self.path)!r}, arch={self.get('general.architecture')}, {len(self.tensors)} tensors)"
