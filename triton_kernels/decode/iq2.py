"""IQ2_XXS, IQ2_XS and IQ2_S: 256 weights a block (layouts in quant/iq2.py).

Tables (triton_kernels.decode.table): grid bytes (8 a entry) from 0, then for IQ2_XXS
(2048 grid bytes) and IQ2_XS (4096) the 128 ksigns bytes.
"""
import triton
import triton.language as tl

from .common import load_f16, load_u16, load_u32, negate_where, xxs_scale_sign


@triton.jit
def _signed(d, s, g, minus):
    return negate_where(d * (0.5 + s) * 0.25 * g, minus)


@triton.jit
def decode_iq2_xxs(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 66
    d = load_f16(q_ptr, base, mask)
    grp = base + 2 + (j // 32) * 8
    gi = tl.load(q_ptr + grp + (j % 32) // 8, mask=mask, other=0).to(tl.int32)
    g = tl.load(tab_ptr + gi * 8 + j % 8, mask=mask, other=0).to(tl.float32)
    s, minus = xxs_scale_sign(load_u32(q_ptr, grp + 4, mask), j, tab_ptr + 2048, mask)
    return _signed(d, s, g, minus)


@triton.jit
def decode_iq2_xs(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 74
    d = load_f16(q_ptr, base, mask)
    qs = load_u16(q_ptr, base + 2 + (j // 8) * 2, mask).to(tl.int32)
    g = tl.load(tab_ptr + (qs & 511) * 8 + j % 8, mask=mask, other=0).to(tl.float32)
    ks = tl.load(tab_ptr + 4096 + (qs >> 9), mask=mask, other=0).to(tl.int32)
    sc = tl.load(q_ptr + base + 66 + j // 32, mask=mask, other=0).to(tl.int32)
    s = ((sc >> (4 * ((j // 16) % 2))) & 0x0F).to(tl.float32)
    return _signed(d, s, g, (ks >> (j % 8)) & 1)


@triton.jit
def decode_iq2_s(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 82
    d = load_f16(q_ptr, base, mask)
    lo = tl.load(q_ptr + base + 2 + j // 8, mask=mask, other=0).to(tl.int32)
    qh = tl.load(q_ptr + base + 66 + j // 32, mask=mask, other=0).to(tl.int32)
    gi = lo | (((qh >> (2 * ((j // 8) % 4))) & 3) << 8)
    g = tl.load(tab_ptr + gi * 8 + j % 8, mask=mask, other=0).to(tl.float32)
    sb = tl.load(q_ptr + base + 34 + j // 8, mask=mask, other=0).to(tl.int32)
    sc = tl.load(q_ptr + base + 74 + j // 32, mask=mask, other=0).to(tl.int32)
    s = ((sc >> (4 * ((j // 16) % 2))) & 0x0F).to(tl.float32)
    return _signed(d, s, g, (sb >> (j % 8)) & 1)
