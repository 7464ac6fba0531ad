"""A one-token step's router GEMV with its routing in the same launch: the MoE's fused
input projection (the router's E rows first, the shared expert's SwiGLU gate and up rows
last) as the dp4a GEMV computes it, and route_align's work on its output by the last of
the GEMV's programs to finish, where the two took a launch each.

    router_gemv(x (1, K), q, fmt, N, top_k, norm_topk_prob, block_m, rows, E, shared=0,
                hits=None, lut=None, routed=None, missed=None, first=0)
        -> (out (1, N) float32, then route_align's outputs for logits = out[:, :E] and,
            with shared > 0, swiglu = its last 2 x shared columns, gate then up)

Each program stores its rows, then counts itself in (an atomic add, acquire and
release, after a barrier: its rows are visible first); the one that counts last reads
the whole row back from L2 and routes, then sets the count back to 0 for the next launch.
Its rows are gemv_dp4a's (the same programs: int8.row_sums, the same tiles) and its
routing route_align's (route_align_body), bit for bit, so a verify's rows, which take
the two launches, route as one-token steps do. `fits` says where the launch is taken:
a format with int8 units and a GEMV that splits no K (a split would sum its rows in
another launch's order; at Flash-Next's 1,793 x 2,560 router the H200's 132
multiprocessors leave it unsplit). `router_gemv_torch` is qmatmul_torch and
route_align_torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import quant

from .asm import asm_for
from .backend import use_triton
from .decode import launch_args, unit, unit_table
from .int8 import gemv_launch, quantize_x, row_sums, zeroed_counts
from .qmatmul import choose_path, qmatmul_torch
from .route_align import _check as _check_route, route_align_body, route_align_torch, shapes


@triton.jit
def _router_gemv_kernel(xq_ptr, xd_ptr, xs_ptr, q_ptr, tab_ptr, out_ptr, count_ptr, N, K,
                        weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr, missed_ptr,
                        sorted_ptr, expert_ids_ptr, n_post_ptr, act_ptr, aq_ptr, ad_ptr, as_ptr,
                        E, first, rows_e, length, n_blocks, n_shared,
                        UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr, BLOCK_HW: tl.constexpr,
                        ZERO: tl.constexpr, OFFSET: tl.constexpr, BODY: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_U: tl.constexpr, MASK: tl.constexpr, ASM: tl.constexpr,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr,
                        NORM: tl.constexpr, COUNT: tl.constexpr, LOOKUP: tl.constexpr, ALIGN: tl.constexpr,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SWIGLU: tl.constexpr, QUANT: tl.constexpr,
                        BLOCK_SH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    y = row_sums(xq_ptr, xd_ptr, xs_ptr, q_ptr, tab_ptr, rows, N, K, 0, K // UW, UNIT, UW, UPB, BLOCK_HW,
                 ZERO, OFFSET, BODY, BLOCK_N, BLOCK_U, MASK, ASM)
    tl.store(out_ptr + rows, y, mask=rows < N)
    tl.debug_barrier()  # every lane's rows stored before the count says so
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        route_align_body(out_ptr, weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr,
                         missed_ptr, sorted_ptr, expert_ids_ptr, n_post_ptr, out_ptr + N - 2 * n_shared,
                         out_ptr + N - n_shared,
                         act_ptr, aq_ptr, ad_ptr, as_ptr, E, first, rows_e, length, n_blocks, n_shared,
                         TOP_K, K_PAD, E_PAD, N_PAD, NORM, COUNT, LOOKUP, ALIGN, BLOCK_M, CHUNK, SWIGLU, QUANT,
                         BLOCK_SH, True)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


def fits(fmt: quant.Format, device, N: int, K: int) -> bool:
    """Whether router_gemv takes this (N, K) projection's one-token step on `device` (see
    the module): the dp4a path, no split K."""
    return (unit(fmt) is not None and choose_path(fmt, 1) == "dp4a" and K % 32 == 0
            and gemv_launch(fmt, device, N, K)[2] == 1)


def _check(x, N, E, shared):
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.float32:
        raise ValueError(f"router_gemv: x must be one float32 row, got {x.dtype} {tuple(x.shape)}")
    if not 0 < E <= N or shared < 0 or E + 2 * shared > N:
        raise ValueError(f"router_gemv: {E} router rows and 2 x {shared} shared-expert rows do not fit N={N}")


def router_gemv(x: torch.Tensor, q: torch.Tensor, fmt, N: int, top_k: int, norm_topk_prob: bool, block_m: int,
                rows: int, E: int, shared: int = 0, hits: torch.Tensor | None = None, lut: torch.Tensor | None = None,
                routed: torch.Tensor | None = None, missed: torch.Tensor | None = None, first: int = 0):
    """(out, weights, ids, local, slots, sorted_token_ids, expert_ids,
    num_tokens_post_padded, product): see the module. x's int8 is quantize_x's (an
    attached one where the launch that wrote x wrote it)."""
    fmt = quant.get(fmt)
    _check(x, N, E, shared)
    K = x.shape[1]
    if not use_triton(x):
        return router_gemv_torch(x, q, fmt, N, top_k, norm_topk_prob, block_m, rows, E, shared, hits, lut, routed,
                                 missed, first)
    if not fits(fmt, q.device, N, K):
        raise ValueError(f"router_gemv: {fmt.name} {N} x {K} on {q.device} takes no fused launch; ask fits first")
    out = torch.empty((1, N), dtype=torch.float32, device=x.device)
    swiglu = _swiglu(out, shared)
    _check_route(out[:, :E], top_k, block_m, rows, hits, lut, routed, missed, swiglu)
    x8 = quantize_x(x)
    u = unit(fmt)
    block_n, block_u, _, warps = gemv_launch(fmt, q.device, N, K)
    r = shapes(out[:, :E], top_k, block_m, rows, shared)
    ids = r.ids
    _router_gemv_kernel[(triton.cdiv(N, block_n),)](
        x8.q, x8.d, x8.s, q.reshape(-1).view(torch.uint16), unit_table(fmt, q.device), out, zeroed_counts(q.device, 1),
        N, K, r.weights, ids, r.local, r.slots, ids if hits is None else hits, ids if lut is None else lut,
        ids if routed is None else routed, ids if missed is None else missed, r.sorted_ids, r.expert_ids, r.n_post,
        r.product, *r.x8, E, first, rows, r.length, r.n_blocks, shared,
        **launch_args(fmt, u), BLOCK_N=block_n, BLOCK_U=block_u, MASK=(K // u.weights) % block_u != 0,
        ASM=asm_for(q.device), **r.constexprs(norm_topk_prob, hits, lut, block_m), num_warps=warps)
    return (out, *r.outputs())


def router_gemv_torch(x: torch.Tensor, q: torch.Tensor, fmt, N: int, top_k: int, norm_topk_prob: bool,
                      block_m: int, rows: int, E: int, shared: int = 0, hits: torch.Tensor | None = None,
                      lut: torch.Tensor | None = None, routed: torch.Tensor | None = None,
                      missed: torch.Tensor | None = None, first: int = 0):
    _check(x, N, E, shared)
    out = qmatmul_torch(x, q, quant.get(fmt), n=N).float()
    return (out, *route_align_torch(out[:, :E], top_k, norm_topk_prob, block_m, rows, hits, lut, routed, missed,
                                    first, _swiglu(out, shared)))


def _swiglu(out: torch.Tensor, shared: int):
    """The shared expert's gate and up columns of the output: its last 2 x shared."""
    N = out.shape[1]
    return (out[:, N - 2 * shared:N - shared], out[:, N - shared:]) if shared else None
