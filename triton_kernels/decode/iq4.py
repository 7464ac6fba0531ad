"""IQ4_NL (32 weights a block, d * KVALUES[nibble]) and IQ4_XS (256 weights, a 6-bit scale
per 32); layouts in quant/iq4.py. Table: the 16 int8 values."""
import triton
import triton.language as tl

from ..asm import pack16, prmt
from .common import f16_at, halves, hw, load_f16, load_u16
from .legacy import nibble, nibble_words


@triton.jit
def iq4_nl_at(q_ptr, tab_ptr, head, body, j, mask):
    d = load_f16(q_ptr, head, mask)
    code = nibble(q_ptr, body, j, mask)
    v = tl.load(tab_ptr + code, mask=mask, other=0).to(tl.int8, bitcast=True)
    return d * v.to(tl.float32)


@triton.jit
def decode_iq4_nl(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 18
    return iq4_nl_at(q_ptr, tab_ptr, base, base + 2, j, mask)


@triton.jit
def decode_iq4_xs(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 136
    d = load_f16(q_ptr, base, mask)
    ib = j // 32
    sh = load_u16(q_ptr, base + 2, mask).to(tl.int32)
    sl = tl.load(q_ptr + base + 4 + ib // 2, mask=mask, other=0).to(tl.int32)
    ls = ((sl >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4)
    dl = d * (ls - 32).to(tl.float32)
    code = nibble(q_ptr, base + 8 + ib * 16, j % 32, mask)
    v = tl.load(tab_ptr + code, mask=mask, other=0).to(tl.int8, bitcast=True)
    return dl * v.to(tl.float32)


# --- int8 units (decode/common.py) ---------------------------------------------------------

@triton.jit
def _lut16(r, t0, t1, t2, t3, ASM: tl.constexpr):
    """Eight nibbles of r (byte k: weight k low, k + 16 high) looked up in the 16-byte
    table t0..t3 with byte permutes, as llama.cpp's get_int_from_table_16 does: returns
    (weights 0-3, weights 16-19) as int32 words of table bytes."""
    sel = r & 0x77777777
    half = ((r >> 1) & 0x44444444) | 0x32103210   # picks the table half by bit 3
    a = prmt(prmt(t0, t1, sel, ASM), prmt(t2, t3, sel, ASM), half, ASM)
    sel_b = sel >> 16
    half_b = half >> 16
    b = prmt(prmt(t0, t1, sel_b, ASM), prmt(t2, t3, sel_b, ASM), half_b, ASM)
    # a holds weights 0, 16, 1, 17 and b 2, 18, 3, 19: deinterleave
    return prmt(a, b, 0x6420, ASM), prmt(a, b, 0x7531, ASM)


@triton.jit
def _lut16_loads(r, tab_ptr):
    """_lut16 by table loads (int32 values from word 4 of the unit table): the twin of the
    byte permutes, cheaper under the interpreter; the device runs the permutes."""
    lo = (tl.load(tab_ptr + 4 + (r & 0xF)) & 0xFF) | ((tl.load(tab_ptr + 4 + ((r >> 8) & 0xF)) & 0xFF) << 8) \
        | ((tl.load(tab_ptr + 4 + ((r >> 16) & 0xF)) & 0xFF) << 16) | (tl.load(tab_ptr + 4 + ((r >> 24) & 0xF)) << 24)
    hi = (tl.load(tab_ptr + 4 + ((r >> 4) & 0xF)) & 0xFF) | ((tl.load(tab_ptr + 4 + ((r >> 12) & 0xF)) & 0xFF) << 8) \
        | ((tl.load(tab_ptr + 4 + ((r >> 20) & 0xF)) & 0xFF) << 16) | (tl.load(tab_ptr + 4 + ((r >> 28) & 0xF)) << 24)
    return lo, hi


@triton.jit
def unit_iq4_nl(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ4_NL: d | 16 nibble bytes; weight = d * KVALUES[q]. Table: KVALUES as 4 int32
    words (the permutes' operands), then as 16 int32 values (the twin's loads)."""
    d = f16_at(p, 0)
    r = nibble_words(p, 1, ASM)
    return looked_up(r[0], r[1], r[2], r[3], tab_ptr, ASM), (d,), (d,)


@triton.jit
def looked_up(r0, r1, r2, r3, tab_ptr, ASM: tl.constexpr):
    """The 32 nibbles of words r0..r3 (byte k: weight k low, k + 16 high) looked up in
    KVALUES: eight words of int8 values, weights 0-3 to 28-31. The unit table holds KVALUES
    as 4 int32 words (the permutes' operands), then as 16 int32 values (the twin's loads)."""
    if ASM == "":
        l0, h0 = _lut16_loads(r0, tab_ptr)
        l1, h1 = _lut16_loads(r1, tab_ptr)
        l2, h2 = _lut16_loads(r2, tab_ptr)
        l3, h3 = _lut16_loads(r3, tab_ptr)
    else:
        t0 = tl.load(tab_ptr)
        t1 = tl.load(tab_ptr + 1)
        t2 = tl.load(tab_ptr + 2)
        t3 = tl.load(tab_ptr + 3)
        l0, h0 = _lut16(r0, t0, t1, t2, t3, ASM)
        l1, h1 = _lut16(r1, t0, t1, t2, t3, ASM)
        l2, h2 = _lut16(r2, t0, t1, t2, t3, ASM)
        l3, h3 = _lut16(r3, t0, t1, t2, t3, ASM)
    return (l0, l1, l2, l3, h0, h1, h2, h3)


@triton.jit
def unit_iq4_xs(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ4_XS group u (0..7): d | scales_h (u16) | scales_l (4 bytes) | 8 x 16 nibble bytes;
    weight = (d * (ls - 32)) * KVALUES[q], ls = 4 bits of scales_l at 4u, 2 of scales_h at
    2u. A block is 136 bytes: the group's nibbles load as two int64 words."""
    d = f16_at(p, 0)
    sh = hw(p, 1).to(tl.int32)
    sl = pack16(hw(p, 2), hw(p, 3), ASM)
    ls = ((sl >> (4 * u)) & 0x0F) | (((sh >> (2 * u)) & 3) << 4)
    dl = d * (ls - 32).to(tl.float32)
    q = p.to(tl.pointer_type(tl.int64)) + (1 + 2 * u)
    r0, r1 = halves(tl.load(q))
    r2, r3 = halves(tl.load(q + 1))
    return looked_up(r0, r1, r2, r3, tab_ptr, ASM), (dl,), (dl,)
