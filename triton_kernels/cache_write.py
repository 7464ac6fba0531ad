"""A decode graph's attention rows written into the cache at device positions, every buffer
in one launch:

    cache_write(dsts, srcs, pos)    for each pair: dst[..., pos[t], :] = src[..., t, :]
        dst (H, C, D) or (C, D), a float cache (float32, bfloat16, float16: the store
        rounds as torch's .to does, to nearest even); src (H, T, D) or (T, D) float32, any
        strides with D contiguous (the fused projection's v and indexer key are views);
        up to three pairs (keys, values, the indexer's keys), their caches of one dtype

Flash-Next's graph step (strata.runtime.graphs_qwen4exp) wrote them by `index_copy_`, a
launch a buffer, and one more a buffer to round to bfloat16 or float16 first. The int8
cache (strata.nn.kv) keeps torch's path: its rows need their scales. `cache_write_torch`
is the same in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .decode.common import round_to_bf16_bits

MAX_PAIRS = 3
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _write_row(src, dst, pos_ptr, r, T, D, s_h, s_t, d_h, d_c, BD: tl.constexpr, BF16: tl.constexpr):
    """Row r = head * T + t of a pair: src[head, t] to dst[head, pos[t]] (BF16: dst viewed
    as int16, the bits rounded by hand, as the interpreter's cast truncates)."""
    h, t = r // T, r % T
    c = tl.arange(0, BD)
    p = tl.load(pos_ptr + t)
    x = tl.load(src + h * s_h + t * s_t + c, mask=c < D, other=0.0)
    y = round_to_bf16_bits(x) if BF16 else x.to(dst.dtype.element_ty)
    tl.store(dst + h * d_h + p * d_c + c, y, mask=c < D)


@triton.jit
def _cache_write_kernel(pos_ptr, T,
                        src0, dst0, rows0, D0, s_h0, s_t0, d_h0, d_c0,
                        src1, dst1, rows1, D1, s_h1, s_t1, d_h1, d_c1,
                        src2, dst2, rows2, D2, s_h2, s_t2, d_h2, d_c2,
                        BD: tl.constexpr, BF16: tl.constexpr):
    # program (r, m): row r of pair m (rows past a pair's own count do nothing)
    r, m = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if m == 0:
        if r < rows0:
            _write_row(src0, dst0, pos_ptr, r, T, D0, s_h0, s_t0, d_h0, d_c0, BD, BF16)
    elif m == 1:
        if r < rows1:
            _write_row(src1, dst1, pos_ptr, r, T, D1, s_h1, s_t1, d_h1, d_c1, BD, BF16)
    else:
        if r < rows2:
            _write_row(src2, dst2, pos_ptr, r, T, D2, s_h2, s_t2, d_h2, d_c2, BD, BF16)


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t


def _check(dsts, srcs, pos: torch.Tensor) -> None:
    if not 1 <= len(dsts) == len(srcs) <= MAX_PAIRS:
        raise ValueError(f"cache_write: 1 to {MAX_PAIRS} (dst, src) pairs, got {len(dsts)} and {len(srcs)}")
    if pos.dim() != 1:
        raise ValueError(f"cache_write: pos must be (T,), got {tuple(pos.shape)}")
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        d3, s3 = _heads(d), _heads(s)
        if d.dim() != s.dim() or d.dim() not in (2, 3) or d3.shape[0] != s3.shape[0] or d3.shape[2] != s3.shape[2] \
                or s3.shape[1] != pos.shape[0]:
            raise ValueError(f"cache_write: pair {i}: dst (H, C, D) or (C, D) and src (H, T, D) or (T, D) with T = "
                             f"{pos.shape[0]} positions, got {tuple(d.shape)} and {tuple(s.shape)}")
        if d.dtype not in FLOATS or s.dtype != torch.float32:
            raise ValueError(f"cache_write: pair {i}: a float cache and float32 rows, got {d.dtype} and {s.dtype}")
    if len({d.dtype for d in dsts}) > 1:
        raise ValueError(f"cache_write: the caches share one dtype, got {[d.dtype for d in dsts]}")


def cache_write_torch(dsts: list[torch.Tensor], srcs: list[torch.Tensor], pos: torch.Tensor) -> None:
    _check(dsts, srcs, pos)
    for d, s in zip(dsts, srcs):
        d.index_copy_(d.dim() - 2, pos, s.to(d.dtype))


def cache_write(dsts: list[torch.Tensor], srcs: list[torch.Tensor], pos: torch.Tensor) -> None:
    """Each src's rows stored at positions pos of its dst, converted to the dst's dtype; in
    place, one launch. Positions must lie in the caches (unchecked: they are on the
    device). CPU tensors without the interpreter run cache_write_torch."""
    _check(dsts, srcs, pos)
    if not use_triton(dsts[0]):
        return cache_write_torch(dsts, srcs, pos)
    srcs = [s if s.stride(-1) == 1 else s.contiguous() for s in srcs]
    if any(d.stride(-1) != 1 for d in dsts):
        raise ValueError("cache_write: the caches must be contiguous along their rows")
    bf16 = dsts[0].dtype == torch.bfloat16
    args, rows = [], []
    for d, s in zip(dsts, srcs):
        d3, s3 = _heads(d.view(torch.int16) if bf16 else d), _heads(s)
        rows.append(s3.shape[0] * s3.shape[1])
        args += [s3, d3, rows[-1], s3.shape[2], s3.stride(0), s3.stride(1), d3.stride(0), d3.stride(1)]
    args += args[:8] * (MAX_PAIRS - len(dsts))  # unused pairs: the first again, never run
    if max(rows):
        width = max(_heads(s).shape[2] for s in srcs)
        _cache_write_kernel[(max(rows), len(dsts))](pos, pos.shape[0], *args, BD=triton.next_power_of_2(width),
                                                    BF16=bf16)
    return None
