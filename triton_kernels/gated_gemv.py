"""A GEMV whose input is a gated product, the gate in the GEMV's launch:

    gated_qmatmul(g (M, K), u (M, K), q, fmt, silu, dtype) -> qmatmul((act(g) * u).to(dtype), q, fmt)
        act = silu (the shared expert's SwiGLU before its down projection) or sigmoid
        (silu=False: the attention's output gate before its output projection)

g and u are float32 rows with unit column stride (column ranges of a fused projection's
output). Where qmatmul would run its float GEMV (formats without an int8 unit decode, at
most GEMV_MAX_M rows, not batch-invariant), each program computes the product of the
columns it reads, as silu_mul / sigmoid_mul compute it, rounds it to `dtype` as the GEMV's
input would be (bfloat16 to nearest even, by its bits: the same on a GPU and in the
interpreter), and multiplies on as qmatmul's GEMV does: the two launches' result bit for
bit in one. On the dp4a path the product's launch also writes it as int8 (int8.attach),
unrounded, for the GEMV; elsewhere it is those two launches. `gated_qmatmul_torch` is silu_mul_torch
(sigmoid_mul_torch), the cast and qmatmul_torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import quant

from . import configs
from .backend import use_triton
from .decode import decoder, table
from .qmatmul import _check as _check_q, choose_path, gemv_store, gemv_tiles, gemv_weights, qmatmul, qmatmul_torch
from .shared_expert import _rows, gate, sigmoid_mul, sigmoid_mul_torch, silu_mul, silu_mul_torch

ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # a dtype -> `rounded`'s ROUND


@triton.jit
def rounded(x, ROUND: tl.constexpr):
    """float32 x rounded to bfloat16 (ROUND 1: nearest even, on the bits, finite values: the
    same on a GPU and in the interpreter) or float16 (2), held as float32; x for 0."""
    if ROUND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _gated_gemv_kernel(g_ptr, u_ptr, q_ptr, tab_ptr, out_ptr, M, N, K, stride_gm, stride_um, stride_om,
                       DECODE: tl.constexpr, QK: tl.constexpr, SILU: tl.constexpr, ROUND: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = gated_rows(g_ptr, u_ptr, q_ptr, tab_ptr, pid_m, offs_n, M, N, K, stride_gm, stride_um,
                     DECODE, QK, SILU, ROUND, BLOCK_M, BLOCK_N, BLOCK_K)
    gemv_store(out_ptr, acc, pid_m, offs_n, offs_n < N, M, stride_om, BLOCK_M)


@triton.jit
def gated_rows(g_ptr, u_ptr, q_ptr, tab_ptr, pid_m, offs_n, M, N, K, stride_gm, stride_um,
               DECODE: tl.constexpr, QK: tl.constexpr, SILU: tl.constexpr, ROUND: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program of the gated GEMV: its BLOCK_M rows of act(g) * u (rounded as ROUND) times
    the weight rows offs_n, [BLOCK_M, BLOCK_N] float32 (also the MoE down launch's extra
    programs: triton_kernels.moe, `pair`)."""
    n_mask = offs_n < N
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, offs_k, k_mask = gemv_weights(q_ptr, tab_ptr, offs_n, n_mask, k0, K, DECODE, QK, BLOCK_K)
        for r in tl.static_range(BLOCK_M):
            m = tl.minimum(pid_m * BLOCK_M + r, M - 1).to(tl.int64)
            g = tl.load(g_ptr + m * stride_gm + offs_k, mask=k_mask, other=0.0)
            u = tl.load(u_ptr + m * stride_um + offs_k, mask=k_mask, other=0.0)
            xr = rounded(gate(g, u, SILU), ROUND)  # silu_mul's or sigmoid_mul's own expression, as the input's dtype
            part = tl.sum(w * xr[None, :], axis=1)
            acc += tl.where(rows[:, None] == r, part[None, :], 0.0)
    return acc


def _check(g, u, dtype):
    _rows("gated_qmatmul", g, u)
    if g.shape != u.shape:
        raise ValueError(f"gated_qmatmul: g {tuple(g.shape)} and u {tuple(u.shape)} differ")
    if dtype not in ROUNDING:
        raise ValueError(f"gated_qmatmul: dtype must be float32, bfloat16 or float16, got {dtype}")


def product_apart(fmt, M: int) -> bool:
    """Whether gated_qmatmul of M rows launches the product apart from its GEMV (the dp4a
    path), so that an earlier launch may write it instead (`product`)."""
    return choose_path(quant.get(fmt), M) == "dp4a"


def gated_qmatmul(g: torch.Tensor, u: torch.Tensor, q: torch.Tensor, fmt, silu: bool = True,
                  dtype: torch.dtype = torch.float32, product: torch.Tensor | None = None) -> torch.Tensor:
    """qmatmul((silu(g) * u).to(dtype), q, fmt), sigmoid for silu=False (see the module);
    (M, N) in dtype. On the dp4a path qmatmul(silu(g) * u, q, fmt).to(dtype): the GEMV rounds
    the float32 product to int8 itself (a copy in dtype first would round it twice).
    `product`: that float32 product as another launch wrote it (its int8 attached as
    silu_mul(quantize=True) attaches it; route_align's for the shared expert), taken on the
    dp4a path in place of the product's own launch (`product_apart`)."""
    fmt = quant.get(fmt)
    _check(g, u, dtype)
    if product is not None and product.shape != g.shape:
        raise ValueError(f"gated_qmatmul: product {tuple(product.shape)} must be g's {tuple(g.shape)}")
    if not use_triton(g):
        return gated_qmatmul_torch(g, u, q, fmt, silu, dtype, product)
    _, N, K = _check_q(g, q, fmt, None)
    M = g.shape[0]
    path = choose_path(fmt, M)
    if path == "dp4a":  # the product in float32, quantized in its launch for the GEMV (int8.attach)
        if product is None:
            product = (silu_mul if silu else sigmoid_mul)(g, u, quantize=g.is_cuda)
        return qmatmul(product, q, fmt).to(dtype)
    if product is not None:
        raise ValueError(f"gated_qmatmul: a product is taken on the dp4a path only ({fmt.name}, {M} rows: "
                         f"{path}); ask product_apart first")
    if path != "gemv" or not M or not N or not K:
        return qmatmul((silu_mul if silu else sigmoid_mul)(g, u).to(dtype), q, fmt)
    block_m, block_n, block_k = gemv_tiles(N, q.device, fmt)
    block_m = min(block_m, triton.next_power_of_2(M))
    # the interpreter holds bf16 as raw uint16: a float32 result, rounded after (exact)
    out = torch.empty((M, N), dtype=dtype if g.is_cuda else torch.float32, device=g.device)
    q = q.contiguous()
    _gated_gemv_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
        g, u, q, table(fmt, q.device), out, M, N, K, g.stride(0), u.stride(0), out.stride(0),
        DECODE=decoder(fmt), QK=fmt.block_elems, SILU=silu, ROUND=ROUNDING[dtype],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=configs.float_gemv_warps(fmt.name, g.device))
    return out.to(dtype)


def gated_qmatmul_torch(g: torch.Tensor, u: torch.Tensor, q: torch.Tensor, fmt, silu: bool = True,
                        dtype: torch.dtype = torch.float32, product: torch.Tensor | None = None) -> torch.Tensor:
    _check(g, u, dtype)
    if product is None:
        product = (silu_mul_torch if silu else sigmoid_mul_torch)(g, u)
    return qmatmul_torch(product.to(dtype), q, fmt)
