"""Quantized matmul: x @ W.T with W held as GGUF blocks, dequantized inside the kernel.

    qmatmul(x, q, fmt, *, n=None, path=None, tiles=None) -> Tensor

`x` is (..., K) float32, float16 or bfloat16; `q` is the weight W (N, K) as stored in a
GGUF file: uint8, (N, K // block_elems * block_bytes), or the same bytes flat (1-D), with
`n` (the row count) checked when given and inferred from K when not. The result is
(..., N) in x's dtype, accumulated in float32.

Three Triton kernels:

- dp4a GEMV ("dp4a", the default for M <= GEMV_MAX_M rows, i.e. token-by-token decoding,
  in every format with an int8 unit decode, triton_kernels.decode.UNITS):
  x is rounded to int8 per 32 values, as llama.cpp's q8_1, and each weight is read once
  as whole int8 words and multiplied four at a time (triton_kernels/int8.py). Its result
  is x̂ @ W.T, x̂ the rounded x: within float32 rounding of that, not of x @ W.T.
- float GEMV ("gemv", the default for few rows in the other formats): a
  program owns BLOCK_N outputs of up to BLOCK_M rows of x. Each [BLOCK_N, BLOCK_K] weight
  tile is decoded once and multiplied with every row, reduced with tl.sum. The work is
  bound by reading the weight bytes, and tensor cores would idle at M this small.
- GEMM ("gemm", prefill): [BLOCK_M, BLOCK_K] tiles of x times decoded [BLOCK_K, BLOCK_N]
  tiles of W.T through tl.dot, float32 accumulator. The dot inputs are x's own dtype on
  CUDA (fp16 or bf16 tensor cores; float32 x goes through tf32 on NVIDIA: dot_types) and
  float32 under the interpreter, which holds bf16 as raw uint16 and so cannot multiply it.
  With fp16 x the decoded weights are rounded to fp16 too, which assumes |w| < 65504 (true
  of real models).
  In the formats with an int8 unit decode the GEMM decodes a unit of each of BLOCK_N rows a
  step (its int8 words and group scales, as the dp4a GEMV reads them, so it reads the
  device layout too) into a [BLOCK_N, unit] tile and multiplies it with one tl.dot:
  12-21 main-loop instructions a weight on sm_90, HGMMA, where the per-weight decode spends
  31-82 (strata bench kernels --static). Batch-invariant mode keeps the per-weight kernel.

The two GEMVs run one program per BLOCK_N rows (and, for dp4a, per row of x). The dp4a GEMV
splits K where those programs leave multiprocessors idle (triton_kernels.int8.split_for);
the float GEMV, for the formats without int8 units, does not.

Neither kernel is bit-exact with the torch path (different summation orders, FMA
contraction left on); tests/triton_kernels/test_qmatmul.py states the error bound.

`qmatmul_torch` is the CPU path: dequantize_torch to float32, then one float32 torch
matmul for every x dtype (CPU half-precision matmuls are slower and less accurate), cast
back to x's dtype. It dequantizes the whole weight on every call; callers that reuse a
weight may cache dequantize_torch(q, fmt) themselves.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import quant

from . import configs, invariant
from .backend import backend_name, use_triton
from .asm import asm_for
from .decode import decoder, launch_args, table, unit, unit_table
from .decode.split import block_ptr
from .dequant import _stack, check_blocks, dequantize_torch
from .int8 import gemv_dp4a, multiprocessors, quantize_x

X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Above this many rows of x the weight tile is reused enough for tensor cores to pay off.
GEMV_MAX_M = 16
# GEMV: 16 rows x 256 weights = 4096 decoded values a tile (32 per thread at 4 warps);
# 256 weights are whole blocks of every format, read as contiguous runs along each row,
# and BLOCK_N=16 gives N/16 programs, enough to cover a GPU for N of a few thousand.
# BLOCK_M caps the rows one program multiplies with a tile (unrolled, so kept small).
GEMV_TILES = (16, 16, 256)


def gemv_tiles(N: int, device, fmt: quant.Format) -> tuple[int, int, int]:
    """The float GEMV's (BLOCK_M, BLOCK_N, BLOCK_K) for N rows in `fmt` on `device`:
    GEMV_TILES, or for float weights (F32, F16, BF16: a released file's routers, 513 rows,
    33 programs at 16 rows on 132 multiprocessors) where N / 16 programs would leave a
    GPU's multiprocessors idle, fewer rows a program and as many more weights along K (the
    same 4096 a tile), down to 4 rows (F32 on sm_90: 7.8 instructions a weight and 89% of
    the bytes in wide loads at 4 x 1024, against 6.7 and 97% at 16 x 256; at 2 x 2048 9.3
    and 80%; a decoded format's tiles grow its count 2-4x, so they keep 16 rows). Every
    float GEMV of a weight (qmatmul's, the gated, the router's and gemv_pair's) asks here,
    so they agree."""
    bm, bn, bk = configs.tiles("gemv", GEMV_TILES)
    sms = multiprocessors(torch.device(device)) if fmt.block_elems == 1 else None
    while sms and bn > 4 and triton.cdiv(N, bn) < sms:
        bn, bk = bn // 2, bk * 2
    return bm, bn, bk
# GEMM: 64x64 outputs, K in steps of 32 (one 32-weight block, an eighth of a 256-weight
# one) at 8 warps (triton_kernels/configs): a step of 64 or 4 warps spills registers on
# sm_90 in every format (strata bench kernels --static); each decoded weight tile serves
# 64 rows.
GEMM_TILES = (64, 64, 32)
# The GEMM of the formats with an int8 unit decode: 64 x 128 outputs (64 x 64 for the
# 64-weight units of Q4_K and Q5_K, 64 x 32 for the 128-weight ones of Q2_K, Q3_K, Q6_K),
# K a unit a step, 4 warps: 10.5-24.4 instructions a weight on sm_90 where the per-weight
# decode costs 31-82, 119-212 registers, no spills (strata bench kernels --static).
# Its warps: configs' "unit_num_warps" (4; 8 for Q2_K, Q3_K, Q5_K and Q6_K on RDNA3's
# 32-lane waves, where 4 spilled 36-488 bytes a lane on gfx1100 and 8 spill none at 21-41%
# more instructions a weight; elsewhere 8 would cost 1.4-3.1x: triton_kernels/NOTES.md).
GEMM_UNIT_TILES = (64, 128)


def gemm_unit_tiles(u) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the unit GEMM: a tile of 128 x 32 weights a step."""
    bm, bn = GEMM_UNIT_TILES
    return bm, bn * 32 // u.weights
# tensor-core inputs on a GPU: half x keeps its type (the weights are rounded to it)
_GPU_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_types(x: torch.Tensor, dtype: torch.dtype | None = None) -> tuple:
    """(DOT_DTYPE, INPUT_PRECISION) of the tl.dot kernels (the GEMMs, the MoE's prefill) for
    activations x: on a GPU `dtype` (a model's compute dtype, the kernels rounding x to it),
    else x's own type; under the interpreter float32."""
    if not x.is_cuda:
        return tl.float32, "ieee"
    dot = _GPU_DOT_DTYPES[dtype or x.dtype]
    return dot, dot_precision(dot, backend_name())


def dot_precision(dot, backend: str) -> str:
    """tl.dot's input_precision for operands of type `dot` on `backend` ("cuda", "hip"):
    TF32 for float32 on NVIDIA (Triton's CUDA default, which keeps float32's range). Else
    "ieee": 16-bit operands multiply the same either way (sm_90's and gfx942's code for a
    bf16 GEMM is instruction for instruction the same under both), and Triton's AMD backend
    takes "tf32" on gfx942 alone (its source adds it there; gfx1100 refused to compile it),
    so float32 operands on AMD multiply in IEEE float32, MI300's XF32 unused."""
    return "tf32" if dot == tl.float32 and backend == "cuda" else "ieee"


@triton.jit
def gemv_weights(q_ptr, tab_ptr, offs_n, n_mask, k0, K, DECODE: tl.constexpr, QK: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The float GEMV's weight tile [BLOCK_N, BLOCK_K] at column k0, decoded, with its
    column offsets and mask (also the gated GEMV's: triton_kernels.gated_gemv)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    blk = offs_n[:, None] * (K // QK) + (offs_k // QK)[None, :]
    j = tl.broadcast_to((offs_k % QK)[None, :], (offs_n.shape[0], BLOCK_K))
    # masked lanes read zero bytes, which decode to 0.0 in every format
    return DECODE(q_ptr, tab_ptr, blk, j, n_mask[:, None] & k_mask[None, :]), offs_k, k_mask


@triton.jit
def gemv_store(out_ptr, acc, pid_m, offs_n, n_mask, M, stride_om, BLOCK_M: tl.constexpr):
    """The float GEMV's accumulator [BLOCK_M, BLOCK_N] stored; rows past M are not."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, tab_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_om,
                 DECODE: tl.constexpr, QK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64: N * row bytes may pass 2^31
    n_mask = offs_n < N
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, offs_k, k_mask = gemv_weights(q_ptr, tab_ptr, offs_n, n_mask, k0, K, DECODE, QK, BLOCK_K)
        for r in tl.static_range(BLOCK_M):
            # rows past M reread row M-1 (always in bounds) and are not stored
            m = tl.minimum(pid_m * BLOCK_M + r, M - 1)
            xr = tl.load(x_ptr + m.to(tl.int64) * stride_xm + offs_k * stride_xk,
                         mask=k_mask, other=0.0).to(tl.float32)
            part = tl.sum(w * xr[None, :], axis=1)
            # row r of the accumulator: a select, so that all rows stay in one tensor
            acc += tl.where(rows[:, None] == r, part[None, :], 0.0)
    gemv_store(out_ptr, acc, pid_m, offs_n, n_mask, M, stride_om, BLOCK_M)


@triton.jit
def _gemm_kernel(x_ptr, q_ptr, tab_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_om,
                 DECODE: tl.constexpr, QK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # pid_m varies fastest: programs that run together share one weight column tile, so
    # its blocks are read from DRAM once and from L2 after
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    blocks_per_row = K // QK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # decoded as [BLOCK_N, BLOCK_K], K fastest: each row's bytes are contiguous there;
        # the transpose for the dot happens in registers/shared memory, not in the loads
        blk = offs_n[:, None] * blocks_per_row + (offs_k // QK)[None, :]
        j = tl.broadcast_to((offs_k % QK)[None, :], (BLOCK_N, BLOCK_K))
        w = DECODE(q_ptr, tab_ptr, blk, j, n_mask[:, None] & k_mask[None, :])
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc,
                     input_precision=INPUT_PRECISION)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def unit_tile(q_ptr, tab_ptr, first, v0, U: tl.constexpr, UNIT: tl.constexpr, UW: tl.constexpr,
              UPB: tl.constexpr, BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
              BODY: tl.constexpr, ASM: tl.constexpr):
    """Units v0 .. v0 + U - 1 of the rows whose first blocks are `first` ([rows], in
    blocks), decoded to a [rows, U * UW] float32 tile of a * (code - ZERO) - b from the unit
    decode's int8 words and group scales (decode/common.py): the numpy codec's values bit
    for bit. The unit GEMM's and the MoE prefill's operand for tl.dot; a lane decodes one
    (row, unit)."""
    rows: tl.constexpr = first.shape[0]
    if U == 1:
        blk = first + v0 // UPB
        u = v0 % UPB
    else:
        v = v0 + tl.arange(0, U)
        blk = tl.reshape(first[:, None] + (v // UPB)[None, :], (rows * U,))
        u = tl.reshape(tl.broadcast_to((v % UPB)[None, :], (rows, U)), (rows * U,))
    words, sa, sb = UNIT(block_ptr(q_ptr, blk, BLOCK_HW, BODY), u, tab_ptr, ASM)
    shift = 24 - 8 * tl.arange(0, 4)
    code = ((_stack(words, UW // 4)[:, :, None] << shift[None, None, :]) >> 24) - ZERO
    w = _stack(sa, len(sa))[:, :, None] * tl.reshape(code, (rows * U, len(sa), UW // len(sa))).to(tl.float32)
    if OFFSET:
        w = w - _stack(sb, len(sb))[:, :, None]
    return tl.reshape(w, (rows, U * UW))


@triton.jit
def _gemm_units_kernel(x_ptr, q_ptr, tab_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_om,
                       UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr,
                       BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                       BODY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                       ASM: tl.constexpr):
    # one unit of each of BLOCK_N rows a step (unit_tile), then one tl.dot; rows past N
    # re-read row N - 1 and are not stored
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    units = K // UW
    first = tl.minimum(rows, N - 1).to(tl.int64) * (units // UPB)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for v in range(0, units):
        offs_k = v * UW + tl.arange(0, UW)
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None], other=0.0)
        w = unit_tile(q_ptr, tab_ptr, first, v, 1, UNIT, UW, UPB, BLOCK_HW, ZERO, OFFSET, BODY, ASM)
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=INPUT_PRECISION)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (rows < N)[None, :])


def _check(x: torch.Tensor, q: torch.Tensor, fmt: quant.Format, n: int | None):
    """Validate the operands; returns (x as (M, K), N, K). ValueError names the format."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{fmt.name}: x must be a torch tensor, got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"{fmt.name}: x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{fmt.name}: x must have shape (..., K), got a scalar")
    K = x.shape[-1]
    if K % fmt.block_elems:
        raise ValueError(f"{fmt.name}: x has K={K}, not a multiple of the "
                         f"{fmt.block_elems}-weight block")
    check_blocks(q, fmt)
    if x.device != q.device:
        raise ValueError(f"{fmt.name}: x is on {x.device} but the weight is on {q.device}")
    row_bytes = K // fmt.block_elems * fmt.block_bytes
    if q.dim() == 2:
        per_row = q.shape[1] // fmt.block_bytes * fmt.block_elems
        if per_row != K:
            raise ValueError(f"{fmt.name}: weight has {q.shape[1]} bytes per row = {per_row} "
                             f"weights, but x has K={K}")
        if n is not None and n != q.shape[0]:
            raise ValueError(f"{fmt.name}: n={n}, but the weight has {q.shape[0]} rows")
        N = q.shape[0]
    elif q.dim() == 1:
        if n is None:
            if row_bytes == 0 or q.shape[0] % row_bytes:
                raise ValueError(f"{fmt.name}: weight has {q.shape[0]} bytes, not whole rows "
                                 f"of K={K} weights ({row_bytes} bytes a row)")
            N = q.shape[0] // row_bytes if row_bytes else 0
        else:
            if n < 0 or n * row_bytes != q.shape[0]:
                raise ValueError(f"{fmt.name}: weight has {q.shape[0]} bytes, but n={n} rows "
                                 f"of K={K} weights take {max(n, 0) * row_bytes}")
            N = n
    else:
        raise ValueError(f"{fmt.name}: weight must be (N, row bytes) or flat 1-D blocks, "
                         f"got shape {tuple(q.shape)}")
    return x.reshape(math.prod(x.shape[:-1]), K), N, K


def choose_path(fmt: quant.Format, M: int) -> str:
    """The kernel qmatmul runs for M rows: dp4a (formats with int8 units) or gemv for at most
    GEMV_MAX_M rows, gemm after. Batch-invariant (triton_kernels.invariant), one kernel for any
    M: dp4a where the format has units (a program a row, its tiles the format's: a row's sums
    never see another row, and decode keeps its 2-5 instructions a weight, where the GEMM
    spends 30-75), else the GEMM with its one tile."""
    if invariant.enabled():
        return "dp4a" if unit(fmt) is not None else "gemm"
    return ("dp4a" if unit(fmt) is not None else "gemv") if M <= GEMV_MAX_M else "gemm"


def qmatmul(x: torch.Tensor, q: torch.Tensor, fmt: str | int | quant.Format, *,
            n: int | None = None, path: str | None = None,
            tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x @ W.T for W (N, K) stored as `fmt` blocks in `q`; result (..., N) in x's dtype.

    path: "dp4a", "gemv" or "gemm" forces a kernel; None: `choose_path`.
    tiles: (BLOCK_M, BLOCK_N, BLOCK_K) powers of two instead of the path's defaults
    (GEMM needs each >= 16 for tl.dot); for dp4a (BLOCK_N, BLOCK_U). CPU tensors without
    the interpreter ignore both and run qmatmul_torch.
    """
    fmt = quant.get(fmt)
    if path not in (None, "dp4a", "gemv", "gemm"):
        raise ValueError(f"{fmt.name}: path must be 'dp4a', 'gemv', 'gemm' or None, got {path!r}")
    x2, N, K = _check(x, q, fmt, n)
    if not use_triton(x):
        return qmatmul_torch(x, q, fmt, n=n)
    M = x2.shape[0]
    path = path or choose_path(fmt, M)
    if path == "dp4a":
        if tiles is not None and (len(tiles) != 2 or any(t < 1 or t & (t - 1) for t in tiles)):
            raise ValueError(f"{fmt.name}: dp4a tiles must be (BLOCK_N, BLOCK_U), powers of two, "
                             f"got {tiles}")
        y = gemv_dp4a(quantize_x(x2), q.contiguous(), fmt, N, tiles)
        return y.to(x.dtype).reshape(*x.shape[:-1], N)
    explicit = tiles
    if tiles is None:
        tiles = gemv_tiles(N, q.device, fmt) if path == "gemv" else configs.tiles(path, GEMM_TILES)
    block_m, block_n, block_k = tiles
    for t in (block_m, block_n, block_k):
        if t < 1 or t & (t - 1) or (path == "gemm" and t < 16):
            raise ValueError(f"{fmt.name}: tiles must be powers of two"
                             f"{' >= 16 for gemm' if path == 'gemm' else ''}, got {tiles}")
    out_dtype = x.dtype
    if x2.dtype == torch.bfloat16 and not x2.is_cuda:
        # the interpreter holds bf16 as raw uint16: widen (exact), round the result after
        x2 = x2.float()
    out = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M and N:
        if K == 0:
            out.zero_()
        else:
            q = q.contiguous()
            args = (x2, q, table(fmt, q.device), out, M, N, K, x2.stride(0), x2.stride(1), out.stride(0))
            if path == "gemv":
                block_m = min(block_m, triton.next_power_of_2(M))
                grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
                _gemv_kernel[grid](*args, DECODE=decoder(fmt), QK=fmt.block_elems,
                                   BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                   num_warps=configs.float_gemv_warps(fmt.name, x2.device))
            else:
                dot_dtype, precision = dot_types(x2)
                u = unit(fmt)
                if u is not None and not invariant.enabled():
                    bm, bn = gemm_unit_tiles(u) if explicit is None else explicit[:2]
                    _gemm_units_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
                        x2, q.reshape(-1).view(torch.uint16), unit_table(fmt, q.device), out, M, N, K,
                        x2.stride(0), x2.stride(1), out.stride(0), **launch_args(fmt, u),
                        BLOCK_M=bm, BLOCK_N=bn, DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
                        ASM=asm_for(q.device), num_warps=configs.num_warps("gemm", fmt.name, q.device, "unit_num_warps"))
                    return out.to(out_dtype).reshape(*x.shape[:-1], N)
                grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
                _gemm_kernel[grid](*args, DECODE=decoder(fmt), QK=fmt.block_elems,
                                   BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                   DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
                                   num_warps=configs.num_warps("gemm", fmt.name, x2.device))
    return out.to(out_dtype).reshape(*x.shape[:-1], N)


def qmatmul_torch(x: torch.Tensor, q: torch.Tensor, fmt: str | int | quant.Format, *,
                  n: int | None = None) -> torch.Tensor:
    """The same product in torch: dequantize to float32, float32 matmul, cast to x's dtype."""
    fmt = quant.get(fmt)
    x2, N, K = _check(x, q, fmt, n)
    w = dequantize_torch(q.reshape(N, K // fmt.block_elems * fmt.block_bytes), fmt)
    return (x2.float() @ w.T).to(x.dtype).reshape(*x.shape[:-1], N)
