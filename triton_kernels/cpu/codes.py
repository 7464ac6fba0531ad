"""Int8 codes times group scales: how the CPU holds a quantized weight, and its matmul.

    codes, scale, offset = int8_parts(blocks, fmt)        (triton_kernels.dequant)
    codes_matmul(x, codes, scale, offset) -> (M, N) float32

Every format in dequant.INT8_FORMATS stores a weight as a small integer times a float
scale per group of 16 or 32 weights (plus an offset for Q4_1, Q5_1 and most K-quants):
IQ3_XXS is d(0.5 + s)/2 x (a signed grid value of at most 62), Q4_K is dl x q - ml. Held
as int8 codes and float32 scales, a weight takes 1.125 bytes (1.25 with an offset; group 16:
1.25/1.5) against bfloat16's 2, and `w = scale * code (+ offset)` is the reference
decoder's own float32 operations: the file's weights exactly, not rounded to bfloat16.

The matmul of a few rows (decode) is one pass of Inductor's C++ over the codes a row:
each weight decoded in registers, multiplied by x and summed, no dequantized weight stored
(torch.compile, compiled once per input size K with the row count N dynamic). Measured on
2 cores (AVX-512): 1.4 ms for SmolLM2's 49152 x 576 Q8_0 output head against 5.1-5.9 ms
for the same weight as bfloat16 through torch's matmul. More rows (prefill) dequantize the
weight into the compute dtype and take torch's matmul, whose blocking wins there.

Error: each product w x is exact up to one float32 rounding and the sum's order is
Inductor's, so against float64, |y - y64| <= gamma_K * sum_k |w_k x_k| with gamma_K =
K u / (1 - K u), u = 2^-24 (tests/triton_kernels/cpu/test_codes.py checks this bound). Where a
C++ compiler is missing, or with STRATA_CPU_COMPILE=0, the weight is decoded in slices and
multiplied by torch's matmul (same bound, slower).
"""
from __future__ import annotations

import torch

from ..backend import upcast
from .compiled import Compiled

# rows up to this go through the one-pass product, a row at a time; more rows dequantize
# and take torch.mm
GEMV_ROWS = 16


def codes_weight(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight (N, K) in `dtype`: float32 scale * code (+ offset), then rounded once."""
    n, k = codes.shape
    w = codes.view(n, scale.shape[1], -1).float() * scale[:, :, None]
    if offset is not None:
        w = w + offset[:, :, None]
    return w.view(n, k).to(dtype)


def _product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """(M, K) float32 x (N, K) codes -> (M, N): codes_weight's float32 weight and its
    product in one expression, which Inductor fuses into one loop over the codes."""
    n, g = scale.shape
    w = codes_weight(codes, scale, offset).view(n, g, -1)
    return (w[None] * x.view(x.shape[0], 1, g, -1)).sum((-1, -2))


# the rows N symbolic (codes, scale, offset); one code object serves every K and row count,
# a compile each: more than dynamo's default 8
_MATMUL = Compiled(_product, "the int8-code matmul", symbolic={1: 0, 2: 0, 3: 0}, recompiles=64, dynamic=False)


def codes_matmul_torch(x, codes, scale, offset=None, dtype: torch.dtype = torch.float32,
                       rows: int = 4096) -> torch.Tensor:
    """x (M, K) @ W.T as float32 (M, N), eagerly: the weight decoded into `dtype` a slice of
    `rows` rows at a time (a large head whole would be hundreds of MB of float32), times x
    in `dtype` through torch's matmul. The reference for codes_matmul (float32), its path
    for many rows and its fallback without a compiler."""
    out = torch.empty((x.shape[0], codes.shape[0]), device=x.device)
    x = x.to(dtype)
    for i in range(0, codes.shape[0], rows):
        sl = slice(i, i + rows)
        out[:, sl] = x @ codes_weight(codes[sl], scale[sl], None if offset is None else offset[sl], dtype).T
    return out


def codes_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x (M, K) @ W.T as float32 (M, N). Up to GEMV_ROWS rows: one compiled pass over the
    codes in float32 for each row, so that a row's result does not depend on the rows
    beside it (a decode batched with others gives the bits it gives alone). More: the
    weight dequantized into `dtype` and torch's matmul, with x in `dtype` (the dense
    path's numerics; float32 where the CPU has no bfloat16 dot products, see
    backend.upcast)."""
    if x.shape[0] > GEMV_ROWS:
        return codes_matmul_torch(x, codes, scale, offset, torch.float32 if upcast(x, dtype) else dtype)
    x = x.float().contiguous()
    if torch.compiler.is_compiling():  # inside a compiled step: traced inline
        return _product(x, codes, scale, offset)
    out = torch.empty((x.shape[0], codes.shape[0]), device=x.device)
    for i in range(x.shape[0]):
        y = _MATMUL(x[i:i + 1], codes, scale, offset)
        out[i:i + 1] = codes_matmul_torch(x[i:i + 1], codes, scale, offset) if y is None else y
    return out
