"""A one-row projection over two weights of two kinds in one launch: one in a format with
int8 units, which qmatmul's one-row GEMV takes by dp4a (int8.row_sums), and one without
(F32, F16, BF16: qmatmul's float GEMV), as a released file holds them (llama-quantize
leaves the routers and the QSA indexer's projections F32 beside quantized rows that read
the same input). QuantLinear runs such a projection as a matmul a run of one format; a
one-token step's two runs take this launch instead.

    gemv_pair(x (1, K), parts [(q, fmt, N), (q, fmt, N)], dtype=torch.float32)
        -> (1, N1 + N2) float32: the parts' rows in their order, each as its own GEMV
           gives them: the float part's from x in `dtype` and rounded to it (QuantLinear's
           float GEMV), the dp4a part's from x's int8 (quantize_x's, or the one attached)

The launch's first programs run the float GEMV's rows, the rest the dp4a GEMV's, each
with its own GEMV's tiles and sums (`pair_rows`, which the router's launch takes too:
triton_kernels.router_gemv), so the bits are the two launches' wherever `pair_path`
takes it: the dp4a part splitting no K, and both GEMVs at the same warps (a launch has
one count, and a reduction's order on a GPU follows it). `gemv_pair_torch` is
qmatmul_torch of each part.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import quant

from . import configs
from .asm import asm_for
from .backend import use_triton
from .decode import decoder, launch_args, table, unit, unit_table
from .gated_gemv import ROUNDING, rounded
from .int8 import gemv_launch, quantize_x, row_sums
from .qmatmul import choose_path, gemv_tiles, gemv_weights, qmatmul_torch


@triton.jit
def float_rows(x_ptr, q_ptr, tab_ptr, out_ptr, pid, N, K, DECODE: tl.constexpr, QK: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUND: tl.constexpr):
    """Program pid of qmatmul's float GEMV of one row (qmatmul._gemv_kernel at BLOCK_M = 1:
    the same sums), its rows stored rounded to the GEMV's dtype (ROUND)."""
    offs_n = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, offs_k, k_mask = gemv_weights(q_ptr, tab_ptr, offs_n, n_mask, k0, K, DECODE, QK, BLOCK_K)
        xr = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum(w * xr[None, :], axis=1)
    tl.store(out_ptr + offs_n, rounded(acc, ROUND), mask=n_mask)


@triton.jit
def pair_rows(pid, P1, x_ptr, q_ptr, tab_ptr, out_ptr, N, xq_ptr, xd_ptr, xs_ptr, q2_ptr, tab2_ptr, out2_ptr, N2, K,
              DECODE: tl.constexpr, QK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              ROUND: tl.constexpr, PAIR: tl.constexpr, UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr,
              BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, BODY: tl.constexpr,
              BLOCK_N2: tl.constexpr, BLOCK_U: tl.constexpr, MASK: tl.constexpr, ASM: tl.constexpr):
    """Program pid's rows: below P1 the float GEMV's (out), from P1 on with PAIR the dp4a
    GEMV's of the second weight (out2): gemv_dp4a's program, unsplit."""
    if PAIR and pid >= P1:
        rows = (pid - P1) * BLOCK_N2 + tl.arange(0, BLOCK_N2)
        y = row_sums(xq_ptr, xd_ptr, xs_ptr, q2_ptr, tab2_ptr, rows, N2, K, 0, K // UW, UNIT, UW, UPB, BLOCK_HW,
                     ZERO, OFFSET, BODY, BLOCK_N2, BLOCK_U, MASK, ASM)
        tl.store(out2_ptr + rows, y, mask=rows < N2)
    else:
        float_rows(x_ptr, q_ptr, tab_ptr, out_ptr, pid, N, K, DECODE, QK, BLOCK_N, BLOCK_K, ROUND)


@triton.jit
def _gemv_pair_kernel(x_ptr, q_ptr, tab_ptr, out_ptr, N, xq_ptr, xd_ptr, xs_ptr, q2_ptr, tab2_ptr, out2_ptr, N2, K,
                      P1, DECODE: tl.constexpr, QK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      ROUND: tl.constexpr, PAIR: tl.constexpr, UNIT: tl.constexpr, UW: tl.constexpr,
                      UPB: tl.constexpr, BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                      BODY: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_U: tl.constexpr, MASK: tl.constexpr,
                      ASM: tl.constexpr):
    pair_rows(tl.program_id(0), P1, x_ptr, q_ptr, tab_ptr, out_ptr, N, xq_ptr, xd_ptr, xs_ptr, q2_ptr, tab2_ptr,
              out2_ptr, N2, K, DECODE, QK, BLOCK_N, BLOCK_K, ROUND, PAIR, UNIT, UW, UPB, BLOCK_HW, ZERO, OFFSET,
              BODY, BLOCK_N2, BLOCK_U, MASK, ASM)


def one_row_path(fmt: quant.Format, device, N: int, K: int) -> str | None:
    """Which of qmatmul's one-row GEMVs an (N, K) weight in fmt runs on `device` whose
    programs a shared launch can take: "dp4a" where it splits no K, "gemv" (the float
    one, never split), or None (a dp4a GEMV that splits K; batch-invariant mode's GEMM
    for float formats). The one decision of router_gemv, gemv_pair and moe(pair=)."""
    p = choose_path(fmt, 1)
    if p == "dp4a":
        return p if K % 32 == 0 and gemv_launch(fmt, device, N, K)[2] == 1 else None
    return p if p == "gemv" else None


def pair_path(fmt: quant.Format, device, N: int, K: int, fmt2: quant.Format, N2: int) -> bool:
    """Whether an (N, K) weight in fmt, run by the float GEMV, and an (N2, K) one in fmt2,
    by the dp4a GEMV, share one launch with each GEMV's bits (see the module)."""
    if one_row_path(fmt, device, N, K) != "gemv" or one_row_path(fmt2, device, N2, K) != "dp4a":
        return False
    return gemv_launch(fmt2, device, N2, K)[3] == configs.float_gemv_warps(fmt.name, device)


def _kinds(parts: list, K: int):
    """(the float part, the dp4a part, whether the dp4a part comes first) of two (q, fmt, N)
    weights that share a launch, or None."""
    for i in (0, 1):
        (qf, ff, nf), (_, fd, nd) = parts[i], parts[1 - i]
        if pair_path(ff, qf.device, nf, K, fd, nd):
            return parts[i], parts[1 - i], i == 1
    return None


def takes(parts: list, K: int) -> bool:
    """Whether gemv_pair takes these two (q, fmt, N) weights of K columns, in either order."""
    return len(parts) == 2 and _kinds([(q, quant.get(f), n) for q, f, n in parts], K) is not None


# the dp4a part's constexprs where a launch has none (never traced)
NO_PAIR = dict(PAIR=False, UNIT=None, UW=1, UPB=1, BLOCK_HW=1, ZERO=0, OFFSET=0, BODY=0, BLOCK_N2=1, BLOCK_U=1,
               MASK=False, ASM="")


def float_launch(x: torch.Tensor, q: torch.Tensor, fmt: quant.Format, N: int, dtype: torch.dtype) -> tuple:
    """(the float part's arguments: x in `dtype`, weight, table; its programs; its
    constexprs) as qmatmul's float GEMV of one row takes them."""
    if dtype not in ROUNDING:
        raise ValueError(f"the float GEMV's dtype must be float32, bfloat16 or float16, got {dtype}")
    xr = x.to(dtype)  # as QuantLinear's float GEMV takes it
    if xr.dtype == torch.bfloat16 and not xr.is_cuda:
        xr = xr.float()  # the interpreter holds bf16 as raw uint16: widened (exact)
    _, block_n, block_k = gemv_tiles(N, q.device, fmt)
    return ((xr, q.contiguous(), table(fmt, q.device)), triton.cdiv(N, block_n),
            dict(DECODE=decoder(fmt), QK=fmt.block_elems, BLOCK_N=block_n, BLOCK_K=block_k, ROUND=ROUNDING[dtype]))


def dp4a_launch(x: torch.Tensor, q: torch.Tensor, fmt: quant.Format, N: int) -> tuple:
    """(the dp4a part's arguments: x's int8 and the weight's units; its programs; its
    constexprs) as gemv_dp4a's unsplit launch takes them."""
    K = x.shape[1]
    x8, un = quantize_x(x), unit(fmt)
    block_n, block_u, _, _ = gemv_launch(fmt, q.device, N, K)
    return ((x8.q, x8.d, x8.s, q.reshape(-1).view(torch.uint16), unit_table(fmt, q.device)),
            triton.cdiv(N, block_n),
            dict(PAIR=True, **launch_args(fmt, un), BLOCK_N2=block_n, BLOCK_U=block_u,
                 MASK=(K // un.weights) % block_u != 0, ASM=asm_for(q.device)))


def _check(x, parts):
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.float32:
        raise ValueError(f"gemv_pair: x must be one float32 row, got {x.dtype} {tuple(x.shape)}")
    if len(parts) != 2:
        raise ValueError(f"gemv_pair: takes two weights, got {len(parts)}")
    return [(q, quant.get(f), N) for q, f, N in parts]


def gemv_pair(x: torch.Tensor, parts: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """See the module: (1, N1 + N2) float32, the parts' rows in their order."""
    parts = _check(x, parts)
    if not use_triton(x):
        return gemv_pair_torch(x, parts, dtype)
    K = x.shape[1]
    kinds = _kinds(parts, K)
    if kinds is None:
        raise ValueError(f"gemv_pair: a {parts[0][1].name} {parts[0][2]} x {K} weight and a {parts[1][1].name} "
                         f"{parts[1][2]} x {K} one on {parts[0][0].device} take no shared launch; ask `takes` first")
    (qf, ff, nf), (qd, fd, nd), dp4a_first = kinds
    out = torch.empty((1, nf + nd), dtype=torch.float32, device=x.device)
    fo, do = (out[:, nd:], out) if dp4a_first else (out, out[:, nf:])  # each part's columns
    f_args, p1, f_cx = float_launch(x, qf, ff, nf, dtype)
    d_args, p2, d_cx = dp4a_launch(x, qd, fd, nd)
    _gemv_pair_kernel[(p1 + p2,)](*f_args, fo, nf, *d_args, do, nd, K, p1, **f_cx, **d_cx,
                                  num_warps=configs.float_gemv_warps(ff.name, qf.device))
    return out


def gemv_pair_torch(x: torch.Tensor, parts: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Each part's qmatmul_torch (the float part from x in `dtype`), joined."""
    parts = _check(x, parts)
    return torch.cat([qmatmul_torch(x if unit(f) is not None else x.to(dtype), q, f, n=N).float()
                      for q, f, N in parts], dim=1)
