"""The sparse MoE block: router, routed experts (SwiGLU), gated shared expert.

    probs = softmax(x @ router.T) in float32 over all experts; top-k; renormalised
    y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))  +  sigmoid(x . g) * shared(x)

Where the experts' weights live and how they are multiplied is the expert store's
business (strata.storage.experts): this module routes, asks the store for the experts
the batch needs, and sums.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import QuantLinear


class MoE(torch.nn.Module):
    def __init__(self, router: QuantLinear, experts, top_k: int, shared_gate_up: QuantLinear,
                 shared_down: QuantLinear, shared_gate: QuantLinear, norm_topk: bool = True):
        """`experts` runs the routed experts: experts(layer_input (T, H) float32,
        weights (T, k) float32, ids (T, k) int) -> (T, H) float32."""
        super().__init__()
        self.router, self.experts, self.top_k, self.norm_topk = router, experts, top_k, norm_topk
        self.shared_gate_up, self.shared_down, self.shared_gate = shared_gate_up, shared_down, shared_gate

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from triton_kernels.moe import route
        return route(self.router(x).float(), self.top_k, self.norm_topk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        routed = self.experts(x.float(), weights, ids)
        g, u = self.shared_gate_up(x).float().chunk(2, dim=-1)
        shared = self.shared_down(F.silu(g) * u).float()
        return routed + torch.sigmoid(self.shared_gate(x).float()) * shared
