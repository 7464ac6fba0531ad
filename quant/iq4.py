"""IQ4_NL: 32 weights in 18 bytes, a non-linear 4-bit code.

Layout: d fp16 | 16 B nibbles (byte i: weight i low, weight i + 16 high); w = d * KVALUES[q].
The 16 values are not symmetric: -127 at the bottom, 113 at the top.
"""
from __future__ import annotations

import numpy as np

from .format import Format, f32_to_fp16_bytes, fp16_to_f32
from .legacy import pack_nibbles, unpack_nibbles

QK = 32
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   dtype=np.int8)


def _dequant(b: np.ndarray) -> np.ndarray:
    d = fp16_to_f32(b[:, :2])
    return d * KVALUES[unpack_nibbles(b[:, 2:])].astype(np.float32)


def _nearest_code(r: np.ndarray) -> np.ndarray:
    """Index of the KVALUES entry nearest to each r (ties to the lower entry)."""
    kv = KVALUES.astype(np.float32)
    mid = (kv[1:] + kv[:-1]) / 2  # decision boundaries between neighbours
    return np.searchsorted(mid, r, side="left").astype(np.uint8)


def _quant(x: np.ndarray, w) -> np.ndarray:
    # Scale-exact quantizer: the weight of largest magnitude maps to -127 exactly, the
    # rest to the nearest value. No scale search (llama.cpp tries several scales); in
    # exchange a second round trip provably changes nothing (tests/quant/test_roundtrip.py).
    imax = np.abs(x).argmax(axis=-1)[:, None]
    d = np.take_along_axis(x, imax, axis=-1) / np.float32(-127)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(d == 0, np.float32(0), x / d)
    q = _nearest_code(r)
    return np.concatenate([f32_to_fp16_bytes(d), pack_nibbles(q)], axis=-1)


IQ4_NL = Format("IQ4_NL", 20, QK, 18, _dequant, _quant, tables={"kvalues": KVALUES},
                scale_offsets=(0,))
