"""IQ3_XXS and IQ3_S: 256 weights a block, groups of four magnitudes from a 3-bit grid.

IQ3_XXS, 98 bytes (3.0625 bpw):
  0-1    d fp16
  2-65   64 grid indices, one byte each, into a 256-entry grid (four magnitudes each)
  66-97  8 little-endian uint32 words, one per 32 weights: four 7-bit sign indices
         (bits 0-27, one per 8 weights, into KSIGNS) and a 4-bit scale s (bits 28-31)
  w = d * (0.5 + s) * 0.5 * grid * sign; grid bytes are 4(2l+1) with 62 (not 60) on top.
IQ3_S, 110 bytes (3.4375 bpw):
  0-1 d fp16 | 2-65 grid index low 8 bits | 66-73 qh: bit 8 of index i is bit i%8 of
  byte i/8 | 74-105 one sign bit per weight | 106-109 a 4-bit scale per 32 weights
  (low nibble first)
  w = d * (1 + 2s) * grid * sign; grid values exactly 1, 3, ..., 15.
Blocks are only 2-byte aligned: the uint32 words are assembled from bytes.
"""
from __future__ import annotations

import numpy as np

from .format import Format, chunked, digit_rows, f32_to_fp16_bytes, fp16_to_f32
from .iq3_tables import IQ3_S_GRID_LEVELS, IQ3_XXS_GRID_LEVELS
from .search import IQ3Options, grid_tables, iq3_search

QK_K = 256

XXS_LEVELS = np.array([4, 12, 20, 28, 36, 44, 52, 62], dtype=np.uint8)
S_LEVELS = np.array([1, 3, 5, 7, 9, 11, 13, 15], dtype=np.uint8)


def _grid(levels_text: tuple[str, ...], levels: np.ndarray) -> np.ndarray:
    return levels[digit_rows(levels_text)]


# (256, 4) and (512, 4) grid magnitudes, as the bytes llama.cpp's uint32 grids hold.
XXS_GRID = _grid(IQ3_XXS_GRID_LEVELS, XXS_LEVELS)
S_GRID = _grid(IQ3_S_GRID_LEVELS, S_LEVELS)


def _parity(i: np.ndarray) -> np.ndarray:
    return (np.unpackbits(np.asarray(i, dtype=np.uint8)[..., None], axis=-1).sum(-1) & 1).astype(np.int64)


# ksigns_iq2xs: 7 sign bits and their parity as the 8th, so every group of 8 has an even
# number of minus signs.
KSIGNS = (np.arange(128) | (_parity(np.arange(128)) << 7)).astype(np.uint8)
BITS = np.arange(8, dtype=np.uint8)
# KSIGNS expanded to +-1.0 per weight: (128, 8)
KSIGNS_F32 = np.where((KSIGNS[:, None] >> BITS) & 1, np.float32(-1), np.float32(1))
_XXS_GRID_F32 = XXS_GRID.astype(np.float32)
_S_GRID_F32 = S_GRID.astype(np.float32)


# --- dequantization ---------------------------------------------------------------------

def xxs_sub_scales(b: np.ndarray) -> np.ndarray:
    """(n, 98) IQ3_XXS blocks -> (n, 8) float32 scales db, one per 32 weights."""
    d = fp16_to_f32(b[:, :2])                                          # (n, 1)
    words = np.ascontiguousarray(b[:, 66:98]).view("<u4")              # (n, 8)
    return d * (np.float32(0.5) + (words >> 28).astype(np.float32)) * np.float32(0.5)


def s_sub_scales(b: np.ndarray) -> np.ndarray:
    """(n, 110) IQ3_S blocks -> (n, 8) float32 scales db, one per 32 weights."""
    d = fp16_to_f32(b[:, :2])
    sc = b[:, 106:110]
    s = np.stack([sc & 0x0F, sc >> 4], axis=-1).reshape(b.shape[0], 8)
    return d * (1 + 2 * s).astype(np.float32)


def _xxs_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    db = xxs_sub_scales(b)
    words = np.ascontiguousarray(b[:, 66:98]).view("<u4")              # (n, 8)
    sidx = (words[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 0x7F
    signs = KSIGNS_F32[sidx]                                          # (n, 8, 4, 8)
    grid = _XXS_GRID_F32[b[:, 2:66]].reshape(n, 8, 4, 8)
    return (db[:, :, None, None] * grid * signs).reshape(n, QK_K)


def _s_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    db = s_sub_scales(b)                                               # (n, 8)
    qh = (b[:, 66:74, None] >> BITS) & 1                              # (n, 8, 8)
    idx = b[:, 2:66].astype(np.uint16) | (qh.reshape(n, 64).astype(np.uint16) << 8)
    grid = _S_GRID_F32[idx].reshape(n, 8, 4, 8)
    sbits = (b[:, 74:106, None] >> BITS) & 1                          # (n, 32, 8)
    signs = np.where(sbits, np.float32(-1), np.float32(1)).reshape(n, 8, 4, 8)
    return (db[:, :, None, None] * grid * signs).reshape(n, QK_K)


# --- quantization -----------------------------------------------------------------------
# llama.cpp's search plus a refinement of d and the codes: see quant/search/iq3.py.

# The nearest grid entry by exhaustive search, which the IQ2 and IQ1 searches use.

def nearest(t: np.ndarray, w: np.ndarray, scale: np.ndarray, grid: np.ndarray):
    """Grid entry minimising sum w (t - scale*g)^2 for each group of four.

    t, w: (..., 4); scale broadcastable to t[..., 0]. Returns (index, error)."""
    g = grid.astype(np.float32)
    cross = (w * t) @ g.T                         # (..., G)
    quad = w @ (g * g).T                          # (..., G)
    s = scale[..., None]
    cost = s * s * quad - 2 * s * cross
    idx = cost.argmin(axis=-1)
    err = np.take_along_axis(cost, idx[..., None], -1)[..., 0] + (w * t * t).sum(-1)
    return idx, err


# The search's tables, built at the first quantization (half a second: not at import).
def _xxs_tables():
    return grid_tables(np.searchsorted(XXS_LEVELS, XXS_GRID), top=15.5)  # cached by grid_tables


def _s_tables():
    return grid_tables(np.searchsorted(S_LEVELS, S_GRID))


XXS_OPTIONS = IQ3Options(n_scales=15, parity=True, fudge=1.0125, eps=1e-8,
                         d_factors=(0.98, 0.99, 1.0, 1.025, 1.04, 1.06))
S_OPTIONS = IQ3Options(n_scales=9, fudge=1.033, d_factors=(1.0, 1.015, 1.05, 1.07))
_CHUNK = 1024  # blocks per step: bounds the search's temporaries to a few tens of MiB


def _xxs_quant(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, s, idx, neg = iq3_search(x, w, _xxs_tables(), XXS_OPTIONS)
    bits = neg.reshape(n, 8, 4, 8)[..., :7].astype(np.uint32)          # 7 stored bits a group
    sidx = (bits << np.arange(7, dtype=np.uint32)).sum(-1)              # (n, 8, 4)
    words = (sidx << np.array([0, 7, 14, 21], dtype=np.uint32)).sum(-1) | (s.astype(np.uint32) << 28)
    return np.concatenate([f32_to_fp16_bytes(d[:, None]), idx.astype(np.uint8),
                           words.astype("<u4").view(np.uint8)], axis=-1)


def _s_quant(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, s, idx, neg = iq3_search(x, w, _s_tables(), S_OPTIONS)
    qh = np.packbits((idx >> 8).astype(np.uint8).reshape(n, 8, 8), axis=-1, bitorder="little")
    signs = np.packbits(neg.reshape(n, 32, 8), axis=-1, bitorder="little")
    scales = s[:, 0::2] | (s[:, 1::2] << 4)
    return np.concatenate([f32_to_fp16_bytes(d[:, None]), (idx & 0xFF).astype(np.uint8),
                           qh.reshape(n, 8), signs.reshape(n, 32), scales], axis=-1)


IQ3_XXS = Format("IQ3_XXS", 18, QK_K, 98, _xxs_dequant, chunked(_xxs_quant, 98, _CHUNK, ones_for_none=False),
                 tables={"grid": XXS_GRID, "ksigns": KSIGNS}, scale_offsets=(0,))
IQ3_S = Format("IQ3_S", 21, QK_K, 110, _s_dequant, chunked(_s_quant, 110, _CHUNK, ones_for_none=False),
               tables={"grid": S_GRID}, scale_offsets=(0,))
