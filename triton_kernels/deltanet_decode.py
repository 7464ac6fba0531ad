"""One token of a DeltaNet layer's mixing in one launch: the conv's step, the recurrence's
inputs, the gated delta rule and the gated norm of its output, where three launches ran
them (deltanet_conv_inputs, deltanet_step, deltanet_gated_norm):

    deltanet_decode(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm, eps)
        -> (the output projection's input rows (1, Hv * dv), the conv's new window)
    the recurrent state (Hv, dk, dv) updated in place; with `quantize` the rows also
    written as int8.quantize_x would, attached (int8.attach); with `in_place` the new window
    written over `window`

A program takes value head h and BLOCK_V of its value columns: it runs the conv of its key
head's q and k channels (every program of that key head runs the same) and of its own v
channels, the inputs' norms and gates, and the recurrence on its (dk, BLOCK_V) tile of the
state, and stores its columns of the recurrence's output. The gated norm needs a head's
whole row and the q and k channels' window may move on only once every program has read
it, so each program counts itself in for its key head (an atomic add, acquire and release,
after a barrier), and the last of a key head's programs norms the rows of its value heads,
read back from L2, and moves the q and k channels' window on. Its counts are
int8.zeroed_counts', left at 0 (a CUDA graph replays the launch as is).

Bit for bit the three launches' result: their jit functions (conv_sum and move_window of
triton_kernels.conv, beta_g and store_gated of deltanet_inputs, delta_token of deltanet),
the same sums in the same order, and like them no fused multiply-add (enable_fp_fusion off
in all four launches: a verify's rows, which take the three launches, round as a decode's).
`deltanet_decode_torch` is the three torch twins one after another (strata.nn.deltanet's
CPU decode step). One token only: a verify's rows and a prompt keep the separate launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .conv import conv_sum, move_window
from .deltanet import BLOCK_V, deltanet_step_torch, delta_token
from .deltanet_inputs import (_check, _silu, beta_g, deltanet_conv_inputs_torch, deltanet_gated_norm_torch,
                              store_gated)
from .int8 import Q8X, attach, int8_buffers, zeroed_counts


@triton.jit
def _decode_kernel(qkv_ptr, b_ptr, a_ptr, dt_ptr, coef_ptr, win_ptr, taps_ptr, new_win_ptr, s_ptr, o_ptr,
                   z_ptr, w_ptr, y_ptr, yq_ptr, yd_ptr, ys_ptr, count_ptr, Hk, Hv, width, scale, eps,
                   DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
                   SPAN: tl.constexpr, KT: tl.constexpr, QUANT: tl.constexpr):
    h = tl.program_id(0)
    kh = h % Hk  # the tiled head order (deltanet_inputs)
    rk = tl.arange(0, BK)
    mk = rk < DK
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mv = rv < DV
    # deltanet_conv_inputs' q and k, the window read only
    qc, kc = kh * DK + rk, (Hk + kh) * DK + rk
    q = _silu(conv_sum(tl.load(qkv_ptr + qc, mask=mk, other=0.0), win_ptr, taps_ptr, qc, mk, SPAN, KT, 1))
    k = _silu(conv_sum(tl.load(qkv_ptr + kc, mask=mk, other=0.0), win_ptr, taps_ptr, kc, mk, SPAN, KT, 1))
    q = q * (1.0 / tl.sqrt_rn(tl.sum(q * q, axis=0) + 1e-6)) * scale
    k = k * (1.0 / tl.sqrt_rn(tl.sum(k * k, axis=0) + 1e-6))
    # this program's v channels: their window is its own, moved on once every lane has read it
    vc = 2 * Hk * DK + h * DV + rv
    xv = tl.load(qkv_ptr + vc, mask=mv, other=0.0)
    v = _silu(conv_sum(xv, win_ptr, taps_ptr, vc, mv, SPAN, KT, 1))
    beta, g = beta_g(b_ptr, a_ptr, dt_ptr, coef_ptr, h)
    # deltanet_step's program
    tile = s_ptr + h * DK * DV + rk[:, None] * DV + rv[None, :]
    live = mk[:, None] & mv[None, :]
    s, o = delta_token(tl.load(tile, mask=live, other=0.0), q, k, v, g, beta)
    tl.store(tile, s, mask=live)
    tl.store(o_ptr + h * DV + rv, o, mask=mv)
    tl.debug_barrier()  # every lane's window read and columns stored before the count says so
    move_window(xv, win_ptr, new_win_ptr, vc, mv, SPAN)
    if tl.atomic_add(count_ptr + kh, 1, sem="acq_rel", scope="gpu") == (Hv // Hk) * tl.num_programs(1) - 1:
        c = tl.arange(0, BD)
        cl = c < DV
        for hv in range(kh, Hv, Hk):  # deltanet_gated_norm's rows of the key head's value heads
            ov = tl.load(o_ptr + hv * DV + c, mask=cl, other=0.0, cache_modifier=".cg")
            # the norm's width a runtime number, as deltanet_gated_norm's (a constant divisor
            # compiles to a product by its reciprocal, which rounds otherwise but at powers of 2)
            store_gated(ov, z_ptr + hv * DV, w_ptr, y_ptr + hv * DV, yq_ptr, yd_ptr, ys_ptr, 0, hv, c, cl, Hv,
                        width, eps, BD, QUANT)
        move_window(tl.load(qkv_ptr + qc, mask=mk, other=0.0), win_ptr, new_win_ptr, qc, mk, SPAN)
        move_window(tl.load(qkv_ptr + kc, mask=mk, other=0.0), win_ptr, new_win_ptr, kc, mk, SPAN)
        tl.atomic_xchg(count_ptr + kh, 0, sem="relaxed", scope="gpu")


def _check_decode(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm):
    _check("deltanet_decode", window=window, qkv=qkv, taps=taps, b=b, a=a, dt_bias=dt_bias, a_coef=a_coef, z=z,
           norm=norm)
    Hv, _, dv = state.shape
    C = qkv.shape[-1]
    if qkv.shape[0] != 1 or taps.dim() != 2 or tuple(taps.shape[:1]) != (C,) or \
            tuple(window.shape) != (C, taps.shape[1] - 1):
        raise ValueError(f"deltanet_decode: one token's qkv (1, C), taps (C, K) and window (C, K - 1); got "
                         f"{tuple(qkv.shape)}, {tuple(taps.shape)} and {tuple(window.shape)}")
    if C != 2 * k_heads * dk + Hv * dv or Hv % k_heads or tuple(b.shape) != (1, Hv) or a.shape != b.shape \
            or tuple(z.shape) != (1, Hv * dv) or tuple(norm.shape) != (dv,) or state.shape[1] != dk:
        raise ValueError(f"deltanet_decode: qkv {tuple(qkv.shape)}, b, a {tuple(b.shape)}, {tuple(a.shape)}, "
                         f"z {tuple(z.shape)} and norm {tuple(norm.shape)} do not fit {k_heads} key heads of {dk} "
                         f"and the state's {Hv} value heads of {dv}")


def deltanet_decode(window, qkv, taps, b, a, dt_bias, a_coef, k_heads: int, dk: int, state: torch.Tensor,
                    z, norm, eps: float, quantize: bool = False, in_place: bool = False):
    """One token's conv step, deltanet_inputs, the recurrence (`state` in place) and the
    gated norm in one launch (see the module): (rows (1, Hv * dv), the conv's new window)."""
    _check_decode(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm)
    if not use_triton(qkv):
        return deltanet_decode_torch(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm, eps,
                                     in_place=in_place)
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("deltanet_decode: the state must be contiguous float32, got "
                         f"{state.dtype}{'' if state.is_contiguous() else ', not contiguous'}")
    if in_place and not window.is_contiguous():
        raise ValueError("deltanet_decode: in_place needs a contiguous window")
    Hv, _, dv = state.shape
    qkv, window, taps, b, a, z = (x.contiguous() for x in (qkv, window, taps, b, a, z))
    new = window if in_place else torch.empty_like(window)
    o = qkv.new_empty(Hv, dv)  # the recurrence's output, read back by each key head's last program
    # the three launches' tile widths (deltanet_step's BLOCK_V, the gated norm's whole row):
    # a sum's order follows its tile's shape
    y = qkv.new_empty(1, Hv * dv)
    quantize, x8 = int8_buffers(quantize, 1, Hv * dv, dv, y)
    _decode_kernel[(Hv, triton.cdiv(dv, BLOCK_V))](
        qkv, b, a, dt_bias.contiguous(), a_coef.contiguous(), window, taps, new, state, o, z, norm.contiguous(),
        y, *x8, zeroed_counts(qkv.device, k_heads), k_heads, Hv, dv, dk ** -0.5, eps, DK=dk, DV=dv,
        BK=triton.next_power_of_2(dk), BV=BLOCK_V, BD=triton.next_power_of_2(dv), SPAN=window.shape[1],
        KT=taps.shape[1], QUANT=quantize, enable_fp_fusion=False)
    return (attach(y, Q8X(*x8)) if quantize else y), new


def deltanet_decode_torch(window, qkv, taps, b, a, dt_bias, a_coef, k_heads: int, dk: int, state: torch.Tensor,
                          z, norm, eps: float, quantize: bool = False, in_place: bool = False):
    """deltanet_conv_inputs_torch, deltanet_step_torch and deltanet_gated_norm_torch one
    after another (`quantize` is the Triton launch's alone)."""
    q, k, v, g, beta, new = deltanet_conv_inputs_torch(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk,
                                                       in_place=in_place)
    return deltanet_gated_norm_torch(deltanet_step_torch(q, k, v, g, beta, state), z, norm, eps), new
