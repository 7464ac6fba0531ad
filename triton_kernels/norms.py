"""Rows scaled to unit L2 norm, in one kernel: the DeltaNet layer's q and k.

    l2norm(x (..., D), eps) -> x * rsqrt(sum(x * x) + eps) over the last dimension

strata.nn.deltanet's torch form is five launches a call (a product, a sum, an add, rsqrt,
a product); here one program a row, so a row's result does not depend on the rows beside
it (a decode and a verify agree). The sum's order differs from torch's: the two agree
within float32's summation bound, gamma(D + 3) of the row's terms
(tests/triton_kernels/test_norms.py), not bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton


@triton.jit
def _l2norm_kernel(x_ptr, out_ptr, D, eps, BD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BD)
    live = c < D
    x = tl.load(x_ptr + r * D + c, mask=live, other=0.0)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) + eps)  # rounded as torch's rsqrt is, not approximated
    tl.store(out_ptr + r * D + c, x * inv, mask=live)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x's rows (the last dimension) at unit L2 norm; float32."""
    if x.dtype != torch.float32:
        raise ValueError(f"l2norm: x must be float32, got {x.dtype}")
    if not use_triton(x):
        return l2norm_torch(x, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    D = x.shape[-1]
    rows = x.numel() // D if D else 0
    if rows:
        _l2norm_kernel[(rows,)](x, out, D, eps, BD=triton.next_power_of_2(D))
    return out


def l2norm_torch(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
