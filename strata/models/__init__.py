"""Models by GGUF architecture."""
from __future__ import annotations

import torch

from strata.gguf import GGUFError, GGUFFile, open_gguf


def load_model(path_or_file, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    g = path_or_file if isinstance(path_or_file, GGUFFile) else open_gguf(path_or_file)
    arch = g.arch
    if arch == "llama":
        from .llama import Llama
        return Llama(g, dtype=dtype, device=device)
    raise GGUFError(f"{g.path}: architecture {arch!r} is not supported (supported: llama)")
