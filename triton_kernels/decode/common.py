"""Byte-assembly helpers shared by the decode functions (blocks are only 2-byte aligned)."""
import triton
import triton.language as tl

from ..asm import pack16


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


@triton.jit
def negate_where(v, minus):
    """v, negated where `minus` is non-zero: as a product, since -v is 0 - v on a GPU and
    -0 would come out +0."""
    return v * tl.where(minus != 0, -1.0, 1.0)


@triton.jit
def xxs_scale_sign(word, j, ksigns_ptr, mask):
    """IQ2_XXS and IQ3_XXS: a 32-weight group's u32 holds a 4-bit scale on top and, under
    it, a 7-bit KSIGNS index per 8 weights. Returns (the scale as float32, weight j's sign
    bit) with KSIGNS at ksigns_ptr."""
    s = (word >> 28).to(tl.float32)
    sidx = ((word >> (7 * ((j % 32) // 8)).to(tl.uint32)) & 0x7F).to(tl.int32)
    ks = tl.load(ksigns_ptr + sidx, mask=mask, other=0).to(tl.int32)
    return s, (ks >> (j % 8)) & 1


@triton.jit
def round_to_bf16_bits(v):
    """float32 -> bf16 bit patterns (as int16, for a store through an int16 view), rounded to
    nearest even, NaN kept quiet: by hand, because the interpreter holds bf16 as raw uint16
    and a bf16 cast there is not to be trusted."""
    u = v.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


# --- int8 units (the dp4a kernels' decode) -------------------------------------------------
# A unit decode reads one unit (32, 64 or 128 weights) of every block that a pointer tensor
# `p` (uint16: blocks are 2-byte aligned, so two 16-bit loads and one PRMT make a word)
# points at, and returns (words, a, b): a tuple of int32 words, each four signed 8-bit codes
# of consecutive weights, and per 32-weight group (or per 16, for the formats that scale
# each 16: Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S, IQ1_M) the float32 scale a and offset b, such that
#     weight = a * (code - ZERO) - b          (the format's ZERO and OFFSET, decode.UNITS)
# with the float operations in the numpy codec's order, so dequant stays bit-exact. The
# kernels tell the two apart by the count: len(a) is UW // 32 or UW // 16.


@triton.jit
def scale_of(a, w: tl.constexpr, UW: tl.constexpr):
    """The scale (or offset) in `a` of a UW-weight unit's word w."""
    return a[w // (UW // 4 // len(a))]

@triton.jit
def hw(p, off):
    """The uint16 at halfword offset `off` of each block."""
    return tl.load(p + off)


@triton.jit
def f16_at(p, off):
    return tl.load(p + off).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def word_at(p, off, ASM: tl.constexpr):
    """The int32 at halfword offset `off` (2-byte aligned) of each block."""
    return pack16(tl.load(p + off), tl.load(p + off + 1), ASM)


@triton.jit
def halves(v):
    """An int64 word (8-byte loads) -> its low and high int32 words."""
    return v.to(tl.int32), (v >> 32).to(tl.int32)


@triton.jit
def lo_nibbles(r):
    return r & 0x0F0F0F0F


@triton.jit
def hi_nibbles(r):
    return (r >> 4) & 0x0F0F0F0F
