"""A one-token step's router GEMV with its routing in the same launch: the MoE's input
projection (the router's E rows first) as qmatmul's one-row GEMV computes it (the dp4a
one, or the float one for formats without int8 units: a released file's F32 router), and
route_align's work on its output by the last of the GEMV's programs to finish, where the
two took a launch each.

    router_gemv(x (1, K), q, fmt, N, top_k, norm_topk_prob, block_m, rows, E, shared=0,
                hits=None, lut=None, routed=None, missed=None, first=0, swiglu=None,
                dtype=torch.float32, pair=None)
        -> (out (1, N) float32, then route_align's outputs for logits = out[:, :E] and the
            shared expert's SwiGLU of its gate and up rows: the last 2 x `shared` columns
            of out, or `swiglu` = (g, u) (1, I) that an earlier launch wrote)
        pair = (q2, fmt2, N2): the float GEMV's launch also runs a second weight's dp4a
            GEMV (triton_kernels.gemv_pair: a released file's F32 routers beside the shared
            expert's quantized gate and up), out (1, N + N2)

Each program stores its rows, then counts itself in (an atomic add, acquire and release,
after a barrier: its rows are visible first); the one that counts last reads the row
back from L2 and routes, then sets the count back to 0 for the next launch. Its rows are
qmatmul's (the same programs: int8.row_sums for dp4a, qmatmul.gemv_weights and the float
GEMV's sums, rounded to `dtype` as that GEMV's output is) and its routing route_align's
(route_align_body), bit for bit, so a verify's rows, which take the two launches, route
as one-token steps do. `path` says where the launch is taken: a one-row GEMV that splits
no K (a split sums its rows in another order; an all-quantized 1,793 x 2,560 projection of
the real shape on an H200's 132 multiprocessors is not split, nor is the float GEMV ever).
The routing is a function of its own (not inlined): beside the float GEMV's registers,
inlined, it spilled 36 bytes a thread on gfx942.
`router_gemv_torch` is qmatmul_torch and route_align_torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import quant

from . import configs
from .asm import asm_for
from .backend import use_triton
from .decode import launch_args, unit, unit_table
from .gemv_pair import NO_PAIR, dp4a_launch, float_launch, one_row_path, pair_path, pair_rows
from .int8 import gemv_launch, quantize_x, row_sums, zeroed_counts
from .qmatmul import qmatmul_torch
from .route_align import _check as _check_route, route_align_body, route_align_torch, shapes

@triton.jit
def _router_gemv_kernel(xq_ptr, xd_ptr, xs_ptr, q_ptr, tab_ptr, out_ptr, count_ptr, N, K,
                        weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr, missed_ptr,
                        sorted_ptr, expert_ids_ptr, n_post_ptr, g_ptr, u_ptr, act_ptr, aq_ptr, ad_ptr, as_ptr,
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
    _route_last(count_ptr, out_ptr, weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr,
                missed_ptr, sorted_ptr, expert_ids_ptr, n_post_ptr, g_ptr, u_ptr, act_ptr, aq_ptr, ad_ptr, as_ptr,
                E, first, rows_e, length, n_blocks, n_shared, TOP_K, K_PAD, E_PAD, N_PAD, NORM, COUNT, LOOKUP,
                ALIGN, BLOCK_M, CHUNK, SWIGLU, QUANT, BLOCK_SH)


@triton.jit
def _router_gemv_float_kernel(x_ptr, q_ptr, tab_ptr, out_ptr, count_ptr, N, K,
                              weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr, missed_ptr,
                              sorted_ptr, expert_ids_ptr, n_post_ptr, g_ptr, u_ptr, act_ptr, aq_ptr, ad_ptr, as_ptr,
                              E, first, rows_e, length, n_blocks, n_shared,
                              xq_ptr, xd_ptr, xs_ptr, q2_ptr, tab2_ptr, N2, P1,
                              DECODE: tl.constexpr, QK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              ROUND: tl.constexpr,
                              TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr,
                              NORM: tl.constexpr, COUNT: tl.constexpr, LOOKUP: tl.constexpr, ALIGN: tl.constexpr,
                              BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SWIGLU: tl.constexpr, QUANT: tl.constexpr,
                              BLOCK_SH: tl.constexpr, PAIR: tl.constexpr,
                              UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr, BLOCK_HW: tl.constexpr,
                              ZERO: tl.constexpr, OFFSET: tl.constexpr, BODY: tl.constexpr, BLOCK_N2: tl.constexpr,
                              BLOCK_U: tl.constexpr, MASK: tl.constexpr, ASM: tl.constexpr):
    # with PAIR, the programs from P1 on run the dp4a GEMV of a second weight (gemv_pair)
    pair_rows(tl.program_id(0), P1, x_ptr, q_ptr, tab_ptr, out_ptr, N, xq_ptr, xd_ptr, xs_ptr, q2_ptr, tab2_ptr,
              out_ptr + N, N2, K, DECODE, QK, BLOCK_N, BLOCK_K, ROUND, PAIR, UNIT, UW, UPB, BLOCK_HW, ZERO, OFFSET,
              BODY, BLOCK_N2, BLOCK_U, MASK, ASM)
    _route_last(count_ptr, out_ptr, weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr,
                missed_ptr, sorted_ptr, expert_ids_ptr, n_post_ptr, g_ptr, u_ptr, act_ptr, aq_ptr, ad_ptr, as_ptr,
                E, first, rows_e, length, n_blocks, n_shared, TOP_K, K_PAD, E_PAD, N_PAD, NORM, COUNT, LOOKUP,
                ALIGN, BLOCK_M, CHUNK, SWIGLU, QUANT, BLOCK_SH)


@triton.jit(noinline=True)
def _route_last(count_ptr, out_ptr, weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr,
                missed_ptr, sorted_ptr, expert_ids_ptr, n_post_ptr, g_ptr, u_ptr, act_ptr, aq_ptr, ad_ptr, as_ptr,
                E, first, rows_e, length, n_blocks, n_shared,
                TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr,
                NORM: tl.constexpr, COUNT: tl.constexpr, LOOKUP: tl.constexpr, ALIGN: tl.constexpr,
                BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SWIGLU: tl.constexpr, QUANT: tl.constexpr,
                BLOCK_SH: tl.constexpr):
    """Count this program in; the last one routes (route_align_body, reading from L2)."""
    tl.debug_barrier()  # every lane's rows stored before the count says so
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        route_align_body(out_ptr, weights_ptr, ids_ptr, local_ptr, slots_ptr, hits_ptr, lut_ptr, routed_ptr,
                         missed_ptr, sorted_ptr, expert_ids_ptr, n_post_ptr, g_ptr, u_ptr, act_ptr, aq_ptr, ad_ptr,
                         as_ptr, E, first, rows_e, length, n_blocks, n_shared, TOP_K, K_PAD, E_PAD, N_PAD, NORM,
                         COUNT, LOOKUP, ALIGN, BLOCK_M, CHUNK, SWIGLU, QUANT, BLOCK_SH, True)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


def path(fmt: quant.Format, device, N: int, K: int) -> str | None:
    """Which GEMV router_gemv runs for this (N, K) projection's one-token step on `device`
    ("dp4a" or "gemv", qmatmul's for one row), or None where it takes no fused launch (a
    dp4a GEMV that splits K, or qmatmul's GEMM: batch-invariant mode's for float formats)."""
    return one_row_path(fmt, device, N, K)


def _check(x, N, E, shared, swiglu):
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.float32:
        raise ValueError(f"router_gemv: x must be one float32 row, got {x.dtype} {tuple(x.shape)}")
    if not 0 < E <= N or shared < 0 or E + 2 * shared > N:
        raise ValueError(f"router_gemv: {E} router rows and 2 x {shared} shared-expert rows do not fit N={N}")
    if shared and swiglu is not None:
        raise ValueError("router_gemv: the shared expert's gate and up are its own last rows (shared) or "
                         "swiglu, not both")


def router_gemv(x: torch.Tensor, q: torch.Tensor, fmt, N: int, top_k: int, norm_topk_prob: bool, block_m: int,
                rows: int, E: int, shared: int = 0, hits: torch.Tensor | None = None, lut: torch.Tensor | None = None,
                routed: torch.Tensor | None = None, missed: torch.Tensor | None = None, first: int = 0,
                swiglu: tuple[torch.Tensor, torch.Tensor] | None = None, dtype: torch.dtype = torch.float32,
                pair: tuple[torch.Tensor, str | quant.Format, int] | None = None):
    """(out, weights, ids, local, slots, sorted_token_ids, expert_ids,
    num_tokens_post_padded, product): see the module. On the dp4a path x's int8 is
    quantize_x's (an attached one where the launch that wrote x wrote it); on the float
    path x and the output are in `dtype` as QuantLinear's float GEMV holds them. `pair`
    (q2, fmt2, N2): a second weight of the projection, in a dp4a format, whose rows the
    float GEMV's launch computes too (where pair_path says so; a released file's F32
    routers beside the shared expert's quantized gate and up): out is then (1, N + N2),
    the second's rows after the first's, as its own dp4a GEMV gives them."""
    fmt = quant.get(fmt)
    q2, fmt2, N2 = pair if pair is not None else (None, None, 0)
    fmt2 = quant.get(fmt2) if fmt2 is not None else None
    _check(x, N + N2, E, shared, swiglu)
    K = x.shape[1]
    if not use_triton(x):
        return router_gemv_torch(x, q, fmt, N, top_k, norm_topk_prob, block_m, rows, E, shared, hits, lut, routed,
                                 missed, first, swiglu, dtype, pair)
    kind = path(fmt, q.device, N, K)
    if kind is None:
        raise ValueError(f"router_gemv: {fmt.name} {N} x {K} on {q.device} takes no fused launch; ask path first")
    if pair is not None and not pair_path(fmt, q.device, N, K, fmt2, N2):
        raise ValueError(f"router_gemv: a {fmt2.name} {N2} x {K} weight does not join the launch of a {fmt.name} "
                         f"{N} x {K} one on {q.device}; ask pair_path first")
    out = torch.empty((1, N + N2), dtype=torch.float32, device=x.device)
    swiglu = _swiglu(out, shared) if shared else swiglu
    _check_route(out[:, :E], top_k, block_m, rows, hits, lut, routed, missed, swiglu)
    g, u = swiglu if swiglu is not None else (out, out)
    r = shapes(out[:, :E], top_k, block_m, rows, g.shape[1] if swiglu is not None else 0)
    ids = r.ids
    route = (r.weights, ids, r.local, r.slots, ids if hits is None else hits, ids if lut is None else lut,
             ids if routed is None else routed, ids if missed is None else missed, r.sorted_ids, r.expert_ids,
             r.n_post, g, u, r.product, *r.x8, E, first, rows, r.length, r.n_blocks, r.n_shared)
    cx = r.constexprs(norm_topk_prob, hits, lut, block_m)
    counts = zeroed_counts(q.device, 1)
    if kind == "dp4a":
        x8 = quantize_x(x)
        un = unit(fmt)
        block_n, block_u, _, warps = gemv_launch(fmt, q.device, N, K)
        _router_gemv_kernel[(triton.cdiv(N, block_n),)](
            x8.q, x8.d, x8.s, q.reshape(-1).view(torch.uint16), unit_table(fmt, q.device), out, counts, N, K,
            *route, **launch_args(fmt, un), BLOCK_N=block_n, BLOCK_U=block_u, MASK=(K // un.weights) % block_u != 0,
            ASM=asm_for(q.device), **cx, num_warps=warps)
    else:
        f_args, p1, f_cx = float_launch(x, q, fmt, N, dtype)
        d_args, p2, d_cx = dp4a_launch(x, q2, fmt2, N2) if pair is not None else ((out,) * 5, 0, NO_PAIR)
        _router_gemv_float_kernel[(p1 + p2,)](
            *f_args, out, counts, N, K, *route, *d_args, N2, p1, **f_cx, **cx, **d_cx,
            num_warps=configs.float_gemv_warps(fmt.name, q.device))
    return (out, *r.outputs())


def router_gemv_torch(x: torch.Tensor, q: torch.Tensor, fmt, N: int, top_k: int, norm_topk_prob: bool,
                      block_m: int, rows: int, E: int, shared: int = 0, hits: torch.Tensor | None = None,
                      lut: torch.Tensor | None = None, routed: torch.Tensor | None = None,
                      missed: torch.Tensor | None = None, first: int = 0,
                      swiglu: tuple[torch.Tensor, torch.Tensor] | None = None, dtype: torch.dtype = torch.float32,
                      pair: tuple[torch.Tensor, str | quant.Format, int] | None = None):
    _check(x, N + (pair[2] if pair is not None else 0), E, shared, swiglu)
    fmt = quant.get(fmt)
    out = qmatmul_torch(x if unit(fmt) is not None else x.to(dtype), q, fmt, n=N).float()
    if pair is not None:  # the second weight's rows, as the first's
        q2, fmt2, N2 = pair
        out = torch.cat([out, qmatmul_torch(x, q2, quant.get(fmt2), n=N2).float()], dim=1)
    return (out, *route_align_torch(out[:, :E], top_k, norm_topk_prob, block_m, rows, hits, lut, routed, missed,
                                    first, _swiglu(out, shared) if shared else swiglu))


def _swiglu(out: torch.Tensor, shared: int):
    """The shared expert's gate and up columns of the output: its last 2 x shared."""
    N = out.shape[1]
    return (out[:, N - 2 * shared:N - shared], out[:, N - shared:]) if shared else None
