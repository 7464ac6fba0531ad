"""The hyper-connections' work around their two small GEMVs, one kernel each
(strata.nn.hyperconn says what a read and a write compute; S streams of width H, rank R):

    hc_norm(x (T, S*H), w (S, H), eps)        -> xn (T, S*H): each stream RMS-normalised,
                                                 times its weight
    hc_gates(both (T, R+S), rank, S)          -> silu(both[:, :R] / S) (T, R), the up
                                                 projection's input, and the injection
                                                 weights 2 sigmoid(both[:, R:] / S) (T, S)
    hc_combine(up (T, S*H), xn (T, S*H), S)   -> the block's input (T, H): the mean over
                                                 streams of sigmoid(up) * xn
    hc_mix(both, w_up (S*H, R), xn, R, S, fmt=None)
                                              -> hc_gates, the up projection by w_up (float32,
                                                 or its blocks in fmt, decoded in the launch)
                                                 and hc_combine in one launch: (the block's
                                                 input (T, H), the injection weights (T, S)
                                                 or (T, 0))
    hc_write(x (T, S*H), out (T, H), inj (T, S)) -> x + inj * out in every stream
    hc_write_norm(x, out, inj, w, eps)        -> hc_write's result and its hc_norm by the
                                                 next read's weight: a block's write and the
                                                 following block's norm in one launch

In torch a read is nine launches beside its GEMVs and a write two or three; here a read is
three and a write one (a read two and one GEMV with hc_mix, whose program multiplies its
columns' rows of the small up weight itself), so that a decode step of Flash-Next launches about 14 fewer kernels
a layer. Each program reads one token's row, so a row's result does not depend on the rows
beside it (a decode and a verify agree). All float32. Not bit for bit with the torch twins:
the norm's sum and the streams' mean add in another order, and exp, the square root and a
product-then-add may round otherwise on a GPU; the bounds are in
tests/triton_kernels/test_hyperconn.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import quant

from .backend import use_triton
from .decode import decoder, table
from .dequant import dequantize_torch
from .hc_down import Down, down_both_torch, parts_both, stream_scale
from .int8 import GROUP, Q8X, attach, int8_buffers, store_groups

BLOCK = 1024  # columns a program of hc_combine and hc_write
MIX_TILE = 4096  # weights of w_up a program of hc_mix holds at once (BLOCK_H x rank)


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, q_ptr, d_ptr, s_ptr, S, H, eps, BH: tl.constexpr,
                 QUANT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # (token, stream) row: r = t * S + s
    c = tl.arange(0, BH)
    live = c < H
    x = tl.load(x_ptr + r * H + c, mask=live, other=0.0)
    store_norm(x, w_ptr, out_ptr, q_ptr, d_ptr, s_ptr, r // S, r % S, c, live, S, H, eps, BH, QUANT)


@triton.jit
def _gates_kernel(both_ptr, a_ptr, inj_ptr, R, C, S, BC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    v = tl.load(both_ptr + t * C + c, mask=c < C, other=0.0) / S
    sig = 1.0 / (1.0 + tl.exp(-v))
    tl.store(a_ptr + t * R + c, v * sig, mask=c < R)
    tl.store(inj_ptr + t * (C - R) + (c - R), 2.0 * sig, mask=(c >= R) & (c < C))


@triton.jit
def _combine_kernel(up_ptr, xn_ptr, out_ptr, S, H, BS: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    s = tl.arange(0, BS)
    live = (s[:, None] < S) & (h[None, :] < H)
    at = t * S * H + s[:, None] * H + h[None, :]
    u = tl.load(up_ptr + at, mask=live, other=0.0)
    xn = tl.load(xn_ptr + at, mask=live, other=0.0)
    m = xn / (1.0 + tl.exp(-u))
    tl.store(out_ptr + t * H + h, tl.sum(tl.where(live, m, 0.0), axis=0) / S, mask=h < H)


@triton.jit
def _mix_kernel(both_ptr, w_ptr, tab_ptr, xn_ptr, out_ptr, inj_ptr, q_ptr, d_ptr, s_ptr, R, C, S, H,
                ss_ptr, wn_ptr, eps,
                BR: tl.constexpr, BC: tl.constexpr, BLOCK_H: tl.constexpr, QUANT: tl.constexpr,
                DECODE: tl.constexpr, QK: tl.constexpr, PARTS: tl.constexpr):
    # PARTS: 0, both and xn as given; else both_ptr holds hc_down's partial sums of PARTS
    # chunks a stream, xn_ptr the streams y (ss_ptr their chunks' sums of squares, wn_ptr
    # the norm's weight): both and xn made here (triton_kernels.hc_down)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    r = tl.arange(0, BR)
    if PARTS == 0:
        v = tl.load(both_ptr + t * C + r, mask=r < R, other=0.0) / S
    else:
        v = parts_both(both_ptr, ss_ptr, t, r, r < R, S, H, C, eps, PARTS) / S
    a = v * (1.0 / (1.0 + tl.exp(-v)))  # _gates_kernel's silu, recomputed by each program
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    live = h < H
    wmask = live[:, None] & (r[None, :] < R)
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for s in range(0, S):
        rows = (s * H + h).to(tl.int64)
        if QK == 0:  # float32 rows
            w = tl.load(w_ptr + rows[:, None] * R + r[None, :], mask=wmask, other=0.0)
        else:  # the rows' blocks, decoded where they lie: the same float32 values
            blk = rows[:, None] * (R // QK) + (r // QK)[None, :]
            w = DECODE(w_ptr, tab_ptr, blk, tl.broadcast_to((r % QK)[None, :], (BLOCK_H, BR)), wmask)
        u = tl.sum(w * a[None, :], axis=1)
        xn = tl.load(xn_ptr + t * S * H + s * H + h, mask=live, other=0.0)
        if PARTS != 0:  # store_norm's expression
            xn = xn * stream_scale(ss_ptr, t, s, S, H, eps, PARTS) * tl.load(wn_ptr + s * H + h, mask=live, other=0.0)
        acc += xn / (1.0 + tl.exp(-u))
    y = acc / S
    tl.store(out_ptr + t * H + h, y, mask=live)
    if QUANT:  # the block's input as the dp4a GEMVs read it (int8.quantize_x), BLOCK_H // 32 groups
        g = hb * (BLOCK_H // 32) + tl.arange(0, BLOCK_H // 32)
        store_groups(q_ptr, d_ptr, s_ptr, t, g, tl.reshape(y, (BLOCK_H // 32, 32)), H, g < H // 32)
    if hb == 0:  # the injection weights: _gates_kernel's, once a row
        c = tl.arange(0, BC)
        n = C - R
        if PARTS == 0:
            vi = tl.load(both_ptr + t * C + R + c, mask=c < n, other=0.0) / S
        else:
            vi = parts_both(both_ptr, ss_ptr, t, R + c, c < n, S, H, C, eps, PARTS) / S
        tl.store(inj_ptr + t * n + c, 2.0 * (1.0 / (1.0 + tl.exp(-vi))), mask=c < n)


@triton.jit
def _write_kernel(x_ptr, o_ptr, inj_ptr, out_ptr, S, H, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # (token, stream) row
    t = r // S
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = h < H
    x = tl.load(x_ptr + r * H + h, mask=live, other=0.0)
    o = tl.load(o_ptr + t * H + h, mask=live, other=0.0).to(tl.float32)
    w = tl.load(inj_ptr + r)
    tl.store(out_ptr + r * H + h, x + w * o, mask=live)


@triton.jit
def _write_norm_kernel(x_ptr, o_ptr, inj_ptr, w_ptr, out_ptr, xn_ptr, q_ptr, d_ptr, s_ptr, S, H, eps,
                       BH: tl.constexpr, QUANT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # (token, stream) row: _write_kernel's, then _norm_kernel's
    t, s = r // S, r % S
    c = tl.arange(0, BH)
    live = c < H
    x = tl.load(x_ptr + r * H + c, mask=live, other=0.0)
    o = tl.load(o_ptr + t * H + c, mask=live, other=0.0).to(tl.float32)
    y = x + tl.load(inj_ptr + r) * o
    tl.store(out_ptr + r * H + c, y, mask=live)
    store_norm(y, w_ptr, xn_ptr, q_ptr, d_ptr, s_ptr, t, s, c, live, S, H, eps, BH, QUANT)


@triton.jit
def store_norm(y, w_ptr, xn_ptr, q_ptr, d_ptr, s_ptr, t, s, c, live, S, H, eps, BH: tl.constexpr,
               QUANT: tl.constexpr):
    """Stream s of token t's row y [BH] (H live) RMS-normed and times its weight, stored at
    xn (T, S*H) row t; with QUANT also as int8.quantize_x of xn writes it (H a multiple of
    32: the row's groups are whole)."""
    inv = 1.0 / tl.sqrt_rn(tl.sum(y * y, axis=0) / H + eps)
    w = tl.load(w_ptr + s * H + c, mask=live, other=0.0)
    v = y * inv * w
    tl.store(xn_ptr + (t * S + s) * H + c, v, mask=live)
    if QUANT:
        i = tl.arange(0, BH // 32)
        store_groups(q_ptr, d_ptr, s_ptr, t, s * (H // 32) + i, tl.reshape(v, (BH // 32, 32)), S * H, i < H // 32)


def _f32(name: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float32:
            raise ValueError(f"{name}: expects float32 tensors, got {t.dtype}")


def hc_norm(x: torch.Tensor, w: torch.Tensor, eps: float, quantize: bool = False) -> torch.Tensor:
    """Each stream of x (T, S*H) RMS-normalised and times its weight w (S, H): (T, S*H).
    With `quantize` (H a multiple of 32) also written as int8.quantize_x would, attached to
    it, for a hyper-connection read's dp4a down projection."""
    _f32("hc_norm", x, w)
    if not use_triton(x):
        return hc_norm_torch(x, w, eps)
    S, H = w.shape
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty_like(x)
    quantize, x8 = int8_buffers(quantize, x.shape[0], x.shape[1], H, out)
    if x.numel():
        _norm_kernel[(x.shape[0] * S,)](x, w, out, *x8, S, H, eps, BH=triton.next_power_of_2(H),
                                        QUANT=quantize)
    return attach(out, Q8X(*x8)) if quantize else out


def hc_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float, quantize: bool = False) -> torch.Tensor:
    """hc_norm in torch (`quantize` is the Triton launch's alone)."""
    S, H = w.shape
    return (F.rms_norm(x.reshape(x.shape[0], S, H), (H,), eps=eps) * w).reshape(x.shape)


def hc_gates(both: torch.Tensor, rank: int, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The down projection's rows both (T, rank + S, or rank alone for the final mixer) ->
    (silu(both[:, :rank] / S), 2 sigmoid(both[:, rank:] / S)), the second (T, S) or (T, 0)."""
    _f32("hc_gates", both)
    if not use_triton(both):
        return hc_gates_torch(both, rank, streams)
    T, C = both.shape
    if C not in (rank, rank + streams):
        raise ValueError(f"hc_gates: both has {C} columns, not rank {rank} (+ streams {streams})")
    both = both.contiguous()
    a, inj = both.new_empty(T, rank), both.new_empty(T, C - rank)
    if T:
        _gates_kernel[(T,)](both, a, inj, rank, C, streams, BC=triton.next_power_of_2(C))
    return a, inj


def hc_gates_torch(both: torch.Tensor, rank: int, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    v = both / streams
    return F.silu(v[:, :rank]), 2 * torch.sigmoid(v[:, rank:])


def hc_combine(up: torch.Tensor, xn: torch.Tensor, streams: int) -> torch.Tensor:
    """The mean over the S streams of sigmoid(up) * xn, both (T, S*H): (T, H)."""
    _f32("hc_combine", up, xn)
    if not use_triton(xn):
        return hc_combine_torch(up, xn, streams)
    T, SH = xn.shape
    H = SH // streams
    up, xn = up.contiguous(), xn.contiguous()
    out = xn.new_empty(T, H)
    if T:
        bh = min(BLOCK, triton.next_power_of_2(H))
        _combine_kernel[(T, triton.cdiv(H, bh))](up, xn, out, streams, H, BS=triton.next_power_of_2(streams),
                                                  BLOCK_H=bh)
    return out


def hc_combine_torch(up: torch.Tensor, xn: torch.Tensor, streams: int) -> torch.Tensor:
    T = xn.shape[0]
    return (torch.sigmoid(up).reshape(T, streams, -1) * xn.reshape(T, streams, -1)).mean(dim=1)


def hc_mix(both: torch.Tensor, w_up: torch.Tensor, xn: torch.Tensor, rank: int,
           streams: int, quantize: bool = False, fmt: str | quant.Format | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A read's work after its down projection, one launch: hc_gates(both, rank, S), the up
    projection of the gates by w_up (S*H, rank), and hc_combine of it with xn (T, S*H):
    (the block's input (T, H), the injection weights (T, S) or (T, 0)). w_up is float32,
    or with `fmt` its GGUF blocks as the file holds them (uint8, rank a whole number of
    blocks a row; in the device layout where fmt says so), decoded in the launch to the
    float32 values dequantize gives: the same result as from those values, and at
    Flash-Next's shape (10240 x 64, Q4_0) 0.37 MB read a launch where float32 is 2.6 MB.
    Each program takes one row and BLOCK_H columns of every stream: it recomputes the
    row's rank gates (a few dozen exps) and reads its columns' rows of w_up. With
    `quantize` (and H a multiple of 32) the launch also writes the input as
    int8.quantize_x would, attached to it (int8.attach): the block's dp4a projections then
    launch no quantize_x."""
    down = both if isinstance(both, Down) else None
    if down is not None:  # hc_down's sums: both and xn made in the launch
        both, xn = down.part, down.y
        if down.w.shape[0] != streams:
            raise ValueError(f"hc_mix: hc_down's sums are of {down.w.shape[0]} streams, not {streams}")
    _f32("hc_mix", both, xn)
    if fmt is None:
        _f32("hc_mix", w_up)
    if not use_triton(xn):
        return hc_mix_torch(down if down is not None else both, w_up, xn, rank, streams, fmt=fmt)
    T, C = both.shape[0], both.shape[-1]
    SH = xn.shape[-1]
    H = SH // streams
    if C not in (rank, rank + streams):
        raise ValueError(f"hc_mix: both has {C} columns, not rank {rank} (+ streams {streams})")
    if SH != streams * H or xn.shape[0] != T:
        raise ValueError(f"hc_mix: xn must be ({T}, streams {streams} x width), got {tuple(xn.shape)}")
    w_up, decode, qk = _up_weight("hc_mix", w_up, fmt, SH, rank)
    both, xn = both.contiguous(), xn.contiguous()
    out, inj = xn.new_empty(T, H), both.new_empty(T, C - rank)
    quantize, x8 = int8_buffers(quantize, T, H, H, out)
    if T:
        br = triton.next_power_of_2(rank)
        bh = min(triton.next_power_of_2(H), max(GROUP if quantize else 16, MIX_TILE // br))
        # a whole tile at 4 warps (32 weights a thread) held 128 registers and spilled 8 bytes
        # a thread on sm_90 at Flash-Next's shape; at 8 warps 106 and none
        parts = (down.ss, down.w.contiguous(), down.eps) if down is not None else (both, both, 0.0)
        _mix_kernel[(T, triton.cdiv(H, bh))](both, w_up, table(fmt, w_up.device) if qk else w_up, xn, out, inj,
                                             *x8, rank, C, streams, H, *parts, BR=br,
                                             BC=triton.next_power_of_2(max(C - rank, 1)), BLOCK_H=bh,
                                             QUANT=quantize, DECODE=decode, QK=qk,
                                             PARTS=down.chunks if down is not None else 0,
                                             num_warps=8 if bh * br >= MIX_TILE else 4)
    return (attach(out, Q8X(*x8)) if quantize else out), inj


def _up_weight(name: str, w_up: torch.Tensor, fmt, rows: int, rank: int):
    """(the tensor the kernel reads, its DECODE, its block size QK: 0 for float32 rows)."""
    if fmt is None:
        if tuple(w_up.shape) != (rows, rank):
            raise ValueError(f"{name}: w_up must be (streams x width {rows}, rank {rank}), got {tuple(w_up.shape)}")
        return w_up.contiguous(), None, 0
    fmt = quant.get(fmt)
    qk = fmt.block_elems
    if rank % qk or w_up.dtype != torch.uint8 or w_up.numel() != rows * rank // qk * fmt.block_bytes:
        raise ValueError(f"{name}: w_up in {fmt.name} must be ({rows} x {rank}) weights' blocks of {qk}, "
                         f"uint8, a whole number a row; got {w_up.dtype} {tuple(w_up.shape)}")
    return w_up.contiguous(), decoder(fmt), qk


def hc_mix_torch(both: torch.Tensor, w_up: torch.Tensor, xn: torch.Tensor, rank: int,
                 streams: int, quantize: bool = False, fmt: str | quant.Format | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """hc_mix in torch (`quantize` is the Triton launch's alone); `both` may be hc_down's
    Down (then xn is made from it)."""
    if isinstance(both, Down):
        both, xn = down_both_torch(both)
    if fmt is not None:
        w_up = dequantize_torch(w_up, quant.get(fmt), torch.float32, compiled=False).reshape(-1, rank)
    a, inj = hc_gates_torch(both, rank, streams)
    return hc_combine_torch(a @ w_up.T, xn, streams), inj


def hc_write(x: torch.Tensor, out: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
    """x (T, S*H) plus the block's output out (T, H, any float dtype) in every stream times
    that stream's weight inj (T, S): (T, S*H), float32."""
    _f32("hc_write", x, inj)
    if not use_triton(x):
        return hc_write_torch(x, out, inj)
    T, S = inj.shape
    H = out.shape[-1]
    x, out, inj = x.contiguous(), out.contiguous(), inj.contiguous()
    y = torch.empty_like(x)
    if T:
        bh = min(BLOCK, triton.next_power_of_2(H))
        _write_kernel[(T * S, triton.cdiv(H, bh))](x, out, inj, y, S, H, BLOCK_H=bh)
    return y


def hc_write_torch(x: torch.Tensor, out: torch.Tensor, inj: torch.Tensor) -> torch.Tensor:
    return x + (inj.unsqueeze(-1) * out.float().unsqueeze(1)).reshape(x.shape)


def hc_write_norm(x: torch.Tensor, out: torch.Tensor, inj: torch.Tensor, w: torch.Tensor,
                  eps: float, quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """hc_write(x, out, inj), and hc_norm of its result by the next read's weight w (S, H):
    (T, S*H) twice, float32. One launch where the two take two; each row's write is
    hc_write's and its norm hc_norm's, in the same order (a whole row a program), so the
    bits are the two kernels'. With `quantize` (H a multiple of 32) the norm is also
    written as int8.quantize_x would, attached to it, for the read's dp4a down projection."""
    _f32("hc_write_norm", x, inj, w)
    if not use_triton(x):
        return hc_write_norm_torch(x, out, inj, w, eps)
    T, S = inj.shape
    H = out.shape[-1]
    if w.shape != (S, H):
        raise ValueError(f"hc_write_norm: the norm's weight must be (streams {S}, width {H}), got {tuple(w.shape)}")
    x, out, inj, w = x.contiguous(), out.contiguous(), inj.contiguous(), w.contiguous()
    y, xn = torch.empty_like(x), torch.empty_like(x)
    quantize, x8 = int8_buffers(quantize, T, S * H, H, y)
    if T:
        _write_norm_kernel[(T * S,)](x, out, inj, w, y, xn, *x8, S, H, eps, BH=triton.next_power_of_2(H),
                                     QUANT=quantize)
    return y, (attach(xn, Q8X(*x8)) if quantize else xn)


def hc_write_norm_torch(x: torch.Tensor, out: torch.Tensor, inj: torch.Tensor, w: torch.Tensor,
                        eps: float, quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """hc_write_norm in torch (`quantize` is the Triton launch's alone)."""
    y = hc_write_torch(x, out, inj)
    return y, hc_norm_torch(y, w, eps)
