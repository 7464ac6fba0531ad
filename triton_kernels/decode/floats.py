"""F32, F16, BF16: one weight a block."""
import triton
import triton.language as tl

from .common import load_f16, load_u16, load_u32


@triton.jit
def decode_f32(q_ptr, tab_ptr, blk, j, mask):
    return load_u32(q_ptr, blk * 4, mask).to(tl.float32, bitcast=True)


@triton.jit
def decode_f16(q_ptr, tab_ptr, blk, j, mask):
    return load_f16(q_ptr, blk * 2, mask)


@triton.jit
def decode_bf16(q_ptr, tab_ptr, blk, j, mask):
    # bf16 is the top half of an fp32; never a bf16 dtype (the interpreter holds it as raw
    # uint16).
    return (load_u16(q_ptr, blk * 2, mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
