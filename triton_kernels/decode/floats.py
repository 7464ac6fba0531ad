"""F32, F16, BF16: one weight a block, loaded as a word of its own width through a typed
pointer (q_ptr is the blocks' byte pointer, 16-byte aligned as torch allocates them, and
a row's bytes a multiple of the word): where a tile's weights are consecutive the loads
vectorize to 16 bytes a lane. Assembled from byte loads instead, the float GEMV spent 31
instructions a weight on sm_90 with 1-byte loads (F32 at Flash-Next's routers and QSA
indexer: 330 MB a token)."""
import triton
import triton.language as tl


@triton.jit
def decode_f32(q_ptr, tab_ptr, blk, j, mask):
    return tl.load(q_ptr.to(tl.pointer_type(tl.float32)) + blk, mask=mask, other=0.0)


@triton.jit
def decode_f16(q_ptr, tab_ptr, blk, j, mask):
    return tl.load(q_ptr.to(tl.pointer_type(tl.float16)) + blk, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def decode_bf16(q_ptr, tab_ptr, blk, j, mask):
    # bf16 is the top half of an fp32; never a bf16 dtype (the interpreter holds it as raw
    # uint16).
    w = tl.load(q_ptr.to(tl.pointer_type(tl.uint16)) + blk, mask=mask, other=0)
    return (w.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
