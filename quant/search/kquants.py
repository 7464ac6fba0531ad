"""llama.cpp's K-quant searches (ggml-quants.c), vectorised over every sub-block of a chunk.

The per-sub-block fits, all weighted least squares over a few candidate scales:
  `qkx`    make_qkx2_quants / make_qkx3_quants: w = d q - m with q in 0..nmax, m >= 0.
           From the range [min(0, min x), max x], nstep + 1 candidate scales
           (nmax + rmin + rdelta k) / range, each rounded, then the weighted least-squares
           d and m of those codes (m clamped to >= 0); the lowest weighted error
           (squared, or absolute with `mad`) wins. A winner's min moves the range of the
           candidates after it, as in llama.cpp.
  `qx`     make_qx_quants (rmse_type 1): w = d q, q in -nmax..nmax-1; the signed extreme
           maps to -nmax, then 18 scales -(nmax + 0.1 k) / max, k = -9..9; each rounded
           and scored by (sum w x q)^2 / sum w q^2, the least-squares d of the best kept.
  `q3`     make_q3_quants: the first of those scales, then five passes of coordinate
           descent (each weight moves to the code its leave-one-out scale asks for when
           that raises the score), weights x^2.
  `qp`     make_qp_quants: the super-block fit of the non-negative sub-block scales and
           mins on 0..nmax codes: 9 scales (nmax + 0.1 k) / max by weighted squared
           error, then coordinate descent as `q3`.

Layout: a fit takes x and its weights as (n, S), the n weights of each of S sub-blocks
down a column. Reductions run over axis 0, which numpy adds in index order (it keeps a
running sum per column), the order of llama.cpp's loops; every product and quotient is
the same float32 operation in the same order, and rounding is nearest_int's (halves to
even, np.rint). So a block comes out bit-identical to ggml's (built without FMA
contraction, as its ggml-base is) except where a fit's arithmetic is not reproduced.

The K-quants' block quantizers (`q2_k` ... `q6_k`) return the codes quant/kquants.py packs,
following quantize_row_q*_K_ref without importance and quantize_row_q*_K_impl with it.
"""
from __future__ import annotations

import numpy as np

from ..format import byte_rows, column_extreme

F32 = np.float32
QK_K = 256
EPS = F32(1e-15)  # GROUP_MAX_EPS


def _rint(v: np.ndarray) -> np.ndarray:
    """nearest_int (halves to even, as adding 1.5 * 2^23 rounds), in place: v is always a
    fresh temporary here."""
    return np.rint(v, out=v)


def _safe(v: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """v with 1 where `bad`: a divisor whose quotient is thrown away."""
    return np.where(bad, F32(1), v)


def _cols(x: np.ndarray, n: int) -> np.ndarray:
    """(B, N) -> (n, B N / n): sub-blocks of n weights as columns."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _rows(c: np.ndarray, b: int) -> np.ndarray:
    """The inverse of `_cols` for codes: (n, S) uint8 -> (b, S n / b)."""
    return byte_rows(c).reshape(b, -1)


def _code_rows(q: np.ndarray, b: int) -> np.ndarray:
    """Codes (n, S), whole numbers 0..255 in float32 -> (b, S n / b) uint8: cast before the
    transpose, which then moves a quarter of the bytes."""
    return _rows(q.astype(np.uint8), b)


# --- the sub-block fits ------------------------------------------------------------------

def _dot(a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None) -> np.ndarray:
    """sum over axis 0 of a * b (* c), (n, S) -> (S,): each product rounded (a * b first),
    then added in index order, as (a * b * c).sum(axis=0) does, without the temporaries."""
    if c is None:
        return np.einsum("ij,ij->j", a, b)
    return np.einsum("ij,ij,ij->j", a, b, c)


def _same_codes(l: np.ndarray, last: np.ndarray) -> bool:
    """Whether every column has the codes of the last candidate fitted: then its fit and
    error are that candidate's, which did not beat the best (or became it), so this one
    cannot either. Rows requantized from a grid as coarse (Q4_1 to Q4_K) keep their codes
    for half the candidates; fresh weights seldom for one column in a hundred, so a few
    columns are compared first."""
    return np.array_equal(l[:, :64], last[:, :64]) and np.array_equal(l, last)


def qkx(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
        mad: bool = False):
    """make_qkx2_quants / make_qkx3_quants: x, w (n, S) -> scale (S,), the_min (S,) (the
    m subtracted, >= 0) and codes L (n, S) float32 in 0..nmax."""
    # three (n, S) buffers written in place: the codes, the last fitted codes, the errors
    l, last, d = np.empty_like(x), np.empty_like(x), np.empty_like(x)

    def codes(iscale, x_mn, out):
        np.multiply(iscale, x_mn, out=out)
        return np.clip(_rint(out), 0, nmax, out=out)

    def err(scale, mn, l):
        np.multiply(scale, l, out=d)
        np.add(d, mn, out=d)                          # scale l + mn - x, in that order
        np.subtract(d, x, out=d)
        return _dot(w, np.abs(d, out=d)) if mad else _dot(d, d, w)   # w (d d), as llama.cpp

    mn = np.minimum(x.min(axis=0), F32(0))
    mx = x.max(axis=0)
    sum_w = w.sum(axis=0)
    sum_x = _dot(w, x)
    flat = mx == mn
    span = _safe(mx - mn, flat)
    x_mn = x - mn
    iscale = F32(nmax) / span
    scale = F32(1) / iscale
    best = err(scale, mn, codes(iscale, x_mn, l))
    best_iscale, best_from = iscale, mn.copy()   # the winner's codes, made again at the end
    fitted = False
    for k in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(k) + F32(nmax)) / span
        codes(iscale, x_mn, l)
        if fitted and _same_codes(l, last):
            continue
        l, last, fitted = last, l, True
        sum_l, sum_l2, sum_xl = _dot(w, last), _dot(w, last, last), _dot(w, last, x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        with np.errstate(divide="ignore", invalid="ignore"):  # quotients where not ok: dropped
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        cur = err(this_scale, this_min, last)
        better = ok & (cur < best)
        i = np.flatnonzero(better)
        if not i.size:  # no column improved (often so on rows requantized): state kept
            continue
        best[i] = cur[i]
        best_iscale[i] = iscale[i]
        best_from[i] = mn[i]
        scale[i] = this_scale[i]
        mn[i] = this_min[i]        # the candidates after a winner start from its min
        span = _safe(mx - mn, flat)
        np.subtract(x, mn, out=x_mn)
    L = codes(best_iscale, x - best_from, l)
    L[:, flat] = 0
    scale = np.where(flat, F32(0), scale)
    return scale, -mn, L


def qp(x: np.ndarray, w: np.ndarray, nmax: int):
    """make_qp_quants: x (n, B) >= 0, w (n, B) -> scale (B,) and codes (n, B) in 0..nmax."""
    mx = np.maximum(x.max(axis=0), F32(0))
    zero = mx < EPS
    mxs = _safe(mx, zero)
    iscale = F32(nmax) / mxs
    L = _rint(iscale * x)
    scale = F32(1) / iscale
    diff = x - scale * L
    best = (w * diff * diff).sum(axis=0)
    for k in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_k = (F32(0.1) * F32(k) + F32(nmax)) / mxs
        scale_k = F32(1) / iscale_k
        l = np.minimum(_rint(iscale_k * x), nmax)
        diff = x - scale_k * l
        mse = (w * diff * diff).sum(axis=0)
        better = mse < best
        best = np.where(better, mse, best)
        iscale = np.where(better, iscale_k, iscale)
    L = np.minimum(_rint(iscale * x), nmax)
    sumlx = (w * x * L).sum(axis=0)
    suml2 = (w * L * L).sum(axis=0)
    wx = w * x
    for _ in range(5):  # llama.cpp stops at a pass that changes nothing: so does this
        for i in range(x.shape[0]):
            wi, xi, li = w[i], x[i], L[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - wi * li * li
            cand = (slx > 0) & (sl2 > 0)
            new = np.minimum(_rint(xi * sl2 / _safe(slx, ~cand)), nmax)
            cand &= new != li
            slx = slx + wx[i] * new
            sl2 = sl2 + wi * new * new
            acc = cand & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L[i] = np.where(acc, new, li)
            sumlx = np.where(acc, slx, sumlx)
            suml2 = np.where(acc, sl2, suml2)
    scale = np.where(suml2 > 0, sumlx / _safe(suml2, suml2 <= 0), F32(0))
    L[:, zero] = 0
    return np.where(zero, F32(0), scale), L


def qx(x: np.ndarray, w: np.ndarray | None, nmax: int):
    """make_qx_quants, rmse_type 1: x (n, S), w (n, S) or None for x^2 -> scale (S,) and
    codes (n, S) float32 in 0..2 nmax - 1 (q + nmax); an all-zero column gets scale 0 and
    codes 0.

    Every candidate's two sums are taken first, into (19, S) arrays; then one pass down the
    candidates keeps, per column, the first that beats the best so far, comparing as
    llama.cpp does (sumlx^2 > best suml2, best = sumlx^2 / suml2 of the one kept)."""
    if w is None:
        w = x * x
    mx = column_extreme(x)
    zero = np.abs(mx) < EPS
    mxs = _safe(mx, zero)
    wx = w * x
    # the first candidate maps the signed extreme to -nmax; then -(nmax + 0.1 k) / max
    top = [F32(nmax)] + [F32(nmax) + F32(0.1) * F32(k) for k in range(-9, 10) if k]
    isc = np.stack([F32(-nmax) / mxs] + [-t / mxs for t in top[1:]])
    sx, s2 = np.empty_like(isc), np.empty_like(isc)
    l = np.empty_like(x)
    for j, t in enumerate(top):
        np.multiply(isc[j], x, out=l)
        _rint(l)
        # |x| <= |max|: every product lies within t (times 1 + 2^-22), so below
        # nmax - 1/2 no code leaves -nmax..nmax-1 and the clip has nothing to do
        if t * F32(1 + 2**-22) >= F32(nmax - 0.5):
            np.clip(l, -nmax, nmax - 1, out=l)
        np.einsum("ij,ij->j", wx, l, out=sx[j])
        np.einsum("ij,ij,ij->j", w, l, l, out=s2[j])
    with np.errstate(divide="ignore", invalid="ignore"):  # suml2 = 0: never kept (see below)
        sc = sx / s2
    sc[0] = np.where(s2[0] != 0, sc[0], F32(0))    # the first is kept with scale 0 there
    kept = sc * sx                                # each candidate's best, were it kept
    sq = sx * sx
    best, pick = kept[0].copy(), np.zeros(x.shape[1], np.intp)
    for j in range(1, len(top)):
        better = sq[j] > best * s2[j]
        better &= s2[j] > 0
        i = np.flatnonzero(better)   # after the first few candidates, few columns
        best[i] = kept[j, i]
        pick[i] = j
    cols = np.arange(x.shape[1])
    l = np.multiply(isc[pick, cols], x, out=l)
    L = np.clip(_rint(l), -nmax, nmax - 1, out=l) + F32(nmax)
    L[:, zero] = 0
    return np.where(zero, F32(0), sc[pick, cols]), L


def q3(x: np.ndarray, nmax: int):
    """make_q3_quants with do_rmse: x (n, S) -> scale (S,) and codes (n, S) in 0..2 nmax - 1."""
    mx = column_extreme(x)
    zero = np.abs(mx) < EPS
    L = np.clip(_rint(F32(-nmax) / _safe(mx, zero) * x), -nmax, nmax - 1)
    w = x * x
    wx = w * x
    sumlx = _dot(wx, L)
    suml2 = _dot(w * L, L)
    # A column whose pass changed nothing is done (its next pass would repeat this one, and
    # llama.cpp stops there): each pass runs over the columns the last one changed.
    live = np.arange(x.shape[1])
    for _ in range(5):
        xs, ws, wxs, Ls = x[:, live], w[:, live], wx[:, live], L[:, live]
        slx_all, sl2_all = sumlx[live], suml2[live]
        changed = np.zeros(live.size, bool)
        for i in range(x.shape[0]):
            li = Ls[i]
            slx = slx_all - wxs[i] * li
            sl2 = sl2_all - ws[i] * li * li
            with np.errstate(divide="ignore", invalid="ignore"):  # slx <= 0: not a candidate
                new = np.clip(_rint(xs[i] * sl2 / slx), -nmax, nmax - 1)
            c = np.flatnonzero((slx > 0) & (new != li))   # few: the rest keep their code
            if not c.size:
                continue
            nc = new[c]
            s1 = slx[c] + wxs[i, c] * nc
            s2 = sl2[c] + ws[i, c] * nc * nc
            acc = (s2 > 0) & (s1 * s1 * sl2_all[c] > slx_all[c] * slx_all[c] * s2)
            j = c[acc]
            Ls[i, j], slx_all[j], sl2_all[j] = nc[acc], s1[acc], s2[acc]
            changed[j] = True
        L[:, live], sumlx[live], suml2[live] = Ls, slx_all, sl2_all
        live = live[changed]
        if not live.size:
            break
    L += nmax
    L[:, zero] = 0
    scale = np.where(suml2 > 0, sumlx / _safe(suml2, suml2 <= 0), F32(0))
    return np.where(zero, F32(0), scale), L


# --- super-blocks ------------------------------------------------------------------------

def _fp16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).astype(F32)


def _requant(x: np.ndarray, L: np.ndarray, d: np.ndarray, m: np.ndarray | None, lo: int, hi: int,
             shift: int) -> np.ndarray:
    """Every weight again on the stored scales: x, L (n, S), d, m (S,) -> codes
    clip(round((x + m) / d), lo, hi) + shift; a sub-block whose d is 0 keeps L."""
    live = d != 0
    v = x if m is None else x + m
    q = np.clip(_rint(v / _safe(d, ~live)), lo, hi) + F32(shift)
    return np.where(live, q, L)


def _max_over(v: np.ndarray, k: int) -> np.ndarray:
    """(S,) -> (B,): each super-block's largest value, floored at 0."""
    return np.maximum(v.reshape(-1, k).max(axis=1), F32(0))


def _code(v: np.ndarray, inv: np.ndarray, k: int, top: int) -> np.ndarray:
    """nearest_int(inv * v) stored as uint8, capped at top: (S,) -> (B, k)."""
    c = _rint(np.repeat(inv, k) * v)
    return np.minimum(np.mod(c, 256), top).reshape(-1, k)


def _sigma2(x: np.ndarray, twice: bool) -> np.ndarray:
    """(B, 256) -> (B,): sum x^2 over the block in index order, times 2/256 (or 1/256)."""
    xt = _cols(x, QK_K)
    s = (xt * xt).sum(axis=0)
    return (F32(2) * s if twice else s) / F32(QK_K)


def _imp_weights(x: np.ndarray, imp: np.ndarray, n: int, twice: bool) -> np.ndarray:
    """qw sqrt(sigma2 + x^2), sigma2 the block's mean x^2 (doubled where llama.cpp does)."""
    s2 = _sigma2(x, twice)[:, None]
    return _cols(imp * np.sqrt(s2 + x * x), n)


def _sub_blocks(x: np.ndarray, n: int, cols: bool) -> tuple[np.ndarray, int]:
    """The weights as sub-block columns (n, S) in block order, and the count of blocks:
    from rows (B, 256), or (`cols`) from the 32-weight columns (32, 8 B) a legacy format
    decodes to (Format.dequantize_cols), which for n = 32 are those already and for n = 16
    split in two (a tenth of the cost of making rows and columns again)."""
    if not cols:
        return _cols(x, n), x.shape[0]
    b = x.shape[1] * 32 // QK_K
    return (x if n == 32 else np.stack([x[:16], x[16:]], axis=2).reshape(16, -1)), b


def _asym(x: np.ndarray, imp: np.ndarray | None, n: int, nmax: int, smax: int, ref: tuple, mad: bool,
          cols: bool):
    """Q2_K, Q4_K, Q5_K: (B, 256) (or 32-weight columns, see _sub_blocks) -> d, dmin (B,)
    float32 (fp16 values), sc, m (B, 256 / n), q (B, 256) uint8."""
    k = QK_K // n
    xc, b = _sub_blocks(x, n, cols)
    if imp is None:
        if n == 16:                                   # Q2_K: weights |x|
            w = np.abs(xc)
        else:                                         # Q4_K, Q5_K: rms of the sub-block + |x|
            av = np.sqrt((xc * xc).sum(axis=0) / F32(n))
            w = av + np.abs(xc)
        scales, mins, L = qkx(xc, w, nmax, *ref, mad=mad)
        ms, mm = _max_over(scales, k), _max_over(mins, k)
        with np.errstate(divide="ignore"):
            inv_s = np.where(ms > 0, F32(smax) / ms, F32(0))
            inv_m = np.where(mm > 0, F32(smax) / mm, F32(0))
        sc, m = _code(scales, inv_s, k, smax), _code(mins, inv_m, k, smax)
        d, dmin = _fp16(ms / F32(smax)), _fp16(mm / F32(smax))
    else:
        w = _imp_weights(x, imp, n, twice=n == 32)
        sw = w.sum(axis=0)
        scales, mins, L = qkx(xc, w, nmax, -0.9, 0.05, 36)
        swb = sw.reshape(b, k).T
        dd, sc = qp(np.ascontiguousarray(scales.reshape(b, k).T), swb, smax)
        dm, m = qp(np.ascontiguousarray(mins.reshape(b, k).T), swb, smax)
        sc, m = np.minimum(sc.T, smax), np.minimum(m.T, smax)
        d, dmin = _fp16(dd), _fp16(dm)
    dl = (d[:, None] * sc).reshape(-1)
    ml = (dmin[:, None] * m).reshape(-1)
    q = _requant(xc, L, dl, ml, 0, nmax, 0)
    return d, dmin, sc, m, _code_rows(q, b)


def _sym(x: np.ndarray, nmax: int, smax: int, fit, eps, cols: bool = False):
    """Q3_K without importance, Q6_K (`fit` holds the importance): the sub-block fits, their
    scales coded as multiples of d = -max / (smax + 1), max the signed largest.
    (B, 256) -> d (B,), sc (B, 16) signed codes, q (B, 256) uint8 in 0..2 nmax - 1 (the value
    plus nmax), live (B,): the blocks whose largest sub-block scale is not below eps
    (nonzero where eps is None); the others store d = 0."""
    xc, b = _sub_blocks(x, 16, cols)
    scales, L = fit(xc)
    s = scales.reshape(b, 16)
    max_scale = s[np.arange(b), np.abs(s).argmax(axis=1)]
    live = np.abs(max_scale) >= eps if eps else max_scale != 0
    iscale = F32(-(smax + 1)) / _safe(max_scale, ~live)
    sc = np.clip(_rint(iscale[:, None] * s), -smax - 1, smax)
    sc = np.where(live[:, None], sc, F32(0))
    d = np.where(live, _fp16(F32(1) / iscale), F32(0))
    dl = (d[:, None] * sc).reshape(-1)
    q = _requant(xc, L, dl, None, -nmax, nmax - 1, nmax)
    return d, sc, _code_rows(q, b), live


def q2_k(x: np.ndarray, imp: np.ndarray | None, cols: bool = False):
    """(B, 256), importance (B, 256) or None -> d, dmin (B,), sc, m (B, 16) in 0..15,
    q (B, 256) in 0..3. With `cols`, x is (32, 8 B) 32-weight columns and imp None (so for
    each of these)."""
    return _asym(x, imp, 16, 3, 15, (-0.5, 0.1, 15), mad=True, cols=cols)


def q4_k(x: np.ndarray, imp: np.ndarray | None, cols: bool = False):
    """-> d, dmin (B,), sc, m (B, 8) in 0..63, q (B, 256) in 0..15."""
    return _asym(x, imp, 32, 15, 63, (-1.0, 0.1, 20), mad=False, cols=cols)


def q5_k(x: np.ndarray, imp: np.ndarray | None, cols: bool = False):
    """-> d, dmin (B,), sc, m (B, 8) in 0..63, q (B, 256) in 0..31."""
    return _asym(x, imp, 32, 31, 63, (-0.5, 0.1, 15), mad=False, cols=cols)


def q3_k(x: np.ndarray, imp: np.ndarray | None, cols: bool = False):
    """-> d (B,), sc (B, 16) in 0..63 (the scale plus 32), q (B, 256) in 0..7 (plus 4)."""
    if imp is None:
        d, sc, q, live = _sym(x, 4, 31, lambda xc: q3(xc, 4), None, cols)
        return d, np.where(live[:, None], sc + 32, F32(0)), q
    b = x.shape[0]
    xc = _cols(x, 16)
    w = _imp_weights(x, imp, 16, twice=True)
    scales, L = qx(xc, w, 4)
    ds, ls = qx(np.ascontiguousarray(scales.reshape(b, 16).T), np.ascontiguousarray(w.sum(axis=0).reshape(b, 16).T), 32)
    d = _fp16(ds)
    ls = ls.T
    dl = (d[:, None] * (ls - 32)).reshape(-1)
    return d, ls, _code_rows(_requant(xc, L, dl, None, -4, 3, 4), b)


def q6_k(x: np.ndarray, imp: np.ndarray | None, cols: bool = False):
    """-> d (B,), sc (B, 16) int8 values, q (B, 256) in 0..63 (the value plus 32); an
    all-zero block (every scale below 1e-15) is all zero bytes."""
    w = None if imp is None else _cols(imp, 16)
    d, sc, q, live = _sym(x, 32, 127, lambda xc: qx(xc, w, 32), EPS, cols)
    q = np.where(live[:, None], q, np.uint8(0))
    return d, sc, q
