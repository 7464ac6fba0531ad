"""A DeltaNet layer's mixing of T tokens, one after another, in one launch: the conv's
steps, the recurrence's inputs, the gated delta rule and the gated norm of its output,
where a decode's token took three launches (deltanet_conv_inputs, deltanet_step,
deltanet_gated_norm) and a verify's rows four (conv_step first):

    deltanet_decode(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm, eps)
        -> (the output projection's input rows (T, Hv * dv), the conv's new window)
    qkv (T, C), b, a (T, Hv), z (T, Hv * dv): the projection's rows (column slices, read by
    their row stride); the recurrent state (Hv, dk, dv) updated in place; with `quantize`
    the rows also written as int8.quantize_x would, attached (int8.attach); with
    `in_place` the new window written over `window`

A program takes value head h and BLOCK_V of its value columns and walks the tokens with
its (dk, BLOCK_V) tile of the state in registers, as deltanet_step's program does: for
each token the conv of its key head's q and k channels (every program of that key head
runs the same) and of its own v channels, the inputs' norms and gates, the recurrence,
and its columns of the output stored. The gated norm needs a head's whole row and the q
and k channels' window may move on only once every program has read it, so each program
counts itself in for its key head (an atomic add, acquire and release, after a barrier),
and the last of a key head's programs norms the rows of its value heads, read back from
L2, and moves the q and k channels' window on. Its counts are int8.zeroed_counts', left
at 0 (a CUDA graph replays the launch as is).

A token's arithmetic is the same whatever T (the state stays float32 between tokens): T
tokens in one launch are T one-token launches bit for bit, so a verify's rows and their
replay (strata.nn.deltanet.DeltaNetState.keep) round as decode steps. And a token is the
separate launches' bits: their jit functions (conv_taps' sums as conv_row takes them,
beta_g and store_gated of deltanet_inputs, delta_token of deltanet), the same sums in the
same order, and like them no fused multiply-add (enable_fp_fusion off in each).
`deltanet_decode_torch` is the torch twins one after another (strata.nn.deltanet's CPU
path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .conv import conv_row, move_rows
from .deltanet import BLOCK_V, deltanet_step_torch, delta_token
from .deltanet_inputs import _check, _silu, beta_g, deltanet_conv_inputs_torch, deltanet_gated_norm_torch, store_gated
from .int8 import Q8X, attach, int8_buffers, zeroed_counts


@triton.jit
def _decode_kernel(qkv_ptr, b_ptr, a_ptr, dt_ptr, coef_ptr, win_ptr, taps_ptr, new_win_ptr, s_ptr, o_ptr,
                   z_ptr, w_ptr, y_ptr, yq_ptr, yd_ptr, ys_ptr, count_ptr, T, qkv_stride, b_stride, a_stride,
                   z_stride, Hk, Hv, width, scale, eps,
                   DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
                   SPAN: tl.constexpr, KT: tl.constexpr, QUANT: tl.constexpr):
    h = tl.program_id(0)
    kh = h % Hk  # the tiled head order (deltanet_inputs)
    rk = tl.arange(0, BK)
    mk = rk < DK
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mv = rv < DV
    qc, kc = kh * DK + rk, (Hk + kh) * DK + rk
    vc = 2 * Hk * DK + h * DV + rv  # this program's v channels: their window is its own
    tile = s_ptr + h * DK * DV + rk[:, None] * DV + rv[None, :]
    live = mk[:, None] & mv[None, :]
    s = tl.load(tile, mask=live, other=0.0)
    for t in range(T):  # token after token, the state in registers (deltanet_step's loop)
        # deltanet_conv_inputs' q, k and v, the window read only
        q = _silu(conv_row(qkv_ptr, qkv_stride, win_ptr, taps_ptr, qc, mk, t, SPAN, KT))
        k = _silu(conv_row(qkv_ptr, qkv_stride, win_ptr, taps_ptr, kc, mk, t, SPAN, KT))
        # both sums before either root: with q scaled first, ptxas 12.8 (Triton 3.6's) holds
        # a value of q on the stack across the call to k's root's slow path (8 bytes at T = 1)
        nq, nk = tl.sum(q * q, axis=0) + 1e-6, tl.sum(k * k, axis=0) + 1e-6
        iq, ik = 1.0 / tl.sqrt_rn(nq), 1.0 / tl.sqrt_rn(nk)
        q = q * iq * scale
        k = k * ik
        v = _silu(conv_row(qkv_ptr, qkv_stride, win_ptr, taps_ptr, vc, mv, t, SPAN, KT))
        beta, g = beta_g(b_ptr + t * b_stride, a_ptr + t * a_stride, dt_ptr, coef_ptr, h)
        s, o = delta_token(s, q, k, v, g, beta)
        tl.store(o_ptr + (t * Hv + h) * DV + rv, o, mask=mv)
    tl.store(tile, s, mask=live)
    tl.debug_barrier()  # every lane's window read and columns stored before the count says so
    move_rows(qkv_ptr, qkv_stride, win_ptr, new_win_ptr, vc, mv, T, SPAN)
    if tl.atomic_add(count_ptr + kh, 1, sem="acq_rel", scope="gpu") == (Hv // Hk) * tl.num_programs(1) - 1:
        c = tl.arange(0, BD)
        cl = c < DV
        for t in range(T):
            for hv in range(kh, Hv, Hk):  # deltanet_gated_norm's rows of the key head's value heads
                r = t * Hv + hv
                ov = tl.load(o_ptr + r * DV + c, mask=cl, other=0.0, cache_modifier=".cg")
                # the norm's width a runtime number, as deltanet_gated_norm's (a constant divisor
                # compiles to a product by its reciprocal, which rounds otherwise but at powers of 2)
                store_gated(ov, z_ptr + t * z_stride + hv * DV, w_ptr, y_ptr + r * DV, yq_ptr, yd_ptr, ys_ptr, t,
                            hv, c, cl, Hv, width, eps, BD, QUANT)
        move_rows(qkv_ptr, qkv_stride, win_ptr, new_win_ptr, qc, mk, T, SPAN)
        move_rows(qkv_ptr, qkv_stride, win_ptr, new_win_ptr, kc, mk, T, SPAN)
        tl.atomic_xchg(count_ptr + kh, 0, sem="relaxed", scope="gpu")


def _check_decode(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm):
    _check("deltanet_decode", window=window, qkv=qkv, taps=taps, b=b, a=a, dt_bias=dt_bias, a_coef=a_coef, z=z,
           norm=norm)
    Hv, _, dv = state.shape
    T, C = qkv.shape
    if taps.dim() != 2 or tuple(taps.shape[:1]) != (C,) or tuple(window.shape) != (C, taps.shape[1] - 1):
        raise ValueError(f"deltanet_decode: the tokens' qkv (T, C), taps (C, K) and window (C, K - 1); got "
                         f"{tuple(qkv.shape)}, {tuple(taps.shape)} and {tuple(window.shape)}")
    if C != 2 * k_heads * dk + Hv * dv or Hv % k_heads or tuple(b.shape) != (T, Hv) or a.shape != b.shape \
            or tuple(z.shape) != (T, Hv * dv) or tuple(norm.shape) != (dv,) or state.shape[1] != dk:
        raise ValueError(f"deltanet_decode: qkv {tuple(qkv.shape)}, b, a {tuple(b.shape)}, {tuple(a.shape)}, "
                         f"z {tuple(z.shape)} and norm {tuple(norm.shape)} do not fit {k_heads} key heads of {dk} "
                         f"and the state's {Hv} value heads of {dv}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x read in place by its row stride (a column slice of the projection's rows)."""
    return x if x.stride(-1) == 1 else x.contiguous()


# a launch's row offsets are 32-bit numbers (t * a row's stride): more rows than fit (a long
# prompt in batch-invariant mode) take several launches, one after another; a token's
# arithmetic is the same in any of them
OFFSETS = 2 ** 31 - 1


def deltanet_decode(window, qkv, taps, b, a, dt_bias, a_coef, k_heads: int, dk: int, state: torch.Tensor,
                    z, norm, eps: float, quantize: bool = False, in_place: bool = False):
    """T tokens' conv steps, deltanet_inputs, the recurrence (`state` in place) and the
    gated norm in one launch, token after token (see the module): (rows (T, Hv * dv), the
    conv's new window)."""
    _check_decode(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm)
    Hv, _, dv = state.shape
    T = qkv.shape[0]
    if not T:
        return qkv.new_empty(0, Hv * dv), (window if in_place else window.clone())
    if not use_triton(qkv):
        return deltanet_decode_torch(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm, eps,
                                     in_place=in_place)
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("deltanet_decode: the state must be contiguous float32, got "
                         f"{state.dtype}{'' if state.is_contiguous() else ', not contiguous'}")
    if in_place and not window.is_contiguous():
        raise ValueError("deltanet_decode: in_place needs a contiguous window")
    qkv, b, a, z = (_rows(x) for x in (qkv, b, a, z))
    window, taps = window.contiguous(), taps.contiguous()
    new = window if in_place else torch.empty_like(window)
    o = qkv.new_empty(T, Hv, dv)  # the recurrence's output, read back by each key head's last program
    y = qkv.new_empty(T, Hv * dv)
    quantize, x8 = int8_buffers(quantize, T, Hv * dv, dv, y)
    widest = max(qkv.stride(0), b.stride(0), a.stride(0), z.stride(0), Hv * dv)
    per = max(1, OFFSETS // widest - taps.shape[1])
    src = window
    for r in range(0, T, per):
        rows = slice(r, min(T, r + per))
        # the separate launches' tile widths (deltanet_step's BLOCK_V, the gated norm's whole
        # row): a sum's order follows its tile's shape
        _decode_kernel[(Hv, triton.cdiv(dv, BLOCK_V))](
            qkv[rows], b[rows], a[rows], dt_bias.contiguous(), a_coef.contiguous(), src, taps, new, state, o[rows],
            z[rows], norm.contiguous(), y[rows], *(t[rows] for t in x8), zeroed_counts(qkv.device, k_heads),
            rows.stop - rows.start, qkv.stride(0), b.stride(0), a.stride(0), z.stride(0), k_heads, Hv, dv,
            dk ** -0.5, eps, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=BLOCK_V,
            BD=triton.next_power_of_2(dv), SPAN=window.shape[1], KT=taps.shape[1], QUANT=quantize,
            enable_fp_fusion=False)
        src = new  # the next rows continue the window these moved on
    return (attach(y, Q8X(*x8)) if quantize else y), new


def deltanet_decode_torch(window, qkv, taps, b, a, dt_bias, a_coef, k_heads: int, dk: int, state: torch.Tensor,
                          z, norm, eps: float, quantize: bool = False, in_place: bool = False):
    """deltanet_conv_inputs_torch, deltanet_step_torch (token after token) and
    deltanet_gated_norm_torch one after another (`quantize` is the Triton launch's alone)."""
    q, k, v, g, beta, new = deltanet_conv_inputs_torch(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk,
                                                       in_place=in_place)
    return deltanet_gated_norm_torch(deltanet_step_torch(q, k, v, g, beta, state), z, norm, eps), new
