"""IQ2_XXS, IQ2_XS and IQ2_S: 256 weights a block (layouts in quant/iq2.py).

Tables (triton_kernels.decode.table): grid bytes (8 a entry) from 0, then for IQ2_XXS
(2048 grid bytes) and IQ2_XS (4096) the 128 ksigns bytes.
"""
import triton
import triton.language as tl

from .common import f16_at, halves, hw, load_f16, load_u16, load_u32, negate_where, word_at, xxs_scale_sign


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


# --- int8 units (decode/common.py) ---------------------------------------------------------
# The unit table (decode.unit_table): each grid entry as two int32 words (8 bytes), then
# the sign patterns as two words of 0x00/0x01 bytes each (bit i set: weight i negative;
# IQ2_XXS and IQ2_XS: the 128 KSIGNS patterns, IQ2_S: all 256 sign bytes), from word
# SIGNS. Grid bytes are 8, 25 or 43, never 0, so (g ^ -m) + m, bytewise, negates exactly
# the bytes where m is 1 with no carry between bytes (as IQ3's, decode/iq3.py).

@triton.jit
def _chunk8(tab_ptr, gi, SIGNS: tl.constexpr, pattern):
    """Eight weights: grid entry gi with sign pattern `pattern`, as two int32 words."""
    t = tab_ptr.to(tl.pointer_type(tl.int64))
    g0, g1 = halves(tl.load(t + gi))
    m0, m1 = halves(tl.load(t + (SIGNS // 2 + pattern)))
    return (g0 ^ (m0 * 255)) + m0, (g1 ^ (m1 * 255)) + m1


@triton.jit
def _db(d, s):
    """d * (0.5 + s) * 0.25 for the integer s, in the numpy codec's order."""
    return d * (0.5 + s.to(tl.float32)) * 0.25


@triton.jit
def unit_iq2_xxs(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ2_XXS group u (0..7): 4 grid index bytes at halfword 1 + 4u, the scale/sign word
    at 3 + 4u (four 7-bit KSIGNS indices, the 4-bit scale on top); weight = db * (+-g)."""
    d = f16_at(p, 0)
    idx = word_at(p, 1 + 4 * u, ASM)
    sw = word_at(p, 3 + 4 * u, ASM)
    a = _db(d, (sw >> 28) & 0xF)
    w0, w1 = _chunk8(tab_ptr, idx & 0xFF, 512, sw & 0x7F)
    w2, w3 = _chunk8(tab_ptr, (idx >> 8) & 0xFF, 512, (sw >> 7) & 0x7F)
    w4, w5 = _chunk8(tab_ptr, (idx >> 16) & 0xFF, 512, (sw >> 14) & 0x7F)
    w6, w7 = _chunk8(tab_ptr, (idx >> 24) & 0xFF, 512, (sw >> 21) & 0x7F)
    return (w0, w1, w2, w3, w4, w5, w6, w7), (a,), (a,)


@triton.jit
def unit_iq2_xs(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ2_XS group u (0..7): four u16 at halfword 1 + 4u (a 9-bit grid index, a 7-bit
    KSIGNS index on top), scale byte 66 + u (a nibble a 16 weights)."""
    d = f16_at(p, 0)
    sc = (hw(p, 33 + u // 2).to(tl.int32) >> (8 * (u % 2))) & 0xFF
    q0 = hw(p, 1 + 4 * u).to(tl.int32)
    q1 = hw(p, 2 + 4 * u).to(tl.int32)
    q2 = hw(p, 3 + 4 * u).to(tl.int32)
    q3 = hw(p, 4 + 4 * u).to(tl.int32)
    w0, w1 = _chunk8(tab_ptr, q0 & 511, 1024, q0 >> 9)
    w2, w3 = _chunk8(tab_ptr, q1 & 511, 1024, q1 >> 9)
    w4, w5 = _chunk8(tab_ptr, q2 & 511, 1024, q2 >> 9)
    w6, w7 = _chunk8(tab_ptr, q3 & 511, 1024, q3 >> 9)
    a = (_db(d, sc & 0xF), _db(d, sc >> 4))
    return (w0, w1, w2, w3, w4, w5, w6, w7), a, a


@triton.jit
def unit_iq2_s(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ2_S group u (0..7): 4 grid index low bytes at byte 2 + 4u, their 9th and 10th
    bits in byte 66 + u (2 a chunk), 4 sign bytes at 34 + 4u, scale byte 74 + u."""
    d = f16_at(p, 0)
    lo = word_at(p, 1 + 2 * u, ASM)
    sb = word_at(p, 17 + 2 * u, ASM)
    qh = (hw(p, 33 + u // 2).to(tl.int32) >> (8 * (u % 2))) & 0xFF
    sc = (hw(p, 37 + u // 2).to(tl.int32) >> (8 * (u % 2))) & 0xFF
    w0, w1 = _chunk8(tab_ptr, (lo & 0xFF) | ((qh & 3) << 8), 2048, sb & 0xFF)
    w2, w3 = _chunk8(tab_ptr, ((lo >> 8) & 0xFF) | (((qh >> 2) & 3) << 8), 2048, (sb >> 8) & 0xFF)
    w4, w5 = _chunk8(tab_ptr, ((lo >> 16) & 0xFF) | (((qh >> 4) & 3) << 8), 2048, (sb >> 16) & 0xFF)
    w6, w7 = _chunk8(tab_ptr, ((lo >> 24) & 0xFF) | (((qh >> 6) & 3) << 8), 2048, (sb >> 24) & 0xFF)
    a = (_db(d, sc & 0xF), _db(d, sc >> 4))
    return (w0, w1, w2, w3, w4, w5, w6, w7), a, a
