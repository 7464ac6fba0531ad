"""Where the routed experts' weights live, and the matmuls over them.

A layer's experts are three GGUF tensors: gate and up (E, I, H) and down (E, H, I), each
a run of E equal slabs of quantized rows. The store of one layer answers
`store(x, weights, ids)`: the routed experts' SwiGLU outputs, weighted and summed per
token. Tiers:

- `dense`: dequantized once into the compute dtype (CPU, while the model's DenseBudget
  lasts); a matmul per routed expert.
- `blocks`: the raw blocks in memory (zero-copy views of the mapped GGUF on the CPU,
  copied to the device on CUDA); the fused MoE kernel (triton_kernels.moe) on CUDA,
  `moe_torch` (dequantize what is routed, then matmul) on the CPU.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from strata.nn.linear import DenseBudget
from strata.tensors import QTensor


def _slabs(t: QTensor) -> torch.Tensor:
    """(E, rows, row_bytes) uint8 view of a stacked expert tensor."""
    e = t.shape[0]
    return torch.from_numpy(t.data).reshape(e, -1, t.data.shape[-1])


class ExpertStore(torch.nn.Module):
    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, dtype=torch.float32, device="cpu",
                 budget: DenseBudget | None = None, tier: str | None = None):
        super().__init__()
        self.names = (gate.name, up.name, down.name)
        self.fmts = (gate.fmt, up.fmt, down.fmt)
        self.n_experts, self.inter, self.hidden = gate.shape
        self.dtype, self.device = dtype, device
        dense_bytes = 3 * self.n_experts * self.inter * self.hidden * torch.finfo(dtype).bits // 8
        if tier is None:
            on_cpu = torch.device(device).type == "cpu"
            tier = "dense" if on_cpu and (budget or DenseBudget()).take(dense_bytes) else "blocks"
        self.tier = tier
        self.hits = torch.zeros(self.n_experts, dtype=torch.long)  # tokens routed to each expert
        if tier == "dense":
            # gate and up stacked: one matmul gives both halves
            self.w13 = torch.cat([gate.dequantize(dtype), up.dequantize(dtype)], dim=1)
            self.w2 = down.dequantize(dtype)
        elif tier == "blocks":
            self.wg, self.wu, self.wd = (_slabs(t).to(device) for t in (gate, up, down))
        else:
            raise ValueError(f"unknown expert tier {tier!r} (dense, blocks)")

    def held_bytes(self) -> int:
        ts = (self.w13, self.w2) if self.tier == "dense" else (self.wg, self.wu, self.wd)
        return sum(t.numel() * t.element_size() for t in ts)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.hits += torch.bincount(ids.reshape(-1).long().cpu(), minlength=self.n_experts)
        if self.tier == "blocks":
            from triton_kernels.moe import moe
            return moe(x, self.wg, self.wu, self.wd, *self.fmts, weights, ids).float()
        T, k = ids.shape
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        xd = x.to(self.dtype)
        out = torch.zeros(T, self.hidden, dtype=torch.float32, device=x.device)
        w = weights.reshape(-1)
        at = 0
        # experts in increasing id order, each over its tokens (as transformers' loop)
        for e in np.nonzero(counts)[0].tolist():
            slots = order[at:at + counts[e]]
            at += counts[e]
            rows = slots // k
            g, u = (xd[rows] @ self.w13[e].T).float().chunk(2, dim=-1)
            y = (F.silu(g) * u).to(self.dtype) @ self.w2[e].T
            # a token meets each expert once, so rows are distinct: a plain indexed add
            # (index_add_ spins up threads for a few rows; this is 100x cheaper on a busy CPU)
            out[rows] += y.float() * w[slots, None]
        return out
