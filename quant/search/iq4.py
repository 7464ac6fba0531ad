"""llama.cpp's IQ4_NL search (`quantize_row_iq4_nl_impl` with ntry = 7), vectorised over
blocks of 32.

Per block: weights w = x^2 (with an importance matrix: imp * sqrt(sigma2 + x^2)); the
scale that maps the extreme weight onto 113, then 15 scales that map it onto -127 + k
(k = -7..7), each with every weight on its nearest value and the weighted least-squares
scale of that choice, scored by (sum w x q)^2 / sum w q^2; the weights are placed again
at the best scale.

quant/iq4.py's own quantizer maps the extreme weight onto -127 and stops there: on
SmolLM2 its 180 IQ4_NL tensors (all 576-column ones) err about 6% more than llama.cpp's
and the model stops answering "Paris"; with this search it answers as llama.cpp's file
does (tests/strata/test_quantize.py).
"""
from __future__ import annotations

import numpy as np

from ..format import f32_to_fp16_bytes
from ..iq4 import KVALUES
from ..legacy import pack_nibbles

F32 = np.float32
_KV = KVALUES.astype(F32)
_SPAN = 300  # |2 v| beyond which every v takes an end value (the values stop at 127)


def _lut() -> np.ndarray:
    """Nearest-value index for every half-unit bin floor(2 v): the midpoints between the
    integer values are integers or halves, so no bin straddles one (ties go up, as
    llama.cpp's best_index_int8)."""
    lo = np.arange(-_SPAN, _SPAN, dtype=F32) / F32(2)
    return (lo[:, None] >= (_KV[1:] + _KV[:-1]) / F32(2)).sum(-1).astype(np.uint8)


_LUT = _lut()


def nearest(v: np.ndarray) -> np.ndarray:
    """Index of the value nearest to each v."""
    b = np.floor(v * F32(2))
    np.clip(b, -_SPAN, _SPAN - 1, out=b)
    return _LUT[b.astype(np.int32) + _SPAN]


def search(x: np.ndarray, importance: np.ndarray | None, ntry: int = 7):
    """(n, 32) float32 -> scale d (n,) float32 and value indices (n, 32) uint8."""
    xx = x * x
    if importance is None:
        w = xx
    else:
        sigma2 = F32(2) * xx.sum(-1, keepdims=True) / F32(32)
        w = importance * np.sqrt(sigma2 + xx)
    wx = w * x
    imax = np.abs(x).argmax(-1)
    mx = np.take_along_axis(x, imax[:, None], -1)[:, 0]
    live = np.abs(mx) >= F32(1e-15)
    safe = np.where(live, mx, F32(1))

    def fit(inv):
        q = _KV[nearest(x * inv[:, None])]
        return np.einsum("ij,ij->i", wx, q), np.einsum("ij,ij->i", w * q, q)

    sqx, sq2 = fit(F32(127) / safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sq2 > 0, sqx / sq2, F32(0))
    best = d * sqx
    for k in range(-ntry, ntry + 1):
        sqx, sq2 = fit((F32(k) - F32(127)) / safe)
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.where(better, sqx / sq2, d)
        best = np.where(better, d * sqx, best)
    d = np.where(live, d, F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0))
    return d, nearest(x * inv[:, None])


def quantize_iq4_nl(x: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """(n, 32) float32 -> (n, 18) IQ4_NL blocks (d fp16, then the nibbles)."""
    d, q = search(x, importance)
    return np.concatenate([f32_to_fp16_bytes(d[:, None]), pack_nibbles(q)], axis=-1)
