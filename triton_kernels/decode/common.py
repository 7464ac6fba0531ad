"""Byte-assembly helpers shared by the decode functions (blocks are only 2-byte aligned)."""
import triton
import triton.language as tl


@triton.jit
def load_u16(q_ptr, off, mask):
    lo = tl.load(q_ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(q_ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return lo | (hi << 8)


@triton.jit
def load_u32(q_ptr, off, mask):
    lo = load_u16(q_ptr, off, mask).to(tl.uint32)
    hi = load_u16(q_ptr, off + 2, mask).to(tl.uint32)
    return lo | (hi << 16)


@triton.jit
def load_f16(q_ptr, off, mask):
    """A little-endian fp16 at byte offset `off`, widened to float32 (exact)."""
    return load_u16(q_ptr, off, mask).to(tl.float16, bitcast=True).to(tl.float32)
