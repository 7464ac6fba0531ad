"""Models by GGUF architecture."""
from __future__ import annotations

import torch

from strata.gguf import GGUFError, GGUFFile, open_gguf


def load_model(path_or_file, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               kernels: str | None = None, **options):
    """The model of a GGUF file on `device`, its ops run by `kernels` ("triton" or "torch";
    None: the device's default); `options` go to architectures that take them (qwen4exp:
    qsa, expert_tier, expert_opts, ple_table)."""
    g = path_or_file if isinstance(path_or_file, GGUFFile) else open_gguf(path_or_file)
    arch = g.arch
    if arch == "llama":
        from .llama import Llama
        return Llama(g, dtype=dtype, device=device, kernels=kernels)
    if arch == "qwen4exp":
        from .qwen4exp import Qwen4Exp
        return Qwen4Exp(g, dtype=dtype, device=device, kernels=kernels, **options)
    raise GGUFError(f"{g.path}: architecture {arch!r} is not supported (supported: llama, qwen4exp)")
