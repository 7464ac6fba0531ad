"""IQ3_XXS and IQ3_S: 256 weights a block (layouts in quant/iq3.py).

Tables (triton_kernels.decode.table): IQ3_XXS grid bytes at 0..1023, ksigns at 1024..1151;
IQ3_S grid bytes at 0..2047.
"""
import triton
import triton.language as tl

from .common import f16_at, halves, hw, load_f16, load_u32, negate_where, word_at, xxs_scale_sign


# `*_at(q_ptr, tab_ptr, head, [scales,] body, j, mask)`: weight j of the block whose d is
# at byte `head`, IQ3_S's four scale bytes at `scales` and the bytes between (quants, high
# bits, signs) from byte `body`: GGUF order or a device layout's (decode/split.py)

@triton.jit
def iq3_xxs_at(q_ptr, tab_ptr, head, body, j, mask):
    d = load_f16(q_ptr, head, mask)
    gi = tl.load(q_ptr + body + j // 4, mask=mask, other=0).to(tl.int32)
    g = tl.load(tab_ptr + gi * 4 + j % 4, mask=mask, other=0).to(tl.float32)
    word = load_u32(q_ptr, body + 64 + (j // 32) * 4, mask)
    s, minus = xxs_scale_sign(word, j, tab_ptr + 1024, mask)
    return negate_where(d * (0.5 + s) * 0.5 * g, minus)


@triton.jit
def decode_iq3_xxs(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 98
    return iq3_xxs_at(q_ptr, tab_ptr, base, base + 2, j, mask)


@triton.jit
def iq3_s_at(q_ptr, tab_ptr, head, scales, body, j, mask):
    d = load_f16(q_ptr, head, mask)
    lo = tl.load(q_ptr + body + j // 4, mask=mask, other=0).to(tl.int32)
    qh = tl.load(q_ptr + body + 64 + j // 32, mask=mask, other=0).to(tl.int32)
    gi = lo | (((qh >> ((j // 4) % 8)) & 1) << 8)
    g = tl.load(tab_ptr + gi * 4 + j % 4, mask=mask, other=0).to(tl.float32)
    sb = tl.load(q_ptr + body + 72 + j // 8, mask=mask, other=0).to(tl.int32)
    minus = (sb >> (j % 8)) & 1
    sc = tl.load(q_ptr + scales + j // 64, mask=mask, other=0).to(tl.int32)
    s = (sc >> (4 * ((j // 32) % 2))) & 0x0F
    return negate_where(d * (1 + 2 * s).to(tl.float32) * g, minus)


@triton.jit
def decode_iq3_s(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 110
    return iq3_s_at(q_ptr, tab_ptr, base, base + 106, base + 2, j, mask)


# --- int8 units (decode/common.py) ---------------------------------------------------------
# Unit table (decode.unit_table): the grid as int32 words (4 unsigned bytes an entry) from
# 0, then for each sign pattern two words of 0x00/0x01 bytes, 1 where the weight is
# negative (IQ3_XXS: the 128 KSIGNS patterns at 256; IQ3_S: the 256 sign bytes at 512).
# Grid bytes are 4..62, never 0, so (g ^ -m) + m, bytewise, negates exactly the bytes
# where m is 1 with no carry between bytes.

@triton.jit
def _signed(tab_ptr, gi, m):
    g = tl.load(tab_ptr + gi)
    return (g ^ (m * 255)) + m


@triton.jit
def _chunk(tab_ptr, i0, i1, SIGNS: tl.constexpr, pattern):
    """Eight weights: grid entries i0, i1 with sign pattern `pattern` of the patterns from
    word SIGNS, whose two words load as one int64 (8-byte aligned: SIGNS is even)."""
    m0, m1 = halves(tl.load(tab_ptr.to(tl.pointer_type(tl.int64)) + (SIGNS // 2 + pattern)))
    return _signed(tab_ptr, i0, m0), _signed(tab_ptr, i1, m1)


@triton.jit
def unit_iq3_xxs(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ3_XXS group u (0..7): 8 index bytes at halfword 1 + 4u, the scale/sign word at
    33 + 2u (four 7-bit KSIGNS indices, the 4-bit scale on top); weight = db * (+-g)."""
    d = f16_at(p, 0)
    sw = word_at(p, 33 + 2 * u, ASM)
    a = d * (0.5 + ((sw >> 28) & 0xF).to(tl.float32)) * 0.5
    h0 = hw(p, 1 + 4 * u).to(tl.int32)
    h1 = hw(p, 2 + 4 * u).to(tl.int32)
    h2 = hw(p, 3 + 4 * u).to(tl.int32)
    h3 = hw(p, 4 + 4 * u).to(tl.int32)
    w0, w1 = _chunk(tab_ptr, h0 & 0xFF, h0 >> 8, 256, sw & 0x7F)
    w2, w3 = _chunk(tab_ptr, h1 & 0xFF, h1 >> 8, 256, (sw >> 7) & 0x7F)
    w4, w5 = _chunk(tab_ptr, h2 & 0xFF, h2 >> 8, 256, (sw >> 14) & 0x7F)
    w6, w7 = _chunk(tab_ptr, h3 & 0xFF, h3 >> 8, 256, (sw >> 21) & 0x7F)
    return (w0, w1, w2, w3, w4, w5, w6, w7), (a,), (a,)


@triton.jit
def _s_chunk(tab_ptr, h, qh, t: tl.constexpr, sb):
    i0 = (h & 0xFF) | (((qh >> t) & 1) << 8)
    i1 = (h >> 8) | (((qh >> (t + 1)) & 1) << 8)
    return _chunk(tab_ptr, i0, i1, 512, sb)


@triton.jit
def unit_iq3_s(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ3_S group u (0..7): index low bytes at halfword 1 + 4u, their 9th bits in byte
    66 + u, sign bytes 74 + 4u.., the scale nibble u of bytes 106..109;
    weight = d * (1 + 2s) * (+-g)."""
    d = f16_at(p, 0)
    s = (hw(p, 53 + u // 4).to(tl.int32) >> (4 * (u % 4))) & 0xF
    a = d * (1 + 2 * s).to(tl.float32)
    qh = (hw(p, 33 + u // 2).to(tl.int32) >> (8 * (u % 2))) & 0xFF
    s01 = hw(p, 37 + 2 * u).to(tl.int32)
    s23 = hw(p, 38 + 2 * u).to(tl.int32)
    w0, w1 = _s_chunk(tab_ptr, hw(p, 1 + 4 * u).to(tl.int32), qh, 0, s01 & 0xFF)
    w2, w3 = _s_chunk(tab_ptr, hw(p, 2 + 4 * u).to(tl.int32), qh, 2, s01 >> 8)
    w4, w5 = _s_chunk(tab_ptr, hw(p, 3 + 4 * u).to(tl.int32), qh, 4, s23 & 0xFF)
    w6, w7 = _s_chunk(tab_ptr, hw(p, 4 + 4 * u).to(tl.int32), qh, 6, s23 >> 8)
    return (w0, w1, w2, w3, w4, w5, w6, w7), (a,), (a,)
