"""The MoE block's elementwise work around its shared expert's GEMVs (strata.nn.moe), one
kernel each:

    silu_mul(g (T, I), u (T, I))                          -> silu(g) * u (T, I), float32
    sigmoid_mul(g (T, N), u (T, N))                       -> sigmoid(g) * u (the same kernel)
    gated_add(routed (T, H), gate (T, 1), shared (T, H))  -> routed + sigmoid(gate) * shared
                     routed (T, k, H): the MoE's per-slot rows, summed first (in slot order):
                     the routed experts' sum in this launch, not one of its own

In torch these are two and three launches a layer (silu, mul; sigmoid, mul, add). The
inputs may be strided views (g, u and gate are column ranges of the block's fused
projection). Each program reads one token's row, so a row's result does not depend on
the batch. The torch twins are the CPU's path as it was (the sigmoid through
invariant.pointwise). Float32; within a bound of the float64 result, not bit for bit with the torch
twins (exp may round otherwise; tests/triton_kernels/test_shared_expert.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import invariant
from .backend import use_triton
from .int8 import Q8X, attach, int8_buffers, store_groups

BLOCK = 1024  # columns a program


@triton.jit
def gate(g, u, SILU: tl.constexpr):
    """silu(g) * u, or sigmoid(g) * u: the one expression of each, which the gated GEMV
    (triton_kernels.gated_gemv) computes too, so that the fused launch keeps these bits."""
    if SILU:
        return g / (1.0 + tl.exp(-g)) * u
    else:
        return (1.0 / (1.0 + tl.exp(-g))) * u


@triton.jit
def gated_sum(a_ptr, gate_ptr, b_ptr, t, c, live, K, stride_a, stride_k, stride_gate, stride_b):
    """Token t's slots' rows summed in slot order plus sigmoid(gate) times b, at columns c:
    gated_add's sum, which the hyper-connection write (triton_kernels.hc_moe_write) takes
    into its own launch."""
    s = 1.0 / (1.0 + tl.exp(-tl.load(gate_ptr + t * stride_gate)))
    a = tl.load(a_ptr + t * stride_a + c, mask=live, other=0.0)
    for j in range(1, K):  # the other slots' rows, in order
        a += tl.load(a_ptr + t * stride_a + j * stride_k + c, mask=live, other=0.0)
    return a + s * tl.load(b_ptr + t * stride_b + c, mask=live, other=0.0)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, q_ptr, d_ptr, s_ptr, N, stride_g, stride_u,
                     BLOCK_N: tl.constexpr, SILU: tl.constexpr = True, QUANT: tl.constexpr = False):
    gate_block(g_ptr, u_ptr, out_ptr, q_ptr, d_ptr, s_ptr, tl.program_id(0).to(tl.int64),
               tl.program_id(1) * BLOCK_N, N, stride_g, stride_u, BLOCK_N, SILU, QUANT, False)


@triton.jit
def gate_block(g_ptr, u_ptr, out_ptr, q_ptr, d_ptr, s_ptr, t, c0, N, stride_g, stride_u,
               BLOCK_N: tl.constexpr, SILU: tl.constexpr, QUANT: tl.constexpr, CG: tl.constexpr):
    """Columns c0 .. c0 + BLOCK_N of row t of silu_mul (sigmoid_mul for SILU False), with
    QUANT also as int8.quantize_x writes them (N a multiple of 32, c0 of BLOCK_N): a
    program of _silu_mul_kernel, and the router's launch for the shared expert
    (triton_kernels.route_align), with the same bits. CG: g and u read from L2 (another
    program of the launch stored them: triton_kernels.router_gemv)."""
    c = c0 + tl.arange(0, BLOCK_N)
    live = c < N
    if CG:
        g = tl.load(g_ptr + t * stride_g + c, mask=live, other=0.0, cache_modifier=".cg")
        u = tl.load(u_ptr + t * stride_u + c, mask=live, other=0.0, cache_modifier=".cg")
    else:
        g = tl.load(g_ptr + t * stride_g + c, mask=live, other=0.0)
        u = tl.load(u_ptr + t * stride_u + c, mask=live, other=0.0)
    v = gate(g, u, SILU)
    tl.store(out_ptr + t * N + c, v, mask=live)
    if QUANT:
        i = c0 // 32 + tl.arange(0, BLOCK_N // 32)
        store_groups(q_ptr, d_ptr, s_ptr, t, i, tl.reshape(v, (BLOCK_N // 32, 32)), N, i < N // 32)


@triton.jit
def _gated_add_kernel(a_ptr, gate_ptr, b_ptr, out_ptr, N, K, stride_a, stride_k, stride_gate, stride_b,
                      BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = c < N
    tl.store(out_ptr + t * N + c, gated_sum(a_ptr, gate_ptr, b_ptr, t, c, live, K, stride_a, stride_k,
                                            stride_gate, stride_b), mask=live)


def _rows(name: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float32 or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{name}: expects float32 (tokens, n) rows with unit column stride, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")


def silu_mul(g: torch.Tensor, u: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """silu(g) * u for g, u (T, N): (T, N) float32. With `quantize` (N a multiple of 32,
    Triton) the launch also writes it as int8.quantize_x would, attached (int8.attach)."""
    if not use_triton(g):
        return silu_mul_torch(g, u)
    return _gate_mul("silu_mul", g, u, True, quantize)


def sigmoid_mul(g: torch.Tensor, u: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """sigmoid(g) * u for g, u (T, N): (T, N) float32 (the gated attention's output gate,
    strata.nn.gated_attention.finish: two launches in torch); `quantize` as silu_mul's."""
    if not use_triton(g):
        return sigmoid_mul_torch(g, u)
    return _gate_mul("sigmoid_mul", g, u, False, quantize)


def _gate_mul(name: str, g: torch.Tensor, u: torch.Tensor, silu: bool, quantize: bool) -> torch.Tensor:
    _rows(name, g, u)
    if g.shape != u.shape:
        raise ValueError(f"{name}: g {tuple(g.shape)} and u {tuple(u.shape)} differ")
    T, N = g.shape
    out = g.new_empty(T, N)
    quantize, x8 = int8_buffers(quantize, T, N, N, out)
    if out.numel():
        bn = min(BLOCK, triton.next_power_of_2(N))
        _silu_mul_kernel[(T, triton.cdiv(N, bn))](g, u, out, *x8, N, g.stride(0), u.stride(0), BLOCK_N=bn,
                                                  SILU=silu, QUANT=quantize)
    return attach(out, Q8X(*x8)) if quantize else out


def sigmoid_mul_torch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return u * torch.sigmoid(g)


def silu_mul_torch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def gated_add(a: torch.Tensor, gate: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + sigmoid(gate) * b for a, b (T, N) and gate (T, 1): (T, N) float32. a may be
    (T, K, N), K rows a token (the MoE's slots): their sum, in slot order, takes a's place."""
    if not use_triton(a):
        return gated_add_torch(a, gate, b)
    if a.dim() == 3:
        if a.dtype != torch.float32 or (a.shape[2] > 1 and a.stride(2) != 1):
            raise ValueError(f"gated_add: expects float32 (tokens, slots, n) rows with unit column stride, got "
                             f"{a.dtype} {tuple(a.shape)} strides {a.stride()}")
        K, stride_k = a.shape[1], a.stride(1)
        a2 = a[:, 0]
    else:
        K, stride_k, a2 = 1, 0, a
    _rows("gated_add", a2, gate, b)
    if a2.shape != b.shape or gate.shape != (a.shape[0], 1) or K < 1:
        raise ValueError(f"gated_add: a {tuple(a.shape)}, b {tuple(b.shape)} and gate {tuple(gate.shape)} "
                         f"must be (T, N) or (T, K >= 1, N), (T, N) and (T, 1)")
    T, N = a2.shape
    out = a.new_empty(T, N)
    if out.numel():
        bn = min(BLOCK, triton.next_power_of_2(N))
        _gated_add_kernel[(T, triton.cdiv(N, bn))](a, gate, b, out, N, K, a.stride(0), stride_k, gate.stride(0),
                                                   b.stride(0), BLOCK_N=bn)
    return out


def gated_add_torch(a: torch.Tensor, gate: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # the sigmoid through invariant.pointwise: a narrow (T, 1) column in batch-invariant mode
    if a.dim() == 3:
        a = a.sum(dim=1)
    return a + invariant.pointwise(torch.sigmoid, gate) * b
