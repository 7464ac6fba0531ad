"""IQ2_XXS, IQ2_XS and IQ2_S: 256 weights a block, groups of eight magnitudes from a grid.

Grid magnitudes are the bytes 8, 25 and 43. Every sub-block scale is
db = d * (0.5 + s) * 0.25 with s a 4-bit code; w = db * grid * sign.

IQ2_XXS, 66 bytes (2.0625 bpw), eight 8-byte groups of 32 weights after d fp16 (0-1):
  bytes 0-3 four grid indices (one byte each, eight weights each, into 256 entries);
  bytes 4-7 a little-endian uint32: four 7-bit sign indices into KSIGNS (bits 0-27)
  and s (bits 28-31).
IQ2_XS, 74 bytes (2.3125 bpw): d | 2-65 32 little-endian uint16, one per eight weights:
  a 9-bit grid index (bits 0-8, into 512 entries) and a 7-bit sign index (bits 9-15) |
  66-73 s per 16 weights, low nibble first.
IQ2_S, 82 bytes (2.5625 bpw): d | 2-33 grid index low 8 bits, one per eight weights |
  34-65 one sign bit per weight | 66-73 index bits 8-9: bits 2(g%4) of byte g/4 |
  74-81 s per 16 weights, low nibble first; 1024 grid entries.
Blocks are only 2-byte aligned: the uint32 words are assembled from bytes.
"""
from __future__ import annotations

import numpy as np

from .format import Format, chunked, digit_rows, f32_to_fp16_bytes, fp16_to_f32
from .iq2_tables import IQ2_S_GRID_LEVELS, IQ2_XS_GRID_LEVELS, IQ2_XXS_GRID_LEVELS
from .iq3 import BITS, KSIGNS, KSIGNS_F32, nearest
from .search.iq3 import signs_and_targets

QK_K = 256
LEVELS = np.array([8, 25, 43], dtype=np.uint8)


def _grid(levels_text: tuple[str, ...]) -> np.ndarray:
    return LEVELS[digit_rows(levels_text)]


# (256, 8), (512, 8) and (1024, 8) grid magnitudes, as the bytes of llama.cpp's uint64 grids.
XXS_GRID = _grid(IQ2_XXS_GRID_LEVELS)
XS_GRID = _grid(IQ2_XS_GRID_LEVELS)
S_GRID = _grid(IQ2_S_GRID_LEVELS)
_XXS_GRID_F32 = XXS_GRID.astype(np.float32)
_XS_GRID_F32 = XS_GRID.astype(np.float32)
_S_GRID_F32 = S_GRID.astype(np.float32)


def _db(d: np.ndarray, s: np.ndarray) -> np.ndarray:
    return d * (np.float32(0.5) + s.astype(np.float32)) * np.float32(0.25)


def _nibbles(b: np.ndarray) -> np.ndarray:
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)


# --- dequantization ---------------------------------------------------------------------

def xxs_sub_scales(b: np.ndarray) -> np.ndarray:
    """(n, 66) IQ2_XXS blocks -> (n, 8) float32 scales db, one per 32 weights."""
    words = np.ascontiguousarray(b[:, 2:]).view("<u4")                 # (n, 16)
    return _db(fp16_to_f32(b[:, :2]), words[:, 1::2] >> 28)


def xs_sub_scales(b: np.ndarray) -> np.ndarray:
    """(n, 74) IQ2_XS blocks -> (n, 16) float32 scales db, one per 16 weights."""
    return _db(fp16_to_f32(b[:, :2]), _nibbles(b[:, 66:74]))


def s_sub_scales(b: np.ndarray) -> np.ndarray:
    """(n, 82) IQ2_S blocks -> (n, 16) float32 scales db, one per 16 weights."""
    return _db(fp16_to_f32(b[:, :2]), _nibbles(b[:, 74:82]))


def _xxs_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    db = xxs_sub_scales(b)                                             # (n, 8)
    words = np.ascontiguousarray(b[:, 2:]).view("<u4").reshape(n, 8, 2)
    sidx = (words[:, :, 1, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 0x7F
    signs = KSIGNS_F32[sidx]                                          # (n, 8, 4, 8)
    gidx = np.ascontiguousarray(words[:, :, 0]).view(np.uint8).reshape(n, 8, 4)
    grid = _XXS_GRID_F32[gidx]                                         # (n, 8, 4, 8)
    return (db[:, :, None, None] * grid * signs).reshape(n, QK_K)


def _xs_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    db = xs_sub_scales(b)                                              # (n, 16)
    qs = np.ascontiguousarray(b[:, 2:66]).view("<u2")                  # (n, 32)
    signs = KSIGNS_F32[qs >> 9].reshape(n, 16, 2, 8)
    grid = _XS_GRID_F32[qs & 511].reshape(n, 16, 2, 8)
    return (db[:, :, None, None] * grid * signs).reshape(n, QK_K)


def _s_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    db = s_sub_scales(b)                                               # (n, 16)
    qh = (b[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
    idx = b[:, 2:34].astype(np.uint16) | (qh.reshape(n, 32).astype(np.uint16) << 8)
    grid = _S_GRID_F32[idx].reshape(n, 16, 2, 8)
    sbits = (b[:, 34:66, None] >> BITS) & 1                           # (n, 32, 8)
    signs = np.where(sbits, np.float32(-1), np.float32(1)).reshape(n, 16, 2, 8)
    return (db[:, :, None, None] * grid * signs).reshape(n, QK_K)


# --- quantization -----------------------------------------------------------------------
# The IQ3 search with groups of eight: per sub-block (32 or 16 weights) try a few scales,
# each with the nearest grid entry per group; keep the scale of least error; one fp16 d a
# block, a 4-bit multiplier a sub-block; then the grid entries again for the stored scale,
# so that every group ends on its nearest grid entry.

_SCALE_TRIES = np.linspace(0.75, 1.1, 8, dtype=np.float32)  # amax / (scale * top level)
_CHUNK = 64  # blocks per step: bounds the (groups x grid) cost matrices


def _iq2_search(x: np.ndarray, w: np.ndarray, grid: np.ndarray, sub: int, even_groups: bool):
    """Returns d (n,), multipliers s (n, 256/sub), grid indices (n, 32), minus bits (n, 256)."""
    n, nsub = x.shape[0], QK_K // sub
    neg, t = signs_and_targets(x, w, even_groups)
    t8 = t.reshape(n, nsub, sub // 8, 8)
    w8 = w.reshape(n, nsub, sub // 8, 8)
    top = np.float32(grid.max())
    amax = np.abs(t).reshape(n, nsub, sub).max(-1)
    best_err = np.full((n, nsub), np.inf, dtype=np.float32)
    best_scale = np.zeros((n, nsub), dtype=np.float32)
    shape = (n, nsub, sub // 8)
    for c in _SCALE_TRIES:
        scale = amax / (top * c)
        _, err = nearest(t8, w8, np.broadcast_to(scale[..., None], shape), grid)
        err = err.sum(-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
    # db = d * (1 + 2 s) / 8: the largest sub-block scale takes the largest multiplier, 31/8.
    d = np.minimum(best_scale.max(-1) * np.float32(8 / 31), np.float32(65504))
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(d16[:, None] > 0, np.rint((best_scale * 8 / d16[:, None] - 1) / 2), 0)
    s = np.clip(s, 0, 15).astype(np.uint8)
    db = _db(d16[:, None], s)
    idx, _ = nearest(t8, w8, np.broadcast_to(db[..., None], shape), grid)
    return d, s, idx.reshape(n, 32), neg




def _sign_indices(neg: np.ndarray) -> np.ndarray:
    """(n, 256) minus bits with even groups of eight -> (n, 32) 7-bit KSIGNS indices."""
    bits = neg.reshape(neg.shape[0], 32, 8)[..., :7].astype(np.uint32)
    return (bits << np.arange(7, dtype=np.uint32)).sum(-1)


def _xxs_quant(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, s, idx, neg = _iq2_search(x, w, XXS_GRID, 32, even_groups=True)
    sidx = _sign_indices(neg).reshape(n, 8, 4)
    sw = (sidx << np.array([0, 7, 14, 21], dtype=np.uint32)).sum(-1) | (s.astype(np.uint32) << 28)
    gw = idx.astype(np.uint8).reshape(n, 8, 4).view("<u4")[..., 0].astype(np.uint32)
    words = np.stack([gw, sw], axis=-1).reshape(n, 16).astype("<u4")
    return np.concatenate([f32_to_fp16_bytes(d[:, None]), words.view(np.uint8)], axis=-1)


def _xs_quant(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    d, s, idx, neg = _iq2_search(x, w, XS_GRID, 16, even_groups=True)
    qs = (idx.astype(np.uint16) | (_sign_indices(neg).astype(np.uint16) << 9)).astype("<u2")
    return np.concatenate([f32_to_fp16_bytes(d[:, None]), qs.view(np.uint8),
                           s[:, 0::2] | (s[:, 1::2] << 4)], axis=-1)


def _s_quant(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, s, idx, neg = _iq2_search(x, w, S_GRID, 16, even_groups=False)
    hi = (idx >> 8).astype(np.uint8).reshape(n, 8, 4) << np.array([0, 2, 4, 6], dtype=np.uint8)
    qh = hi[..., 0] | hi[..., 1] | hi[..., 2] | hi[..., 3]
    signs = np.packbits(neg.reshape(n, 32, 8), axis=-1, bitorder="little").reshape(n, 32)
    return np.concatenate([f32_to_fp16_bytes(d[:, None]), (idx & 0xFF).astype(np.uint8),
                           signs, qh, s[:, 0::2] | (s[:, 1::2] << 4)], axis=-1)


IQ2_XXS = Format("IQ2_XXS", 16, QK_K, 66, _xxs_dequant, chunked(_xxs_quant, 66, _CHUNK),
                 tables={"grid": XXS_GRID, "ksigns": KSIGNS}, scale_offsets=(0,))
IQ2_XS = Format("IQ2_XS", 17, QK_K, 74, _xs_dequant, chunked(_xs_quant, 74, _CHUNK),
                tables={"grid": XS_GRID, "ksigns": KSIGNS}, scale_offsets=(0,))
IQ2_S = Format("IQ2_S", 22, QK_K, 82, _s_dequant, chunked(_s_quant, 82, _CHUNK),
               tables={"grid": S_GRID}, scale_offsets=(0,))
