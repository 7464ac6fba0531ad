"""The n-gram PLE block's work after its two projections, for T tokens, in one kernel
(strata.nn.ple says what the block computes; S streams of width H, a depthwise causal
conv of K taps with dilation d over the S*H channels):

    ple_mix(x (T, S*H), k (T, S*H), v (T, H), norm_key, norm_query, norm_conv (S*H each),
            taps (S*H, K), window (S*H, (K-1) d), S, eps, d, in_place=False)
        -> (x + gv + silu(conv(norm_conv(gv))) (T, S*H), the conv's new window)
        in_place: the new window written over `window` (a decode graph's buffer: no copy
        launched after it) and returned

    per stream s:  kn = rmsnorm(k_s) norm_key_s,  q = rmsnorm(x_s) norm_query_s
                   g  = signed_sqrt(sum(kn q) / sqrt(H)),  gv_s = sigmoid(g) v

In torch (`ple_mix_torch`, strata.nn.ple.mix's ops) this is three norms of three or four
launches each (or one each through hc_norm), eleven elementwise ops and reductions, the
conv's step and the final sums: one launch here, one program a stream (its H channels:
the norms, the gate, the conv's taps and the window's shift are all within the stream),
token after token, each token's arithmetic the one-token launch's (a verify's rows are
decode steps', bit for bit). Float32, not bit for bit with the twin (the sums' order, exp
and sqrt may round otherwise); the bound is in tests/triton_kernels/test_ple_mix.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import invariant
from .backend import use_triton, warp_lanes
from .conv import causal_conv_torch, conv_taps
from .hyperconn import hc_norm_torch


@triton.jit
def _ple_mix_kernel(x_ptr, k_ptr, v_ptr, wk_ptr, wq_ptr, wc_ptr, taps_ptr, win_ptr, out_ptr, new_win_ptr,
                    T, H, eps, root, SPAN: tl.constexpr, K: tl.constexpr, DIL: tl.constexpr, BH: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BH)
    live = h < H
    C = tl.num_programs(0).to(tl.int64) * H
    # the stream's rows: a 64-bit base a program and 32-bit offsets a lane (64-bit channel
    # numbers a lane cost registers: at Flash-Next's width ptxas 12.8 spilled them)
    x_s, k_s, out_s = x_ptr + s * H, k_ptr + s * H, out_ptr + s * H
    win, new_win, taps = win_ptr + s * H * SPAN, new_win_ptr + s * H * SPAN, taps_ptr + s * H * K
    # the window moved on where it is to land (in place: onto itself), then token by token
    # there, each channel's row one lane's (conv_taps reads an element before it writes it)
    for j in tl.static_range(SPAN):
        tl.store(new_win + h * SPAN + j, tl.load(win + h * SPAN + j, mask=live, other=0.0), mask=live)
    for t in range(T):
        row = t * C
        k = tl.load(k_s + row + h, mask=live, other=0.0)
        x = tl.load(x_s + row + h, mask=live, other=0.0)
        kn = k * (1.0 / tl.sqrt_rn(tl.sum(k * k, axis=0) / H + eps)) * tl.load(wk_ptr + s * H + h, mask=live,
                                                                                 other=0.0)
        qn = x * (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / H + eps)) * tl.load(wq_ptr + s * H + h, mask=live,
                                                                                 other=0.0)
        g = tl.sum(kn * qn, axis=0) / root
        sign = tl.where(g > 0, 1.0, tl.where(g < 0, -1.0, 0.0))
        g = tl.sqrt_rn(tl.maximum(tl.abs(g), 1e-6)) * sign
        gv = (1.0 / (1.0 + tl.exp(-g))) * tl.load(v_ptr + t * H + h, mask=live, other=0.0)
        nc = gv * (1.0 / tl.sqrt_rn(tl.sum(gv * gv, axis=0) / H + eps)) * tl.load(wc_ptr + s * H + h, mask=live,
                                                                                    other=0.0)
        y = conv_taps(nc, new_win, taps, new_win, h, live, SPAN, K, DIL)  # conv_step's taps, in order
        tl.store(out_s + row + h, (x + gv) + y * (1.0 / (1.0 + tl.exp(-y))), mask=live)


def _check(x, k, v, norm_key, norm_query, norm_conv, taps, window, streams, dilation):
    ts = dict(x=x, k=k, v=v, norm_key=norm_key, norm_query=norm_query, norm_conv=norm_conv, taps=taps,
              window=window)
    bad = [n for n, t in ts.items() if t.dtype != torch.float32]
    if bad:
        raise ValueError(f"ple_mix: expects float32 tensors, got {', '.join(f'{n} {ts[n].dtype}' for n in bad)}")
    if streams < 1 or x.dim() != 2 or x.shape[1] % streams:
        raise ValueError(f"ple_mix: x must be (T, streams * width) for {streams} streams, got {tuple(x.shape)}")
    T, C = x.shape
    H = C // streams
    Kt = taps.shape[1] if taps.dim() == 2 else 0
    if (tuple(k.shape) != (T, C) or tuple(v.shape) != (T, H)
            or any(w.numel() != C for w in (norm_key, norm_query, norm_conv)) or taps.dim() != 2
            or taps.shape[0] != C or Kt < 1 or tuple(window.shape) != (C, (Kt - 1) * dilation)):
        raise ValueError(f"ple_mix: x (T, {C}), k (T, {C}), v (T, {H}), norms of {C}, taps ({C}, K) and "
                         f"a window ({C}, (K - 1) * {dilation}); got x {tuple(x.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, taps {tuple(taps.shape)}, window {tuple(window.shape)}")
    return C, H, Kt


def ple_mix(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_key: torch.Tensor, norm_query: torch.Tensor,
            norm_conv: torch.Tensor, taps: torch.Tensor, window: torch.Tensor, streams: int, eps: float,
            dilation: int, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of the PLE block after its projections: (x plus the block's output
    (T, S*H), the conv's new window), float32 (see the module)."""
    C, H, Kt = _check(x, k, v, norm_key, norm_query, norm_conv, taps, window, streams, dilation)
    if not use_triton(x):
        return ple_mix_torch(x, k, v, norm_key, norm_query, norm_conv, taps, window, streams, eps, dilation,
                             in_place)
    if in_place and not window.is_contiguous():
        raise ValueError("ple_mix: in_place needs a contiguous window")
    # in place: a channel's window is one lane's, read before it is written (conv_taps)
    out, new = torch.empty_like(x), window if in_place else torch.empty_like(window)
    args = [t.contiguous() for t in (x, k, v, norm_key, norm_query, norm_conv, taps, window)]
    bh = triton.next_power_of_2(H)
    _ple_mix_kernel[(streams,)](*args, out, new, x.shape[0], H, eps, float(H ** 0.5), SPAN=window.shape[1], K=Kt,
                                DIL=dilation, BH=bh, num_warps=mix_warps(bh, warp_lanes(x.device)))
    return out, new


def mix_warps(bh: int, lanes: int) -> int:
    """A whole stream a program, four channels a lane up to a program's 1024 lanes (of
    `lanes` a warp: backend.warp_lanes): a
    decode step's launch is a few programs (a stream each), so its time is one program's
    chain of loads and sums, and a lane's channels are registers held across them.
    Flash-Next's 2560 channels (a tile of 4096): 32 warps, 56-64 registers a thread on
    sm_90; at 8 warps 206-255, and ptxas 12.8 (Triton 3.6) spilled. Past a tile of 4096
    a lane's channels outgrow its 64 registers and spill."""
    return max(4, min(bh // 4, 1024) // lanes)


def ple_mix_torch(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm_key: torch.Tensor,
                  norm_query: torch.Tensor, norm_conv: torch.Tensor, taps: torch.Tensor, window: torch.Tensor,
                  streams: int, eps: float, dilation: int, in_place: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """strata.nn.ple.mix's ops after the projections, for any number of rows."""
    T, C = x.shape
    H = C // streams

    def norm(t, w):
        return hc_norm_torch(t, w.reshape(streams, H), eps).reshape(T, streams, H)

    kn, q = norm(k, norm_key), norm(x, norm_query)
    gate = (kn * q).sum(dim=-1, keepdim=True) / H ** 0.5
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gv = invariant.pointwise(torch.sigmoid, gate) * v.unsqueeze(1)  # (T, S, H)
    normed = norm(gv.reshape(T, -1), norm_conv).reshape(T, -1)
    out, new = causal_conv_torch(window, normed, taps, dilation)
    return x + gv.reshape(T, -1) + F.silu(out), window.copy_(new) if in_place else new
