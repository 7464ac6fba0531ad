"""FP8_E4M3 (e4m3fn, one weight a byte; layout in quant/fp8.py), decoded on the bits."""
import triton
import triton.language as tl


@triton.jit
def decode_fp8_e4m3(q_ptr, tab_ptr, blk, j, mask):
    b = tl.load(q_ptr + blk, mask=mask, other=0).to(tl.uint32)
    sign = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 7
    # normal: rebias the exponent 7 -> 127 and move the 3 mantissa bits to the top of fp32's
    normal = sign | ((e + 120) << 23) | (m << 20)
    # subnormal: m * 2^-9 is exact in float32; the sign goes on the bits, so 0x80 is -0.0
    sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True) | sign
    bits = tl.where(e == 0, sub, normal)
    bits = tl.where((b & 0x7F) == 0x7F, sign | 0x7FC00000, bits)  # the only NaNs; no Inf
    return bits.to(tl.float32, bitcast=True)
