"""llama.cpp's IQ3 quantizer, one block and one group at a time, as its C loops read
(`quantize_row_iq3_xxs_impl`, `quantize_row_iq3_s_impl`, `iq3_find_best_neighbour`).

Slow and plain on purpose: the tests hold the vectorised search in `iq3.py` against it.
Returns the same fields as `iq3.search` (d, codes, grid entries, minus signs).
"""
from __future__ import annotations

import numpy as np

from .grid import GridTables

F32 = np.float32


def _best_neighbour(tab: GridTables, u: int, xval, weight, scale) -> int:
    best, bi = np.inf, -1
    for j in tab.neighbours[u, :tab.n_neighbours[u]]:
        g = (2 * tab.level_index[j] + 1).astype(F32)   # llama.cpp fits the odd levels 1..15
        d2 = float((weight * (scale * g - xval) ** 2).sum())
        if d2 < best:
            best, bi = d2, int(j)
    return bi


def _round_point(xval4, inv) -> int:
    l = np.clip(np.rint(F32(0.5) * (F32(inv) * xval4 - F32(1))), 0, 7).astype(int)
    return int(l[0] | l[1] << 3 | l[2] << 6 | l[3] << 9)


def quantize_block(x: np.ndarray, imp: np.ndarray | None, tab: GridTables, parity: bool,
                   n_scales: int, fudge: float, eps: float):
    """One block of 256 weights: (d float32, codes (8,), grid entries (64,), minus signs (256,))."""
    x = x.astype(F32)
    sigma2 = F32(2) * (x * x).sum() / F32(256)
    scales = np.zeros(8, F32)
    entries = np.zeros(64, np.int64)
    neg = x < 0
    for ib in range(8):
        xb = x[32 * ib:32 * ib + 32]
        weight = xb * xb if imp is None else imp[32 * ib:32 * ib + 32] * np.sqrt(sigma2 + xb * xb)
        waux = np.sqrt(weight)
        xval = np.abs(xb)
        if parity:
            for k in range(4):
                sl = slice(8 * k, 8 * k + 8)
                if neg[32 * ib:32 * ib + 32][sl].sum() % 2:
                    imin = int(np.argmin(weight[sl] * xb[sl] * xb[sl]))
                    xval[8 * k + imin] = -xval[8 * k + imin]
                    neg[32 * ib + 8 * k + imin] ^= True
        mx = xval.max()
        ent = np.full(8, tab.index[0])
        if mx <= eps:
            entries[8 * ib:8 * ib + 8] = ent
            continue
        best, scale = F32(0), mx / F32(15)
        on_grid = np.full(8, parity)
        for k in range(-n_scales, n_scales + 1):
            inv = (F32(15) + F32(k) * F32(0.2)) / mx
            aux, aux_on = np.zeros(8, np.int64), np.zeros(8, bool)
            for g in range(8):
                u = _round_point(xval[4 * g:4 * g + 4], inv)
                gi = tab.index[u]
                aux_on[g] = gi >= 0
                if gi < 0:
                    gi = _best_neighbour(tab, u, xval[4 * g:4 * g + 4], waux[4 * g:4 * g + 4], F32(1) / inv)
                aux[g] = gi
            q = (2 * tab.level_index[aux].reshape(32) + 1).astype(F32)
            sumqx, sumq2 = (weight * xval * q).sum(), (weight * q * q).sum()
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                ent, on_grid = aux, aux_on
        if not on_grid.all() and scale > 0:
            for g in range(8):
                if parity and on_grid[g]:
                    continue
                u = _round_point(xval[4 * g:4 * g + 4], F32(1) / scale)
                gi = tab.index[u]
                if gi < 0:
                    gi = _best_neighbour(tab, u, xval[4 * g:4 * g + 4], waux[4 * g:4 * g + 4], scale)
                ent[g] = gi
            q = (2 * tab.level_index[ent].reshape(32) + 1).astype(F32)
            sumqx, sumq2 = (weight * xval * q).sum(), (weight * q * q).sum()
            if sumq2 > 0:
                scale = sumqx / sumq2
        if scale < 0:
            scale = -scale
            neg[32 * ib:32 * ib + 32] ^= True
        scales[ib] = scale
        entries[8 * ib:8 * ib + 8] = ent
    max_scale = scales.max()
    if max_scale == 0:
        return F32(0), np.zeros(8, np.uint8), entries, neg
    d = max_scale / F32(31)
    codes = np.clip(np.rint(F32(0.5) * (scales / d - F32(1))), 0, 15).astype(np.uint8)
    d16 = F32(np.float16(d * F32(fudge)))
    return d16, codes, entries, neg
