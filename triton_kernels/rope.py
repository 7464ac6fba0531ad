"""q and k of the gated attention (strata.nn.gated_attention.project) normed per head and
roped, one kernel:

    norm_rope(x (T, Hx, D), w (D,), eps, cos (T, R), sin (T, R), pos=None) -> (Hx, T, D)
    norm_rope2(q, wq, k, wk, eps, cos, sin, pos=None) -> (norm_rope(q, wq, ...), norm_rope(k, wk, ...))
        q and k in one launch (their rows' programs side by side), the two calls' bits
    with pos (T,) integers: cos and sin are tables (N, R) and token t takes row pos[t],
        read on the device (a CUDA graph's step: no gather launched for the rows)

each head's row RMS-normalised times w, then rotate-half RoPE on its first R dims by its
token's cos and sin rows (strata.nn.rope.rotate), written head-major. In torch this is an
rms_norm and six launches of RoPE (two products, a negation, two concatenations, a sum)
for q and again for k: twelve launches an attention layer become two. x may be a strided
view (q is every other half of the fused projection's rows). Each program reads one
(token, head) row, so a row's result does not depend on the batch. Float32; within a
bound of the float64 result, not bit for bit with the torch twin (the norm's sum adds in
another order; tests/triton_kernels/test_rope.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import use_triton


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, T, D, R, stride_t, stride_h, eps,
                      BD: tl.constexpr, HAS_POS: tl.constexpr = False):
    _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, tl.program_id(0).to(tl.int64), T, D, R,
                   stride_t, stride_h, eps, BD, HAS_POS)


@triton.jit
def _norm_rope2_kernel(q_ptr, wq_ptr, k_ptr, wk_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, ko_ptr, T, D, R, n_q,
                       stride_qt, stride_qh, stride_kt, stride_kh, eps, BD: tl.constexpr,
                       HAS_POS: tl.constexpr = False):
    r = tl.program_id(0).to(tl.int64)  # q's rows, then k's
    if r < n_q:
        _norm_rope_row(q_ptr, wq_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, r, T, D, R, stride_qt, stride_qh, eps,
                       BD, HAS_POS)
    else:
        _norm_rope_row(k_ptr, wk_ptr, cos_ptr, sin_ptr, pos_ptr, ko_ptr, r - n_q, T, D, R, stride_kt, stride_kh,
                       eps, BD, HAS_POS)


@triton.jit
def _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, r, T, D, R, stride_t, stride_h, eps,
                   BD: tl.constexpr, HAS_POS: tl.constexpr):
    """Output row r = head * T + token of norm_rope."""
    h, t = r // T, r % T
    at = t
    if HAS_POS:  # the token's row of the tables
        at = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.arange(0, BD)
    row = x_ptr + t * stride_t + h * stride_h
    x = tl.load(row + c, mask=c < D, other=0.0)
    xp = tl.load(row + partner_of(c, R), mask=c < R, other=0.0)
    tl.store(out_ptr + r * D + c, norm_rope_values(x, xp, w_ptr, cos_ptr + at * R, sin_ptr + at * R, D, R, eps, BD),
             mask=c < D)


@triton.jit
def partner_of(c, R):
    """Rotate-half: dim c < R/2 pairs with c + R/2 (taken negated), c < R with c - R/2."""
    return tl.where(c < R // 2, c + R // 2, c - R // 2)


@triton.jit
def norm_rope_values(x, xp, w_ptr, cos_ptr, sin_ptr, D, R, eps, BD: tl.constexpr):
    """One row x [BD] (D live) RMS-normed times w and roped on its first R dims by the cos
    and sin row at cos_ptr, sin_ptr; xp [BD]: x at partner_of(c, R) (0 past R)."""
    c = tl.arange(0, BD)
    live, roped = c < D, c < R
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    y = x * inv * tl.load(w_ptr + c, mask=live, other=0.0)
    yp = xp * inv * tl.load(w_ptr + partner_of(c, R), mask=roped, other=0.0)
    yp = tl.where(c < R // 2, -yp, yp)
    cos = tl.load(cos_ptr + c, mask=roped, other=1.0)
    sin = tl.load(sin_ptr + c, mask=roped, other=0.0)
    return tl.where(roped, y * cos + yp * sin, y)


def _check(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos) -> None:
    if x.dim() != 3 or w.shape != (x.shape[2],):
        raise ValueError(f"norm_rope: x must be (tokens, heads, head_dim) with w (head_dim,), "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    if pos is not None and (pos.shape != (x.shape[0],) or pos.dtype.is_floating_point):
        raise ValueError(f"norm_rope: pos must be ({x.shape[0]},) integers, one per token, got "
                         f"{pos.dtype} {tuple(pos.shape)}")
    rows = "(tokens, rope_dim)" if pos is None else "tables (positions, rope_dim)"
    if cos.shape != sin.shape or cos.dim() != 2 or (pos is None and cos.shape[0] != x.shape[0]) \
            or cos.shape[1] % 2 or cos.shape[1] > x.shape[2]:
        raise ValueError(f"norm_rope: cos and sin must be {rows}, rope_dim even and at most "
                         f"head_dim {x.shape[2]}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    for t in (x, w, cos, sin):
        if t.dtype != torch.float32:
            raise ValueError(f"norm_rope: expects float32 tensors, got {t.dtype}")


def norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              pos: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, Hx, D) RMS-normed per head times w (D,), roped on its first R dims by cos and
    sin (T, R), or with `pos` by their rows pos (see the module): (Hx, T, D) float32."""
    _check(x, w, cos, sin, pos)
    if not use_triton(x):
        return norm_rope_torch(x, w, eps, cos, sin, pos)
    T, Hx, D = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    w, cos, sin = w.contiguous(), cos.contiguous(), sin.contiguous()
    out = x.new_empty(Hx, T, D)
    if out.numel():
        _norm_rope_kernel[(Hx * T,)](x, w, cos, sin, _pos(pos, cos), out, T, D, cos.shape[1], x.stride(0),
                                     x.stride(1), eps, BD=triton.next_power_of_2(D), HAS_POS=pos is not None)
    return out


def norm_rope2(q: torch.Tensor, wq: torch.Tensor, k: torch.Tensor, wk: torch.Tensor, eps: float,
               cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm_rope(q, wq, eps, cos, sin, pos), norm_rope(k, wk, eps, cos, sin, pos)) in one
    launch; q and k of one head size and tokens."""
    _check(q, wq, cos, sin, pos)
    _check(k, wk, cos, sin, pos)
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"norm_rope2: q {tuple(q.shape)} and k {tuple(k.shape)} must share tokens and head_dim")
    if not use_triton(q):
        return norm_rope2_torch(q, wq, k, wk, eps, cos, sin, pos)
    T, Hq, D = q.shape
    Hk = k.shape[1]
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    wq, wk, cos, sin = wq.contiguous(), wk.contiguous(), cos.contiguous(), sin.contiguous()
    qo, ko = q.new_empty(Hq, T, D), k.new_empty(Hk, T, D)
    if T and D and Hq + Hk:
        _norm_rope2_kernel[((Hq + Hk) * T,)](q, wq, k, wk, cos, sin, _pos(pos, cos), qo, ko, T, D, cos.shape[1],
                                             Hq * T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps,
                                             BD=triton.next_power_of_2(D), HAS_POS=pos is not None)
    return qo, ko


def _pos(pos: torch.Tensor | None, cos: torch.Tensor) -> torch.Tensor:
    """The positions as the kernel reads them (cos itself where there are none: unread)."""
    return cos if pos is None else pos.contiguous()


def norm_rope2_torch(q: torch.Tensor, wq: torch.Tensor, k: torch.Tensor, wk: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    if pos is not None:  # the rows once, for both
        cos, sin = cos[pos], sin[pos]
    return norm_rope_torch(q, wq, eps, cos, sin), norm_rope_torch(k, wk, eps, cos, sin)


def norm_rope_torch(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    pos: torch.Tensor | None = None) -> torch.Tensor:
    """norm_rope in torch: F.rms_norm, then `rotate` (by the rows at `pos` where given)."""
    if pos is not None:
        cos, sin = cos[pos], sin[pos]
    return rotate(F.rms_norm(x, w.shape, w, eps).transpose(0, 1), cos, sin, cos.shape[-1])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """RoPE in the rotate-half layout on the first `dim` dims of x (..., head_dim), by the
    positions' cos and sin rows (strata.nn.rope.Rope's, or a compiled step's)."""
    r, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    out = r * cos + torch.cat([-r[..., half:], r[..., :half]], dim=-1) * sin
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
