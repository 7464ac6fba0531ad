"""The IQ3_XXS / IQ3_S search, vectorised over every sub-block of a chunk of rows.

llama.cpp's method (`quantize_row_iq3_xxs_impl`, `quantize_row_iq3_s_impl`), per 32
weights: weights w = x^2 (with an importance matrix: imp * sqrt(sigma2 + x^2), sigma2 =
2 mean x^2 of the block); signs taken out (IQ3_XXS: where a group of 8 has an odd number
of minus signs, the weight of least w x^2 keeps the wrong sign); for each of 31 (IQ3_XXS)
or 19 (IQ3_S) scales around max/15, every group of four rounds to the 3-bit point nearest
t/scale and, where that point is off the grid, takes the best of its grid neighbours;
the weighted least-squares scale of that choice scores (sum w t q)^2 / sum w q^2; the best
choice is re-picked once at its own scale. One fp16 d a block: d = max scale / 31, stored
times 1.0125 (IQ3_XXS) or 1.033 (IQ3_S), and a 4-bit code s per 32 weights, db = d (1 + 2s)
in units of the odd levels.

What `refine` adds (see `_refine`): llama.cpp fixes the grid points before it rounds the
scale to d and the 4-bit code, so every weight is fitted to a scale a few percent off the
stored one, and it weighs by x^2 alone, which buys the large weights' accuracy with the
small ones'. Here each block tries several d (`d_factors`) and per sub-block the codes
around its scale, then picks the points again at the stored scale, judging by x^2 error
plus plain (importance-weighted) error; a block keeps llama.cpp's own result unless both
errors go down. The grid tables of IQ3_XXS carry its top level as the 15.5 it decodes to
(byte 62 = 4 * 15.5), where llama.cpp fits 15.

Measured on SmolLM2's 30 ffn_down (scripts/quant_quality.py): against llama.cpp the
plain RMSE falls 13% (IQ3_S, no imatrix) and 2% (IQ3_XXS, all-ones imatrix), the error
under the search's own weights 10% and 2%; lower on all 30 tensors. A finer scale step (0.1, twice the candidates) bought nothing measurable; picking the
refined points over the whole grid instead of among neighbours bought <0.5%.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .grid import WIDTHS, GridTables

QK_K = 256
F32 = np.float32


@dataclass(frozen=True)
class IQ3Options:
    n_scales: int          # scale candidates 15 + step * k, k = -n..n, over the sub-block max
    scale_step: float = 0.2
    parity: bool = False   # IQ3_XXS: an even number of minus signs per 8 weights
    fudge: float = 1.0     # llama.cpp's d multiplier (1.0125 IQ3_XXS, 1.033 IQ3_S)
    eps: float = 0.0       # sub-blocks whose max |x| is not above eps are left at zero
    refine: bool = True
    rounds: int = 1        # `refine`: d/codes then points, this many times (2nd round: ~0.1%)
    exact: bool = False    # `refine` picks over the whole grid (measured: <0.5% better, ~15% slower)
    d_factors: tuple[float, ...] = ()   # d multipliers tried by `refine`; fudge is added


def weights(x: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """The error weight of each of (n, 256) weights, as llama.cpp sets it."""
    if importance is None:
        return x * x
    sigma2 = F32(2) * (x * x).sum(-1, keepdims=True) / F32(QK_K)
    return importance * np.sqrt(sigma2 + x * x)


def signs_and_targets(x: np.ndarray, w: np.ndarray, parity: bool):
    """(minus-sign mask, magnitudes to fit); with `parity` the least important weight of an
    odd group of 8 keeps the wrong sign and its target becomes -|x|."""
    neg = x < 0
    t = np.abs(x)
    if parity:
        n = x.shape[0]
        odd = neg.reshape(n, -1, 8).sum(-1) % 2 == 1
        least = (w * x * x).reshape(n, -1, 8).argmin(-1)
        flip = np.zeros((n, x.shape[1] // 8, 8), dtype=bool)
        np.put_along_axis(flip, least[..., None], odd[..., None], axis=-1)
        flip = flip.reshape(x.shape)
        neg ^= flip
        t = np.where(flip, -t, t)
    return neg, t


def pick(y: np.ndarray, nw: np.ndarray, tab: GridTables) -> tuple[np.ndarray, np.ndarray]:
    """Grid entry per group of four: the 3-bit point nearest y if on the grid, else the
    neighbour of least sum nw (c - y)^2, c its level coordinates.

    y: (N, 4) level coordinates (t / db - 1) / 2 of the targets, nw: (N, 4) weights.
    Minimising over c here is minimising sum nw (db g - t)^2 over grid entries g, since
    db g - t = 2 db (c - y). Returns (entries (N,) int32, on-grid mask (N,))."""
    l = np.rint(y)
    np.clip(l, 0, 7, out=l)
    l = l.astype(np.int32)
    u = l[:, 0] | (l[:, 1] << 3) | (l[:, 2] << 6) | (l[:, 3] << 9)
    # gathers by np.take: numpy's fancy indexing copies the same rows at half its speed
    gi = np.take(tab.index, u)
    on = gi >= 0
    off = np.flatnonzero(~on)
    if off.size:
        uo = np.take(u, off)
        cls = np.take(tab.width_class, uo)
        widest = tab.neighbours.shape[1]
        for c, _width in enumerate(WIDTHS):
            sel = np.flatnonzero(cls == c)
            if not sel.size:
                continue
            uc, rows = np.take(uo, sel), np.take(off, sel)
            coords = np.take(tab.neighbour_coords[c], uc, axis=0)       # (k, 4, W)
            yr, wr = np.take(y, rows, axis=0), np.take(nw, rows, axis=0)
            err = None
            for i in range(4):
                d = coords[:, i, :] - yr[:, i, None]
                d *= d
                d *= wr[:, i, None]
                err = d if err is None else err + d
            np.put(gi, rows, np.take(tab.neighbours, uc * widest + err.argmin(-1)))
    return gi, on


def pick_exact(y: np.ndarray, nw: np.ndarray, tab: GridTables, rows: int = 8192) -> np.ndarray:
    """The grid entry of least sum nw (c - y)^2 over the whole grid, per group of four:
    sum nw c^2 - 2 sum nw y c as one (N, 8) @ (8, G) product, `rows` groups at a time."""
    c = (tab.levels - F32(1)) / F32(2)                                   # (G, 4)
    basis = np.concatenate([c * c, F32(-2) * c], axis=1).T.copy()        # (8, G)
    out = np.empty(y.shape[0], dtype=np.int32)
    for i in range(0, y.shape[0], rows):
        a = np.concatenate([nw[i:i + rows], nw[i:i + rows] * y[i:i + rows]], axis=1)
        out[i:i + rows] = (a @ basis).argmin(-1)
    return out


def _coords(t: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """(m, 32) targets, (m,) or (m, 1) inverse scales -> (m * 8, 4) level coordinates."""
    y = t * (F32(0.5) * inv.reshape(-1, 1))
    y -= F32(0.5)
    return y.reshape(-1, 4)


def search(x: np.ndarray, importance: np.ndarray | None, tab: GridTables, opt: IQ3Options):
    """(n, 256) float32 weights -> d (n,) float32 (an fp16 value), codes s (n, 8) uint8,
    grid entries (n, 64) int32, minus signs (n, 256) bool."""
    n = x.shape[0]
    m = n * 8
    w = weights(x, importance).astype(F32, copy=False)
    neg, t = signs_and_targets(x, w, opt.parity)
    t = t.reshape(m, 32)
    w = w.reshape(m, 32)
    wt = w * t
    wa = np.sqrt(w).reshape(-1, 4)   # llama.cpp picks neighbours by sqrt(w) in its scale search
    levels = tab.levels
    top = t.max(-1)
    # a sub-block whose largest target is below 1e-30 would take an inverse scale past
    # float32's range (and its scale rounds to a zero fp16 d anyway): left at zero
    live = top > F32(max(opt.eps, 1e-30))
    safe_top = np.where(live, top, F32(1))

    # --- scale candidates (llama.cpp) ---
    best = np.zeros(m, F32)
    scale = safe_top / F32(15)
    bgi = np.full((m, 8), tab.index[0], dtype=np.int32)
    bon = np.full((m, 8), opt.parity)   # IQ3_XXS starts "on grid", IQ3_S not (as llama.cpp)
    for k in range(-opt.n_scales, opt.n_scales + 1):
        inv = (F32(15) + F32(k) * F32(opt.scale_step)) / safe_top
        gi, on = pick(_coords(t, inv), wa, tab)
        gi, on = gi.reshape(m, 8), on.reshape(m, 8)
        sqx, sq2 = _ls(w, wt, np.take(levels, gi, axis=0).reshape(m, 32))
        better = live & (sq2 > 0) & (sqx * sqx > best * sq2)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(better, sqx / sq2, scale)
        best = np.where(better, scale * sqx, best)
        bgi = np.where(better[:, None], gi, bgi)
        bon = np.where(better[:, None], on, bon)

    # --- the best choice picked again at its own scale (llama.cpp) ---
    redo = live & ~bon.all(-1) & (scale > 0)
    if redo.any():
        r = np.flatnonzero(redo)
        gi, _ = pick(_coords(t[r], F32(1) / scale[r]), wa.reshape(m, 8, 4)[r].reshape(-1, 4), tab)
        keep = bon[r] if opt.parity else np.zeros_like(bon[r])  # IQ3_S re-picks every group
        bgi[r] = np.where(keep, bgi[r], gi.reshape(-1, 8))
        sqx, sq2 = _ls(w[r], wt[r], levels[bgi[r]].reshape(-1, 32))
        with np.errstate(divide="ignore", invalid="ignore"):
            scale[r] = np.where(sq2 > 0, sqx / sq2, scale[r])
    flip = scale < 0          # never seen; llama.cpp flips the signs to keep codes unsigned
    if flip.any():
        scale = np.abs(scale)
        neg = (neg.reshape(m, 32) ^ flip[:, None]).reshape(n, QK_K)
    scale = np.where(live, scale, F32(0))

    # --- one d a block, a 4-bit code a sub-block ---
    max_scale = scale.reshape(n, 8).max(-1)
    d = max_scale / F32(31)
    with np.errstate(divide="ignore", invalid="ignore"):
        code = np.rint(F32(0.5) * (scale.reshape(n, 8) / d[:, None] - F32(1)))
    code = np.clip(np.nan_to_num(code), 0, 15).astype(np.uint8)
    d16 = np.minimum(d * F32(opt.fudge), F32(65504)).astype(np.float16).astype(F32)
    if opt.refine:
        mw = (np.ones_like(t) if importance is None
              else np.ascontiguousarray(importance, dtype=F32).reshape(m, 32))
        d16, code, bgi = _refine(t, w, wt, mw, bgi, scale, max_scale, d16, code, tab, opt)
    d16 = np.where(max_scale > 0, d16, F32(0))
    return d16, code, bgi.reshape(n, 64), neg


def _ls(w: np.ndarray, wt: np.ndarray, q: np.ndarray):
    """sum w t q and sum w q^2 per sub-block; all (m, 32)."""
    return np.einsum("ij,ij->i", wt, q), np.einsum("ij,ij->i", w * q, q)


def _refine(t, w, wt, mw, gi0, scale, max_scale, d16_0, code0, tab, opt):
    """Better d, codes and grid entries than llama.cpp's, block by block.

    Two errors count: the objective (weights w, what llama.cpp minimises) and the metric
    (weights mw: the importance matrix, ones without one, i.e. the plain squared error).
    x^2 alone favours large weights so much that the plain error grows, so choices are made
    on the sum of both, each normalised by its block mean; and a block keeps llama.cpp's
    result unless both its errors go down.

    1. d: for each factor f, d = fp16(max scale / 31 * f); each sub-block takes the best
       of the codes next to its scale (or its current code) with its current points
       (llama.cpp's in the first round).
    2. points: picked again at the stored db (among neighbours, or over the whole grid
       with `exact`), kept per sub-block where they help.
    `rounds` > 1 repeats 1 and 2 from the least-squares scales of the points kept."""
    m = t.shape[0]
    n = m // 8
    levels = tab.levels
    mo = np.repeat(w.reshape(n, 256).mean(-1), 8)[:, None]
    mm = np.repeat(mw.reshape(n, 256).mean(-1), 8)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        cw = np.nan_to_num(w / mo) + np.nan_to_num(mw / mm)             # (m, 32)
    cwt, mwt = cw * t, mw * t
    cw4 = cw.reshape(-1, 4)
    q0 = np.take(levels, gi0, axis=0).reshape(m, 32)
    sums0 = [_ls(v, vt, q0) for v, vt in ((w, wt), (mw, mwt), (cw, cwt))]

    def errs(sums, db):
        return [db * db * sq2 - F32(2) * db * sqx for sqx, sq2 in sums]

    dd0 = np.repeat(d16_0, 8)
    c0 = code0.reshape(m).astype(F32)
    eo0, em0, _ = errs(sums0, dd0 * (F32(1) + F32(2) * c0))
    llama_o, llama_m = eo0.reshape(n, 8).sum(-1), em0.reshape(n, 8).sum(-1)

    out_d, out_code, gi, sums = d16_0, c0, gi0, sums0
    for _ in range(opt.rounds):
        # 1. d and codes, on the current points (llama.cpp's in the first round)
        best_c = np.full(n, np.inf, F32)
        cur_code = out_code
        for f in (opt.fudge,) + tuple(opt.d_factors):
            d16 = np.minimum(max_scale / F32(31) * F32(f), F32(65504)).astype(np.float16).astype(F32)
            dd = np.repeat(d16, 8)
            with np.errstate(divide="ignore", invalid="ignore"):
                c = np.nan_to_num(F32(0.5) * (scale / dd - F32(1)))
            lo = np.clip(np.floor(c), 0, 15)
            codes = np.stack([cur_code, lo, np.minimum(lo + 1, 15)])    # (3, m)
            ec = np.stack([errs(sums, dd * (F32(1) + F32(2) * cc))[2] for cc in codes])
            which = ec.argmin(0)
            tot = np.take_along_axis(ec, which[None], 0)[0].reshape(n, 8).sum(-1)
            better = tot < best_c
            best_c = np.where(better, tot, best_c)
            out_d = np.where(better, d16, out_d)
            out_code = np.where(np.repeat(better, 8), np.take_along_axis(codes, which[None], 0)[0], out_code)

        # 2. points picked again at the stored scale, kept per sub-block where they help
        db = np.repeat(out_d, 8) * (F32(1) + F32(2) * out_code)
        safe = np.where(db > 0, db, F32(1))
        y = _coords(t, F32(1) / safe)
        new_gi = (pick_exact(y, cw4, tab) if opt.exact else pick(y, cw4, tab)[0]).reshape(m, 8)
        q = np.take(levels, new_gi, axis=0).reshape(m, 32)
        new_sums = [_ls(v, vt, q) for v, vt in ((w, wt), (mw, mwt), (cw, cwt))]
        take = errs(new_sums, db)[2] < errs(sums, db)[2]
        gi = np.where(take[:, None], new_gi, gi)
        sums = [(np.where(take, a1, a0), np.where(take, b1, b0)) for (a0, b0), (a1, b1) in zip(sums, new_sums)]
        # the next round's scales: least squares on the kept points, combined weights
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(sums[2][1] > 0, sums[2][0] / sums[2][1], scale)
        max_scale = scale.reshape(n, 8).max(-1)
    eo, em, _ = errs(sums, db)
    eo, em = eo.reshape(n, 8).sum(-1), em.reshape(n, 8).sum(-1)

    # a block keeps llama.cpp's result unless both errors go down
    keep = (eo <= llama_o) & (em <= llama_m)
    out_d = np.where(keep, out_d, d16_0)
    out_code = np.where(np.repeat(keep, 8), out_code, c0).reshape(n, 8).astype(np.uint8)
    gi = np.where(np.repeat(keep, 8)[:, None], gi, gi0)
    return out_d, out_code, gi
