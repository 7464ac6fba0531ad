"""IQ1_S and IQ1_M: 256 weights a block (layouts in quant/iq1.py).

Table (triton_kernels.decode.table): the grid, 2048 x 8 int8 values -1, 0, 1.
"""
import triton
import triton.language as tl

from .common import load_f16, load_u16


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
