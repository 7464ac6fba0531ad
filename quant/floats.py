"""The plain float formats: F32, F16, BF16 (one weight a block)."""
from __future__ import annotations

import numpy as np

from .format import Format


def _f32_dequant(b: np.ndarray) -> np.ndarray:
    return b.view(np.float32).copy()


def _f32_quant(x: np.ndarray, w) -> np.ndarray:
    return x.astype(np.float32).view(np.uint8)


def _f16_dequant(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def _f16_quant(x: np.ndarray, w) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8)


def _bf16_dequant(b: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an fp32: widen by a 16-bit shift.
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even; NaN stays a quiet NaN
    (ggml's ggml_compute_fp32_to_bf16 does the same)."""
    n = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    is_nan = (n & 0x7FFFFFFF) > 0x7F800000
    rounded = (n.astype(np.uint64) + 0x7FFF + ((n >> 16) & 1)) >> 16
    return np.where(is_nan, (n >> 16) | 0x40, rounded).astype(np.uint16)


def _bf16_quant(x: np.ndarray, w) -> np.ndarray:
    return bf16_bits(x).view(np.uint8)


F32 = Format("F32", 0, 1, 4, _f32_dequant, _f32_quant)
F16 = Format("F16", 1, 1, 2, _f16_dequant, _f16_quant)
BF16 = Format("BF16", 30, 1, 2, _bf16_dequant, _bf16_quant)
