"""The sparse MoE block: router, routed experts (SwiGLU), gated shared expert.

    probs = softmax(x @ router.T) in float32 over all experts; top-k; renormalised
    y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))  +  sigmoid(x . g) * shared(x)

Where the experts' weights live and how they are multiplied is the expert store's
business (strata.storage.experts): this module routes, asks the store for the experts
the batch needs, and sums (with the Triton kernels, the routed slots' rows in the launch
that adds the gated shared expert).
"""
from __future__ import annotations

import torch

from triton_kernels.moe import choose_path as choose_moe_path, down_pair_path
from triton_kernels.router_gemv import pair_path as router_pair_path, path as router_path

from .linear import QuantLinear


class MoE(torch.nn.Module):
    def __init__(self, proj: QuantLinear, experts, n_experts: int, top_k: int, shared_dim: int,
                 shared_down: QuantLinear, norm_topk: bool = True):
        """`proj` is the block's input projection, its weights in this order: the router (E
        rows), the shared expert's gate (1 row), then its SwiGLU's gate and up (shared_dim
        rows each); one matmul where their formats agree (QuantLinear.outputs). `experts`
        runs the routed experts: experts(x (T, H) float32, weights (T, k) float32, ids
        (T, k)) -> (T, H)."""
        super().__init__()
        from triton_kernels.ops import impl
        self.proj, self.experts, self.shared_down = proj, experts, shared_down
        self.route = impl("route", proj.kernels)
        self.route_align = impl("route_align", proj.kernels)
        self.router_gemv = impl("router_gemv", proj.kernels)
        self.gated_add = impl("gated_add", proj.kernels)
        self.n_experts, self.shared_dim = n_experts, shared_dim
        self.top_k, self.norm_topk = top_k, norm_topk
        self.share = None  # strata.dist.ExpertShare under --ep: this rank holds some experts

    def shard(self, share) -> "MoE":
        """Hold only `share`'s experts (strata.dist.ExpertShare): route as before, run the
        ones held here, sum the shares' outputs."""
        self.share = share
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gated_add(*self.parts(x))

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's output unsummed: (the routed experts' rows (T, k, H) with the kernels,
        else their sum (T, H); the shared expert's gate (T, 1); the shared expert (T, H)),
        whose gated_add is `forward`'s result; a hyper-connection's write sums them in its
        launch (HyperConnection.write)."""
        kernels = self.proj.kernels == "triton" and self.share is None and not torch.compiler.is_compiling()
        plan = (self.experts.route_plan(x.shape[0], self.top_k) if kernels and hasattr(self.experts, "route_plan")
                else None)
        if plan is not None:
            return self._planned(x, plan)
        logits, gate, g, u = self.proj.outputs(x)
        tally = self.experts.route_tally() if kernels and hasattr(self.experts, "route_tally") else None
        if tally is not None:  # the store's hit counter counted in the router's launch
            weights, ids = self.route(logits, self.top_k, self.norm_topk, hits=tally)
        else:
            weights, ids = self.route(logits, self.top_k, self.norm_topk)
        if kernels:  # the slots' rows summed by gated_add's launch
            routed, summed = self.experts(x.float(), weights, ids, slots=True, counted=tally is not None), None
        elif self.share is None:
            routed, summed = self.experts(x.float(), weights, ids), None
        else:  # the shares' sum travels while this rank computes the shared expert
            routed, summed = self.share.reduce_start(self.experts(x.float(), weights, self.share.local(ids)))
        return self._finish(routed, summed, g, u, gate)

    def _planned(self, x: torch.Tensor, plan: dict):
        """`parts` of a one-token step whose router's launch also counts, looks up and aligns
        for the store (route_align), that launch the router GEMV's own where router_gemv
        takes it, and the shared expert's SwiGLU in it too where its down GEMV does not take
        it (the dp4a path)."""
        block_m = plan.pop("block_m")
        shared = self.shared_dim if self.shared_down.product_apart(1) else 0
        E, p = self.n_experts, self.proj
        # the routers' matmul: the whole projection, or where formats differ its first run
        # (a released file's F32 routers), after the shared expert's gate and up
        router, rest = (p.parts[0], p.parts[1:]) if p.mode == "parts" else (p, [])
        fused = (x.dtype == torch.float32 and router.mode == "triton"
                 and router.splits == ([E, 1] if rest else [E, 1, self.shared_dim, self.shared_dim])
                 and [n for m in rest for n in m.splits] == ([self.shared_dim] * 2 if rest else [])
                 and router_path(router.fmt, router.blocks.device, router.out_features, router.in_features))
        # the shared expert's gate and up in the same launch too, where they are one dp4a
        # run that joins the float routers' GEMV (router_gemv.pair_path)
        pair = (fused and len(rest) == 1 and rest[0].mode == "triton"
                and router_pair_path(router.fmt, router.blocks.device, router.out_features, router.in_features,
                                     rest[0].fmt, rest[0].out_features))
        if pair:
            m = rest[0]
            out, weights, ids, local, slot, *aligned, product = self.router_gemv(
                x, router.blocks, router.fmt, router.out_features, self.top_k, self.norm_topk, block_m, E=E,
                shared=shared, dtype=router.dtype, pair=(m.blocks, m.fmt, m.out_features), **plan)
            logits, gate, g, u = out.split(router.splits + m.splits, dim=-1)
        elif fused:
            g, u = [y for m in rest for y in m.outputs(x)] if rest else (None, None)
            out, weights, ids, local, slot, *aligned, product = self.router_gemv(
                x, router.blocks, router.fmt, router.out_features, self.top_k, self.norm_topk, block_m, E=E,
                shared=0 if rest else shared, swiglu=(g, u) if rest and shared else None, dtype=router.dtype,
                **plan)
            logits, gate, *gu = out.split(router.splits, dim=-1)
            if not rest:
                g, u = gu
        else:
            logits, gate, g, u = p.outputs(x)
            weights, ids, local, slot, *aligned, product = self.route_align(
                logits, self.top_k, self.norm_topk, block_m, **plan, swiglu=(g, u) if shared else None)
        # the shared expert's down GEMV in the routed experts' down launch where it fits
        # (moe.down_pair_path: both dp4a, the GEMV unsplit, or float experts and the gated
        # float GEMV, at the down kernel's warps): its product, or its gate and up rows
        sd, path = self.shared_down, choose_moe_path(*self.experts.fmts, 1)
        rows = product if shared else (g, u)
        down = (sd.mode == "triton" and path == ("dp4a" if shared else "dot")
                and down_pair_path(self.experts.fmts[2], sd.fmt, sd.blocks.device, sd.out_features, sd.in_features,
                                   path))
        out2 = torch.empty((1, sd.out_features), dtype=torch.float32, device=x.device) if down else None
        routed = self.experts(x.float(), weights, ids, slots=True, plan=(local, slot, (*aligned, block_m) if block_m
                                                                         else None),
                              pair=(rows, sd.blocks, sd.fmt, sd.out_features, sd.dtype, out2) if down else None)
        if down:
            return routed, gate, out2
        return self._finish(routed, None, g, u, gate, product if shared else None)

    def _finish(self, routed, summed, g, u, gate, product=None):
        shared = self.shared_down.gated(g, u, product=product)  # else the SwiGLU in the down GEMV's launch
        if summed is not None:
            summed()
        return routed, gate, shared
