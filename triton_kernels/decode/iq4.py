"""IQ4_NL (32 weights a block, d * KVALUES[nibble]) and IQ4_XS (256 weights, a 6-bit scale
per 32); layouts in quant/iq4.py. Table: the 16 int8 values."""
import triton
import triton.language as tl

from .common import load_f16, load_u16
from .legacy import _nibble


@triton.jit
def decode_iq4_nl(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 18
    d = load_f16(q_ptr, base, mask)
    code = _nibble(q_ptr, base + 2, j, mask)
    v = tl.load(tab_ptr + code, mask=mask, other=0).to(tl.int8, bitcast=True)
    return d * v.to(tl.float32)


@triton.jit
def decode_iq4_xs(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 136
    d = load_f16(q_ptr, base, mask)
    ib = j // 32
    sh = load_u16(q_ptr, base + 2, mask).to(tl.int32)
    sl = tl.load(q_ptr + base + 4 + ib // 2, mask=mask, other=0).to(tl.int32)
    ls = ((sl >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4)
    dl = d * (ls - 32).to(tl.float32)
    code = _nibble(q_ptr, base + 8 + ib * 16, j % 32, mask)
    v = tl.load(tab_ptr + code, mask=mask, other=0).to(tl.int8, bitcast=True)
    return dl * v.to(tl.float32)
