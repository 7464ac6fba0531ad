"""Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256 weights a block (layouts in quant/kquants.py)."""
import triton
import triton.language as tl

from .common import f16_at, halves, hi_nibbles, hw, lo_nibbles, load_f16, word_at


@triton.jit
def _byte(q_ptr, off, mask):
    return tl.load(q_ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _crumb(q_ptr, off, j, mask):
    """Weight j's 2-bit field of a 64-byte array at `off` (Q2_K, Q3_K qs; Q6_K qh)."""
    byte = _byte(q_ptr, off + (j // 128) * 32 + j % 32, mask)
    return (byte >> (2 * ((j % 128) // 32))) & 3


@triton.jit
def _bit(q_ptr, off, j, mask):
    """Weight j's bit of a 32-byte array at `off` (Q3_K hmask, Q5_K qh)."""
    return (_byte(q_ptr, off + j % 32, mask) >> (j // 32)) & 1


@triton.jit
def _nibble(q_ptr, off, j, mask, WIDTH: tl.constexpr):
    """Weight j's nibble of a 128-byte array at `off`: runs of WIDTH weights alternate
    between the low and the high halves of the same WIDTH bytes."""
    byte = _byte(q_ptr, off + (j // (2 * WIDTH)) * WIDTH + j % WIDTH, mask)
    return tl.where((j // WIDTH) % 2 == 0, byte & 0x0F, byte >> 4)


@triton.jit
def decode_q2_k(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 84
    d = load_f16(q_ptr, base + 80, mask)
    dmin = load_f16(q_ptr, base + 82, mask)
    s = _byte(q_ptr, base + j // 16, mask)
    dl = d * (s & 0x0F).to(tl.float32)
    ml = dmin * (s >> 4).to(tl.float32)
    q = _crumb(q_ptr, base + 16, j, mask).to(tl.float32)
    return dl * q - ml  # exact only without FMA contraction (enable_fp_fusion=False)


# `*_at(q_ptr, tab_ptr, head, body, j, mask)`: weight j of the block whose scales start at
# byte `head` and quants at byte `body`: GGUF order or the split layout's (decode/split.py)

@triton.jit
def q3_k_at(q_ptr, tab_ptr, head, body, j, mask):
    """head: the 12 scale bytes, then d; body: hmask (32 bytes), then qs (64)."""
    d = load_f16(q_ptr, head + 12, mask)
    i = j // 16
    lo = (_byte(q_ptr, head + i % 8, mask) >> (4 * (i // 8))) & 0x0F
    hi = (_byte(q_ptr, head + 8 + i % 4, mask) >> (2 * (i // 4))) & 0x03
    dl = d * ((lo | (hi << 4)) - 32).to(tl.float32)
    q = _crumb(q_ptr, body + 32, j, mask) - ((_bit(q_ptr, body, j, mask) ^ 1) << 2)
    return dl * q.to(tl.float32)


@triton.jit
def decode_q3_k(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 110
    return q3_k_at(q_ptr, tab_ptr, base + 96, base, j, mask)


@triton.jit
def _k_scaled(q_ptr, base, j, q, mask):
    """Q4_K/Q5_K: (d * sc) * q - (dmin * m) for weight j's sub-block j // 32."""
    d = load_f16(q_ptr, base, mask)
    dmin = load_f16(q_ptr, base + 2, mask)
    i = j // 32
    a = _byte(q_ptr, base + 4 + i % 4, mask)
    b = _byte(q_ptr, base + 8 + i % 4, mask)
    c = _byte(q_ptr, base + 12 + i % 4, mask)
    low = i < 4
    sc = tl.where(low, a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30))
    m = tl.where(low, b & 0x3F, (c >> 4) | ((b >> 2) & 0x30))
    dl = d * sc.to(tl.float32)
    ml = dmin * m.to(tl.float32)
    return dl * q.to(tl.float32) - ml  # exact only without FMA contraction


@triton.jit
def decode_q4_k(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 144
    q = _nibble(q_ptr, base + 16, j, mask, 32)
    return _k_scaled(q_ptr, base, j, q, mask)


@triton.jit
def decode_q5_k(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 176
    q = _nibble(q_ptr, base + 48, j, mask, 32) | (_bit(q_ptr, base + 16, j, mask) << 4)
    return _k_scaled(q_ptr, base, j, q, mask)


@triton.jit
def q6_k_at(q_ptr, tab_ptr, head, body, j, mask):
    """head: the 16 int8 scales, then d; body: ql (128 bytes), then qh (64)."""
    d = load_f16(q_ptr, head + 16, mask)
    sc = tl.load(q_ptr + head + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
    dl = d * sc.to(tl.float32)
    q = (_nibble(q_ptr, body, j, mask, 64) | (_crumb(q_ptr, body + 128, j, mask) << 4)) - 32
    return dl * q.to(tl.float32)


@triton.jit
def decode_q6_k(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 210
    return q6_k_at(q_ptr, tab_ptr, base + 192, base, j, mask)


# --- int8 units (decode/common.py) ---------------------------------------------------------

@triton.jit
def _k_scale_min(a, b, c, j: tl.constexpr, low):
    """6-bit scale and min of sub-block 2u + j from the halfwords a, b, c that hold bytes
    4 + i % 4, 8 + i % 4, 12 + i % 4 of its pair of sub-blocks (k_scale_min in quant/)."""
    a = (a >> (8 * j)) & 0xFF
    b = (b >> (8 * j)) & 0xFF
    c = (c >> (8 * j)) & 0xFF
    sc = tl.where(low, a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30))
    m = tl.where(low, b & 0x3F, (c >> 4) | ((b >> 2) & 0x30))
    return sc, m


@triton.jit
def k_scales_mins(p, u):
    """Q4_K and Q5_K unit u (sub-blocks 2u, 2u + 1): the scales (d * sc) and offsets
    (dmin * m) of its two groups, from d, dmin and the 12 scale bytes at the block's start."""
    d = f16_at(p, 0)
    dmin = f16_at(p, 1)
    ha = hw(p, 2 + u % 2).to(tl.int32)
    hb = hw(p, 4 + u % 2).to(tl.int32)
    hc = hw(p, 6 + u % 2).to(tl.int32)
    low = u < 2
    sc0, m0 = _k_scale_min(ha, hb, hc, 0, low)
    sc1, m1 = _k_scale_min(ha, hb, hc, 1, low)
    return ((d * sc0.to(tl.float32), d * sc1.to(tl.float32)),
            (dmin * m0.to(tl.float32), dmin * m1.to(tl.float32)))


@triton.jit
def unit_q4_k(p, u, tab_ptr, ASM: tl.constexpr):
    """Q4_K unit u (0..3): 64 weights, sub-blocks 2u (low nibbles of bytes 16 + 32u..) and
    2u + 1 (high nibbles); weight = (d * sc) * q - dmin * m, OFFSET."""
    a, b = k_scales_mins(p, u)
    # the quants as int64 words: a block is 144 bytes and its quants start at byte 16, so
    # GGUF order already aligns them to 16 bytes (no device layout needed)
    q = p.to(tl.pointer_type(tl.int64)) + (2 + 4 * u)
    r0, r1 = halves(tl.load(q))
    r2, r3 = halves(tl.load(q + 1))
    r4, r5 = halves(tl.load(q + 2))
    r6, r7 = halves(tl.load(q + 3))
    return ((lo_nibbles(r0), lo_nibbles(r1), lo_nibbles(r2), lo_nibbles(r3),
             lo_nibbles(r4), lo_nibbles(r5), lo_nibbles(r6), lo_nibbles(r7),
             hi_nibbles(r0), hi_nibbles(r1), hi_nibbles(r2), hi_nibbles(r3),
             hi_nibbles(r4), hi_nibbles(r5), hi_nibbles(r6), hi_nibbles(r7)), a, b)


@triton.jit
def unit_q5_k(p, u, tab_ptr, ASM: tl.constexpr):
    """Q5_K unit u (0..3): Q4_K's 64 weights with their fifth bits, bits 2u and 2u + 1 of
    the 32 qh bytes (16-byte aligned at byte 16: a block is 176 bytes); OFFSET."""
    a, b = k_scales_mins(p, u)
    w = p.to(tl.pointer_type(tl.int64))
    h0, h1 = halves(tl.load(w + 2))
    h2, h3 = halves(tl.load(w + 3))
    h4, h5 = halves(tl.load(w + 4))
    h6, h7 = halves(tl.load(w + 5))
    q = w + (6 + 4 * u)
    r0, r1 = halves(tl.load(q))
    r2, r3 = halves(tl.load(q + 1))
    r4, r5 = halves(tl.load(q + 2))
    r6, r7 = halves(tl.load(q + 3))
    s = 2 * u
    return ((lo_nibbles(r0) | _fifth(h0, s), lo_nibbles(r1) | _fifth(h1, s),
             lo_nibbles(r2) | _fifth(h2, s), lo_nibbles(r3) | _fifth(h3, s),
             lo_nibbles(r4) | _fifth(h4, s), lo_nibbles(r5) | _fifth(h5, s),
             lo_nibbles(r6) | _fifth(h6, s), lo_nibbles(r7) | _fifth(h7, s),
             hi_nibbles(r0) | _fifth(h0, s + 1), hi_nibbles(r1) | _fifth(h1, s + 1),
             hi_nibbles(r2) | _fifth(h2, s + 1), hi_nibbles(r3) | _fifth(h3, s + 1),
             hi_nibbles(r4) | _fifth(h4, s + 1), hi_nibbles(r5) | _fifth(h5, s + 1),
             hi_nibbles(r6) | _fifth(h6, s + 1), hi_nibbles(r7) | _fifth(h7, s + 1)), a, b)


@triton.jit
def _fifth(h, bit):
    """Bit `bit` of each byte of h, moved to bit 4 (a fifth bit onto four nibbles)."""
    return ((h >> bit) & 0x01010101) << 4


# The 16-weight-scale formats' units (Q2_K, Q3_K, Q6_K) are half a block, 128 weights:
# a 32-weight group's codes lie in the same bytes as three others' (bit fields 2 or 4
# apart), so half a block is the smallest run that reads each byte once. They return one
# scale (and offset) per 16 weights; the kernels find that from the count (decode/common.py).

@triton.jit
def unit_q6_k(p, u, tab_ptr, ASM: tl.constexpr):
    """Q6_K half u (0, 1): ql (64 bytes at 64u), qh (32 bytes at 128 + 32u), 8 int8
    scales at 192 + 8u, d at 208; weight = (d * sc) * (q - 32), ZERO 32. A block is 210
    bytes, so words come from halfword pairs (the split layout's from int64 words)."""
    ql = p + 32 * u
    qh = p + 64 + 16 * u
    low = ()
    for i in tl.static_range(16):
        low = low + (word_at(ql, 2 * i, ASM),)
    high = ()
    for i in tl.static_range(8):
        high = high + (word_at(qh, 2 * i, ASM),)
    sc = p + 96 + 4 * u
    return q6_k_unit(low, high, word_at(sc, 0, ASM), word_at(sc, 2, ASM), f16_at(p, 104))


@triton.jit
def q6_k_unit(low, high, s03, s47, d):
    """A Q6_K half from its words: ql's 16 (group g of 32 takes words 8 (g % 2).., low
    nibbles for g < 2), qh's 8 (group g takes bits 2g, 2g + 1), its 8 scale bytes."""
    words = ()
    for g in tl.static_range(4):
        for i in tl.static_range(8):
            lo = (low[8 * (g % 2) + i] >> (4 * (g // 2))) & 0x0F0F0F0F
            words = words + (lo | (((high[i] >> (2 * g)) & 0x03030303) << 4),)
    scales = (d * _sbyte_f(s03, 0), d * _sbyte_f(s03, 1), d * _sbyte_f(s03, 2), d * _sbyte_f(s03, 3),
              d * _sbyte_f(s47, 0), d * _sbyte_f(s47, 1), d * _sbyte_f(s47, 2), d * _sbyte_f(s47, 3))
    return words, scales, scales


@triton.jit
def _sbyte_f(w, k: tl.constexpr):
    """Signed byte k of int32 w as float32."""
    return ((w << (24 - 8 * k)) >> 24).to(tl.float32)


@triton.jit
def unit_q3_k(p, u, tab_ptr, ASM: tl.constexpr):
    """Q3_K half u (0, 1): hmask (32 bytes at 0), qs (32 bytes at 32 + 32u), 12 scale
    bytes at 96, d at 108; weight = (d * (sc - 32)) * q. A block is 110 bytes: words from
    halfword pairs (the split layout's from int64 words)."""
    qs = p + 16 + 16 * u
    crumbs = ()
    marks = ()
    for i in tl.static_range(8):
        crumbs = crumbs + (word_at(qs, 2 * i, ASM),)
        marks = marks + (word_at(p, 2 * i, ASM),)
    return q3_k_unit(crumbs, marks, word_at(p, 48, ASM), word_at(p, 50, ASM), word_at(p, 52, ASM),
                     f16_at(p, 54), u)


@triton.jit
def q3_k_unit(crumbs, marks, lo0, lo1, hi, d, u):
    """A Q3_K half u from its words: qs's 8 (group g of 32 takes bits 2g, 2g + 1), hmask's
    8 (group g takes bit 4u + g), the scale bytes 0-3 (lo0: low nibbles scales 0-3, high
    8-11), 4-7 (lo1) and 8-11 (hi: bits 4-5 of scale k at bit 8 (k % 4) + 2 (k // 4)).
    q = crumb - 4 where the hmask bit is clear: signed codes, ZERO 0."""
    words = ()
    for g in tl.static_range(4):
        for i in tl.static_range(8):
            clear = (~marks[i] >> (4 * u + g)) & 0x01010101
            words = words + (((crumbs[i] >> (2 * g)) & 0x03030303) | (clear * 0xFC),)  # crumb - 4, signed
    scales = ()
    for k in tl.static_range(8):
        lo = ((lo0 if k < 4 else lo1) >> (8 * (k % 4) + 4 * u)) & 0x0F
        top = (hi >> (8 * (k % 4) + 2 * (2 * u + k // 4))) & 0x03
        scales = scales + (d * ((lo | (top << 4)) - 32).to(tl.float32),)
    return words, scales, scales


@triton.jit
def unit_q2_k(p, u, tab_ptr, ASM: tl.constexpr):
    """Q2_K half u (0, 1): 16 scale bytes at 0 (scale in the low nibble, min in the high),
    qs (32 bytes at 16 + 32u), d at 80, dmin at 82; weight = (d * sc) * q - dmin * m,
    OFFSET. Group g takes qs bits 2g, 2g + 1. A block is 84 bytes: int32 loads."""
    d = f16_at(p, 40)
    dmin = f16_at(p, 41)
    w = p.to(tl.pointer_type(tl.int32))
    s0 = tl.load(w + 2 * u)
    s1 = tl.load(w + 2 * u + 1)
    q = w + (4 + 8 * u)
    crumbs = ()
    for i in tl.static_range(8):
        crumbs = crumbs + (tl.load(q + i),)
    words = ()
    for g in tl.static_range(4):
        for i in tl.static_range(8):
            words = words + ((crumbs[i] >> (2 * g)) & 0x03030303,)
    a = ()
    b = ()
    for k in tl.static_range(8):
        s = ((s0 if k < 4 else s1) >> (8 * (k % 4))) & 0xFF
        a = a + (d * (s & 0x0F).to(tl.float32),)
        b = b + (dmin * (s >> 4).to(tl.float32),)
    return words, a, b
