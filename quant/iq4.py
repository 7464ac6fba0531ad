"""IQ4_NL: 32 weights in 18 bytes, a non-linear 4-bit code.

Layout: d fp16 | 16 B nibbles (byte i: weight i low, weight i + 16 high); w = d * KVALUES[q].
The 16 values are not symmetric: -127 at the bottom, 113 at the top.
Both formats quantize with llama.cpp's scale search (quant/search/iq4.py).
"""
from __future__ import annotations

import numpy as np

from .format import Format, chunked, f32_to_fp16_bytes, fp16_to_f32
from .legacy import pack_nibbles, unpack_nibbles

QK = 32
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   dtype=np.int8)


def _dequant(b: np.ndarray) -> np.ndarray:
    d = fp16_to_f32(b[:, :2])
    return d * KVALUES[unpack_nibbles(b[:, 2:])].astype(np.float32)


def _quant(x: np.ndarray, w) -> np.ndarray:
    from .search.iq4 import search  # the search imports KVALUES from here
    d, _, q = search(x, w, KVALUES)
    return np.concatenate([f32_to_fp16_bytes(d[:, None]), pack_nibbles(q)], axis=-1)


IQ4_NL = Format("IQ4_NL", 20, QK, 18, _dequant, chunked(_quant, 18, 8192, ones_for_none=False), tables={"kvalues": KVALUES},
                scale_offsets=(0,))


# --- IQ4_XS -----------------------------------------------------------------------------
# 256 weights in 136 bytes (4.25 bpw), eight sub-blocks of 32 with a 6-bit scale each:
#   0-1 d fp16 | 2-3 scales_h: bits 2i, 2i+1 are the top two bits of scale i | 4-7 scales_l:
#   the low nibble of scale i is nibble i%2 of byte 4 + i/2 | 8-135 nibbles, 16 bytes a
#   sub-block laid out as IQ4_NL's.
#   w = (d * (ls - 32)) * KVALUES[q], ls the 6-bit scale.

QK_K = 256


def xs_sub_scales(b: np.ndarray) -> np.ndarray:
    """(n, 136) IQ4_XS blocks -> (n, 8) float32 scales dl = d * (ls - 32)."""
    d = fp16_to_f32(b[:, :2])
    sh = np.ascontiguousarray(b[:, 2:4]).view("<u2")                     # (n, 1)
    hi = ((sh >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    lo = np.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], axis=-1).reshape(-1, 8)
    ls = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    return d * ls.astype(np.float32)


def _xs_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = xs_sub_scales(b)                                                # (n, 8)
    q = unpack_nibbles(b[:, 8:].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl[:, :, None] * KVALUES[q].astype(np.float32)).reshape(n, QK_K)


def _xs_quant(x: np.ndarray, w) -> np.ndarray:
    from .search.iq4 import search
    n = x.shape[0]
    d, ls, q = search(x, w, KVALUES)
    sh = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    sl = (ls[:, 0::2] & 0x0F) | ((ls[:, 1::2] & 0x0F) << 4)
    return np.concatenate([f32_to_fp16_bytes(d[:, None]), sh[:, None].astype("<u2").view(np.uint8),
                           sl, pack_nibbles(q.reshape(n * 8, 32)).reshape(n, 128)], axis=-1)


IQ4_XS = Format("IQ4_XS", 23, QK_K, 136, _xs_dequant, chunked(_xs_quant, 136, 1024, ones_for_none=False), tables={"kvalues": KVALUES},
                scale_offsets=(0,))
