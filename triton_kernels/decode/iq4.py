"""IQ4_NL: 32 weights a block, d * KVALUES[nibble] (layout in quant/iq4.py)."""
import triton
import triton.language as tl

from .common import load_f16
from .legacy import _nibble


@triton.jit
def decode_iq4_nl(q_ptr, tab_ptr, blk, j, mask):
    base = blk * 18
    d = load_f16(q_ptr, base, mask)
    code = _nibble(q_ptr, base + 2, j, mask)
    v = tl.load(tab_ptr + code, mask=mask, other=0).to(tl.int8, bitcast=True)
    return d * v.to(tl.float32)
