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

from .format import Format, byte_rows, column_extreme, f32_to_fp16_bytes, fp16_to_f32

QK = 32


def _reciprocal(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _codes(q: np.ndarray, top: int) -> np.ndarray:
    """Float codes -> uint8, cast first and clipped after, as ggml's reference does: with a
    subnormal scale, 1/d overflows and 0 * inf gives NaN, whose cast must land alike."""
    with np.errstate(invalid="ignore"):
        c = q.astype(np.uint8)
    # against an array, not a scalar: numpy vectorises only that uint8 minimum (7x faster)
    return np.minimum(c, np.full_like(c, top), out=c)


def round_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero. Not floor(|x| + 0.5): in float32 that sum rounds
    up for |x| just below one half."""
    a = np.abs(x)
    whole = np.floor(a)
    a -= whole                        # the fraction, exact
    whole += a >= np.float32(0.5)
    # copysign, not sign(x) * ...: one pass fewer, and -0.0 stays -0.0 as in C
    return np.copysign(whole, x, out=whole)


# --- blocks as columns ------------------------------------------------------------------
# The codecs run on the weights of block i in column i, (32, n): numpy's reductions and
# broadcasts then run along rows n long, where over a block's 32 in a row they cost up to
# ten times more (numpy's overhead per row). The bytes are turned on the way in and out;
# the float weights only where a caller asks for rows (strata quantize converts one of
# these formats into another without ever making them).

_SHIFT = np.arange(8, dtype=np.uint8)[None, :, None]   # bit j of a byte (k, j, n)


def _fp16_col(b: np.ndarray, at: int) -> np.ndarray:
    """(n, bytes) blocks -> (n,) float32: the fp16 at byte `at` (even, as every block's
    size) of each, read through a uint16 view rather than copied out first."""
    return b.view(np.uint16)[:, at // 2].view(np.float16).astype(np.float32)


def _nibble_cols(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (32, n) uint8 values 0..15: weight i in the low half of byte i,
    weight i + 16 in its high half."""
    t = np.ascontiguousarray(qs.T)
    return np.concatenate([t & 0x0F, t >> 4])


def _q5_cols(qh_qs: np.ndarray) -> np.ndarray:
    """(n, 20) bytes, qh (4) then nibbles (16) -> (32, n) values 0..31: the fifth bit of
    weight i is bit i of the little-endian u32 qh."""
    qh = np.ascontiguousarray(qh_qs[:, :4].T)[:, None, :]
    return _nibble_cols(qh_qs[:, 4:]) | (((qh >> _SHIFT) & 1) << 4).reshape(32, -1)


def _pack_nibble_cols(q: np.ndarray) -> np.ndarray:
    """(32, n) values 0..15 -> (16, n) bytes: byte i of each column holds weights i, i + 16."""
    return q[:16] | (q[16:] << 4)


def _pack_q5_cols(q: np.ndarray) -> np.ndarray:
    """(32, n) values 0..31 -> (20, n) bytes: qh (4) then nibbles (16)."""
    qh = np.einsum("kjn,j->kn", (q >> 4).reshape(4, 8, -1), np.uint8(1) << _SHIFT[0, :, 0])  # weight 8k + j
    return np.concatenate([qh, _pack_nibble_cols(q & 0x0F)])


def _blocks(*fields: np.ndarray) -> np.ndarray:
    """Column fields (k_i, n) uint8 -> (n, sum k_i) blocks, the fields end to end: stacked,
    then one transpose (a field's own transpose into a strided slice costs twice as much)."""
    return byte_rows(np.concatenate(fields))


def _fp16_field(v: np.ndarray) -> np.ndarray:
    """(n,) float32 -> (2, n) fp16 bytes, rounded to nearest even."""
    return f32_to_fp16_bytes(v[:, None]).T


# --- Q8_0 -------------------------------------------------------------------------------

def _q8_0_dequant(b: np.ndarray) -> np.ndarray:
    q = np.ascontiguousarray(b[:, 2:].view(np.int8).T)
    return q.astype(np.float32) * _fp16_col(b, 0)


# the float32 just below one half: v + copysign(it, v), cast (which truncates), is C's
# roundf(v) for every float32 |v| <= 128 (checked exhaustively), in two passes to
# round_away's five
_BELOW_HALF = np.nextafter(np.float32(0.5), np.float32(0))
_SIGN, _BELOW_HALF_BITS = np.uint32(0x80000000), _BELOW_HALF.view(np.uint32)


def _roundf_int8(v: np.ndarray) -> np.ndarray:
    """C's roundf of float32 v (|v| <= 128) as int8, v overwritten: v + copysign(_BELOW_HALF,
    v) with the copysign as v's sign bit on the constant's (np.copysign is three times
    slower), then the truncating cast."""
    half = v.view(np.uint32) & _SIGN
    half |= _BELOW_HALF_BITS
    v += half.view(np.float32)
    return v.astype(np.int8)


def _q8_0_quant(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=0) / np.float32(127)
    q = _roundf_int8(x * _reciprocal(d))
    return _blocks(_fp16_field(d), q.view(np.uint8))


# --- Q4_0, Q5_0: w = d * (q - zero), zero 8 or 16 --------------------------------------

def _centred_dequant(b: np.ndarray, zero: int, unpack) -> np.ndarray:
    q = unpack(b[:, 2:]).astype(np.int8) - np.int8(zero)
    return _fp16_col(b, 0) * q.astype(np.float32)


def _centred_quant(x: np.ndarray, zero: int, pack) -> np.ndarray:
    # The weight of largest magnitude, with its sign, maps to -zero: the asymmetric end.
    d = column_extreme(x) / np.float32(-zero)
    q = _codes(np.trunc(x * _reciprocal(d) + np.float32(zero + 0.5)), 2 * zero - 1)
    return _blocks(_fp16_field(d), pack(q))


# --- Q4_1, Q5_1: w = d * q + m, q up to top 15 or 31 -----------------------------------

def _min_dequant(b: np.ndarray, unpack) -> np.ndarray:
    q = unpack(b[:, 4:]).astype(np.float32)
    return (_fp16_col(b, 0) * q) + _fp16_col(b, 2)


def _min_quant(x: np.ndarray, top: int, pack) -> np.ndarray:
    lo = x.min(axis=0)
    hi = x.max(axis=0)
    d = (hi - lo) / np.float32(top)
    q = _codes(np.trunc((x - lo) * _reciprocal(d) + np.float32(0.5)), top)
    return _blocks(_fp16_field(d), _fp16_field(lo), pack(q))


# --- the row layout, for the other formats' packing and tests -----------------------------

def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) uint8 values 0..15 in weight order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..15 -> (n, 16) bytes."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def pack_q5(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..31 -> (n, 20) bytes: qh (4) then nibbles (16)."""
    return np.ascontiguousarray(_pack_q5_cols(np.ascontiguousarray(q.astype(np.uint8).T)).T)


def q4_fields(blocks: np.ndarray):
    """Split Q4_0 (18 B) or Q4_1 (20 B) blocks (n, bytes) into float32 d (n,), m (n,) (zeros
    for Q4_0, whose codes are centred on 8 instead) and codes (n, 32) uint8, so that
    w = d * q + m (Q4_1) or w = d * (q - 8) (Q4_0). For repacking into other layouts."""
    d = fp16_to_f32(blocks[:, :2])[:, 0]
    if blocks.shape[1] == 20:
        return d, fp16_to_f32(blocks[:, 2:4])[:, 0], unpack_nibbles(blocks[:, 4:])
    return d, np.zeros_like(d), unpack_nibbles(blocks[:, 2:])


def _format(name: str, type_id: int, block_bytes: int, dequant, quant, scale_offsets) -> Format:
    return Format(name, type_id, QK, block_bytes,
                  lambda b: np.ascontiguousarray(dequant(b).T), lambda x, w: quant(np.ascontiguousarray(x.T)),
                  scale_offsets=scale_offsets, dequantize_cols=dequant, quantize_cols=quant)


Q8_0 = _format("Q8_0", 8, 34, _q8_0_dequant, _q8_0_quant, (0,))
Q4_0 = _format("Q4_0", 2, 18, partial(_centred_dequant, zero=8, unpack=_nibble_cols),
               partial(_centred_quant, zero=8, pack=_pack_nibble_cols), (0,))
Q4_1 = _format("Q4_1", 3, 20, partial(_min_dequant, unpack=_nibble_cols),
               partial(_min_quant, top=15, pack=_pack_nibble_cols), (0, 2))
Q5_0 = _format("Q5_0", 6, 22, partial(_centred_dequant, zero=16, unpack=_q5_cols),
               partial(_centred_quant, zero=16, pack=_pack_q5_cols), (0,))
Q5_1 = _format("Q5_1", 7, 24, partial(_min_dequant, unpack=_q5_cols),
               partial(_min_quant, top=31, pack=_pack_q5_cols), (0, 2))
