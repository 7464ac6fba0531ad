"""Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32 weights a block (layouts in quant/legacy.py)."""
import triton
import triton.language as tl

from .common import load_f16


@triton.jit
def _nibble(q_ptr, off, j, mask):
    """Weight j of a 16-byte nibble array at `off`: low halves hold 0..15, high 16..31."""
    byte = tl.load(q_ptr + off + (j % 16), mask=mask, other=0)
    return tl.where(j < 16, byte & 0x0F, byte >> 4)


@triton.jit
def decode_q8_0(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 34
    d = load_f16(q_ptr, base, mask)
    q = tl.load(q_ptr + base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
    return q.to(tl.float32) * d


@triton.jit
def decode_q4_0(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 18
    d = load_f16(q_ptr, base, mask)
    q = _nibble(q_ptr, base + 2, j, mask).to(tl.int32) - 8
    return d * q.to(tl.float32)


@triton.jit
def decode_q4_1(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 20
    d = load_f16(q_ptr, base, mask)
    m = load_f16(q_ptr, base + 2, mask)
    q = _nibble(q_ptr, base + 4, j, mask).to(tl.float32)
    return d * q + m  # exact only without FMA contraction (enable_fp_fusion=False)


@triton.jit
def _q5(q_ptr, off, j, mask):
    """Weight j's 5-bit code: the fifth bit from the u32 at `off`, the nibble after it."""
    hb = (tl.load(q_ptr + off + j // 8, mask=mask, other=0).to(tl.int32) >> (j % 8)) & 1
    return _nibble(q_ptr, off + 4, j, mask).to(tl.int32) | (hb << 4)


@triton.jit
def decode_q5_0(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 22
    d = load_f16(q_ptr, base, mask)
    q = _q5(q_ptr, base + 2, j, mask) - 16
    return d * q.to(tl.float32)


@triton.jit
def decode_q5_1(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 24
    d = load_f16(q_ptr, base, mask)
    m = load_f16(q_ptr, base + 2, mask)
    q = _q5(q_ptr, base + 4, j, mask).to(tl.float32)
    return d * q + m  # exact only without FMA contraction (enable_fp_fusion=False)
