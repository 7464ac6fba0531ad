"""IQ1_S and IQ1_M: 256 weights a block (layouts in quant/iq1.py).

Table (triton_kernels.decode.table): the grid, 2048 x 8 int8 values -1, 0, 1.
"""
import triton
import triton.language as tl

from .common import f16_at, halves, hw, load_f16, load_u16, word_at


@triton.jit
def _shifted(tab_ptr, idx, j, minus, dl, mask):
    g = tl.load(tab_ptr + idx * 8 + j % 8, mask=mask, other=0).to(tl.int8, bitcast=True)
    delta = tl.where(minus != 0, -0.125, 0.125)
    return dl * (g.to(tl.float32) + delta)


@triton.jit
def decode_iq1_s(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 50
    d = load_f16(q_ptr, base, mask)
    lo = tl.load(q_ptr + base + 2 + j // 8, mask=mask, other=0).to(tl.int32)
    qh = load_u16(q_ptr, base + 34 + (j // 32) * 2, mask).to(tl.int32)
    idx = lo | (((qh >> (3 * ((j // 8) % 4))) & 7) << 8)
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    return _shifted(tab_ptr, idx, j, qh & 0x8000, dl, mask)


@triton.jit
def decode_iq1_m(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 56
    w0 = load_u16(q_ptr, base + 48, mask)
    w1 = load_u16(q_ptr, base + 50, mask)
    w2 = load_u16(q_ptr, base + 52, mask)
    w3 = load_u16(q_ptr, base + 54, mask)
    bits = (w0 >> 12) | ((w1 >> 12) << 4) | ((w2 >> 12) << 8) | ((w3 >> 12) << 12)
    d = bits.to(tl.float16, bitcast=True).to(tl.float32)
    sub = j // 16
    w = load_u16(q_ptr, base + 48 + (sub // 4) * 2, mask).to(tl.int32)
    dl = d * (2 * ((w >> (3 * (sub % 4))) & 7) + 1).to(tl.float32)
    grp = j // 8
    lo = tl.load(q_ptr + base + grp, mask=mask, other=0).to(tl.int32)
    nb = tl.load(q_ptr + base + 32 + grp // 2, mask=mask, other=0).to(tl.int32)
    nib = (nb >> (4 * (grp % 2))) & 0x0F
    return _shifted(tab_ptr, lo | ((nib & 7) << 8), j, nib & 8, dl, mask)


# --- int8 units (decode/common.py) ---------------------------------------------------------
# weight = dl * (g + delta), delta = +-1/8, is (dl / 8) * (8g +- 1) to the bit: dl / 8 is
# exact (dl is at least fp16's least subnormal, far above float32's), and both are one
# rounding of the same real product. So a unit's codes are 8g +- 1 (-9..9, never 0) and
# its scale dl * 0.125. The unit table holds each grid entry as two int32 words of 8g + 1
# (entries 0..2047), then of 8g - 1 (2048..4095).

@triton.jit
def _entry(tab_ptr, idx, minus):
    """Eight codes 8g +- 1 of grid entry idx (delta -1/8 where minus), as two int32 words."""
    t = tab_ptr.to(tl.pointer_type(tl.int64))
    return halves(tl.load(t + (idx + tl.where(minus != 0, 2048, 0))))


@triton.jit
def unit_iq1_s(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ1_S group u (0..7): 4 grid index low bytes at byte 2 + 4u, the u16 at halfword 17
    + u (3 high index bits a chunk, a 3-bit scale at bit 12, the delta's sign on top)."""
    d = f16_at(p, 0)
    lo = word_at(p, 1 + 2 * u, ASM)
    qh = hw(p, 17 + u).to(tl.int32)
    a = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32) * 0.125
    minus = qh & 0x8000
    w0, w1 = _entry(tab_ptr, (lo & 0xFF) | ((qh & 7) << 8), minus)
    w2, w3 = _entry(tab_ptr, ((lo >> 8) & 0xFF) | (((qh >> 3) & 7) << 8), minus)
    w4, w5 = _entry(tab_ptr, ((lo >> 16) & 0xFF) | (((qh >> 6) & 7) << 8), minus)
    w6, w7 = _entry(tab_ptr, ((lo >> 24) & 0xFF) | (((qh >> 9) & 7) << 8), minus)
    return (w0, w1, w2, w3, w4, w5, w6, w7), (a,), (a,)


@triton.jit
def unit_iq1_m(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ1_M group u (0..7): 4 grid index low bytes at byte 4u, a nibble a chunk at
    halfword 16 + u (3 high index bits, the delta's sign), the 3-bit scales of its two 16s
    in the u16 at halfword 24 + u // 2, whose four top nibbles hold d's bits."""
    w0 = hw(p, 24)
    w1 = hw(p, 25)
    w2 = hw(p, 26)
    w3 = hw(p, 27)
    bits = (w0 >> 12) | ((w1 >> 12) << 4) | ((w2 >> 12) << 8) | ((w3 >> 12) << 12)
    d = bits.to(tl.float16, bitcast=True).to(tl.float32)
    sw = hw(p, 24 + u // 2).to(tl.int32) >> (6 * (u % 2))
    a = (d * (2 * (sw & 7) + 1).to(tl.float32) * 0.125, d * (2 * ((sw >> 3) & 7) + 1).to(tl.float32) * 0.125)
    lo = word_at(p, 2 * u, ASM)
    nib = hw(p, 16 + u).to(tl.int32)
    c0, c1 = _entry(tab_ptr, (lo & 0xFF) | ((nib & 7) << 8), nib & 8)
    c2, c3 = _entry(tab_ptr, ((lo >> 8) & 0xFF) | (((nib >> 4) & 7) << 8), nib & 0x80)
    c4, c5 = _entry(tab_ptr, ((lo >> 16) & 0xFF) | (((nib >> 8) & 7) << 8), nib & 0x800)
    c6, c7 = _entry(tab_ptr, ((lo >> 24) & 0xFF) | (((nib >> 12) & 7) << 8), nib & 0x8000)
    return (c0, c1, c2, c3, c4, c5, c6, c7), a, a
