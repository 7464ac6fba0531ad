"""The K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, 256 weights a block in sub-blocks.

Layouts (little-endian, byte offsets), with j the weight's index in the block:
  Q2_K   84 B: 0-15 scales (sub-block i of 16: scale nibble sc = low, min nibble m = high)
               | 16-79 qs | 80-81 d fp16 | 82-83 dmin fp16
               2-bit q of weight j: byte 16 + 32 (j // 128) + j % 32, bits 2 ((j % 128) // 32)
               w = (d * sc) * q - (dmin * m),  sub-block j // 16
  Q3_K  110 B: 0-31 hmask | 32-95 qs | 96-107 scales | 108-109 d fp16
               low two bits as Q2_K's (from byte 32 + ...); high bit hb = bit j // 32 of
               hmask byte j % 32; q = low - 4 (1 - hb) in -4..3
               6-bit scale of sub-block i (of 16): low nibble = nibble i // 8 of byte 96 + i % 8,
               top two bits = bits 2 (i // 4) of byte 104 + i % 4
               w = (d * (sc - 32)) * q,  sub-block j // 16
  Q4_K  144 B: 0-1 d | 2-3 dmin | 4-15 scales (8 six-bit scales sc and mins m, below)
               | 16-143 qs: nibble (j // 32) % 2 of byte 16 + 32 (j // 64) + j % 32
               w = (d * sc) * q - (dmin * m),  sub-block j // 32
  Q5_K  176 B: as Q4_K, with 16-47 qh and the nibbles at 48-175; the fifth bit of weight j
               is bit j // 32 of qh byte j % 32.
  Q6_K  210 B: 0-127 ql | 128-191 qh | 192-207 int8 scales | 208-209 d fp16
               low nibble: nibble (j % 128) // 64 of byte 64 (j // 128) + j % 64;
               top two bits: bits 2 ((j % 128) // 32) of byte 128 + 32 (j // 128) + j % 32
               w = (d * sc) * (q - 32),  sub-block j // 16
Q4_K/Q5_K scale bytes s[0..11], sub-block i < 4: sc = s[i] & 63, m = s[i + 4] & 63;
i >= 4: sc = (s[i + 4] & 15) | ((s[i - 4] >> 6) << 4), m = (s[i + 4] >> 4) | ((s[i] >> 6) << 4).

The quantizers are llama.cpp's (quantize_row_q*_K_ref, and quantize_row_q*_K_impl with an
importance), searches vectorised over a chunk's sub-blocks in quant/search/kquants.py; the
bytes are ggml's, block for block (tests/quant/test_search.py). Each ends with every weight
on its nearest code under the stored scales; the error bounds are in
tests/quant/test_roundtrip.py.
"""
from __future__ import annotations

import numpy as np

from .format import Format, chunked, f32_to_fp16_bytes, fp16_to_f32
from .search import kquants as search

QK_K = 256
CHUNK = 1024  # super-blocks a search step holds (1 MiB a float32 temporary)


def _shifts(n: int, step: int) -> np.ndarray:
    return (step * np.arange(n, dtype=np.uint8)).reshape(1, 1, n, 1)


def _crumbs(b: np.ndarray) -> np.ndarray:
    """(n, 64) bytes -> (n, 256) 2-bit fields: weight j is bits 2 ((j % 128) // 32) of byte
    32 (j // 128) + j % 32."""
    n = b.shape[0]
    return ((b.reshape(n, 2, 1, 32) >> _shifts(4, 2)) & 3).reshape(n, QK_K)


# The packers work on eight codes at once, as uint64 words of the (n, 256) uint8 codes:
# numpy's shifts and ors over rows of 8 to 64 bytes cost per element, so eight times less.
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


def _words(q: np.ndarray, *shape: int) -> np.ndarray:
    """(n, 256) codes of 0..255 -> their uint64 words (n, *shape), eight codes a word."""
    q = np.ascontiguousarray(q, dtype=np.uint8)
    return q.view(np.uint64).reshape(q.shape[0], *shape)


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    """(n, 256) values 0..3 -> (n, 64) bytes, the inverse of `_crumbs`."""
    w = _words(q, 2, 4, 4)                      # (n, 128-weight half, crumb k, word)
    out = w[:, :, 0] | (w[:, :, 1] << np.uint64(2)) | (w[:, :, 2] << np.uint64(4)) | (w[:, :, 3] << np.uint64(6))
    return out.view(np.uint8).reshape(q.shape[0], 64)


def _bits(b: np.ndarray) -> np.ndarray:
    """(n, 32) bytes -> (n, 256) bits: weight j is bit j // 32 of byte j % 32."""
    n = b.shape[0]
    return ((b.reshape(n, 1, 1, 32) >> _shifts(8, 1)) & 1).reshape(n, QK_K)


def _pack_bits(q: np.ndarray) -> np.ndarray:
    """(n, 256) values 0..1 -> (n, 32) bytes, the inverse of `_bits`."""
    w = _words(q, 8, 4)                         # (n, bit k, word)
    out = w[:, 0].copy()
    for k in range(1, 8):
        out |= w[:, k] << np.uint64(k)
    return out.view(np.uint8).reshape(q.shape[0], 32)


def _nibbles64(b: np.ndarray, width: int) -> np.ndarray:
    """(n, 128) bytes -> (n, 256) nibbles: runs of `width` weights alternate low, high."""
    n = b.shape[0]
    return ((b.reshape(n, -1, 1, width) >> _shifts(2, 4)) & 0x0F).reshape(n, QK_K)


def _pack_nibbles64(q: np.ndarray, width: int) -> np.ndarray:
    """(n, 256) values (their low nibbles) -> (n, 128) bytes, the inverse of `_nibbles64`."""
    w = _words(q, -1, 2, width // 8) & _LOW_NIBBLES
    out = w[:, :, 0] | (w[:, :, 1] << np.uint64(4))
    return out.view(np.uint8).reshape(q.shape[0], 128)


def k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) Q4_K/Q5_K scale bytes -> sc (n, 8), m (n, 8), uint8 values 0..63."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, m


def pack_k_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    a = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    b = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([a, b, c], axis=-1)


def q3_k_scales(s: np.ndarray) -> np.ndarray:
    """(n, 12) Q3_K scale bytes -> (n, 16) six-bit scales 0..63 (stored with +32)."""
    lo = (s[:, None, :8] >> _shifts(2, 4)[0]) & 0x0F                   # (n, 2, 8)
    hi = (s[:, None, 8:] >> _shifts(4, 2)[0]) & 0x03                   # (n, 4, 4)
    return lo.reshape(-1, 16) | (hi.reshape(-1, 16) << 4)


def pack_q3_k_scales(sc: np.ndarray) -> np.ndarray:
    sc = sc.astype(np.uint8)
    lo = (sc[:, :8] & 0x0F) | ((sc[:, 8:] & 0x0F) << 4)
    hi = ((sc >> 4) & 3).reshape(-1, 4, 4) << _shifts(4, 2)[0]          # (n, 4 shifts, 4)
    return np.concatenate([lo, hi.sum(axis=1, dtype=np.uint8)], axis=-1)


# --- packing from codes ------------------------------------------------------------------
# d, dmin: (n,) or (n, 1) float32, rounded to fp16 on packing.

def pack_q2_k(d, dmin, sc, m, q) -> np.ndarray:
    """sc, m: (n, 16) 0..15; q: (n, 256) 0..3."""
    scales = (sc.astype(np.uint8) & 0x0F) | (m.astype(np.uint8) << 4)
    return np.concatenate([scales, _pack_crumbs(q), _f16(d), _f16(dmin)], axis=-1)


def pack_q3_k(d, sc, q) -> np.ndarray:
    """sc: (n, 16) 0..63 (the scale plus 32); q: (n, 256) -4..3."""
    q = q.astype(np.int8)
    return np.concatenate([_pack_bits(q >= 0), _pack_crumbs(q & 3),
                           pack_q3_k_scales(sc), _f16(d)], axis=-1)


def pack_q4_k(d, dmin, sc, m, q) -> np.ndarray:
    """sc, m: (n, 8) 0..63; q: (n, 256) 0..15."""
    return np.concatenate([_f16(d), _f16(dmin), pack_k_scale_min(sc, m),
                           _pack_nibbles64(q, 32)], axis=-1)


def pack_q5_k(d, dmin, sc, m, q) -> np.ndarray:
    """sc, m: (n, 8) 0..63; q: (n, 256) 0..31."""
    q = q.astype(np.uint8)
    return np.concatenate([_f16(d), _f16(dmin), pack_k_scale_min(sc, m),
                           _pack_bits(q >> 4), _pack_nibbles64(q, 32)], axis=-1)


def pack_q6_k(d, sc, q) -> np.ndarray:
    """sc: (n, 16) int8; q: (n, 256) 0..63 (the value plus 32)."""
    q = q.astype(np.uint8)
    return np.concatenate([_pack_nibbles64(q, 64), _pack_crumbs(q >> 4),
                           sc.astype(np.int8).view(np.uint8), _f16(d)], axis=-1)


def _f16(v) -> np.ndarray:
    return f32_to_fp16_bytes(np.asarray(v, dtype=np.float32).reshape(-1, 1))


# --- dequantization ----------------------------------------------------------------------

def _q2_k_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = fp16_to_f32(b[:, 80:82]), fp16_to_f32(b[:, 82:84])
    dl = (d * (b[:, :16] & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (b[:, :16] >> 4).astype(np.float32))[:, :, None]
    q = _crumbs(b[:, 16:80]).astype(np.float32).reshape(n, 16, 16)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = fp16_to_f32(b[:, 108:110])
    sc = (q3_k_scales(b[:, 96:108]).astype(np.int8) - np.int8(32)).astype(np.float32)
    dl = (d * sc)[:, :, None]
    q = _crumbs(b[:, 32:96]).astype(np.int8) - (((_bits(b[:, :32]) ^ 1) << 2).astype(np.int8))
    return (dl * q.astype(np.float32).reshape(n, 16, 16)).reshape(n, QK_K)


def _k_dequant(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = fp16_to_f32(b[:, 0:2]), fp16_to_f32(b[:, 2:4])
    sc, m = k_scale_min(b[:, 4:16])
    dl = (d * sc.astype(np.float32))[:, :, None]
    ml = (dmin * m.astype(np.float32))[:, :, None]
    return (dl * q.astype(np.float32).reshape(n, 8, 32) - ml).reshape(n, QK_K)


def _q4_k_dequant(b: np.ndarray) -> np.ndarray:
    return _k_dequant(b, _nibbles64(b[:, 16:144], 32))


def _q5_k_dequant(b: np.ndarray) -> np.ndarray:
    return _k_dequant(b, _nibbles64(b[:, 48:176], 32) | (_bits(b[:, 16:48]) << 4))


def _q6_k_dequant(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = fp16_to_f32(b[:, 208:210])
    dl = (d * b[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]
    q = (_nibbles64(b[:, :128], 64) | (_crumbs(b[:, 128:192]) << 4)).astype(np.int8) - np.int8(32)
    return (dl * q.astype(np.float32).reshape(n, 16, 16)).reshape(n, QK_K)


# --- quantization ------------------------------------------------------------------------

def _q2_k_quant(x: np.ndarray, w, cols: bool = False) -> np.ndarray:
    return pack_q2_k(*search.q2_k(x, w, cols))


def _q3_k_quant(x: np.ndarray, w, cols: bool = False) -> np.ndarray:
    d, sc, q = search.q3_k(x, w, cols)
    return pack_q3_k(d, sc, q.astype(np.int8) - np.int8(4))


def _q4_k_quant(x: np.ndarray, w, cols: bool = False) -> np.ndarray:
    return pack_q4_k(*search.q4_k(x, w, cols))


def _q5_k_quant(x: np.ndarray, w, cols: bool = False) -> np.ndarray:
    return pack_q5_k(*search.q5_k(x, w, cols))


def _q6_k_quant(x: np.ndarray, w, cols: bool = False) -> np.ndarray:
    return pack_q6_k(*search.q6_k(x, w, cols))


def _format(name: str, type_id: int, block_bytes: int, dequant, quant, scale_offsets) -> Format:
    """A K-quant; it also takes a legacy source's 32-weight columns (Format.requantize)."""
    return Format(name, type_id, QK_K, block_bytes, dequant,
                  chunked(quant, block_bytes, CHUNK, ones_for_none=False), scale_offsets=scale_offsets,
                  quantize_cols=lambda c: quant(c, None, cols=True))


Q2_K = _format("Q2_K", 10, 84, _q2_k_dequant, _q2_k_quant, (80, 82))
Q3_K = _format("Q3_K", 11, 110, _q3_k_dequant, _q3_k_quant, (108,))
Q4_K = _format("Q4_K", 12, 144, _q4_k_dequant, _q4_k_quant, (0, 2))
Q5_K = _format("Q5_K", 13, 176, _q5_k_dequant, _q5_k_quant, (0, 2))
Q6_K = _format("Q6_K", 14, 210, _q6_k_dequant, _q6_k_quant, (208,))
