"""The decode of the split layout (triton_kernels/layout/split.py): four blocks' bodies, then
their heads, so that quants load as 8-byte words.

Per weight: `decode_<fmt>_split(q_ptr, tab_ptr, blk, j, mask)`, the GGUF decode's
arithmetic (`<fmt>_at`) at the block's split offsets. Int8 units: `unit_<fmt>_split(p, u,
tab_ptr, ASM)` with p = (b, h), b an int64 pointer at the block's body and h a uint16
pointer at its head, returning what the GGUF unit decode returns (decode/common.py).
`block_ptr` gives either kind of p from a block index, so a kernel serves both layouts.
"""
import triton
import triton.language as tl

from ..asm import pack16, prmt
from .common import f16_at, halves, hi_nibbles, hw, lo_nibbles
from .iq3 import _chunk, _s_chunk, iq3_s_at, iq3_xxs_at
from .iq4 import iq4_nl_at, looked_up
from .kquants import q3_k_at, q3_k_unit, q6_k_at, q6_k_unit
from .legacy import q4_0_at, q5_0_at, q5_words, q8_0_at

TILE_BLOCKS = tl.constexpr(4)  # layout/split.py's tile


@triton.jit
def split_at(blk, BB: tl.constexpr, BODY: tl.constexpr):
    """Byte offsets (head, body) of block `blk` in the split layout of BB-byte blocks, in
    int32 (layout.choose keeps tensors past 2 GiB in GGUF order) and without a division:
    body = blk * BODY + (blk // 4) * 4 * HEAD, head = blk * HEAD + (blk // 4 + 1) * 4 * BODY."""
    b = blk.to(tl.int32)
    tile = b >> 2
    return (b * (BB - BODY) + (tile + 1) * (TILE_BLOCKS * BODY),
            b * BODY + tile * (TILE_BLOCKS * (BB - BODY)))


@triton.jit
def block_ptr(q_ptr, blk, BLOCK_HW: tl.constexpr, BODY: tl.constexpr):
    """What a unit decode takes for block `blk` of the uint16 blocks at q_ptr: a uint16
    pointer at the block (GGUF order, BODY 0), or (int64 body pointer, uint16 head pointer)."""
    if BODY == 0:
        return q_ptr + blk * BLOCK_HW
    else:
        # split_at's offsets counted in int64 words and halfwords
        b = blk.to(tl.int32)
        tile = b >> 2
        HEAD: tl.constexpr = 2 * BLOCK_HW - BODY
        return (q_ptr.to(tl.pointer_type(tl.int64)) + (b * (BODY // 8) + tile * (HEAD // 2)),
                q_ptr + (b * (HEAD // 2) + (tile + 1) * (2 * BODY)))


@triton.jit
def _word_of(b, i, u, ASM: tl.constexpr):
    """The int32 word u % 2 of the int64 word at b + i + u // 2: picked by a PRMT, which
    keeps what is computed from it in 32 bits (as _byte)."""
    lo, hi = halves(tl.load(b + i + u // 2))
    return prmt(lo, hi, 0x3210 + (u % 2) * 0x4444, ASM)


@triton.jit
def _byte(w, k: tl.constexpr, ASM: tl.constexpr):
    """Byte k of int32 w, zero-extended: one PRMT, which keeps the table address that
    follows in 32 bits (from shifts of a 64-bit load the compiler builds 64-bit ones)."""
    return prmt(w, tl.zeros_like(w), 0x4440 + k, ASM)


# --- per weight ----------------------------------------------------------------------------

@triton.jit
def decode_q8_0_split(q_ptr, tab_ptr, blk, j, mask):
    head, body = split_at(blk, 34, 32)
    return q8_0_at(q_ptr, tab_ptr, head, body, j, mask)


@triton.jit
def decode_q4_0_split(q_ptr, tab_ptr, blk, j, mask):
    head, body = split_at(blk, 18, 16)
    return q4_0_at(q_ptr, tab_ptr, head, body, j, mask)


@triton.jit
def decode_q5_0_split(q_ptr, tab_ptr, blk, j, mask):
    head, body = split_at(blk, 22, 16)
    return q5_0_at(q_ptr, tab_ptr, head, body, j, mask)


@triton.jit
def decode_q3_k_split(q_ptr, tab_ptr, blk, j, mask):
    head, body = split_at(blk, 110, 96)
    return q3_k_at(q_ptr, tab_ptr, head, body, j, mask)


@triton.jit
def decode_q6_k_split(q_ptr, tab_ptr, blk, j, mask):
    head, body = split_at(blk, 210, 192)
    return q6_k_at(q_ptr, tab_ptr, head, body, j, mask)


@triton.jit
def decode_iq4_nl_split(q_ptr, tab_ptr, blk, j, mask):
    head, body = split_at(blk, 18, 16)
    return iq4_nl_at(q_ptr, tab_ptr, head, body, j, mask)


@triton.jit
def decode_iq3_xxs_split(q_ptr, tab_ptr, blk, j, mask):
    head, body = split_at(blk, 98, 96)
    return iq3_xxs_at(q_ptr, tab_ptr, head, body, j, mask)


@triton.jit
def decode_iq3_s_split(q_ptr, tab_ptr, blk, j, mask):
    head, body = split_at(blk, 110, 104)
    return iq3_s_at(q_ptr, tab_ptr, head, head + 2, body, j, mask)


# --- int8 units ----------------------------------------------------------------------------

@triton.jit
def unit_q8_0_split(p, u, tab_ptr, ASM: tl.constexpr):
    """Q8_0: 32 int8 in four int64 words; weight = d * q."""
    b, h = p
    d = f16_at(h, 0)
    w0, w1 = halves(tl.load(b))
    w2, w3 = halves(tl.load(b + 1))
    w4, w5 = halves(tl.load(b + 2))
    w6, w7 = halves(tl.load(b + 3))
    return (w0, w1, w2, w3, w4, w5, w6, w7), (d,), (d,)


@triton.jit
def unit_q4_0_split(p, u, tab_ptr, ASM: tl.constexpr):
    """Q4_0: 16 nibble bytes in two int64 words; weight = d * (q - 8), ZERO = 8."""
    b, h = p
    d = f16_at(h, 0)
    r0, r1 = halves(tl.load(b))
    r2, r3 = halves(tl.load(b + 1))
    return ((lo_nibbles(r0), lo_nibbles(r1), lo_nibbles(r2), lo_nibbles(r3),
             hi_nibbles(r0), hi_nibbles(r1), hi_nibbles(r2), hi_nibbles(r3)),
            (d,), (d,))


@triton.jit
def unit_iq4_nl_split(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ4_NL: 16 nibble bytes in two int64 words; weight = d * KVALUES[q] (decode/iq4.py)."""
    b, h = p
    d = f16_at(h, 0)
    r0, r1 = halves(tl.load(b))
    r2, r3 = halves(tl.load(b + 1))
    return looked_up(r0, r1, r2, r3, tab_ptr, ASM), (d,), (d,)


@triton.jit
def unit_iq3_xxs_split(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ3_XXS group u (0..7): its 8 grid indices are int64 word u of the body, its
    scale/sign word (decode/iq3.py) half of word 8 + u // 2."""
    b, h = p
    d = f16_at(h, 0)
    sw = _word_of(b, 8, u, ASM)
    a = d * (0.5 + ((sw >> 28) & 0xF).to(tl.float32)) * 0.5
    lo, hi = halves(tl.load(b + u))
    w0, w1 = _chunk(tab_ptr, _byte(lo, 0, ASM), _byte(lo, 1, ASM), 256, sw & 0x7F)
    w2, w3 = _chunk(tab_ptr, _byte(lo, 2, ASM), _byte(lo, 3, ASM), 256, (sw >> 7) & 0x7F)
    w4, w5 = _chunk(tab_ptr, _byte(hi, 0, ASM), _byte(hi, 1, ASM), 256, (sw >> 14) & 0x7F)
    w6, w7 = _chunk(tab_ptr, _byte(hi, 2, ASM), _byte(hi, 3, ASM), 256, (sw >> 21) & 0x7F)
    return (w0, w1, w2, w3, w4, w5, w6, w7), (a,), (a,)


@triton.jit
def unit_iq3_s_split(p, u, tab_ptr, ASM: tl.constexpr):
    """IQ3_S group u (0..7): index low bytes are int64 word u of the body, their 9th bits
    byte u of word 8, the sign bytes half of word 9 + u // 2; the head holds d and the
    four scale bytes (decode/iq3.py)."""
    b, h = p
    d = f16_at(h, 0)
    s = (hw(h, 1 + u // 4).to(tl.int32) >> (4 * (u % 4))) & 0xF
    a = d * (1 + 2 * s).to(tl.float32)
    q_lo, q_hi = halves(tl.load(b + 8))
    qh = (tl.where(u < 4, q_lo, q_hi) >> (8 * (u % 4))) & 0xFF
    sw = _word_of(b, 9, u, ASM)
    lo, hi = halves(tl.load(b + u))
    w0, w1 = _s_chunk(tab_ptr, lo & 0xFFFF, qh, 0, sw & 0xFF)
    w2, w3 = _s_chunk(tab_ptr, (lo >> 16) & 0xFFFF, qh, 2, (sw >> 8) & 0xFF)
    w4, w5 = _s_chunk(tab_ptr, hi & 0xFFFF, qh, 4, (sw >> 16) & 0xFF)
    w6, w7 = _s_chunk(tab_ptr, (hi >> 16) & 0xFFFF, qh, 6, (sw >> 24) & 0xFF)
    return (w0, w1, w2, w3, w4, w5, w6, w7), (a,), (a,)


@triton.jit
def _words(b, i: tl.constexpr, n: tl.constexpr):
    """The 2n int32 words of the n int64 words from b + i."""
    out = ()
    for k in tl.static_range(n):
        lo, hi = halves(tl.load(b + i + k))
        out = out + (lo, hi)
    return out


@triton.jit
def unit_q5_0_split(p, u, tab_ptr, ASM: tl.constexpr):
    """Q5_0: 16 nibble bytes in two int64 words; the head holds d and qh; ZERO = 16."""
    b, h = p
    d = f16_at(h, 0)
    return q5_words(_words(b, 0, 2), pack16(hw(h, 1), hw(h, 2), ASM)), (d,), (d,)


@triton.jit
def unit_q3_k_split(p, u, tab_ptr, ASM: tl.constexpr):
    """Q3_K half u: hmask is int64 words 0-3 of the body, qs's half u words 4 + 4u..; the
    head holds the 12 scale bytes and d (decode/kquants.py: q3_k_unit)."""
    b, h = p
    return q3_k_unit(_words(b + 4 * u, 4, 4), _words(b, 0, 4), pack16(hw(h, 0), hw(h, 1), ASM),
                     pack16(hw(h, 2), hw(h, 3), ASM), pack16(hw(h, 4), hw(h, 5), ASM), f16_at(h, 6), u)


@triton.jit
def unit_q6_k_split(p, u, tab_ptr, ASM: tl.constexpr):
    """Q6_K half u: ql's half u is int64 words 8u.. of the body, qh's 16 + 4u..; the head
    holds the 16 scale bytes and d (decode/kquants.py: q6_k_unit)."""
    b, h = p
    return q6_k_unit(_words(b + 8 * u, 0, 8), _words(b + 4 * u, 16, 4), pack16(hw(h, 4 * u), hw(h, 4 * u + 1), ASM),
                     pack16(hw(h, 4 * u + 2), hw(h, 4 * u + 3), ASM), f16_at(h, 8))
