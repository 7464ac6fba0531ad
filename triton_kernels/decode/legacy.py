"""Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32 weights a block (layouts in quant/legacy.py)."""
import triton
import triton.language as tl

from .common import f16_at, halves, hi_nibbles, lo_nibbles, load_f16, word_at


@triton.jit
def nibble(q_ptr, off, j, mask):
    """Weight j of a 16-byte nibble array at `off`: low halves hold 0..15, high 16..31."""
    byte = tl.load(q_ptr + off + (j % 16), mask=mask, other=0)
    return tl.where(j < 16, byte & 0x0F, byte >> 4)


# `*_at(q_ptr, tab_ptr, head, body, j, mask)`: weight j of the block whose scale is at
# byte `head` and quants at byte `body`: GGUF order (head + 2) or a device layout's
# (decode/split.py)

@triton.jit
def q8_0_at(q_ptr, tab_ptr, head, body, j, mask):
    d = load_f16(q_ptr, head, mask)
    q = tl.load(q_ptr + body + j, mask=mask, other=0).to(tl.int8, bitcast=True)
    return q.to(tl.float32) * d


@triton.jit
def decode_q8_0(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 34
    return q8_0_at(q_ptr, tab_ptr, base, base + 2, j, mask)


@triton.jit
def q4_0_at(q_ptr, tab_ptr, head, body, j, mask):
    d = load_f16(q_ptr, head, mask)
    q = nibble(q_ptr, body, j, mask).to(tl.int32) - 8
    return d * q.to(tl.float32)


@triton.jit
def decode_q4_0(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 18
    return q4_0_at(q_ptr, tab_ptr, base, base + 2, j, mask)


@triton.jit
def decode_q4_1(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 20
    d = load_f16(q_ptr, base, mask)
    m = load_f16(q_ptr, base + 2, mask)
    q = nibble(q_ptr, base + 4, j, mask).to(tl.float32)
    return d * q + m  # exact only without FMA contraction (enable_fp_fusion=False)


@triton.jit
def _q5(q_ptr, qh, qs, j, mask):
    """Weight j's 5-bit code: the fifth bit from the u32 at `qh`, the nibble from `qs`."""
    hb = (tl.load(q_ptr + qh + j // 8, mask=mask, other=0).to(tl.int32) >> (j % 8)) & 1
    return nibble(q_ptr, qs, j, mask).to(tl.int32) | (hb << 4)


@triton.jit
def q5_0_at(q_ptr, tab_ptr, head, body, j, mask):
    """head: d, then qh; body: the 16 nibble bytes."""
    d = load_f16(q_ptr, head, mask)
    q = _q5(q_ptr, head + 2, body, j, mask) - 16
    return d * q.to(tl.float32)


@triton.jit
def decode_q5_0(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 22
    return q5_0_at(q_ptr, tab_ptr, base, base + 6, j, mask)


@triton.jit
def decode_q5_1(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 24
    d = load_f16(q_ptr, base, mask)
    m = load_f16(q_ptr, base + 2, mask)
    q = _q5(q_ptr, base + 4, base + 8, j, mask).to(tl.float32)
    return d * q + m  # exact only without FMA contraction (enable_fp_fusion=False)


# --- int8 units (decode/common.py) ---------------------------------------------------------

@triton.jit
def unit_q8_0(p, u, tab_ptr, ASM: tl.constexpr):
    """Q8_0: d | 32 int8; one unit a block. weight = d * q."""
    d = f16_at(p, 0)
    return ((word_at(p, 1, ASM), word_at(p, 3, ASM), word_at(p, 5, ASM), word_at(p, 7, ASM),
             word_at(p, 9, ASM), word_at(p, 11, ASM), word_at(p, 13, ASM), word_at(p, 15, ASM)),
            (d,), (d,))


@triton.jit
def nibble_words(p, off, ASM: tl.constexpr):
    """32 weights of 16 nibble bytes at halfword `off` (byte i: weight i low, i + 16 high)."""
    r0 = word_at(p, off, ASM)
    r1 = word_at(p, off + 2, ASM)
    r2 = word_at(p, off + 4, ASM)
    r3 = word_at(p, off + 6, ASM)
    return (r0, r1, r2, r3)


@triton.jit
def negated(m):
    """-m with its zero's sign flipped too. Triton before 3.7 compiles a float's unary minus
    as 0 - m, which gives +0 for m = +0, and then d * q - (-m) is -0 for d = -0 where the
    codec's d * q + m is +0 (Triton 3.6, the lent GPUs', interpreted and compiled alike);
    a product with -1 is exact and keeps the sign."""
    return m * -1.0


@triton.jit
def unit_q4_1(p, u, tab_ptr, ASM: tl.constexpr):
    """Q4_1: d | m | 16 nibble bytes; weight = d * q + m, OFFSET with b = -m (d * q - (-m)
    is d * q + m to the bit, signed zeros too: `negated`). A block is 20 bytes: its nibbles
    lie 4-byte aligned at halfword 2 in GGUF order, read as four int32 words (no device
    layout needed)."""
    d = f16_at(p, 0)
    m = f16_at(p, 1)
    w = (p + 2).to(tl.pointer_type(tl.int32))
    r = (tl.load(w), tl.load(w + 1), tl.load(w + 2), tl.load(w + 3))
    return ((lo_nibbles(r[0]), lo_nibbles(r[1]), lo_nibbles(r[2]), lo_nibbles(r[3]),
             hi_nibbles(r[0]), hi_nibbles(r[1]), hi_nibbles(r[2]), hi_nibbles(r[3])),
            (d,), (negated(m),))


@triton.jit
def unit_q4_0(p, u, tab_ptr, ASM: tl.constexpr):
    """Q4_0: d | 16 nibble bytes; weight = d * (q - 8), ZERO = 8."""
    d = f16_at(p, 0)
    r = nibble_words(p, 1, ASM)
    return ((lo_nibbles(r[0]), lo_nibbles(r[1]), lo_nibbles(r[2]), lo_nibbles(r[3]),
             hi_nibbles(r[0]), hi_nibbles(r[1]), hi_nibbles(r[2]), hi_nibbles(r[3])),
            (d,), (d,))


@triton.jit
def _fifths(h):
    """The low 4 bits of h spread one a byte, to bit 4: the fifth bits of four weights."""
    return ((h & 0xF) * 0x00204081 & 0x01010101) << 4


@triton.jit
def q5_words(r, qh):
    """32 five-bit codes from nibble_words' r and the u32 of fifth bits (bit i: weight i)."""
    return (lo_nibbles(r[0]) | _fifths(qh), lo_nibbles(r[1]) | _fifths(qh >> 4),
            lo_nibbles(r[2]) | _fifths(qh >> 8), lo_nibbles(r[3]) | _fifths(qh >> 12),
            hi_nibbles(r[0]) | _fifths(qh >> 16), hi_nibbles(r[1]) | _fifths(qh >> 20),
            hi_nibbles(r[2]) | _fifths(qh >> 24), hi_nibbles(r[3]) | _fifths(qh >> 28))


@triton.jit
def unit_q5_0(p, u, tab_ptr, ASM: tl.constexpr):
    """Q5_0: d | qh (u32) | 16 nibble bytes; weight = d * (q - 16), ZERO 16. A block is 22
    bytes: words from halfword pairs."""
    d = f16_at(p, 0)
    return q5_words(nibble_words(p, 3, ASM), word_at(p, 1, ASM)), (d,), (d,)


@triton.jit
def unit_q5_1(p, u, tab_ptr, ASM: tl.constexpr):
    """Q5_1: d | m | qh (u32) | 16 nibble bytes; weight = d * q + m, OFFSET with b = -m (as
    Q4_1). A block is 24 bytes, so its qh loads as an int32 word and its nibbles, 8-byte
    aligned at byte 8, as two int64 words."""
    d = f16_at(p, 0)
    m = f16_at(p, 1)
    qh = tl.load((p + 2).to(tl.pointer_type(tl.int32)))
    q = (p + 4).to(tl.pointer_type(tl.int64))
    r0, r1 = halves(tl.load(q))
    r2, r3 = halves(tl.load(q + 1))
    return q5_words((r0, r1, r2, r3), qh), (d,), (negated(m),)
