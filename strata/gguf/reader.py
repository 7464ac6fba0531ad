"""Reading GGUF files into quantized tensors, with one clear error per kind of bad file."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

import quant
from strata.tensors import QTensor


class GGUFError(ValueError):
    """A GGUF file Strata cannot use; the message names the file and what is wrong."""


class GGUFFile:
    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        try:
            self._reader = GGUFReader(self.path, "r")
        except Exception as e:  # the gguf package raises bare ValueError/KeyError/IndexError
            raise GGUFError(f"{self.path}: cannot read as GGUF: {e}") from e
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field.contents()
        self.tensors: dict[str, QTensor] = {}
        for t in self._reader.tensors:
            fmt = quant.get(int(t.tensor_type))
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            row = shape[-1]
            data = np.asarray(t.data).view(np.uint8).reshape(-1, fmt.row_bytes(row))
            self.tensors[t.name] = QTensor(t.name, fmt, shape, data)

    @property
    def arch(self) -> str:
        return self.require("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    def tensor(self, name: str) -> QTensor:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing")
        return self.tensors[name]

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.get('general.architecture')}, {len(self.tensors)} tensors)"


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)
