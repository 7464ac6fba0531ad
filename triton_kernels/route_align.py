"""A one-token decode step's routing in one program: the router's top-k (route), an
expert cache's lookup and counters (cache_lookup), the MoE's alignment of the slots by
expert (moe_align_block_size) and the shared expert's SwiGLU for its dp4a down projection
(silu_mul), which took four launches a layer (three on the resident tier).

    route_align(logits (1, E), top_k, norm_topk_prob, block_m, rows, hits=None,
                lut=None, routed=None, missed=None, first=0, swiglu=None)
        -> weights (1, k) float32, ids (1, k) int32   the chosen experts, as route's
           local (1, k) int32                         the rows of the MoE's weights they name
           slots (k,) int64                           lut[ids] (-1: a miss; -1s without lut)
           sorted_token_ids, expert_ids, num_tokens_post_padded
                                                      moe_align_block_size(local, rows, block_m);
                                                      empty for block_m = 0 (the dp4a path)
           product (1, I) float32                     silu_mul(g, u) for swiglu = (g, u), each
                                                      (1, I), with its int8 attached (int8.attach)
                                                      as silu_mul(quantize=True) writes it (I a
                                                      multiple of 32); (1, 0) without swiglu

Without `lut`, local is ids (the resident tier: `rows` = E). With an expert cache's table
`lut` (E,) int64 (expert -> VRAM slot, -1 where not held), local is the slot, or for a
miss the staging row first + j, and `routed` and `missed` (E,) int64 are added to as
cache_lookup adds to them; `hits` (E,) int64 is route's tally. The router's ids are always
in [0, E) (a NaN logit ranks last), so the alignment leaves no slot out and zeroes no rows.

The top-k is route's own code (triton_kernels.moe._top_k), the alignment the align
kernel's (triton_kernels.moe_align.align_slots) and the product silu_mul's
(shared_expert.gate_block): the outputs are those of the four launches, bit for bit.
`route_align_torch` is the same in torch: route_torch, cache_lookup_torch,
moe_align_block_size_torch, silu_mul_torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .int8 import Q8X, attach, int8_buffers
from .moe import _check_route, _top_k, route_torch
from .moe_align import ALIGN_CHUNK, ALIGN_MAX_SLOTS, _length, align_slots, moe_align_block_size_torch
from .shared_expert import BLOCK as SWIGLU_BLOCK
from .shared_expert import _rows, gate_block, silu_mul_torch
from .stage import cache_lookup_torch


@triton.jit
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr,
                        missed_ptr, sorted_ptr, expert_ids_ptr, n_post_ptr, g_ptr, u_ptr, act_ptr, q_ptr, d_ptr, s_ptr,
                        E, first, rows, length, n_blocks, n_shared,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr,
                        NORM: tl.constexpr, COUNT: tl.constexpr, LOOKUP: tl.constexpr, ALIGN: tl.constexpr,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SWIGLU: tl.constexpr, QUANT: tl.constexpr,
                        BLOCK_SH: tl.constexpr):
    route_align_body(logits_ptr, weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr,
                     missed_ptr, sorted_ptr, expert_ids_ptr, n_post_ptr, g_ptr, u_ptr, act_ptr, q_ptr, d_ptr, s_ptr,
                     E, first, rows, length, n_blocks, n_shared, TOP_K, K_PAD, E_PAD, N_PAD, NORM, COUNT, LOOKUP,
                     ALIGN, BLOCK_M, CHUNK, SWIGLU, QUANT, BLOCK_SH, False)


@triton.jit
def route_align_body(logits_ptr, weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr,
                     missed_ptr, sorted_ptr, expert_ids_ptr, n_post_ptr, g_ptr, u_ptr, act_ptr, q_ptr, d_ptr, s_ptr,
                     E, first, rows, length, n_blocks, n_shared,
                     TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr,
                     NORM: tl.constexpr, COUNT: tl.constexpr, LOOKUP: tl.constexpr, ALIGN: tl.constexpr,
                     BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SWIGLU: tl.constexpr, QUANT: tl.constexpr,
                     BLOCK_SH: tl.constexpr, CG: tl.constexpr):
    """The one program's work (the module's), also the last program of the router's GEMV
    (triton_kernels.router_gemv), which reads the logits and the shared expert's g and u
    that the GEMV's other programs stored from L2 (CG: never a stale L1 line)."""
    offs = tl.arange(0, E_PAD)
    live = offs < E
    if CG:
        logit = tl.load(logits_ptr + offs, mask=live, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    else:
        logit = tl.load(logits_ptr + offs, mask=live, other=float("-inf")).to(tl.float32)
    top_w, top_i = _top_k(logit, offs, live, TOP_K, K_PAD, E_PAD, NORM)
    kk = tl.arange(0, K_PAD)
    on = kk < TOP_K
    tl.store(weights_ptr + kk, top_w, mask=on)
    tl.store(ids_ptr + kk, top_i, mask=on)
    if COUNT:
        tl.atomic_add(hits_ptr + top_i, tl.full((K_PAD,), 1, tl.int64), mask=on)
    local = top_i
    if LOOKUP:
        e = top_i.to(tl.int64)
        s = tl.load(lut_ptr + e, mask=on, other=0)
        tl.store(slots_ptr + kk, s, mask=on)
        local = tl.where(s >= 0, s, first + kk).to(tl.int32)
        one = tl.full((K_PAD,), 1, tl.int64)  # the counters: integers, in any order
        tl.atomic_add(routed_ptr + e, one, mask=on)
        tl.atomic_add(missed_ptr + e, one, mask=on & (s < 0))
    else:
        tl.store(slots_ptr + kk, tl.full((K_PAD,), -1, tl.int64), mask=on)
    tl.store(local_ptr + kk, local, mask=on)
    if ALIGN:
        # the alignment's N_PAD lanes (at least 16): the ids read back once every thread's are written
        tl.debug_barrier()
        i = tl.arange(0, N_PAD)
        raw = tl.load(local_ptr + i, mask=i < TOP_K, other=-1)
        align_slots(raw, TOP_K, rows, sorted_ptr, expert_ids_ptr, n_post_ptr, local_ptr, 0, 0, length, n_blocks,
                    N_PAD, BLOCK_M, CHUNK, False)
    if SWIGLU:  # the shared expert's product: silu_mul's programs, one after another
        for c0 in range(0, n_shared, BLOCK_SH):
            gate_block(g_ptr, u_ptr, act_ptr, q_ptr, d_ptr, s_ptr, 0, c0, n_shared, 0, 0, BLOCK_SH, True, QUANT, CG)


def _check(logits, top_k, block_m, rows, hits, lut, routed, missed, swiglu):
    _check_route(logits, top_k)
    T, E = logits.shape
    if T != 1:
        raise ValueError(f"route_align: routes one token, got logits {tuple(logits.shape)}")
    if not 0 < top_k <= ALIGN_MAX_SLOTS or block_m < 0 or rows < 1:
        raise ValueError(f"route_align: top_k={top_k} must be 1..{ALIGN_MAX_SLOTS}, block_m={block_m} >= 0 and "
                         f"rows={rows} >= 1")
    for name, t in (("hits", hits), ("lut", lut), ("routed", routed), ("missed", missed)):
        if t is not None and (t.dtype != torch.int64 or tuple(t.shape) != (E,) or t.device != logits.device):
            raise ValueError(f"route_align: {name} must be an int64 ({E},) tensor on {logits.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if (lut is None) != (routed is None) or (lut is None) != (missed is None):
        raise ValueError("route_align: lut, routed and missed come together")
    if swiglu is not None:
        g, u = swiglu
        _rows("route_align", g, u)
        if g.shape != u.shape or g.shape[0] != 1 or g.device != logits.device:
            raise ValueError(f"route_align: swiglu's g {tuple(g.shape)} and u {tuple(u.shape)} must be one row "
                             f"each, of one width, on {logits.device}")


def _empty_alignment(dev):
    """No alignment (block_m = 0): empty ids, and a length that nothing reads."""
    return (torch.empty(0, dtype=torch.int32, device=dev), torch.empty(0, dtype=torch.int32, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev))  # apart: a torch op's outputs alias nothing


def route_align(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, block_m: int, rows: int,
                hits: torch.Tensor | None = None, lut: torch.Tensor | None = None,
                routed: torch.Tensor | None = None, missed: torch.Tensor | None = None, first: int = 0,
                swiglu: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(weights, ids, local, slots, sorted_token_ids, expert_ids, num_tokens_post_padded,
    product) of one token's logits (see the module); hits, routed and missed added to in
    place."""
    _check(logits, top_k, block_m, rows, hits, lut, routed, missed, swiglu)
    if not use_triton(logits):
        return route_align_torch(logits, top_k, norm_topk_prob, block_m, rows, hits, lut, routed, missed, first,
                                 swiglu)
    if not logits.is_cuda and logits.dtype == torch.bfloat16:
        logits = logits.float()  # the interpreter holds bf16 as raw uint16; widening is exact
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    g, u = swiglu if swiglu is not None else (logits, logits)
    r = shapes(logits, top_k, block_m, rows, g.shape[1] if swiglu is not None else 0)
    ids = r.ids
    _route_align_kernel[(1,)](logits, r.weights, ids, r.local, r.slots, ids if hits is None else hits,
                              ids if lut is None else lut, ids if routed is None else routed,
                              ids if missed is None else missed, r.sorted_ids, r.expert_ids, r.n_post,
                              g, u, r.product, *r.x8, logits.shape[1], first, rows, r.length, r.n_blocks, r.n_shared,
                              **r.constexprs(norm_topk_prob, hits, lut, block_m))
    return r.outputs()


@dataclass
class Shapes:
    """route_align's outputs, made for a launch (`shapes`), its sizes and constexprs: the
    one decision for its own launch and the router GEMV's (triton_kernels.router_gemv)."""
    E: int
    top_k: int
    weights: torch.Tensor
    ids: torch.Tensor
    local: torch.Tensor
    slots: torch.Tensor
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    n_post: torch.Tensor
    length: int
    n_blocks: int
    n_shared: int
    product: torch.Tensor
    quantize: bool
    x8: tuple

    def constexprs(self, norm_topk_prob: bool, hits, lut, block_m: int) -> dict:
        k = self.top_k
        return dict(TOP_K=k, K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(self.E),
                    N_PAD=max(16, triton.next_power_of_2(k)), NORM=norm_topk_prob, COUNT=hits is not None,
                    LOOKUP=lut is not None, ALIGN=block_m > 0, BLOCK_M=max(block_m, 1), CHUNK=ALIGN_CHUNK,
                    SWIGLU=self.n_shared > 0, QUANT=self.quantize,
                    BLOCK_SH=min(SWIGLU_BLOCK, triton.next_power_of_2(max(self.n_shared, 32))))

    def outputs(self) -> tuple:
        product = attach(self.product, Q8X(*self.x8)) if self.quantize else self.product
        return (self.weights, self.ids, self.local, self.slots, self.sorted_ids, self.expert_ids, self.n_post,
                product)


def shapes(logits: torch.Tensor, top_k: int, block_m: int, rows: int, n_shared: int) -> Shapes:
    """The outputs of route_align for logits (1, E) and a shared expert of n_shared (0:
    none), made on logits' device."""
    dev = logits.device
    weights = torch.empty((1, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((1, top_k), dtype=torch.int32, device=dev)
    local = torch.empty((1, top_k), dtype=torch.int32, device=dev)
    slots = torch.empty(top_k, dtype=torch.int64, device=dev)
    if block_m:
        length = _length(top_k, rows, block_m)
        n_blocks = -(-length // block_m)
        sorted_ids = torch.empty(length, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(n_blocks, dtype=torch.int32, device=dev)
        n_post = torch.empty(1, dtype=torch.int32, device=dev)
    else:
        length = n_blocks = 0
        sorted_ids, expert_ids, n_post = _empty_alignment(dev)
    product = torch.empty((1, n_shared), dtype=torch.float32, device=dev)
    # with its int8 for the dp4a GEMV (whole groups of 32), which then quantizes nothing
    quantize, x8 = int8_buffers(n_shared > 0, 1, n_shared, n_shared, product)
    return Shapes(logits.shape[1], top_k, weights, ids, local, slots, sorted_ids, expert_ids, n_post, length,
                  n_blocks, n_shared, product, quantize, x8)


def route_align_torch(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, block_m: int, rows: int,
                      hits: torch.Tensor | None = None, lut: torch.Tensor | None = None,
                      routed: torch.Tensor | None = None, missed: torch.Tensor | None = None, first: int = 0,
                      swiglu: tuple[torch.Tensor, torch.Tensor] | None = None):
    _check(logits, top_k, block_m, rows, hits, lut, routed, missed, swiglu)
    weights, ids = route_torch(logits, top_k, norm_topk_prob, hits)
    if lut is not None:
        slots, local = cache_lookup_torch(ids.reshape(-1), lut, routed, missed, first)
        local = local.reshape(ids.shape)
    else:
        slots, local = torch.full((top_k,), -1, dtype=torch.int64, device=logits.device), ids.clone()
    aligned = (moe_align_block_size_torch(local, rows, block_m) if block_m else _empty_alignment(logits.device))
    product = silu_mul_torch(*swiglu) if swiglu is not None else logits.new_empty((1, 0), dtype=torch.float32)
    return weights, ids, local, slots, *aligned, product



