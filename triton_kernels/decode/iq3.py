"""IQ3_XXS and IQ3_S: 256 weights a block (layouts in quant/iq3.py).

Tables (triton_kernels.decode.table): IQ3_XXS grid bytes at 0..1023, ksigns at 1024..1151;
IQ3_S grid bytes at 0..2047.
"""
import triton
import triton.language as tl

from .common import load_f16, load_u32


@triton.jit
def decode_iq3_xxs(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 98
    d = load_f16(q_ptr, base, mask)
    gi = tl.load(q_ptr + base + 2 + j // 4, mask=mask, other=0).to(tl.int32)
    g = tl.load(tab_ptr + gi * 4 + j % 4, mask=mask, other=0).to(tl.float32)
    word = load_u32(q_ptr, base + 66 + (j // 32) * 4, mask)
    s = (word >> 28).to(tl.float32)
    sidx = ((word >> (7 * ((j % 32) // 8)).to(tl.uint32)) & 0x7F).to(tl.int32)
    ks = tl.load(tab_ptr + 1024 + sidx, mask=mask, other=0).to(tl.int32)
    minus = (ks >> (j % 8)) & 1
    v = d * (0.5 + s) * 0.5 * g
    return tl.where(minus != 0, -v, v)


@triton.jit
def decode_iq3_s(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 110
    d = load_f16(q_ptr, base, mask)
    lo = tl.load(q_ptr + base + 2 + j // 4, mask=mask, other=0).to(tl.int32)
    qh = tl.load(q_ptr + base + 66 + j // 32, mask=mask, other=0).to(tl.int32)
    gi = lo | (((qh >> ((j // 4) % 8)) & 1) << 8)
    g = tl.load(tab_ptr + gi * 4 + j % 4, mask=mask, other=0).to(tl.float32)
    sb = tl.load(q_ptr + base + 74 + j // 8, mask=mask, other=0).to(tl.int32)
    minus = (sb >> (j % 8)) & 1
    sc = tl.load(q_ptr + base + 106 + j // 64, mask=mask, other=0).to(tl.int32)
    s = (sc >> (4 * ((j // 32) % 2))) & 0x0F
    v = d * (1 + 2 * s).to(tl.float32) * g
    return tl.where(minus != 0, -v, v)
