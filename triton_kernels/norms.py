"""Rows scaled to unit L2 norm: the DeltaNet layer's q and k in torch.

    l2norm_torch(x (..., D), eps) -> x * rsqrt(sum(x * x) + eps) over the last dimension

The GPU path norms q and k inside triton_kernels/deltanet_inputs.py's kernel, with its
conv's SiLU and the repeat to the value heads; this is its torch twin's norm and the CPU's
(tests/triton_kernels/test_norms.py holds it to float64)."""
from __future__ import annotations

import torch


def l2norm_torch(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
