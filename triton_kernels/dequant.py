"""Dequantization: GGUF blocks -> float tensors.

    dequantize(q, fmt, dtype=torch.float32) -> Tensor

`q` is a uint8 tensor of whole blocks along its last axis (1-D, or row-major 2-D with one
tensor row per row); the result has the same leading axes and `k * block_elems` values
per row. Formats with an int8 unit decode (triton_kernels.decode.UNITS: every quantized
GGUF format) run `_dequant_units_kernel`: each thread decodes whole units (32, 64 or 128
weights) from whole-word loads and scales each code once. The others (FP8, the float
formats) run `_dequant_kernel`, one weight a lane through the format's per-weight decode
function.
`dequantize_torch` is the same computation in vectorised torch, the CPU fast path, with
torch.compile's one-pass loops for Q8_0, Q4_0 and IQ4_NL on request (cpu/dequant_compiled.py).
`int8_parts` gives a weight of the int8-code formats as codes and group scales from the same
decoders (the CPU's held form: triton_kernels.cpu.codes).
"""
from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

import quant

from . import backend
from .asm import asm_for, cvt_pairs
from .backend import use_triton
from .decode import decoder, launch_args, table, unit, unit_table
from .decode.common import round_to_bf16_bits, scale_of
from .decode.split import block_ptr
from .layout import gguf_bytes
from .cpu.dequant_compiled import dequantize_fused, has_fused

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# units a program of _dequant_units_kernel: one a thread at 4 warps
DEQUANT_UNITS_BLOCK = 128


@triton.jit
def _dequant_kernel(q_ptr, tab_ptr, out_ptr, n_elements,
                    DECODE: tl.constexpr, QK: tl.constexpr, BLOCK: tl.constexpr,
                    OUT_BF16: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # flat weight index; rows are whole blocks
    mask = offs < n_elements
    blk = offs // QK
    j = (offs % QK).to(tl.int32)
    v = DECODE(q_ptr, tab_ptr, blk, j, mask)
    if OUT_BF16:
        tl.store(out_ptr + offs, round_to_bf16_bits(v), mask=mask)
    else:
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stack(parts, N: tl.constexpr):
    """A tuple of N = 2^k [lanes] tensors -> one [lanes, N] tensor, in order."""
    if N == 1:
        return parts[0][:, None]
    elif N == 2:
        return tl.join(parts[0], parts[1])
    elif N == 8:
        # each join appends the least significant index: pair the most distant parts first
        return tl.reshape(tl.join(tl.join(tl.join(parts[0], parts[4]), tl.join(parts[2], parts[6])),
                                  tl.join(tl.join(parts[1], parts[5]), tl.join(parts[3], parts[7]))),
                          (parts[0].shape[0], 8))
    else:  # 4, 16, 32: two halves, side by side
        return tl.join(_stack(parts[:N // 2], N // 2), _stack(parts[N // 2:], N // 2)).permute(0, 2, 1).reshape(
            (parts[0].shape[0], N))


@triton.jit
def store_units(dst, words, a, b, live, scale, UW: tl.constexpr, ZERO: tl.constexpr,
                OFFSET: tl.constexpr, HAS_SCALE: tl.constexpr, OUT: tl.constexpr,
                ASM: tl.constexpr, CVT: tl.constexpr = True):
    """Write one decoded unit a lane at dst (UW consecutive values): a * (code - ZERO)
    [- b] [* scale], in the numpy codec's order; OUT "bf16" stores bf16 bits (int16).
    On NVIDIA a word's four values go out as one 8-byte store (`store_packed`); on AMD one
    store a value (packing costs gfx942 more than it saves); a [lanes, UW] tile would go
    through shared memory on either. Under the interpreter, whose cost goes with the
    number of operations, the whole unit as one tile."""
    if ASM == "":
        i = tl.arange(0, 4)
        w = _stack(words, UW // 4)                                     # [lanes, UW / 4]
        code = ((w[:, :, None] << (24 - 8 * i)[None, None, :]) >> 24) - ZERO
        code = tl.reshape(code, (code.shape[0], len(a), UW // len(a)))
        val = _stack(a, len(a))[:, :, None] * code.to(tl.float32)      # [lanes, scales, 32 or 16]
        if OFFSET:
            val = val - _stack(b, len(b))[:, :, None]
        if HAS_SCALE:
            val = val * scale
        val = tl.reshape(val, (val.shape[0], UW))
        at = dst[:, None] + tl.arange(0, UW)[None, :]
        if OUT == "bf16":
            tl.store(at, round_to_bf16_bits(val), mask=live[:, None])
        else:
            tl.store(at, val.to(dst.dtype.element_ty), mask=live[:, None])
    elif ASM == "ptx":  # CVT: the device has the paired cvt (asm.cvt_pairs)
        store_packed(dst, words, a, b, live, scale, UW, ZERO, OFFSET, HAS_SCALE, OUT, CVT)
    else:
        for w in tl.static_range(UW // 4):
            for i in tl.static_range(4):
                val = _unit_value(words[w], i, scale_of(a, w, UW), scale_of(b, w, UW), scale, ZERO, OFFSET, HAS_SCALE)
                if OUT == "bf16":  # the device's own round-to-nearest-even
                    tl.store(dst + (4 * w + i), val.to(tl.bfloat16).to(tl.int16, bitcast=True),
                             mask=live)
                else:
                    tl.store(dst + (4 * w + i), val.to(dst.dtype.element_ty), mask=live)


@triton.jit
def store_packed(dst, words, a, b, live, scale, UW: tl.constexpr, ZERO: tl.constexpr,
                 OFFSET: tl.constexpr, HAS_SCALE: tl.constexpr, OUT: tl.constexpr,
                 CVT: tl.constexpr):
    """store_units' NVIDIA path: each word's four values as one 8-byte store (two for
    float32), their bits packed in registers, two 16-bit values by one `cvt` with CVT (so
    a word costs 2 conversions and a store where it cost 4 conversions, 4 byte moves and 4
    stores). dst must be 8-byte aligned, as a fresh tensor is."""
    for w in tl.static_range(UW // 4):
        sa = scale_of(a, w, UW)
        sb = scale_of(b, w, UW)
        v0 = _unit_value(words[w], 0, sa, sb, scale, ZERO, OFFSET, HAS_SCALE)
        v1 = _unit_value(words[w], 1, sa, sb, scale, ZERO, OFFSET, HAS_SCALE)
        v2 = _unit_value(words[w], 2, sa, sb, scale, ZERO, OFFSET, HAS_SCALE)
        v3 = _unit_value(words[w], 3, sa, sb, scale, ZERO, OFFSET, HAS_SCALE)
        at = (dst + 4 * w).to(tl.pointer_type(tl.int64))
        if dst.dtype.element_ty == tl.float32:
            tl.store(at, _word64(v0.to(tl.int32, bitcast=True), v1.to(tl.int32, bitcast=True)), mask=live)
            tl.store(at + 1, _word64(v2.to(tl.int32, bitcast=True), v3.to(tl.int32, bitcast=True)), mask=live)
        else:
            tl.store(at, _word64(_pair16(v0, v1, OUT, CVT), _pair16(v2, v3, OUT, CVT)), mask=live)


@triton.jit
def _unit_value(word, i: tl.constexpr, a, b, scale, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                HAS_SCALE: tl.constexpr):
    """Byte i of a word of codes, decoded: a * (code - ZERO) [- b] [* scale]."""
    val = a * (((word << (24 - 8 * i)) >> 24) - ZERO).to(tl.float32)
    if OFFSET:
        val = val - b
    if HAS_SCALE:
        val = val * scale
    return val


@triton.jit
def _pair16(lo, hi, OUT: tl.constexpr, CVT: tl.constexpr):
    """Two float32 values as one int32 of their bf16 (OUT "bf16") or float16 bits, each
    rounded to nearest even, lo in the low half (the lower address). With CVT one PTX
    instruction, whose first source goes to the upper half (PTX ISA, cvt: "the value
    converted from input a is stored in the upper half of d")."""
    if CVT:
        cvt: tl.constexpr = "cvt.rn.bf16x2.f32 $0, $2, $1;" if OUT == "bf16" else "cvt.rn.f16x2.f32 $0, $2, $1;"
        return tl.inline_asm_elementwise(cvt, "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)
    if OUT == "bf16":  # by hand: the interpreter's bf16 cast truncates
        lo16, hi16 = round_to_bf16_bits(lo), round_to_bf16_bits(hi)
    else:
        lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True)
        hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True)
    return (lo16.to(tl.int32) & 0xFFFF) | (hi16.to(tl.int32) << 16)


@triton.jit
def _word64(lo, hi):
    """Two int32 as one int64, lo in the low half (the lower address)."""
    return (lo.to(tl.int64) & 0xFFFFFFFF) | (hi.to(tl.int64) << 32)


@triton.jit
def _dequant_units_kernel(q_ptr, tab_ptr, out_ptr, n_units,
                          UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr,
                          BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                          BODY: tl.constexpr, BLOCK: tl.constexpr, OUT: tl.constexpr,
                          ASM: tl.constexpr, CVT: tl.constexpr = True):
    v = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = v < n_units
    v = tl.where(live, v, 0)  # lanes past the end decode unit 0 and store nothing
    p = block_ptr(q_ptr, v // UPB, BLOCK_HW, BODY)
    words, a, b = UNIT(p, (v % UPB).to(tl.int32), tab_ptr, ASM)
    store_units(out_ptr + v * UW, words, a, b, live, 1.0, UW, ZERO, OFFSET, False, OUT, ASM, CVT)


def check_blocks(q: torch.Tensor, fmt: quant.Format) -> None:
    """ValueError naming the format and the expected size, for anything but whole blocks."""
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"{fmt.name}: expected a uint8 torch tensor of blocks, got {type(q).__name__}")
    if q.dtype != torch.uint8:
        raise ValueError(f"{fmt.name}: quantized data must be a uint8 tensor, got {q.dtype}; "
                         f"use .view(torch.uint8) on raw blocks")
    if q.dim() == 0 or q.shape[-1] % fmt.block_bytes:
        n = q.shape[-1] if q.dim() else 0
        raise ValueError(f"{fmt.name}: {n} bytes per row is not a whole number of blocks; "
                         f"expected a multiple of {fmt.block_bytes} bytes "
                         f"({fmt.block_elems} weights a block)")
    if fmt.layout == "split" and (q.numel() % (4 * fmt.block_bytes) or q.storage_offset() % 8):
        raise ValueError(f"{fmt.name} (split layout): the blocks are laid out in fours; a tensor "
                         f"must hold whole fours and start at one, got {q.numel() // fmt.block_bytes} "
                         f"blocks at byte {q.storage_offset()} of its storage")


def _out_shape(q: torch.Tensor, fmt: quant.Format) -> tuple[int, ...]:
    return (*q.shape[:-1], q.shape[-1] // fmt.block_bytes * fmt.block_elems)


def dequantize(q: torch.Tensor, fmt: str | int | quant.Format,
               dtype: torch.dtype = torch.float32, block: int = 1024) -> torch.Tensor:
    fmt = quant.get(fmt)
    check_blocks(q, fmt)
    if dtype not in OUT_DTYPES:
        raise ValueError(f"{fmt.name}: dequantize writes float32, float16 or bfloat16, not {dtype}")
    if not use_triton(q):
        return dequantize_torch(q, fmt, dtype)
    q = q.contiguous()
    out = torch.empty(_out_shape(q, fmt), dtype=dtype, device=q.device)
    n = out.numel()
    dst = out.view(torch.int16) if dtype == torch.bfloat16 else out
    u = unit(fmt)
    if n and u is not None:
        n_units = n // u.weights
        block = DEQUANT_UNITS_BLOCK
        # No FMA contraction: Q4_K's a * q - b must round twice, as numpy does.
        _dequant_units_kernel[(triton.cdiv(n_units, block),)](
            q.reshape(-1).view(torch.uint16), unit_table(fmt, q.device), dst, n_units,
            **launch_args(fmt, u), BLOCK=block,
            OUT="bf16" if dtype == torch.bfloat16 else "", ASM=asm_for(q.device), CVT=cvt_pairs(q.device),
            enable_fp_fusion=False)
    elif n:
        grid = (triton.cdiv(n, block),)
        # No FMA contraction: Q4_1's d*q+m must round twice, as numpy does.
        _dequant_kernel[grid](q, table(fmt, q.device), dst, n, DECODE=decoder(fmt),
                              QK=fmt.block_elems, BLOCK=block,
                              OUT_BF16=dtype == torch.bfloat16, enable_fp_fusion=False)
    return out


# --- torch implementation ---------------------------------------------------------------

_CHUNK_VALUES = 1 << 20  # per step of the torch path: keeps its temporaries in cache (swept 256k-8M)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) fp16 bytes -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


class _Tables:
    """Torch copies of the format tables, per device, built once."""
    _cache: dict = {}

    @classmethod
    def get(cls, name: str, device: torch.device) -> torch.Tensor:
        return backend.constant(cls._cache, (name, str(device)), lambda: _build_table(name), device)


def _signed_grid_words(grid) -> torch.Tensor:
    """Grid entries with every sign pattern folded in, as int8 codes packed four to an int32:
    word gi*16 + signs holds entry gi's four values, value i negated where bit i of `signs`
    is set. Folding the sign into the code is exact: (db*g)*-1 == db*(-g), |g| <= 62."""
    g = grid.astype(np.int16)                                             # (G, 4)
    pat = (np.arange(16)[:, None] >> np.arange(4)) & 1                   # (16, 4)
    v = (g[:, None, :] * np.where(pat == 1, -1, 1)[None]).astype(np.int8)
    return torch.from_numpy(v.reshape(-1, 4).copy().view("<i4").reshape(-1))


def _build_table(name: str) -> torch.Tensor:
    from quant import iq3, iq4
    if name == "iq3_xxs_words":
        return _signed_grid_words(iq3.XXS_GRID)
    if name == "iq3_s_words":
        return _signed_grid_words(iq3.S_GRID)
    if name == "ksigns":
        return torch.from_numpy(iq3.KSIGNS.astype("int32"))
    if name == "ksign_shifts":  # the four 7-bit KSIGNS indices of a group's u32
        return torch.tensor([0, 7, 14, 21], dtype=torch.int32)
    if name == "qh_keys":  # qh byte -> the 9th index bit of its 8 grid entries, as key bits (<< 4)
        return (torch.arange(256)[:, None] >> torch.arange(8) & 1).to(torch.int32) << 12
    if name in ("iq2_xxs", "iq2_xs", "iq2_s"):
        from quant import iq2
        return torch.from_numpy(getattr(iq2, name[4:].upper() + "_GRID").astype("float32"))
    if name == "ksigns_f32":   # 7-bit sign index -> 8 factors +-1
        return torch.from_numpy(iq3.KSIGNS_F32.copy())
    if name == "sign_bits_f32":  # byte -> 8 factors +-1, bit i for weight i
        return torch.where(torch.arange(256)[:, None] >> torch.arange(8) & 1 == 1, -1.0, 1.0)
    if name == "iq1":
        from quant import iq1
        return torch.from_numpy(iq1.GRID.astype("float32"))
    if name == "iq4_nl":
        return torch.from_numpy(iq4.KVALUES.astype("float32"))
    if name == "iq4_nl_i8":
        return torch.from_numpy(iq4.KVALUES.astype("int8"))
    raise KeyError(name)


# Each torch implementation fills `out`, a float32 (n_blocks, block_elems) view, from
# (n_blocks, block_bytes) uint8 blocks, repeating the numpy codec's float operations in
# the same order (bit-exact).

def _deq_f32(b, out):
    out.copy_(b.contiguous().view(torch.float32))


def _deq_f16(b, out):
    out.copy_(b.contiguous().view(torch.float16))


def _deq_bf16(b, out):
    out.copy_((b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32))


def _deq_fp8_e4m3(b, out):
    out.copy_(b.contiguous().view(torch.float8_e4m3fn))


def _lead_scale(b):
    """(n, block_bytes) blocks -> (n, 1) float32: the fp16 at byte 0 of each block, read in
    place (dequantize_torch hands over 2-byte aligned rows)."""
    return b.view(torch.float16)[:, :1].float()


# The int8-code formats write `out` once from int8 codes (a contiguous conversion, which
# runs at the speed of the writes) and scale it in place while the chunk is in cache: the
# fewest passes eager torch allows. Their float operation is the reference's single
# product, so the order of the factors cannot change a bit.

def _deq_q8_0(b, out):
    out.copy_(b[:, 2:].view(torch.int8))
    out.mul_(_lead_scale(b))


def _nibble_codes(qs, dtype=torch.uint8):
    """(n, 16) nibble bytes -> (n, 32) codes: byte i's low half is weight i, its high i + 16."""
    c = torch.empty((qs.shape[0], 2, 16), dtype=dtype, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=c[:, 0])
    torch.bitwise_right_shift(qs, 4, out=c[:, 1])
    return c.view(-1, 32)


def _deq_q4_0(b, out):
    c = _nibble_codes(b[:, 2:])
    c -= 8  # wraps: the uint8 bytes of the int8 codes q - 8
    out.copy_(c.view(torch.int8))
    out.mul_(_lead_scale(b))


def _deq_q4_1(b, out):
    torch.mul(_f16(b[:, :2]), _nibbles(b[:, 4:]).float(), out=out)
    out += _f16(b[:, 2:4])


def _lookup(tab: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    # index_select with int32 indices: about 3x faster than tab[idx] or embedding() here
    return tab.index_select(0, idx.reshape(-1)).reshape(*idx.shape, *tab.shape[1:])


def _deq_iq4_nl(b, out):
    idx = _nibble_codes(b[:, 2:], torch.int32)
    torch.index_select(_Tables.get("iq4_nl", b.device), 0, idx.view(-1), out=out.view(-1))
    out.mul_(_lead_scale(b))



def _deq_iq4_xs(b, out):
    n = b.shape[0]
    dl = _iq4_xs_scales(b)                                               # (n, 8)
    q = _nibbles(b[:, 8:].reshape(n * 8, 16)).to(torch.int32)
    vals = _lookup(_Tables.get("iq4_nl", b.device), q).view(n, 8, 32)
    torch.mul(dl[:, :, None], vals, out=out.view(n, 8, 32))


def _u32_words(b, n):
    """(n, 4k) bytes -> (n, k) int32 little-endian words (copied: offsets need not be 4-aligned)."""
    return torch.empty((n, b.shape[1]), dtype=torch.uint8, device=b.device).copy_(b).view(torch.int32)


def _iq2_db(d, s):
    return d * (0.5 + s.float()) * 0.25


def _deq_iq2_xxs(b, out):
    n, dev = b.shape[0], b.device
    words = _u32_words(b[:, 2:66], n).view(n, 8, 2)
    db = _iq2_db(_f16(b[:, :2]), (words[:, :, 1] >> 28) & 0x0F)            # (n, 8)
    sidx = torch.stack([(words[:, :, 1] >> s) & 0x7F for s in (0, 7, 14, 21)], dim=-1)
    signs = _lookup(_Tables.get("ksigns_f32", dev), sidx)                 # (n, 8, 4, 8)
    gidx = b[:, 2:66].reshape(n, 8, 8)[:, :, :4].to(torch.int32)
    grid = _lookup(_Tables.get("iq2_xxs", dev), gidx)                      # (n, 8, 4, 8)
    torch.mul(db[:, :, None, None] * grid, signs, out=out.view(n, 8, 4, 8))


def _deq_iq2_xs(b, out):
    n, dev = b.shape[0], b.device
    sc = b[:, 66:74].to(torch.int32)
    db = _iq2_db(_f16(b[:, :2]), torch.stack([sc & 0x0F, sc >> 4], dim=-1).reshape(n, 16))
    qs = b[:, 2:66:2].to(torch.int32) | (b[:, 3:66:2].to(torch.int32) << 8)   # (n, 32)
    grid = _lookup(_Tables.get("iq2_xs", dev), qs & 511).view(n, 16, 16)
    signs = _lookup(_Tables.get("ksigns_f32", dev), qs >> 9).view(n, 16, 16)
    torch.mul(db[:, :, None] * grid, signs, out=out.view(n, 16, 16))


def _deq_iq2_s(b, out):
    n, dev = b.shape[0], b.device
    sc = b[:, 74:82].to(torch.int32)
    db = _iq2_db(_f16(b[:, :2]), torch.stack([sc & 0x0F, sc >> 4], dim=-1).reshape(n, 16))
    qh = b[:, 66:74].to(torch.int32)
    hi = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).reshape(n, 32)
    idx = b[:, 2:34].to(torch.int32) | (hi << 8)
    grid = _lookup(_Tables.get("iq2_s", dev), idx).view(n, 16, 16)
    signs = _lookup(_Tables.get("sign_bits_f32", dev), b[:, 34:66].to(torch.int32)).view(n, 16, 16)
    torch.mul(db[:, :, None] * grid, signs, out=out.view(n, 16, 16))


def _iq1_delta(minus):
    return torch.where(minus, -0.125, 0.125)


def _deq_iq1_s(b, out):
    n, dev = b.shape[0], b.device
    qh = b[:, 34:50:2].to(torch.int32) | (b[:, 35:50:2].to(torch.int32) << 8)   # (n, 8)
    dl = _f16(b[:, :2]) * (2 * ((qh >> 12) & 7) + 1).float()
    hi = torch.stack([(qh >> s) & 7 for s in (0, 3, 6, 9)], dim=-1).reshape(n, 32)
    grid = _lookup(_Tables.get("iq1", dev), b[:, 2:34].to(torch.int32) | (hi << 8)).view(n, 8, 32)
    delta = _iq1_delta(qh & 0x8000 != 0)
    torch.mul(dl[:, :, None], grid + delta[:, :, None], out=out.view(n, 8, 32))


def _deq_iq1_m(b, out):
    n, dev = b.shape[0], b.device
    w = b[:, 48:56:2].to(torch.int32) | (b[:, 49:56:2].to(torch.int32) << 8)   # (n, 4)
    bits = ((w >> 12) << torch.tensor([0, 4, 8, 12], dtype=torch.int32, device=dev)).sum(-1)
    bits = bits - ((bits >> 15) << 16)                                       # as int16
    d = bits.to(torch.int16).view(torch.float16).float()[:, None]            # (n, 1)
    s = torch.stack([(w >> k) & 7 for k in (0, 3, 6, 9)], dim=-1).reshape(n, 16)
    dl = d * (2 * s + 1).float()                                             # (n, 16)
    nb = b[:, 32:48].to(torch.int32)
    nib = torch.stack([nb & 0x0F, nb >> 4], dim=-1).reshape(n, 32)
    grid = _lookup(_Tables.get("iq1", dev), b[:, :32].to(torch.int32) | ((nib & 7) << 8))
    vals = (grid + _iq1_delta(nib & 8 != 0)[:, :, None]).view(n, 16, 16)
    torch.mul(dl[:, :, None], vals, out=out.view(n, 16, 16))


def _words(h: torch.Tensor) -> torch.Tensor:
    """(n, 2k) int16 halfwords -> (n, k) little-endian int32 words (IQ3's blocks are 98 and
    110 bytes: only 2-byte aligned, so a u32 is two halfwords)."""
    x = h.to(torch.int32)
    return (x[:, 0::2] & 0xFFFF) | (x[:, 1::2] << 16)


def _signed_codes(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """(n, 256) int8: the signed grid codes that `key` (n, 64) picks from `words` (a gather
    of int8 words)."""
    n = key.shape[0]
    return words.index_select(0, key.view(-1)).view(n, 64).view(torch.int8)


def _scale_codes(codes: torch.Tensor, db: torch.Tensor, out: torch.Tensor) -> None:
    """out = db * codes: one conversion into `out`, one in-place scale per 32 weights."""
    out.copy_(codes)
    out.view(codes.shape[0], -1, 32).mul_(db[:, :, None])


def _iq3_xxs_parts(b):
    """(codes (n, 256) int8, db (n, 8)): w = db * code."""
    n, dev = b.shape[0], b.device
    # the arithmetic shift's sign bits never reach the masked fields
    words = _words(b.view(torch.int16)[:, 33:49])                        # (n, 8)
    db = _lead_scale(b) * (0.5 + ((words >> 28) & 0x0F).float()) * 0.5   # (n, 8)
    sidx = (words[:, :, None] >> _Tables.get("ksign_shifts", dev)) & 0x7F
    ks = _Tables.get("ksigns", dev).index_select(0, sidx.view(-1)).view(n, 32, 1)
    # each grid entry covers 4 weights: its sign nibble is half of the 8 weights' ksigns byte
    key = b[:, 2:66].view(n, 32, 2).to(torch.int32) << 4
    key[:, :, :1] |= ks & 0x0F
    key[:, :, 1:] |= ks >> 4
    return _signed_codes(_Tables.get("iq3_xxs_words", dev), key), db


def _iq3_s_parts(b):
    """(codes (n, 256) int8, db (n, 8)): w = db * code."""
    n, dev = b.shape[0], b.device
    sc = b[:, 106:110].to(torch.int32)
    s = torch.stack([sc & 0x0F, sc >> 4], dim=-1).view(n, 8)
    db = _lead_scale(b) * (1 + 2 * s).float()                            # (n, 8)
    key = b[:, 2:66].to(torch.int32) << 4
    key |= _Tables.get("qh_keys", dev).index_select(0, b[:, 66:74].to(torch.int32).view(-1)).view(n, 64)
    sb = b[:, 74:106].to(torch.int32)                                    # a sign byte per 8 weights
    k2 = key.view(n, 32, 2)
    k2[:, :, 0] |= sb & 0x0F
    k2[:, :, 1] |= sb >> 4
    return _signed_codes(_Tables.get("iq3_s_words", dev), key), db


def _deq_iq3_xxs(b, out):
    _scale_codes(*_iq3_xxs_parts(b), out)


def _deq_iq3_s(b, out):
    _scale_codes(*_iq3_s_parts(b), out)


def _shr(b: torch.Tensor, shifts: tuple, width: int) -> torch.Tensor:
    """(n, k * width) bytes -> (n, k, len(shifts), width): each run of `width` bytes shifted
    right by every amount; the caller masks the field."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=b.device).view(1, 1, -1, 1)
    return b.reshape(b.shape[0], -1, 1, width) >> s


def _q5_codes(b: torch.Tensor) -> torch.Tensor:
    """(n, 20) qh (u32) then nibbles -> (n, 32) 5-bit codes, uint8."""
    return _nibbles(b[:, 4:]) | ((_shr(b[:, :4], tuple(range(8)), 4) & 1).transpose(2, 3).reshape(-1, 32) << 4)


def _deq_q5_0(b, out):
    torch.mul(_f16(b[:, :2]), (_q5_codes(b[:, 2:]).to(torch.int8) - 16).float(), out=out)


def _deq_q5_1(b, out):
    torch.mul(_f16(b[:, :2]), _q5_codes(b[:, 4:]).float(), out=out)
    out += _f16(b[:, 2:4])


def _k_crumbs(b: torch.Tensor) -> torch.Tensor:
    """(n, 64) -> (n, 256) 2-bit fields (quant/kquants.py: weight j in byte 32 (j // 128) + j % 32)."""
    return (_shr(b, (0, 2, 4, 6), 32) & 3).reshape(-1, 256)


def _k_bits(b: torch.Tensor) -> torch.Tensor:
    """(n, 32) -> (n, 256) bits: weight j is bit j // 32 of byte j % 32."""
    return (_shr(b, tuple(range(8)), 32) & 1).reshape(-1, 256)


def _k_nibbles(b: torch.Tensor, width: int) -> torch.Tensor:
    """(n, 128) -> (n, 256) nibbles, runs of `width` weights alternating low and high."""
    return (_shr(b, (0, 4), width) & 0x0F).reshape(-1, 256)


def _q2_k_parts(b):
    s = b[:, :16]
    dl = _f16(b[:, 80:82]) * (s & 0x0F).float()
    ml = _f16(b[:, 82:84]) * (s >> 4).float()
    return _k_crumbs(b[:, 16:80]).view(torch.int8), dl, -ml


def _q3_k_parts(b):
    s = b[:, 96:108]
    lo = (_shr(s[:, :8], (0, 4), 8) & 0x0F).reshape(-1, 16)
    hi = (_shr(s[:, 8:], (0, 2, 4, 6), 4) & 0x03).reshape(-1, 16)
    dl = _f16(b[:, 108:110]) * ((lo | (hi << 4)).to(torch.int8) - 32).float()
    q = _k_crumbs(b[:, 32:96]).to(torch.int8) - ((_k_bits(b[:, :32]) ^ 1) << 2).to(torch.int8)
    return q, dl, None


def _k_scales(b):
    """Q4_K/Q5_K: (dl, ml) (n, 8) float32, a scale and a minimum per 32 weights."""
    a, m_, c = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    m = torch.cat([m_ & 0x3F, (c >> 4) | ((m_ >> 2) & 0x30)], dim=-1)
    return _f16(b[:, :2]) * sc.float(), _f16(b[:, 2:4]) * m.float()


def _q4_k_parts(b):
    dl, ml = _k_scales(b)
    return _k_nibbles(b[:, 16:144], 32).view(torch.int8), dl, -ml


def _q5_k_parts(b):
    dl, ml = _k_scales(b)
    return (_k_nibbles(b[:, 48:176], 32) | (_k_bits(b[:, 16:48]) << 4)).view(torch.int8), dl, -ml


def _q6_k_parts(b):
    dl = _f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()
    q = (_k_nibbles(b[:, :128], 64) | (_k_crumbs(b[:, 128:192]) << 4)).to(torch.int8) - 32
    return q, dl, None


def _k_dequant(parts):
    """A K-quant's decoder from its parts: out = dl * q (+ offset), per sub-block. The
    offset is the negated minimum, and x + (-m) rounds as x - m does."""
    def deq(b, out):
        q, dl, off = parts(b)
        n, k = dl.shape
        o = out.view(n, k, -1)
        torch.mul(dl[:, :, None], q.view(n, k, -1).float(), out=o)
        if off is not None:
            o += off[:, :, None]
    return deq


_deq_q2_k, _deq_q3_k, _deq_q4_k, _deq_q5_k, _deq_q6_k = map(
    _k_dequant, (_q2_k_parts, _q3_k_parts, _q4_k_parts, _q5_k_parts, _q6_k_parts))


_TORCH = {
    "F32": _deq_f32, "F16": _deq_f16, "BF16": _deq_bf16, "Q8_0": _deq_q8_0,
    "Q5_0": _deq_q5_0, "Q5_1": _deq_q5_1, "Q2_K": _deq_q2_k, "Q3_K": _deq_q3_k,
    "Q4_K": _deq_q4_k, "Q5_K": _deq_q5_k, "Q6_K": _deq_q6_k,
    "Q4_0": _deq_q4_0, "Q4_1": _deq_q4_1, "IQ4_NL": _deq_iq4_nl, "IQ4_XS": _deq_iq4_xs,
    "IQ3_XXS": _deq_iq3_xxs, "IQ3_S": _deq_iq3_s,
    "IQ2_XXS": _deq_iq2_xxs, "IQ2_XS": _deq_iq2_xs, "IQ2_S": _deq_iq2_s,
    "IQ1_S": _deq_iq1_s, "IQ1_M": _deq_iq1_m, "FP8_E4M3": _deq_fp8_e4m3,
}


def _iq4_codes(nib_bytes):
    """(n, 16k) nibble bytes -> (n, 32k) int8 IQ4_NL grid values (runs of 32: low halves, then high)."""
    idx = _nibble_codes(nib_bytes.reshape(-1, 16), torch.int32)
    return _Tables.get("iq4_nl_i8", nib_bytes.device).index_select(0, idx.view(-1)).view(nib_bytes.shape[0], -1)


def _iq4_xs_scales(b):
    n = b.shape[0]
    sh = b[:, 2:3].to(torch.int32) | (b[:, 3:4].to(torch.int32) << 8)
    sl = b[:, 4:8].to(torch.int32)
    lo = torch.stack([sl & 0x0F, sl >> 4], dim=-1).reshape(n, 8)
    hi = (sh >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    return _f16(b[:, :2]) * ((lo | (hi << 4)) - 32).float()


def _q4_0_codes(b):
    c = _nibble_codes(b[:, 2:])
    c -= 8
    return c.view(torch.int8)


# Each format whose weight is an int8 code times a float32 group scale, plus an offset for
# some: (blocks) -> (codes (n, block_elems) int8, scale (n, groups), offset (n, groups) or
# None), w = scale * code (+ offset) in float32 being the decoder's own operations.
_PARTS = {
    "Q8_0": lambda b: (b[:, 2:].view(torch.int8), _lead_scale(b), None),
    "Q4_0": lambda b: (_q4_0_codes(b), _lead_scale(b), None),
    "Q4_1": lambda b: (_nibbles(b[:, 4:]).view(torch.int8), _f16(b[:, :2]), _f16(b[:, 2:4])),
    "Q5_0": lambda b: (_q5_codes(b[:, 2:]).to(torch.int8) - 16, _f16(b[:, :2]), None),
    "Q5_1": lambda b: (_q5_codes(b[:, 4:]).view(torch.int8), _f16(b[:, :2]), _f16(b[:, 2:4])),
    "IQ4_NL": lambda b: (_iq4_codes(b[:, 2:]), _lead_scale(b), None),
    "IQ4_XS": lambda b: (_iq4_codes(b[:, 8:]), _iq4_xs_scales(b), None),
    "IQ3_XXS": lambda b: (*_iq3_xxs_parts(b), None),
    "IQ3_S": lambda b: (*_iq3_s_parts(b), None),
    "Q2_K": _q2_k_parts, "Q3_K": _q3_k_parts, "Q4_K": _q4_k_parts, "Q5_K": _q5_k_parts,
    "Q6_K": _q6_k_parts,
}
INT8_FORMATS = tuple(_PARTS)


def int8_parts(q: torch.Tensor, fmt: str | int | quant.Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A weight of whole blocks (rows of k blocks) as int8 codes and float32 group scales:
    (codes (n, k * block_elems) int8, scale (n, groups), offset (n, groups) or None), with
    w = scale * code (+ offset) in float32 equal bit for bit to `dequantize_torch` (the
    same float operations; tests/triton_kernels/cpu/test_codes.py). A group is 32 weights,
    16 for Q2_K, Q3_K and Q6_K. Formats: INT8_FORMATS."""
    fmt = quant.get(fmt)
    if fmt.name not in _PARTS:
        raise ValueError(f"{fmt.name} has no int8-code form (those that do: {', '.join(INT8_FORMATS)})")
    check_blocks(q, fmt)
    q, fmt = gguf_bytes(q, fmt)
    rows = q.shape[0] if q.dim() == 2 else 1
    blocks = q.reshape(-1, fmt.block_bytes)
    if not blocks.is_contiguous() or blocks.storage_offset() % 2:
        blocks = torch.empty(blocks.shape, dtype=torch.uint8, device=q.device).copy_(blocks)
    codes, scale, offset = _PARTS[fmt.name](blocks)
    n = blocks.shape[0]
    out = (codes.reshape(rows, -1), scale.reshape(rows, -1).contiguous())
    return (*out, None if offset is None else offset.expand(n, scale.shape[1]).reshape(rows, -1).contiguous())


def _compile_requested() -> bool:
    return os.environ.get("STRATA_DEQUANT_COMPILE", "0") not in ("", "0")


_compile_broken: list[str] = []  # why the compiled path failed once under STRATA_DEQUANT_COMPILE


def _fused(blocks: torch.Tensor, fmt: quant.Format, out: torch.Tensor, compiled: bool | None) -> bool:
    """Run the compiled one-pass dequant (triton_kernels/cpu/dequant_compiled.py) if asked and
    possible; True when it did."""
    if compiled is False or not has_fused(fmt) or blocks.device.type != "cpu" or blocks.shape[0] < 2:
        return False
    if compiled is None:
        if not _compile_requested() or _compile_broken:
            return False
        try:
            dequantize_fused(blocks, fmt, out)
        except Exception as e:  # noqa: BLE001 - any compile failure (no C++ compiler, ...): eager gives the same bits
            import warnings
            _compile_broken.append(f"{type(e).__name__}: {e}")
            warnings.warn(f"STRATA_DEQUANT_COMPILE: torch.compile failed for {fmt.name} ({_compile_broken[0][:200]}); "
                          f"dequantizing eagerly from now on", RuntimeWarning, stacklevel=3)
            return False
        return True
    dequantize_fused(blocks, fmt, out)
    return True


def dequantize_torch(q: torch.Tensor, fmt: str | int | quant.Format,
                     dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                     compiled: bool | None = None) -> torch.Tensor:
    """`dequantize` in torch. `out`: a contiguous `dtype` tensor of the result's shape to
    write, as ggml's to_float writes its caller's buffer (a fresh 256 MB float32 tensor costs
    more in first-touch page faults than dequantizing into it); returned. `compiled`: Q8_0,
    Q4_0 and IQ4_NL through torch.compile's one-pass loop (cpu/dequant_compiled.py) for at least
    2 blocks on the CPU: True always, None when STRATA_DEQUANT_COMPILE=1, False never."""
    fmt = quant.get(fmt)
    check_blocks(q, fmt)
    q, fmt = gguf_bytes(q, fmt)  # a device layout's bytes: unpacked first
    if dtype not in OUT_DTYPES:
        raise ValueError(f"{fmt.name}: dequantize writes float32, float16 or bfloat16, not {dtype}")
    shape = _out_shape(q, fmt)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=q.device)
    elif out.shape != shape or out.dtype != dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"{fmt.name}: out must be a contiguous {dtype} tensor of shape {tuple(shape)} on "
                         f"{q.device}, got a {'' if out.is_contiguous() else 'non-contiguous '}{out.dtype} "
                         f"tensor of shape {tuple(out.shape)} on {out.device}")
    blocks = q.reshape(-1, fmt.block_bytes)
    if not blocks.is_contiguous() or blocks.storage_offset() % 2:
        # the decoders read fp16 scales and halfwords in place: rows 2-byte aligned
        blocks = torch.empty(blocks.shape, dtype=torch.uint8, device=q.device).copy_(blocks)
    flat = out.view(-1, fmt.block_elems)
    n = blocks.shape[0]
    if _fused(blocks, fmt, flat, compiled):
        return out
    fn = _TORCH[fmt.name]
    step = max(1, _CHUNK_VALUES // fmt.block_elems)
    tmp = None if dtype == torch.float32 else torch.empty((min(n, step), fmt.block_elems), device=q.device)
    for i in range(0, n, step):
        part = blocks[i:i + step]
        if tmp is None:
            fn(part, flat[i:i + step])
        else:
            fn(part, tmp[:part.shape[0]])
            flat[i:i + step] = tmp[:part.shape[0]]  # rounds to nearest even, as the kernel does
    return out
