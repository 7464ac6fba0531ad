"""Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256 weights a block (layouts in quant/kquants.py)."""
import triton
import triton.language as tl

from .common import f16_at, halves, hi_nibbles, hw, lo_nibbles, load_f16


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


@triton.jit
def decode_q3_k(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 110
    d = load_f16(q_ptr, base + 108, mask)
    i = j // 16
    lo = (_byte(q_ptr, base + 96 + i % 8, mask) >> (4 * (i // 8))) & 0x0F
    hi = (_byte(q_ptr, base + 104 + i % 4, mask) >> (2 * (i // 4))) & 0x03
    dl = d * ((lo | (hi << 4)) - 32).to(tl.float32)
    q = _crumb(q_ptr, base + 32, j, mask) - ((_bit(q_ptr, base, j, mask) ^ 1) << 2)
    return dl * q.to(tl.float32)


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
def decode_q6_k(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 210
    d = load_f16(q_ptr, base + 208, mask)
    sc = tl.load(q_ptr + base + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
    dl = d * sc.to(tl.float32)
    q = (_nibble(q_ptr, base, j, mask, 64) | (_crumb(q_ptr, base + 128, j, mask) << 4)) - 32
    return dl * q.to(tl.float32)


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
def unit_q4_k(p, u, tab_ptr, ASM: tl.constexpr):
    """Q4_K unit u (0..3): 64 weights, sub-blocks 2u (low nibbles of bytes 16 + 32u..) and
    2u + 1 (high nibbles); weight = (d * sc) * q - dmin * m, OFFSET."""
    d = f16_at(p, 0)
    dmin = f16_at(p, 1)
    ha = hw(p, 2 + u % 2).to(tl.int32)
    hb = hw(p, 4 + u % 2).to(tl.int32)
    hc = hw(p, 6 + u % 2).to(tl.int32)
    low = u < 2
    sc0, m0 = _k_scale_min(ha, hb, hc, 0, low)
    sc1, m1 = _k_scale_min(ha, hb, hc, 1, low)
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
             hi_nibbles(r4), hi_nibbles(r5), hi_nibbles(r6), hi_nibbles(r7)),
            (d * sc0.to(tl.float32), d * sc1.to(tl.float32)),
            (dmin * m0.to(tl.float32), dmin * m1.to(tl.float32)))
