"""llama.cpp's IQ4_NL and IQ4_XS search (`quantize_row_iq4_nl_impl` with ntry = 7, as
`quantize_iq4_nl` and `quantize_iq4_xs` run it), vectorised over blocks of 32.

Per block of 32: weights w = x^2 (with an importance matrix: imp * sqrt(sigma2 + x^2),
sigma2 = 2 mean x^2 over the super-block); the scale that maps the extreme weight onto
-127 places every weight on its nearest value, then 15 scales map it onto -127 + k
(k = -7..7); each choice is scored by (sum w x q)^2 / sum w q^2 and the best one's
weighted least-squares scale kept. IQ4_NL stores that scale and places the weights
again at it. IQ4_XS codes the eight scales of a super-block as d (l - 32), l in 0..63,
with d = -(the scale of largest magnitude) / 32, and places the weights again at each
coded scale.

Sums run in index order over (32, S) columns and each product in llama.cpp's order, so
the blocks are ggml's to the bit (tests/quant/test_search.py holds a few against bytes
ggml wrote). quant/iq4.py's formats quantize with this search.
"""
from __future__ import annotations

import numpy as np

from ..format import column_extreme
from .kquants import EPS, _cols, _dot, _rows, _safe

F32 = np.float32
_SPAN = 300  # |2 v| beyond which every v takes an end value (the values stop at 127)


def _lut(kv: np.ndarray) -> np.ndarray:
    """Nearest-value index for every half-unit bin floor(2 v): the midpoints between the
    integer values are integers or halves, so no bin straddles one (ties go up, as
    llama.cpp's best_index_int8)."""
    lo = np.arange(-_SPAN, _SPAN, dtype=F32) / F32(2)
    return (lo[:, None] >= (kv[1:] + kv[:-1]) / F32(2)).sum(-1).astype(np.uint8)


def nearest(v: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """Index of the value nearest to each v."""
    b = np.floor(v * F32(2))
    np.clip(b, -_SPAN, _SPAN - 1, out=b)
    return np.take(lut, b.astype(np.int32) + _SPAN)   # np.take: twice fancy indexing's speed


def search(x: np.ndarray, importance: np.ndarray | None, kvalues: np.ndarray, ntry: int = 7):
    """(B, 32 k) float32 super-blocks -> (d (B,) float32, l (B, k) scale codes 0..63 or
    None where k = 1, q (B, 32 k) value indices uint8)."""
    b, n = x.shape
    k = n // 32
    kv = kvalues.astype(F32)
    lut = _lut(kv)
    xc = _cols(x, 32)
    if importance is None:
        w = xc * xc
    else:
        xt = np.ascontiguousarray(x.T)
        sigma2 = (xt * xt).sum(axis=0) * (F32(2) / F32(n))
        w = _cols(importance * np.sqrt(sigma2[:, None] + x * x), 32)
    mx = column_extreme(xc)
    zero = np.abs(mx) < EPS
    mxs = _safe(mx, zero)

    def fit(inv):
        q = np.take(kv, nearest(inv * xc, lut))
        wq = w * q
        return _dot(wq, xc), _dot(wq, q)

    sumqx, sumq2 = fit(F32(1) / ((-mxs) / kv[0]))
    d = np.where(sumq2 > 0, sumqx / _safe(sumq2, sumq2 <= 0), F32(0))
    best = d * sumqx
    for t in range(-ntry, ntry + 1):
        sumqx, sumq2 = fit(F32(t + int(kvalues[0])) / mxs)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / _safe(sumq2, ~better), d)
        best = np.where(better, d * sumqx, best)
    scales = np.where(zero, F32(0), d)
    if k == 1:
        inv = np.where(scales != 0, F32(1) / _safe(scales, scales == 0), F32(0))
        return scales, None, _rows(nearest(inv * xc, lut), b)
    s = scales.reshape(b, k)
    max_scale = s[np.arange(b), np.abs(s).argmax(axis=1)]
    dd = -max_scale / F32(32)
    inv = np.where(dd != 0, F32(1) / _safe(dd, dd == 0), F32(0))
    l = np.clip(np.rint(inv[:, None] * s), -32, 31)
    dl = (dd[:, None] * l).reshape(-1)
    idl = np.where(dl != 0, F32(1) / _safe(dl, dl == 0), F32(0))
    q = nearest(idl * xc, lut)
    return dd, (l + 32).astype(np.uint8), _rows(q, b)
