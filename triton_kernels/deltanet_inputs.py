"""The gated delta rule's inputs from a DeltaNet layer's projections and conv, and its
output's gated RMSNorm, one kernel each (strata.nn.deltanet says what the layer computes):

    deltanet_inputs(mixed (T, C), b (T, Hv), a (T, Hv), dt_bias (Hv,), a_coef (Hv,), Hk, dk)
        -> q, k (T, Hv, dk), v (T, Hv, dv), g, beta (T, Hv)
    mixed = [q heads (Hk * dk) | k heads (Hk * dk) | v heads (Hv * dv)], the conv's output
    before its SiLU
        q[t, h] = l2norm(silu(q heads of mixed)[h % Hk]) * dk^-1/2
        k[t, h] = l2norm(silu(k heads of mixed)[h % Hk])
        v[t, h] = silu(v heads of mixed)[h]
        beta    = sigmoid(b);  g = a_coef * softplus(a + dt_bias)  (g: the log of the decay)

    deltanet_conv_inputs(window, qkv (1, C), taps, b, a, dt_bias, a_coef, Hk, dk)
        -> one token's conv step (triton_kernels.conv) and then the above in one launch,
           and the conv's new window

    deltanet_gated_norm(o (T, Hv, dv), z (T, Hv * dv), w (dv,), eps)
        -> rms_norm(o over dv) * w * sigmoid(z), as rows (T, Hv * dv)

Value head h reads key head h % Hk: llama.cpp's converter stores the value heads tiled
(torch's `repeat`, not `repeat_interleave`). In torch the first is nine launches a step
(SiLU, the norm, two repeats, the scale, sigmoid, add, softplus, product) and the second
four; here one each. Each program reads one token's row, so a row's result does not
depend on the rows beside it (a decode and a verify agree).

All float32. Not bit for bit with the torch twins (`*_torch`, the CPU path's own ops):
the sums of squares add in another order, and exp and the square root may round
otherwise on a GPU; the bounds are in tests/triton_kernels/test_deltanet_inputs.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import invariant
from .backend import use_triton
from .conv import causal_conv_torch, conv_taps
from .int8 import Q8X, attach, int8_buffers, store_groups
from .norms import l2norm_torch


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _conv_mixed(x_ptr, win_ptr, taps_ptr, new_win_ptr, c, live, SPAN: tl.constexpr, KT: tl.constexpr):
    """conv_step's output at channels c (dilation 1) and the channels' new window."""
    return conv_taps(tl.load(x_ptr + c, mask=live, other=0.0), win_ptr, taps_ptr, new_win_ptr, c, live,
                     SPAN, KT, 1)


@triton.jit
def _inputs_kernel(mixed_ptr, b_ptr, a_ptr, dt_ptr, coef_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                   C, b_stride, a_stride, Hk, Hv, DK, DV, scale, eps, BK: tl.constexpr, BV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h % Hk  # the tiled head order (see the module)
    rk, rv = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    row = mixed_ptr + t * C
    q = _silu(tl.load(row + kh * DK + rk, mask=mk, other=0.0))
    k = _silu(tl.load(row + (Hk + kh) * DK + rk, mask=mk, other=0.0))
    v = _silu(tl.load(row + 2 * Hk * DK + h * DV + rv, mask=mv, other=0.0))
    # rounded as torch's rsqrt is, not approximated
    q = q * (1.0 / tl.sqrt_rn(tl.sum(q * q, axis=0) + eps)) * scale
    k = k * (1.0 / tl.sqrt_rn(tl.sum(k * k, axis=0) + eps))
    out = (t * Hv + h)
    tl.store(q_ptr + out * DK + rk, q, mask=mk)
    tl.store(k_ptr + out * DK + rk, k, mask=mk)
    tl.store(v_ptr + out * DV + rv, v, mask=mv)
    _beta_g(b_ptr + t * b_stride, a_ptr + t * a_stride, dt_ptr, coef_ptr, g_ptr, beta_ptr, h, out)


@triton.jit
def _beta_g(b_row, a_row, dt_ptr, coef_ptr, g_ptr, beta_ptr, h, out):
    beta, g = beta_g(b_row, a_row, dt_ptr, coef_ptr, h)
    tl.store(beta_ptr + out, beta)
    tl.store(g_ptr + out, g)


@triton.jit
def beta_g(b_row, a_row, dt_ptr, coef_ptr, h):
    """Value head h's (beta, g) from its b and a."""
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_row + h)))
    x = tl.load(a_row + h) + tl.load(dt_ptr + h)
    # softplus as torch's (threshold 20), log1p(e) by Goldberg's log(u) e / (u - 1), u = 1 + e,
    # exact to a few ulp where e is below float32's epsilon and log(1 + e) would round to 0
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return beta, tl.load(coef_ptr + h) * tl.where(x > 20.0, x, log1p)


@triton.jit
def _conv_inputs_kernel(qkv_ptr, b_ptr, a_ptr, dt_ptr, coef_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                        win_ptr, taps_ptr, new_win_ptr, Hk, Hv, DK, DV, scale, eps,
                        BK: tl.constexpr, BV: tl.constexpr, SPAN: tl.constexpr, KT: tl.constexpr):
    # one token; a program a key head and its value heads h = kh, kh + Hk, ... (the tiled
    # order): every channel's conv and window are one program's, so the window may be
    # moved on in place (new_win_ptr == win_ptr)
    kh = tl.program_id(0)
    rk, rv = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    q = _silu(_conv_mixed(qkv_ptr, win_ptr, taps_ptr, new_win_ptr, kh * DK + rk, mk, SPAN, KT))
    k = _silu(_conv_mixed(qkv_ptr, win_ptr, taps_ptr, new_win_ptr, (Hk + kh) * DK + rk, mk, SPAN, KT))
    q = q * (1.0 / tl.sqrt_rn(tl.sum(q * q, axis=0) + eps)) * scale
    k = k * (1.0 / tl.sqrt_rn(tl.sum(k * k, axis=0) + eps))
    for h in range(kh, Hv, Hk):
        tl.store(q_ptr + h * DK + rk, q, mask=mk)
        tl.store(k_ptr + h * DK + rk, k, mask=mk)
        v = _silu(_conv_mixed(qkv_ptr, win_ptr, taps_ptr, new_win_ptr, 2 * Hk * DK + h * DV + rv, mv, SPAN, KT))
        tl.store(v_ptr + h * DV + rv, v, mask=mv)
        _beta_g(b_ptr, a_ptr, dt_ptr, coef_ptr, g_ptr, beta_ptr, h, h)


@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, q_ptr, d_ptr, s_ptr, Hv, DV, z_stride, eps,
                       BV: tl.constexpr, QUANT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # (token, head) row: r = t * Hv + h
    t, h = r // Hv, r % Hv
    c = tl.arange(0, BV)
    live = c < DV
    o = tl.load(o_ptr + r * DV + c, mask=live, other=0.0)
    store_gated(o, z_ptr + t * z_stride + h * DV, w_ptr, y_ptr + r * DV, q_ptr, d_ptr, s_ptr, t, h, c, live, Hv,
                DV, eps, BV, QUANT)


@triton.jit
def store_gated(o, z_row, w_ptr, y_row, q_ptr, d_ptr, s_ptr, t, h, c, live, Hv, DV, eps, BV: tl.constexpr,
                QUANT: tl.constexpr):
    """Head h of token t, its recurrence's output o [BV] (DV live): the gated norm's row
    stored at y_row (and with QUANT its groups as int8.quantize_x writes them, for the
    output projection's dp4a GEMV)."""
    inv = 1.0 / tl.sqrt_rn(tl.sum(o * o, axis=0) / DV + eps)
    w = tl.load(w_ptr + c, mask=live, other=0.0)
    z = tl.load(z_row + c, mask=live, other=0.0)
    y = o * inv * w * (1.0 / (1.0 + tl.exp(-z)))
    tl.store(y_row + c, y, mask=live)
    if QUANT:
        i = tl.arange(0, BV // 32)
        store_groups(q_ptr, d_ptr, s_ptr, t, h * (DV // 32) + i, tl.reshape(y, (BV // 32, 32)), Hv * DV,
                     i < DV // 32)


def _check(name: str, **ts) -> None:
    for n, t in ts.items():
        if t.dtype != torch.float32:
            raise ValueError(f"{name}: {n} must be float32, got {t.dtype}")


def deltanet_inputs(mixed, b, a, dt_bias, a_coef, k_heads: int, dk: int):
    """(q, k, v, g, beta) of the recurrence from the conv's output `mixed` before its SiLU
    and the projections' b and a (see the module)."""
    _check("deltanet_inputs", mixed=mixed, b=b, a=a, dt_bias=dt_bias, a_coef=a_coef)
    T, C = mixed.shape
    Hv = b.shape[-1]
    dv, rest = divmod(C - 2 * k_heads * dk, Hv)
    if rest or dv <= 0 or Hv % k_heads or a.shape != b.shape or b.shape[0] != T:
        raise ValueError(f"deltanet_inputs: mixed {tuple(mixed.shape)} and b, a {tuple(b.shape)}, {tuple(a.shape)} "
                         f"do not fit {k_heads} key heads of {dk} and {Hv} value heads")
    if not use_triton(mixed):
        return deltanet_inputs_torch(mixed, b, a, dt_bias, a_coef, k_heads, dk)
    mixed = mixed.contiguous()
    # b and a are column slices of the projection's rows: read in place, by their row stride
    b, a = (x if x.stride(-1) == 1 else x.contiguous() for x in (b, a))
    q, k = (mixed.new_empty(T, Hv, dk) for _ in range(2))
    v = mixed.new_empty(T, Hv, dv)
    g, beta = (mixed.new_empty(T, Hv) for _ in range(2))
    if T:
        _inputs_kernel[(T, Hv)](mixed, b, a, dt_bias.contiguous(), a_coef.contiguous(), q, k, v, g, beta, C,
                                b.stride(0), a.stride(0), k_heads, Hv, dk, dv, dk ** -0.5, 1e-6,
                                BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv),
                                enable_fp_fusion=False)  # no FMA: rows round as deltanet_decode's tokens
    return q, k, v, g, beta


def deltanet_conv_inputs(window, qkv, taps, b, a, dt_bias, a_coef, k_heads: int, dk: int,
                         in_place: bool = False):
    """One token's conv step and deltanet_inputs in one launch: (q, k, v, g, beta, the
    conv's new window) from the window (C, K - 1), the projection's qkv (1, C) and the
    taps (C, K) (dilation 1). The conv's output is conv_step's bit for bit (its taps in
    its order, no fused multiply-add in this launch); the rest is deltanet_inputs'.
    in_place: the new window written over `window` (contiguous) and returned. The engine's
    tokens take triton_kernels.deltanet_decode's one launch, which this launch, the
    recurrence's and the gated norm's are the reference for (its tests) and the peer of
    (strata.bench.deltanet)."""
    _check("deltanet_conv_inputs", window=window, qkv=qkv, taps=taps)
    C = qkv.shape[-1]
    if qkv.shape[0] != 1 or taps.dim() != 2 or tuple(taps.shape[:1]) != (C,) or \
            tuple(window.shape) != (C, taps.shape[1] - 1):
        raise ValueError(f"deltanet_conv_inputs: one token's qkv (1, C), taps (C, K) and window (C, K - 1); got "
                         f"{tuple(qkv.shape)}, {tuple(taps.shape)} and {tuple(window.shape)}")
    if not use_triton(qkv):
        return deltanet_conv_inputs_torch(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk)
    _check("deltanet_conv_inputs", b=b, a=a, dt_bias=dt_bias, a_coef=a_coef)
    Hv = b.shape[-1]
    dv, rest = divmod(C - 2 * k_heads * dk, Hv)
    if rest or dv <= 0 or Hv % k_heads or a.shape != b.shape or b.shape[0] != 1:
        raise ValueError(f"deltanet_conv_inputs: qkv {tuple(qkv.shape)} and b, a {tuple(b.shape)}, {tuple(a.shape)} "
                         f"do not fit {k_heads} key heads of {dk} and {Hv} value heads")
    if in_place and not window.is_contiguous():
        raise ValueError("deltanet_conv_inputs: in_place needs a contiguous window")
    qkv, window, taps = qkv.contiguous(), window.contiguous(), taps.contiguous()
    b, a = (x.contiguous() for x in (b, a))
    q, k = (qkv.new_empty(1, Hv, dk) for _ in range(2))
    v = qkv.new_empty(1, Hv, dv)
    g, beta = (qkv.new_empty(1, Hv) for _ in range(2))
    new = window if in_place else torch.empty_like(window)
    _conv_inputs_kernel[(k_heads,)](qkv, b, a, dt_bias.contiguous(), a_coef.contiguous(), q, k, v, g, beta,
                                    window, taps, new, k_heads, Hv, dk, dv, dk ** -0.5, 1e-6,
                                    BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv),
                                    SPAN=window.shape[1], KT=taps.shape[1], enable_fp_fusion=False)
    return q, k, v, g, beta, new


def deltanet_conv_inputs_torch(window, qkv, taps, b, a, dt_bias, a_coef, k_heads: int, dk: int,
                               in_place: bool = False):
    """conv_step in torch, then deltanet_inputs_torch."""
    mixed, new = causal_conv_torch(window, qkv, taps)
    if in_place:
        new = window.copy_(new)
    return (*deltanet_inputs_torch(mixed, b, a, dt_bias, a_coef, k_heads, dk), new)


def deltanet_inputs_torch(mixed, b, a, dt_bias, a_coef, k_heads: int, dk: int):
    """The same as torch ops: the CPU path's (strata.nn.deltanet), in its order."""
    T, Hv = mixed.shape[0], b.shape[-1]
    # batch-invariant: the vector code for every element also where a row's width is not a
    # multiple of invariant.VEC (free where it is: no padding then)
    mixed = invariant.pointwise(F.silu, mixed)
    qk, v = mixed.split([2 * k_heads * dk, mixed.shape[1] - 2 * k_heads * dk], dim=-1)
    rep = Hv // k_heads
    q = l2norm_torch(qk[:, :k_heads * dk].reshape(T, k_heads, dk))
    k = l2norm_torch(qk[:, k_heads * dk:].reshape(T, k_heads, dk))
    q = q.repeat(1, rep, 1) * dk ** -0.5
    k = k.repeat(1, rep, 1)
    v = v.reshape(T, Hv, -1)
    # a value a head, (T, Hv): batch-invariant, through the vector code for any T (ATen runs
    # the last elements of a call through its scalar code, which rounds otherwise)
    beta = invariant.pointwise(torch.sigmoid, b)
    g = a_coef * invariant.pointwise(F.softplus, a + dt_bias)
    return q, k, v, g, beta


def deltanet_gated_norm(o, z, w, eps: float, quantize: bool = False):
    """Gated RMSNorm per head: rms_norm(o) * w * sigmoid(z), o (T, Hv, dv), z (T, Hv * dv):
    rows (T, Hv * dv). With `quantize` (dv a multiple of 32, Triton) the launch also writes
    them as int8.quantize_x would, attached (int8.attach), for the output projection."""
    _check("deltanet_gated_norm", o=o, z=z, w=w)
    T, Hv, dv = o.shape
    if z.shape != (T, Hv * dv) or w.shape != (dv,):
        raise ValueError(f"deltanet_gated_norm: o {tuple(o.shape)}, z {tuple(z.shape)} and w {tuple(w.shape)} "
                         f"do not fit {Hv} heads of {dv}")
    if not use_triton(o):
        return deltanet_gated_norm_torch(o, z, w, eps)
    o, w = o.contiguous(), w.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    y = o.new_empty(T, Hv * dv)
    quantize, x8 = int8_buffers(quantize, T, Hv * dv, dv, y)
    if T:
        _gated_norm_kernel[(T * Hv,)](o, z, w, y, *x8, Hv, dv, z.stride(0), eps, BV=triton.next_power_of_2(dv),
                                      QUANT=quantize, enable_fp_fusion=False)  # as deltanet_decode's
    return attach(y, Q8X(*x8)) if quantize else y


def deltanet_gated_norm_torch(o, z, w, eps: float, quantize: bool = False):
    T, Hv, dv = o.shape
    o = F.rms_norm(o, (dv,), eps=eps) * w * torch.sigmoid(z.reshape(T, Hv, dv))
    return o.reshape(T, Hv * dv)
