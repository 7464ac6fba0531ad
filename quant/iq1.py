"""IQ1_S and IQ1_M: 256 weights a block, groups of eight ternary values from a grid.

Both index one grid of 2048 entries (eight values -1, 0 or 1 each) with 11 bits a group
of eight weights, and shift every value of a group by a delta of +-1/8:
w = dl * (grid + delta), dl = d * (2 s + 1) with s a 3-bit code.

IQ1_S, 50 bytes (1.5625 bpw): d fp16 (0-1) | 2-33 grid index low 8 bits, one per group |
  34-49 eight little-endian uint16, one per 32 weights: index bits 8-10 of its four
  groups (bits 3k..3k+2 for group k), s (bits 12-14), and the sign of delta (bit 15, set
  means -1/8) for all 32 weights.
IQ1_M, 56 bytes (1.75 bpw), no d field: 0-31 grid index low 8 bits | 32-47 one nibble per
  group (low nibble first): index bits 8-10 (bits 0-2) and the sign of that group's delta
  (bit 3) | 48-55 four little-endian uint16 words: s per 16 weights in bits 3k..3k+2
  (k = 0..3) of word i for sub-block 4i + k, and the top nibbles (bits 12-15) of words
  0, 1, 2, 3 are bits 0-3, 4-7, 8-11, 12-15 of the block's fp16 d.
"""
from __future__ import annotations

import numpy as np

from .format import Format, chunked, digit_rows, f32_to_fp16_bytes, fp16_to_f32
from .iq1_tables import IQ1_GRID_LEVELS
from .iq3 import nearest

QK_K = 256
DELTA = np.float32(0.125)

# (2048, 8) int8 values -1, 0, 1
GRID = digit_rows(IQ1_GRID_LEVELS).astype(np.int8) - np.int8(1)
_GRID_F32 = GRID.astype(np.float32)


# --- IQ1_M's fp16 scale, spread over the top nibbles of its scale words ---------------

def m_scale_bits(b: np.ndarray) -> np.ndarray:
    """(n, 56) IQ1_M blocks -> (n,) uint16: the bits of the fp16 d."""
    words = np.ascontiguousarray(b[:, 48:56]).view("<u2")               # (n, 4)
    return ((words >> 12) << np.array([0, 4, 8, 12], dtype=np.uint16)).sum(-1, dtype=np.uint16)


def m_scale(b: np.ndarray) -> np.ndarray:
    """(n, 56) IQ1_M blocks -> (n,) float16 d."""
    return m_scale_bits(b).view(np.float16)


def set_m_scale(b: np.ndarray, d: np.ndarray) -> None:
    """Write fp16 scales d (n,) into (n, 56) IQ1_M blocks in place; other bits are kept."""
    bits = np.asarray(d, dtype=np.float16).reshape(-1).view(np.uint16)
    words = np.ascontiguousarray(b[:, 48:56]).view("<u2").copy()
    nib = (bits[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0x0F
    words = (words & 0x0FFF) | (nib << 12).astype(np.uint16)
    b[:, 48:56] = words.astype("<u2").view(np.uint8)


# --- dequantization ---------------------------------------------------------------------

def _delta(minus: np.ndarray) -> np.ndarray:
    return np.where(minus, -DELTA, DELTA)


def s_sub_scales(b: np.ndarray) -> np.ndarray:
    """(n, 50) IQ1_S blocks -> (n, 8) float32 scales dl, one per 32 weights."""
    qh = np.ascontiguousarray(b[:, 34:50]).view("<u2")                   # (n, 8)
    return fp16_to_f32(b[:, :2]) * (2 * ((qh >> 12) & 7) + 1)


def m_sub_scales(b: np.ndarray) -> np.ndarray:
    """(n, 56) IQ1_M blocks -> (n, 16) float32 scales dl, one per 16 weights."""
    words = np.ascontiguousarray(b[:, 48:56]).view("<u2")                # (n, 4)
    s = ((words[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7).reshape(-1, 16)
    d = m_scale(b).astype(np.float32)[:, None]
    return d * (2 * s + 1)


def _s_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = s_sub_scales(b)                                                 # (n, 8)
    qh = np.ascontiguousarray(b[:, 34:50]).view("<u2")
    hi = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7  # (n, 8, 4)
    idx = b[:, 2:34].astype(np.uint16) | (hi.reshape(n, 32) << 8)
    delta = _delta(qh & 0x8000 != 0)                                     # (n, 8)
    grid = _GRID_F32[idx].reshape(n, 8, 32)
    return (dl[:, :, None] * (grid + delta[:, :, None])).reshape(n, QK_K)


def _m_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = m_sub_scales(b)                                                 # (n, 16)
    nib = np.stack([b[:, 32:48] & 0x0F, b[:, 32:48] >> 4], axis=-1).reshape(n, 32)
    idx = b[:, :32].astype(np.uint16) | ((nib & 7).astype(np.uint16) << 8)
    delta = _delta(nib & 8 != 0)                                         # (n, 32)
    grid = _GRID_F32[idx]                                                # (n, 32, 8)
    vals = (grid + delta[:, :, None]).reshape(n, 16, 16)
    return (dl[:, :, None] * vals).reshape(n, QK_K)


# --- quantization -----------------------------------------------------------------------
# A scale search as for the IQ2/IQ3 formats, over the grid shifted by each delta: per
# sub-block try a few scales, each with the nearest (entry, delta) per group of eight
# (IQ1_S: one delta for the sub-block's 32 weights, the better of the two); one fp16 d a
# block, a 3-bit multiplier a sub-block (the best of three neighbours); then the entries
# and deltas again for the stored scale, so that every group ends on its nearest (entry,
# delta).

_SCALE_TRIES = np.linspace(0.5, 1.2, 8, dtype=np.float32)  # amax / (scale * 1.125)
_CHUNK = 32  # blocks per step: bounds the (groups x 4096) cost matrices to ~32 MiB
_SHIFTED = np.concatenate([_GRID_F32 + DELTA, _GRID_F32 - DELTA])        # (4096, 8)


def _choose(t8: np.ndarray, w8: np.ndarray, scale: np.ndarray, shared_delta: bool):
    """Entries and delta signs for groups t8 (n, nsub, k, 8) at scale (n, nsub).

    Returns index (n, nsub, k) into _SHIFTED (>= 2048: delta -1/8) and error (n, nsub)."""
    sc = np.broadcast_to(scale[..., None], t8.shape[:-1])
    if not shared_delta:
        idx, err = nearest(t8, w8, sc, _SHIFTED)
        return idx, err.sum(-1)
    ip, ep = nearest(t8, w8, sc, _SHIFTED[:2048])
    im, em = nearest(t8, w8, sc, _SHIFTED[2048:])
    ep, em = ep.sum(-1), em.sum(-1)
    minus = em < ep
    return np.where(minus[..., None], im + 2048, ip), np.where(minus, em, ep)


def _iq1_search(x: np.ndarray, w: np.ndarray, sub: int, shared_delta: bool):
    """Returns d (n,), multipliers s (n, 256/sub), entry indices (n, 32) < 2048 and delta
    signs (n, 32) (True: -1/8)."""
    n, nsub = x.shape[0], QK_K // sub
    t8 = x.reshape(n, nsub, sub // 8, 8)
    w8 = w.reshape(n, nsub, sub // 8, 8)
    amax = np.abs(x).reshape(n, nsub, sub).max(-1)
    best_err = np.full((n, nsub), np.inf, dtype=np.float32)
    best_scale = np.zeros((n, nsub), dtype=np.float32)
    for c in _SCALE_TRIES:
        scale = amax / (np.float32(1.125) * c)
        _, err = _choose(t8, w8, scale, shared_delta)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
    # dl = d * (2 s + 1): the largest sub-block scale takes the largest multiplier, 15.
    d = np.minimum(best_scale.max(-1) / np.float32(15), np.float32(65504))
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(d16[:, None] > 0, np.rint((best_scale / d16[:, None] - 1) / 2), 0)
    # Each sub-block then takes the best of the multipliers s - 1, s, s + 1 by its error at
    # the stored scale: rounding the scale to an odd multiple of d moves it up to 1/3 off
    # (s = 1), and the neighbour often fits the grid better. On the row sets of
    # scripts/quant_rmse_limits.py this lowers IQ1_S's error 5-8% for a fifth more time.
    s = np.clip(s, 0, 7)
    best_idx = best_err = None
    for step in (0, -1, 1):
        si = np.clip(s + step, 0, 7).astype(np.uint16)
        idx, err = _choose(t8, w8, d16[:, None] * (2 * si + 1), shared_delta)
        if best_idx is None:
            best_idx, best_err, best_s = idx, err, si
            continue
        better = err < best_err
        best_idx = np.where(better[..., None], idx, best_idx)
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, si, best_s)
    idx = best_idx.reshape(n, 32)
    return d16, best_s, idx % 2048, idx >= 2048




def _s_quant(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, s, idx, minus = _iq1_search(x, w, 32, shared_delta=True)
    hi = (idx >> 8).astype(np.uint16).reshape(n, 8, 4) << np.array([0, 3, 6, 9], dtype=np.uint16)
    qh = hi.sum(-1, dtype=np.uint16) | (s << 12) | (minus.reshape(n, 8, 4)[..., 0].astype(np.uint16) << 15)
    return np.concatenate([f32_to_fp16_bytes(d[:, None]), (idx & 0xFF).astype(np.uint8),
                           qh.astype("<u2").view(np.uint8)], axis=-1)


def _m_quant(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, s, idx, minus = _iq1_search(x, w, 16, shared_delta=False)
    nib = ((idx >> 8) | (minus.astype(idx.dtype) << 3)).astype(np.uint8)  # (n, 32)
    words = (s.reshape(n, 4, 4) << np.array([0, 3, 6, 9], dtype=np.uint16)).sum(-1, dtype=np.uint16)
    out = np.concatenate([(idx & 0xFF).astype(np.uint8), nib[:, 0::2] | (nib[:, 1::2] << 4),
                          words.astype("<u2").view(np.uint8)], axis=-1)
    set_m_scale(out, d)
    return out


IQ1_S = Format("IQ1_S", 19, QK_K, 50, _s_dequant, chunked(_s_quant, 50, _CHUNK),
               tables={"grid": GRID}, scale_offsets=(0,))
IQ1_M = Format("IQ1_M", 29, QK_K, 56, _m_dequant, chunked(_m_quant, 56, _CHUNK),
               tables={"grid": GRID}, read_scale=m_scale, write_scale=set_m_scale)
