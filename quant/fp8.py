"""FP8_E4M3: the e4m3fn 8-bit float, one weight a byte. Not a GGUF type (no ggml type id):
the PLE table of the safetensors releases is stored this way, with one global bf16 scale
(`weight_scale`) that the reader multiplies in afterwards.

Layout of a byte: sign (bit 7) | exponent e (bits 6..3, bias 7) | mantissa m (bits 2..0).
  e == 0          subnormal: m * 2^-9
  e == 15, m == 7 NaN (0x7F, 0xFF): "fn" = finite, there is no infinity
  otherwise       (8 + m) * 2^(e - 10), so the largest value is 448
Decoding matches torch's float8_e4m3fn -> float32 bit for bit (NaN payloads aside);
encoding rounds to nearest even and saturates at +-448, as torch's float32 -> float8_e4m3fn
cast does.
"""
from __future__ import annotations

import numpy as np

from .format import Format

MAX = 448.0


def _value_table() -> np.ndarray:
    """The 256 codes as float32, exactly (every value is a small integer times a power of 2)."""
    code = np.arange(256, dtype=np.uint32)
    e = (code >> 3) & 0xF
    m = (code & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e.astype(np.float64) - 10))
    bits = mag.astype(np.float32).view(np.uint32) | ((code & 0x80) << 24)
    bits = np.where(code & 0x7F == 0x7F, (code & 0x80) << 24 | 0x7FC00000, bits)
    return bits.astype(np.uint32).view(np.float32)


VALUES = _value_table()


def _fp8_dequant(b: np.ndarray) -> np.ndarray:
    return VALUES[b]


def encode(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn codes (uint8): nearest, ties to even; beyond +-448 saturates to
    +-448 (torch's cast does the same); NaN -> 0x7F with the sign kept."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    mag = bits & 0x7FFFFFFF
    a = mag.view(np.float32)
    # Normal range (>= 2^-6): round the float32 mantissa to 3 bits, ties to even, on the bit
    # pattern; a carry rolls into the exponent, as it should. Rebias 127 -> 7: code =
    # (exponent << 3 | mantissa) - (120 << 3).
    rounded = (mag.astype(np.int64) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = np.minimum(rounded - 960, 0x7E)
    # Subnormal range: the code is the value in units of 2^-9 (scaling by 512 is exact);
    # np.rint rounds ties to even, and a result of 8 is the smallest normal's code, 0x08.
    with np.errstate(invalid="ignore"):
        sub = np.rint(a * np.float32(512)).astype(np.int64)
    code = np.where(a < np.float32(2.0 ** -6), sub, normal)
    code = np.where(np.isnan(a), 0x7F, code)
    return (code.astype(np.uint8) | sign).astype(np.uint8)


def _fp8_quant(x: np.ndarray, w) -> np.ndarray:
    return encode(x)


FP8_E4M3 = Format("FP8_E4M3", None, 1, 1, _fp8_dequant, _fp8_quant)
