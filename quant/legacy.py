"""The legacy 32-weight formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.

Layouts (little-endian, 2-byte aligned):
  Q8_0  34 B: d fp16 | 32 x int8 q                          w = d * q
  Q4_0  18 B: d fp16 | 16 B nibbles                         w = d * (q - 8)
  Q4_1  20 B: d fp16 | m fp16 | 16 B nibbles                w = d * q + m
  Q5_0  22 B: d fp16 | qh u32 | 16 B nibbles                w = d * (q - 16)
  Q5_1  24 B: d fp16 | m fp16 | qh u32 | 16 B nibbles       w = d * q + m
Nibbles: byte i holds weight i in its low half and weight i + 16 in its high half. Q5's
fifth bit of weight i is bit i of the little-endian u32 qh.
The quantizers follow ggml's reference ones (quantize_row_q*_ref), so that their bytes
equal gguf-py's.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from .format import Format, f32_to_fp16_bytes, fp16_to_f32

QK = 32


def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) uint8 values 0..15 in weight order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..15 -> (n, 16) bytes."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _reciprocal(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _codes(q: np.ndarray, top: int) -> np.ndarray:
    """Float codes -> uint8, cast first and clipped after, as ggml's reference does: with a
    subnormal scale, 1/d overflows and 0 * inf gives NaN, whose cast must land alike."""
    with np.errstate(invalid="ignore"):
        return q.astype(np.uint8).clip(0, top)


def round_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero. Not floor(|x| + 0.5): in float32 that sum rounds
    up for |x| just below one half."""
    a = np.abs(x)
    whole = np.floor(a)
    return np.sign(x) * (whole + (a - whole >= np.float32(0.5)))


# --- Q8_0 -------------------------------------------------------------------------------

def _q8_0_dequant(b: np.ndarray) -> np.ndarray:
    d = fp16_to_f32(b[:, :2])
    return b[:, 2:].view(np.int8).astype(np.float32) * d


def _q8_0_quant(x: np.ndarray, w) -> np.ndarray:
    d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    q = round_away(x * _reciprocal(d)).astype(np.int8)
    return np.concatenate([f32_to_fp16_bytes(d), q.view(np.uint8)], axis=-1)


# --- Q5's codes ------------------------------------------------------------------------

def unpack_q5(qh_qs: np.ndarray) -> np.ndarray:
    """(n, 20) bytes, qh (4) then nibbles (16) -> (n, 32) uint8 values 0..31."""
    qh = np.unpackbits(qh_qs[:, :4], axis=-1, bitorder="little")
    return unpack_nibbles(qh_qs[:, 4:]) | (qh << 4)


def pack_q5(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..31 -> (n, 20) bytes: qh (4) then nibbles (16)."""
    q = q.astype(np.uint8)
    # a row of 32 bits is 4 whole bytes: packed as one run (along each row: 4x slower)
    qh = np.packbits((q >> 4).reshape(-1), bitorder="little").reshape(-1, 4)
    return np.concatenate([qh, pack_nibbles(q & 0x0F)], axis=-1)


# --- Q4_0, Q5_0: w = d * (q - zero), zero 8 or 16 --------------------------------------

def _centred_dequant(b: np.ndarray, zero: int, unpack) -> np.ndarray:
    d = fp16_to_f32(b[:, :2])
    q = unpack(b[:, 2:]).astype(np.int8) - np.int8(zero)
    return d * q.astype(np.float32)


def _centred_quant(x: np.ndarray, w, zero: int, pack) -> np.ndarray:
    # The weight of largest magnitude, with its sign, maps to -zero: the asymmetric end.
    imax = np.abs(x).argmax(axis=-1)[:, None]
    d = np.take_along_axis(x, imax, axis=-1) / np.float32(-zero)
    q = _codes(np.trunc(x * _reciprocal(d) + np.float32(zero + 0.5)), 2 * zero - 1)
    return np.concatenate([f32_to_fp16_bytes(d), pack(q)], axis=-1)


# --- Q4_1, Q5_1: w = d * q + m, q up to top 15 or 31 -----------------------------------

def _min_dequant(b: np.ndarray, unpack) -> np.ndarray:
    d = fp16_to_f32(b[:, :2])
    m = fp16_to_f32(b[:, 2:4])
    q = unpack(b[:, 4:]).astype(np.float32)
    return (d * q) + m


def _min_quant(x: np.ndarray, w, top: int, pack) -> np.ndarray:
    lo = x.min(axis=-1, keepdims=True)
    hi = x.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(top)
    q = _codes(np.trunc((x - lo) * _reciprocal(d) + np.float32(0.5)), top)
    return np.concatenate([f32_to_fp16_bytes(d), f32_to_fp16_bytes(lo), pack(q)], axis=-1)


def q4_fields(blocks: np.ndarray):
    """Split Q4_0 (18 B) or Q4_1 (20 B) blocks (n, bytes) into float32 d (n,), m (n,) (zeros
    for Q4_0, whose codes are centred on 8 instead) and codes (n, 32) uint8, so that
    w = d * q + m (Q4_1) or w = d * (q - 8) (Q4_0). For repacking into other layouts."""
    d = fp16_to_f32(blocks[:, :2])[:, 0]
    if blocks.shape[1] == 20:
        return d, fp16_to_f32(blocks[:, 2:4])[:, 0], unpack_nibbles(blocks[:, 4:])
    return d, np.zeros_like(d), unpack_nibbles(blocks[:, 2:])


Q8_0 = Format("Q8_0", 8, QK, 34, _q8_0_dequant, _q8_0_quant, scale_offsets=(0,))
Q4_0 = Format("Q4_0", 2, QK, 18, partial(_centred_dequant, zero=8, unpack=unpack_nibbles),
              partial(_centred_quant, zero=8, pack=pack_nibbles), scale_offsets=(0,))
Q4_1 = Format("Q4_1", 3, QK, 20, partial(_min_dequant, unpack=unpack_nibbles),
              partial(_min_quant, top=15, pack=pack_nibbles), scale_offsets=(0, 2))
Q5_0 = Format("Q5_0", 6, QK, 22, partial(_centred_dequant, zero=16, unpack=unpack_q5),
              partial(_centred_quant, zero=16, pack=pack_q5), scale_offsets=(0,))
Q5_1 = Format("Q5_1", 7, QK, 24, partial(_min_dequant, unpack=unpack_q5),
              partial(_min_quant, top=31, pack=pack_q5), scale_offsets=(0, 2))
