"""A depthwise causal conv (the DeltaNet layer's and the PLE block's) over T tokens, in one
kernel:

    conv_step(window (C, S), x (T, C), w (C, K), dilation, in_place=False)
        -> (y (T, C), new window (C, S))
    full = [window | x^T]                              (C, S + T), S = (K - 1) * dilation
    y[t, c] = sum over j of full[c, t + j * dilation] * w[c, j]   taps in order j = 0, 1, ...
    new window = full[:, T:]          (with in_place written over `window`, and returned)

`causal_conv_torch` is the same conv as torch ops (a concatenation, K products and K - 1
sums, a transpose and a copy: ten launches at K = 4, and a copy back into a held window);
here one program covers BLOCK_C channels of up to BLOCK_T tokens. The taps are summed in the
same order, each product and sum rounded on its own (no fused multiply-add), so the kernel
equals the torch twin bit for bit, and a token's output is the same whatever T: a verify's
rows are one-token steps' (the one-token kernels that take the conv inside theirs,
deltanet_conv_inputs and ple_mix, share `conv_taps`; deltanet_decode's tokens take
`conv_row`, its sums).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton

BLOCK_C = 128  # channels a program
BLOCK_T = 16   # tokens a program, at most


@triton.jit
def conv_taps(x, win_ptr, taps_ptr, new_win_ptr, c, live, S: tl.constexpr, K: tl.constexpr,
              DIL: tl.constexpr):
    """One token of the conv at channels c (`live` of them), x its values there: the taps
    of [window | x] in order, each product and sum rounded on its own, and the window
    moved on by one into new_win_ptr (each element read before it is written, so in place
    too: a barrier between, since where a tensor is narrower than the program's lanes
    several warps hold each channel and read it, one writes it). The DeltaNet inputs' and
    the PLE block's kernels run it inside theirs."""
    y = conv_sum(x, win_ptr, taps_ptr, c, live, S, K, DIL)
    tl.debug_barrier()
    move_window(x, win_ptr, new_win_ptr, c, live, S)
    return y


@triton.jit
def conv_sum(x, win_ptr, taps_ptr, c, live, S: tl.constexpr, K: tl.constexpr, DIL: tl.constexpr):
    """conv_taps' output alone: the window read, not moved on."""
    y = tl.zeros(c.shape, tl.float32)
    for j in tl.static_range(K):
        p = j * DIL  # column p of [window | x]
        if p < S:
            f = tl.load(win_ptr + c * S + p, mask=live, other=0.0)
        else:
            f = x
        y = _tap(y, f, taps_ptr, c, live, j, K)
    return y


@triton.jit
def _tap(y, f, taps_ptr, c, live, j: tl.constexpr, K: tl.constexpr):
    """y plus column f times tap j, the product and the sum each rounded (tap 0: the product)."""
    w = tl.load(taps_ptr + c * K + j, mask=live, other=0.0)
    if j == 0:
        y = f * w
    else:
        y = y + f * w
    return y


@triton.jit
def conv_row(x_ptr, stride, win_ptr, taps_ptr, c, live, t, S: tl.constexpr, K: tl.constexpr):
    """Row t's conv (dilation 1) over [window | rows of x_ptr (row stride `stride`)] at
    channels c: conv_sum's taps, products and sums for that row (at t = 0 its bits)."""
    y = tl.zeros(c.shape, tl.float32)
    for j in tl.static_range(K):
        y = _tap(y, _column(win_ptr, x_ptr, c, live, t + j, stride, S), taps_ptr, c, live, j, K)
    return y


@triton.jit
def move_rows(x_ptr, stride, win_ptr, new_win_ptr, c, live, T, S: tl.constexpr):
    """The window at channels c moved on by T rows of x_ptr: column i from column T + i of
    [window | rows] (in place too: a lane reads column T + i before it writes column i, in
    order; a barrier before, as move_window's)."""
    for i in tl.static_range(S):
        tl.store(new_win_ptr + c * S + i, _column(win_ptr, x_ptr, c, live, T + i, stride, S), mask=live)


@triton.jit
def move_window(x, win_ptr, new_win_ptr, c, live, S: tl.constexpr):
    """The window at channels c moved on by one token, x, into new_win_ptr (a lane reads
    each of its elements before it writes it: in place too, once every lane that reads the
    window for the conv's sum has: a barrier before)."""
    for p in tl.static_range(1, S):
        tl.store(new_win_ptr + c * S + p - 1, tl.load(win_ptr + c * S + p, mask=live, other=0.0), mask=live)
    if S > 0:
        tl.store(new_win_ptr + c * S + S - 1, x, mask=live)


@triton.jit
def _conv_step_kernel(win_ptr, x_ptr, w_ptr, y_ptr, out_ptr, C, T, stride_x, S: tl.constexpr, K: tl.constexpr,
                      DIL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    # a program: BLOCK_T tokens x BLOCK channels (a token's output reads inputs only, so a
    # prompt's tokens run side by side); the first token block also moves the window on
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = c < C
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (t * C passes 2^31 in a long prompt)
    tile = (t < T)[:, None] & live[None, :]
    y = tl.zeros((BLOCK_T, BLOCK), tl.float32)
    for j in tl.static_range(K):
        f = _column(win_ptr, x_ptr, c[None, :], tile, (t + j * DIL)[:, None], stride_x, S)
        y = _tap(y, f, w_ptr, c[None, :], live[None, :], j, K)
    tl.store(y_ptr + t[:, None] * C + c[None, :], y, mask=tile)
    if tl.program_id(1) == 0:
        # the new window, column i from column T + i. In place (one token block then: the
        # launcher's), every lane has read the window before any writes it, and a lane
        # reads column T + i of its channel before it writes column i (i in order, T >= 1);
        # later token blocks start at or past column S, so never read the window
        tl.debug_barrier()
        move_rows(x_ptr, stride_x, win_ptr, out_ptr, c, live, T, S)


@triton.jit
def _column(win_ptr, x_ptr, c, live, p, stride_x, S: tl.constexpr):
    """Column p of [window | x^T] at channels c."""
    p = p + c * 0  # a vector, whether p came as a number or a scalar
    held = p < S
    a = tl.load(win_ptr + c * S + p, mask=live & held, other=0.0)
    b = tl.load(x_ptr + (p - S) * stride_x + c, mask=live & (p >= S), other=0.0)
    return tl.where(held, a, b)


def _check(window, x, w, dilation):
    C, S = window.shape
    K = w.shape[1]
    if x.dim() != 2 or x.shape[1] != C or w.shape[0] != C or S != (K - 1) * dilation:
        raise ValueError(f"conv_step: window {tuple(window.shape)}, x {tuple(x.shape)} and taps {tuple(w.shape)} "
                         f"do not fit tokens (T, {C}) of a conv of {K} taps, dilation {dilation}")
    if not all(t.dtype == torch.float32 for t in (window, x, w)):
        raise ValueError("conv_step: window, x and taps must be float32")


def conv_step(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dilation: int = 1, in_place: bool = False):
    """(y (T, C), the new window): T tokens of the conv (see the module); `in_place`: the
    new window written over `window` (a decode graph's buffer), which is returned."""
    _check(window, x, w, dilation)
    if not use_triton(x):
        return conv_step_torch(window, x, w, dilation, in_place)
    if in_place and not window.is_contiguous():
        raise ValueError("conv_step: in_place needs a contiguous window")
    C, S = window.shape
    T = x.shape[0]
    window, w = window.contiguous(), w.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty((T, C), dtype=x.dtype, device=x.device)
    out = window if in_place else torch.empty_like(window)
    if T:
        # tokens a program: all of a short window's (a verify's), else blocks that start at
        # or past the window's S columns (see the kernel)
        bt = triton.next_power_of_2(T) if T <= BLOCK_T else max(BLOCK_T, triton.next_power_of_2(S))
        if in_place and bt < T:  # (a long prompt into a held window: written after)
            y, new = conv_step(window, x, w, dilation)
            return y, window.copy_(new)
        _conv_step_kernel[(triton.cdiv(C, BLOCK_C), triton.cdiv(T, bt))](
            window, x, w, y, out, C, T, x.stride(0), S=S, K=w.shape[1], DIL=dilation, BLOCK=BLOCK_C, BLOCK_T=bt,
            enable_fp_fusion=False)
    elif not in_place:
        out.copy_(window)
    return y, out


def conv_step_torch(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dilation: int = 1,
                    in_place: bool = False):
    _check(window, x, w, dilation)
    y, new = causal_conv_torch(window, x, w, dilation)
    return y, window.copy_(new) if in_place else new


def causal_conv_torch(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dilation: int = 1):
    """Depthwise causal conv of x (T, C) with taps w (C, K), continuing `window` (C, (K-1)*d)
    of earlier inputs; returns (output (T, C), the new window)."""
    span, T = window.shape[1], x.shape[0]
    full = torch.cat([window, x.T], dim=1)                    # (C, span+T)
    # tap by tap, in the same order for any T: a token's output does not depend on how
    # the prompt was cut into chunks (conv1d sums in an order of its own), and for decode
    # four small ops beat conv1d's setup
    y = full[:, :T] * w[:, :1]
    for j in range(1, w.shape[1]):
        y = y + full[:, j * dilation:j * dilation + T] * w[:, j:j + 1]
    # rows contiguous: an activation applied next (SiLU) then runs its vector code on
    # every element, where a (T, C) view of (C, T) runs T-long rows, scalar for a short T,
    # and a scalar exp rounds differently from the vector one
    return y.T.contiguous(), full[:, -span:].clone()
