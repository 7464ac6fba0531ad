"""An attention layer's inputs in one launch: what norm_rope2, the rows' stores into the
cache, qsa_pool and norm_rope launched apart (a decode graph's step,
strata.runtime.graph_attention; the eager forward, strata.nn.gated_attention, without the
pool):

    attention_rows(q, wq, k, wk, v, eps, cos, sin, pos, k_cache, v_cache,
                   idx=None, pool=None, slots=None) -> (qo (H, T, D), qi (n_idx, T, d) or None)
        q (T, H, D), k and v (T, Hkv, D): views of the fused projection's rows, D contiguous,
        roped at the rows pos (T,) of the cos and sin tables
        k normed times wk and roped, then stored with v at rows `slots` (T,) of the caches
        (Hkv, C, D) (default: pos), rounded to their float dtype to nearest even (as
        torch's .to)
        idx = (idx_q (T, n_idx*d) or None, w_iq (d,), idx_k (T, d), idx_cache (C, d)): the
            QSA indexer's key stored at the slots, its queries normed and roped (norm_rope's qi)
        pool = (ratio, w_ik (d,), blocks (nb, d) float32): each position's block key
            pooled as qsa_pool pools it, in place (positions that are the slots: a graph's)

Programs side by side in one grid: q's rows, k's, v's, the indexer key's, the indexer
queries', then one a position for the block keys. The launch is its four launches' result
bit for bit (their jit functions, the same sums in the same order), with one difference
of source: a block key's rows at the step's own positions are read from the rows this
launch stores there, rounded as stored, since another program of the same launch writes
the cache (no order between programs); every other row from the cache, as qsa_pool reads
it. Float caches only: an int8 cache's rows need their scales (strata.nn.kv), and keep
the separate launches. `attention_rows_torch` is the four torch twins in order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .decode.common import round_to_bf16_bits
from .qsa import qsa_pool_torch
from .rope import _check as _check_rope
from .rope import _norm_rope_row, norm_rope2_torch, norm_rope_torch, norm_rope_values, partner_of

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # a cache's dtype -> the kernel's STORE


@triton.jit
def _stored(x, STORE: tl.constexpr):
    """float32 x as a cache of kind STORE holds it: float32, bf16 bits as int16 (rounded to
    nearest even by hand: the interpreter holds bf16 as raw uint16, and its cast
    truncates), float16 (cast: to nearest even)."""
    if STORE == 1:
        y = round_to_bf16_bits(x)
    elif STORE == 2:
        y = x.to(tl.float16)
    else:
        y = x
    return y


@triton.jit
def _read(y, STORE: tl.constexpr):
    """A cache's stored value as float32 (bf16 bits widened: exact, the interpreter's too)."""
    if STORE == 1:
        x = (y.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = y.to(tl.float32)
    return x


@triton.jit
def _attention_rows_kernel(q_ptr, wq_ptr, k_ptr, wk_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, qo_ptr,
                           kc_ptr, vc_ptr, iq_ptr, wiq_ptr, ik_ptr, ic_ptr, wik_ptr, blocks_ptr, qi_ptr,
                           T, D, R, Hq, Hk, NI, DI, C, ratio, eps,
                           s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ch, s_cn, s_iq, s_ik, s_ic, s_b,
                           BD: tl.constexpr, BDI: tl.constexpr, T_P2: tl.constexpr, STORE: tl.constexpr,
                           IDX: tl.constexpr, POOL: tl.constexpr):
    # BD and BDI: the heads' and the indexer's widths as the separate kernels tile them (a
    # row's sum of squares reduces in their lanes' order: another width, other bits on a GPU)
    r = tl.program_id(0).to(tl.int64)
    n_q, n_kv = Hq * T, Hk * T
    c = tl.arange(0, BD)
    if r < n_q:  # q's rows: norm_rope2's
        _norm_rope_row(q_ptr, wq_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, r, T, D, R, s_qt, s_qh, eps, BD, True)
    elif r < n_q + 2 * n_kv:  # k's rows normed and roped, v's as they are, into the caches at slot[t]
        kv = r - n_q
        is_k = kv < n_kv
        kv = tl.where(is_k, kv, kv - n_kv)
        h, t = kv // T, kv % T
        p = tl.load(slot_ptr + t).to(tl.int64)
        if is_k:
            at = tl.load(pos_ptr + t).to(tl.int64)
            row = k_ptr + t * s_kt + h * s_kh
            x = tl.load(row + c, mask=c < D, other=0.0)
            xp = tl.load(row + partner_of(c, R), mask=c < R, other=0.0)
            y = norm_rope_values(x, xp, wk_ptr, cos_ptr + at * R, sin_ptr + at * R, D, R, eps, BD)
            tl.store(kc_ptr + h * s_ch + p * s_cn + c, _stored(y, STORE), mask=c < D)
        else:
            y = tl.load(v_ptr + t * s_vt + h * s_vh + c, mask=c < D, other=0.0)
            tl.store(vc_ptr + h * s_ch + p * s_cn + c, _stored(y, STORE), mask=c < D)
    elif IDX:
        i = r - n_q - 2 * n_kv
        if i < T:  # the indexer key's rows, as they are
            ci = tl.arange(0, BDI)
            p = tl.load(slot_ptr + i).to(tl.int64)
            y = tl.load(ik_ptr + i * s_ik + ci, mask=ci < DI, other=0.0)
            tl.store(ic_ptr + p * s_ic + ci, _stored(y, STORE), mask=ci < DI)
        elif i < (1 + NI) * T:  # the indexer queries: norm_rope's, (n_idx, T, d)
            _norm_rope_row(iq_ptr, wiq_ptr, cos_ptr, sin_ptr, pos_ptr, qi_ptr, i - T, T, DI, R, s_iq, DI, eps, BDI,
                           True)
        elif POOL:  # a position's block key: qsa_pool's sums, the step's own rows taken from ik
            _pool_row(ik_ptr, ic_ptr, wik_ptr, cos_ptr, sin_ptr, slot_ptr, blocks_ptr, i - (1 + NI) * T, T, DI, R, C,
                      ratio, eps, s_ik, s_ic, s_b, BDI, T_P2, STORE)


@triton.jit
def _pool_row(ik_ptr, ic_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, blocks_ptr, t, T, D, R, C, ratio, eps, s_ik, s_ic,
              s_b, BD: tl.constexpr, T_P2: tl.constexpr, STORE: tl.constexpr):
    """qsa_pool's program for position pos[t]: the mean of its block's rows, row by row in
    its order, a row the step stores read from ik (its row of the step), rounded as stored."""
    c = tl.arange(0, BD)
    tt = tl.arange(0, T_P2)
    at = tl.load(pos_ptr + tt, mask=tt < T, other=-1).to(tl.int64)
    first = (tl.load(pos_ptr + t).to(tl.int64) // ratio) * ratio
    partner = partner_of(c, R)
    x = tl.zeros((BD,), tl.float32)
    xp = tl.zeros((BD,), tl.float32)
    for j in range(0, ratio):
        row = tl.minimum(first + j, C - 1)
        mine = tl.max(tl.where(at == row, tt, -1), axis=0)  # the step's row stored there, or -1
        own = mine >= 0
        src = ik_ptr + tl.maximum(mine, 0) * s_ik  # both rows read (each is in bounds), one kept
        v = tl.where(own, _read(_stored(tl.load(src + c, mask=c < D, other=0.0), STORE), STORE),
                     _read(tl.load(ic_ptr + row * s_ic + c, mask=c < D, other=0), STORE))
        vp = tl.where(own, _read(_stored(tl.load(src + partner, mask=c < R, other=0.0), STORE), STORE),
                      _read(tl.load(ic_ptr + row * s_ic + partner, mask=c < R, other=0), STORE))
        x += v
        xp += vp
    out = norm_rope_values(x / ratio, xp / ratio, w_ptr, cos_ptr + first * R, sin_ptr + first * R, D, R, eps, BD)
    tl.store(blocks_ptr + (first // ratio) * s_b + c, out, mask=c < D)


def _check(q, wq, k, wk, v, eps, cos, sin, pos, k_cache, v_cache, idx, pool, slots):
    if pos is None:
        raise ValueError("attention_rows: pos (T,), the rows of the cos and sin tables, is needed")
    _check_rope(q, wq, cos, sin, pos)
    _check_rope(k, wk, cos, sin, pos)
    T, Hk, D = k.shape
    if slots is not None:
        if slots.shape != pos.shape or slots.dtype.is_floating_point:
            raise ValueError(f"attention_rows: slots must be ({T},) integers, got {slots.dtype} {tuple(slots.shape)}")
        if pool is not None:
            raise ValueError("attention_rows: the block keys are pooled at positions that are the slots (a graph's "
                             "step): give no slots with a pool")
    if q.shape[0] != T or q.shape[2] != D or v.shape != k.shape:
        raise ValueError(f"attention_rows: q (T, H, D), k and v (T, Hkv, D) of one T and D, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    caches = [k_cache, v_cache] + ([idx[3]] if idx is not None else [])
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.shape[0] != Hk or k_cache.shape[2] != D:
        raise ValueError(f"attention_rows: k_cache and v_cache must be ({Hk}, capacity, {D}), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if any(c.dtype not in FLOATS or c.dtype != k_cache.dtype for c in caches) or v.dtype != torch.float32:
        raise ValueError(f"attention_rows: float caches of one dtype and float32 rows, got "
                         f"{[c.dtype for c in caches]} and {v.dtype} (an int8 cache's rows need their scales: the "
                         f"separate launches)")
    if idx is not None:
        idx_q, w_iq, idx_k, idx_cache = idx
        d = idx_k.shape[-1]
        if idx_k.shape != (T, d) or idx_cache.shape != (k_cache.shape[1], d):
            raise ValueError(f"attention_rows: idx_k (T, d) and idx_cache ({k_cache.shape[1]}, d), got "
                             f"{tuple(idx_k.shape)} and {tuple(idx_cache.shape)}")
        if cos.shape[1] > d:
            raise ValueError(f"attention_rows: rope_dim {cos.shape[1]} is more than the indexer's width {d}")
        if idx_q is not None:
            if idx_q.dim() != 2 or idx_q.shape[0] != T or idx_q.shape[1] % d:
                raise ValueError(f"attention_rows: idx_q must be (T, n_idx*{d}), got {tuple(idx_q.shape)}")
            _check_rope(idx_q.reshape(T, -1, d), w_iq, cos, sin, pos)
    if pool is not None:
        if idx is None:
            raise ValueError("attention_rows: pooling the block keys needs the indexer's rows (idx)")
        ratio, w_ik, blocks = pool
        if ratio < 1 or blocks.dim() != 2 or blocks.shape[1] != idx[2].shape[-1] or blocks.dtype != torch.float32 \
                or w_ik.shape != (idx[2].shape[-1],):
            raise ValueError(f"attention_rows: pool is (ratio >= 1, w (d,), blocks (n_blocks, d) float32), got "
                             f"{ratio}, {tuple(w_ik.shape)}, {tuple(blocks.shape)} {blocks.dtype}")


def cache_write_torch(dsts: list[torch.Tensor], srcs: list[torch.Tensor], pos: torch.Tensor) -> None:
    """Each src's rows (H, T, D) or (T, D) stored at positions pos of its dst (H, C, D) or
    (C, D), converted to the dst's float dtype: the launch's stores, bit for bit."""
    for d, s in zip(dsts, srcs):
        d.index_copy_(d.dim() - 2, pos, s.to(d.dtype))


def attention_rows_torch(q, wq, k, wk, v, eps, cos, sin, pos, k_cache, v_cache, idx=None, pool=None, slots=None):
    """The four ops' torch twins in their order (see the module)."""
    _check(q, wq, k, wk, v, eps, cos, sin, pos, k_cache, v_cache, idx, pool, slots)
    qo, ko = norm_rope2_torch(q, wq, k, wk, eps, cos, sin, pos)
    dsts, srcs = [k_cache, v_cache], [ko, v.transpose(0, 1)]
    if idx is not None:
        dsts.append(idx[3])
        srcs.append(idx[2])
    cache_write_torch(dsts, srcs, pos if slots is None else slots)
    if pool is not None:
        qsa_pool_torch(idx[3], None, pos, pool[0], pool[1], eps, cos, sin, pool[2])
    if idx is None or idx[0] is None:
        return qo, None
    T, d = idx[2].shape
    return qo, norm_rope_torch(idx[0].reshape(T, -1, d), idx[1], eps, cos, sin, pos)


def attention_rows(q: torch.Tensor, wq: torch.Tensor, k: torch.Tensor, wk: torch.Tensor, v: torch.Tensor,
                   eps: float, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, idx: tuple | None = None, pool: tuple | None = None,
                   slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q normed and roped (H, T, D), the indexer queries normed and roped (n_idx, T, d) or
    None), the caches and block keys written in place, in one launch (see the module).
    Positions must lie in the caches (unchecked: they are on the device). CPU tensors
    without the interpreter run attention_rows_torch."""
    _check(q, wq, k, wk, v, eps, cos, sin, pos, k_cache, v_cache, idx, pool, slots)
    if not use_triton(q):
        return attention_rows_torch(q, wq, k, wk, v, eps, cos, sin, pos, k_cache, v_cache, idx, pool, slots)
    T, Hq, D = q.shape
    Hk = k.shape[1]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("attention_rows: the k and v caches must be contiguous along their rows, strided alike")
    store = KIND[k_cache.dtype]
    as_stored = (lambda c: c.view(torch.int16)) if store == 1 else (lambda c: c)
    qo = q.new_empty(Hq, T, D)
    iq = wiq = ik = ic = wik = blocks = qi = qo  # unread without IDX / POOL
    NI = DI = ratio = 0
    if idx is not None:
        iq, wiq, ik, ic = idx
        DI = ik.shape[-1]
        ik = ik if ik.stride(-1) == 1 else ik.contiguous()
        if ic.stride(-1) != 1:
            raise ValueError("attention_rows: the indexer's cache must be contiguous along its rows")
        ic = as_stored(ic)
        if iq is not None:
            NI = iq.shape[1] // DI
            iq, wiq = (iq if iq.stride(-1) == 1 else iq.contiguous()), wiq.contiguous()
            qi = q.new_empty(NI, T, DI)
        else:
            iq = wiq = qo  # unread: no queries' programs
    if pool is not None:
        ratio, wik, blocks = pool
        wik = wik.contiguous()
        if blocks.stride(-1) != 1:
            raise ValueError("attention_rows: blocks must be contiguous along d")
    n = (Hq + 2 * Hk) * T + ((1 + NI) * T if idx is not None else 0) + (T if pool is not None else 0)
    if T and D:
        kc, vc = as_stored(k_cache), as_stored(v_cache)
        _attention_rows_kernel[(n,)](
            q, wq.contiguous(), k, wk.contiguous(), v, cos.contiguous(), sin.contiguous(), pos.contiguous(),
            (pos if slots is None else slots).contiguous(), qo,
            kc, vc, iq, wiq, ik, ic, wik, blocks, qi, T, D, cos.shape[1], Hq, Hk, NI, DI, k_cache.shape[1], ratio,
            eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), iq.stride(0), ik.stride(0), ic.stride(0), blocks.stride(0),
            BD=triton.next_power_of_2(D), BDI=triton.next_power_of_2(max(DI, 1)), T_P2=triton.next_power_of_2(T),
            STORE=store, IDX=idx is not None, POOL=pool is not None)
    return qo, (qi if idx is not None and idx[0] is not None else None)
