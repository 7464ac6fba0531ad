"""Int8 activations and the dp4a GEMV: the decode-time matmul at the memory roof.

    quantize_x(x) -> Q8X(q, d, s)        x (M, K) -> int8 per 32 values, as llama.cpp's q8_1
    gemv_dp4a(x8, q, fmt, N, tiles)      (M, N) float32 = x̂ @ W.T, W as GGUF blocks

x̂ is x rounded to int8 per group of 32 consecutive values: d = max|x| / 127, q =
round(x / d) (half away from zero, clamped to ±127), x̂ = d * q; s = d * Σq, the group's
sum of x̂. The GEMV then reads each weight once as the format's int8 units (triton_kernels.decode.UNITS)
and multiplies four weights at a time with `dp4a`:

    y[n] = Σ_groups  a * d * dp4a-sum(code, q)  -  (a * ZERO + b) * s

(a, b the group's scale and offset, ZERO the format's code offset: Q4_0's -8 and the
K-quants' minimum are applied once a group, through s, never per weight). The only error
beyond float32 rounding is x's rounding to int8; tests/triton_kernels/test_int8.py states
both bounds.

Work per thread: a program owns BLOCK_N rows and walks K in steps of BLOCK_U units; each
thread decodes whole units (32, 64 or 128 weights), sums their dp4a results in int32 and
scales them once a group: of 32, or of 16 for the formats that scale each 16 (Q2_K,
Q3_K, Q6_K, IQ2_XS, IQ2_S, IQ1_M), whose ZERO and offsets then take x's sums of each 16,
by dp4a with a word of ones, in place of s. The accumulator [BLOCK_N, BLOCK_U] is reduced
across lanes once, after the loop. Rows past N are clamped (read, never stored), so the
main loop carries no masks; K that is no whole number of steps takes masked loads (MASK).
Where a GEMV's tiles are fewer than the GPU's multiprocessors (N of 512 to 1,024 at
BLOCK_N 8: an attention layer's k and v, a router), K splits over up to MAX_SPLIT
programs a tile (split_for); the last of them to finish adds the partial sums in split
order in the same launch, so the bits do not depend on which finishes last, nor on M.
Weights in GGUF order or in the split device layout (triton_kernels.layout; BODY > 0),
whose quants load as 8-byte words; x̂'s codes load as 8-byte words either way.

A launch that writes a dp4a GEMV's input can write its int8 form as well (`store_groups`,
whole groups of 32 a program) and `attach` it to its output: quantize_x of that tensor then
returns it and launches nothing (the hyper-connections' reads and norming writes, the
gates, DeltaNet's gated norm; the MoE's gate/up kernel writes its intermediate so: a
decode layer at Flash-Next's shape launches no quantize_x where it launched eight).

`quantize_x_torch` repeats quantize_x's float operations (equal bits); `gemv_dp4a_torch`
computes the same product, x̂ @ W.T, as one float32 torch matmul with the dequantized W.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import quant

from . import configs
from .asm import asm_for, dp4a
from .backend import device_name, device_properties, faking, use_triton
from .decode import launch_args, unit, unit_table
from .decode.common import halves
from .decode.split import block_ptr

GROUP = 32


class Q8X(NamedTuple):
    """x rounded to int8 per 32 values: q (M, K // 4) int32 words of four int8 codes,
    d (M, K // 32) float32 scales, s (M, K // 32) float32 sums d * Σq."""
    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """x̂ as float32 (M, K)."""
        M, G = self.d.shape
        codes = self.q.contiguous().view(torch.int8).float()
        return (codes.view(M, G, GROUP) * self.d[:, :, None]).view(M, G * GROUP)


# --- quantizing x ------------------------------------------------------------------------

@triton.jit
def _round_away(v):
    a = tl.floor(tl.abs(v) + 0.5)
    return tl.where(v < 0, -a, a)


@triton.jit
def quantize_groups(x):
    """[G, 32] float32 -> quantize_x's (words [G, 8] int32, d [G], s [G]) of each row: for
    the launches that quantize what they write (`attach`)."""
    # div_rn: IEEE division, as torch's (Triton's `/` may approximate on a GPU)
    d = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
    safe = tl.where(d == 0, 1.0, d)
    code = tl.where(d[:, None] == 0, 0.0, _round_away(tl.math.div_rn(x, safe[:, None])))
    # a subnormal max|x| rounds d down so far that the largest code reaches 128
    code = tl.minimum(tl.maximum(code, -127.0), 127.0)
    c = code.to(tl.int32)
    s = d * tl.sum(c, axis=1).to(tl.float32)
    shift = (tl.arange(0, 4) * 8)[None, None, :]
    words = tl.sum((tl.reshape(c, (x.shape[0], 8, 4)) & 0xFF) << shift, axis=2)
    return words, d, s


@triton.jit
def store_groups(q_ptr, d_ptr, s_ptr, m, g, x, K, gmask):
    """quantize_groups of x [G, 32], the groups g [G] of row m of an (M, K) x, stored where
    quantize_x stores them."""
    words, d, s = quantize_groups(x)
    w = tl.arange(0, 8)
    tl.store(q_ptr + m * (K // 4) + g[:, None] * 8 + w[None, :], words, mask=gmask[:, None])
    tl.store(d_ptr + m * (K // 32) + g, d, mask=gmask)
    tl.store(s_ptr + m * (K // 32) + g, s, mask=gmask)


@triton.jit
def _quantize_x_kernel(x_ptr, q_ptr, d_ptr, s_ptr, K, stride_xm, stride_xk,
                       BLOCK_G: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = g < K // 32
    i = tl.arange(0, 32)
    x = tl.load(x_ptr + m * stride_xm + (g[:, None] * 32 + i[None, :]) * stride_xk,
                mask=gmask[:, None], other=0.0).to(tl.float32)
    store_groups(q_ptr, d_ptr, s_ptr, m, g, x, K, gmask)


def _check_x(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % GROUP:
        raise ValueError(f"quantize_x: x must be (M, K) with K a multiple of {GROUP}, "
                         f"got shape {tuple(x.shape)}")
    return x


def empty_q8x(M: int, K: int, device) -> Q8X:
    """A Q8X for x (M, K), to be written."""
    q = torch.empty((M, K // 4), dtype=torch.int32, device=device)
    d = torch.empty((M, K // GROUP), dtype=torch.float32, device=device)
    return Q8X(q, d, torch.empty_like(d))


# what launches that quantize what they write left (attach): storage -> (x, its version, x8),
# the last few; x is held, so that its storage, the key, is never another tensor's
_ATTACHED: OrderedDict = OrderedDict()
_ATTACHED_MAX = 4
_ATTACHED_LOCK = threading.Lock()  # steps on several threads (a server's) share it


def int8_buffers(quantize: bool, M: int, K: int, span: int, spare: torch.Tensor) -> tuple[bool, tuple]:
    """For a launch that may write its (M, K) output as int8 too (store_groups): whether it
    does (asked, and `span`, the width its programs split a row at, whole groups of 32),
    and the q, d, s buffers to pass it, or `spare` three times (unread)."""
    quantize = quantize and span % GROUP == 0
    return quantize, (tuple(empty_q8x(M, K, spare.device)) if quantize else (spare,) * 3)


def attach(x: torch.Tensor, x8: Q8X) -> torch.Tensor:
    """Mark x (M, K) as quantized to x8 by the launch that wrote it (hc_mix): quantize_x of
    x, or of any view of all of x in the same shape (inference tensors keep no `_base`, so
    views are matched by their storage), returns x8 and launches nothing. A write to x
    afterwards moves its version and ends that; an inference tensor (the engine's steps
    run in inference mode) has no version, so x must not be written after the launch (the
    engine reads a block's input, never writes it). Not while torch.compile traces (each
    op's output is a new tensor there: quantize_x then launches as before). Returns x."""
    if not torch.compiler.is_compiling():
        key = x.untyped_storage()._cdata
        with _ATTACHED_LOCK:
            _ATTACHED[key] = (x, _version(x), x8)
            _ATTACHED.move_to_end(key)
            while len(_ATTACHED) > _ATTACHED_MAX:
                _ATTACHED.popitem(last=False)
    return x


def _version(x: torch.Tensor) -> int | None:
    return None if x.is_inference() else x._version


def _attached(x: torch.Tensor) -> Q8X | None:
    if not _ATTACHED or torch.compiler.is_compiling():
        return None
    with _ATTACHED_LOCK:
        held = _ATTACHED.get(x.untyped_storage()._cdata)
    if held is None:
        return None
    src, version, x8 = held
    if (_version(x) == version and x.shape == src.shape and x.dtype == src.dtype and x.is_contiguous()
            and src.is_contiguous() and x.storage_offset() == src.storage_offset()):
        return x8
    return None


def quantize_x(x: torch.Tensor) -> Q8X:
    """x (M, K), any float dtype -> Q8X. Triton on CUDA or under the interpreter; where the
    launch that wrote x quantized it too (`attach`), that."""
    _check_x(x)
    held = _attached(x)
    if held is not None:
        return held
    if not use_triton(x):
        return quantize_x_torch(x)
    M, K = x.shape
    if not x.is_cuda and x.dtype == torch.bfloat16:
        x = x.float()  # the interpreter holds bf16 as raw uint16; widening is exact
    q, d, s = empty_q8x(M, K, x.device)
    if M and K:
        block_g = 4
        _quantize_x_kernel[(M, triton.cdiv(K // GROUP, block_g))](
            x, q, d, s, K, x.stride(0), x.stride(1), BLOCK_G=block_g)
    return Q8X(q, d, s)


def quantize_x_torch(x: torch.Tensor) -> Q8X:
    """quantize_x in torch, the same float operations: equal bits."""
    _check_x(x)
    M, K = x.shape
    xg = x.float().reshape(M, K // GROUP, GROUP)
    d = xg.abs().amax(dim=2) / 127.0 if K else torch.zeros((M, 0))
    safe = torch.where(d == 0, torch.ones_like(d), d)
    v = xg / safe[:, :, None]
    code = torch.where(v < 0, -torch.floor(v.abs() + 0.5), torch.floor(v.abs() + 0.5))
    code = torch.where(d[:, :, None] == 0, torch.zeros_like(code), code).clamp(-127, 127).to(torch.int32)
    s = d * code.sum(dim=2).float()
    if K == 0:  # an empty int8 tensor cannot be viewed as int32
        return Q8X(torch.zeros((M, 0), dtype=torch.int32, device=x.device), d, s)
    q = code.to(torch.int8).reshape(M, K).contiguous().view(torch.int32)
    return Q8X(q, d, s)


# --- the dp4a GEMV -----------------------------------------------------------------------

@triton.jit
def row_start(q_ptr, first, BLOCK_HW: tl.constexpr, BODY: tl.constexpr):
    """Where dot_units walks a row from, given the block index `first` of its first block:
    a uint16 pointer at that block in GGUF order (BODY 0); the index itself in the split
    layout, whose blocks are found from their index (decode/split.py)."""
    if BODY == 0:
        return q_ptr + first * BLOCK_HW
    else:
        return first.to(tl.int32)  # layout.choose: a split tensor's blocks count in int32


@triton.jit
def dot_units(q_ptr, p_row, v, vmask, xq_ptr, xd_ptr, xs_ptr, tab_ptr,
              UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr, BLOCK_HW: tl.constexpr,
              ZERO: tl.constexpr, OFFSET: tl.constexpr, BODY: tl.constexpr, MASK: tl.constexpr,
              ASM: tl.constexpr):
    """Σ over units v (a [1, BLOCK_U] tensor of unit indices along K) of rows p_row (a
    [BLOCK_N, 1] tensor from row_start: each row's first block) of the blocks at q_ptr
    (uint16) · x̂: float32 [BLOCK_N, BLOCK_U], one partial sum per (row, unit), scaled, not
    yet reduced. x̂'s codes load as int64 words (x's rows are whole 32-byte groups)."""
    if UPB == 1:
        off = v
        u = 0
    elif v.shape[1] % UPB == 0:
        # a step starts at a block (the launchers' steps are whole blocks): each lane keeps
        # its unit of a block, loop-invariant
        lane = tl.arange(0, v.shape[1])[None, :]
        off = (v - lane) // UPB + lane // UPB
        u = lane % UPB
    else:
        off = v // UPB
        u = v % UPB
    if BODY == 0:
        p = p_row + off * BLOCK_HW
        if MASK:
            # the last step's units past K re-read unit 0 of the row: in bounds, and x's
            # masked scale zeroes them below
            p = tl.where(vmask, p, p_row)
    else:
        blk = p_row + off
        if MASK:
            blk = tl.where(vmask, blk, p_row)
        p = block_ptr(q_ptr, blk, BLOCK_HW, BODY)
    words, a, b = UNIT(p, u, tab_ptr, ASM)
    part = tl.zeros_like(words[0]).to(tl.float32)
    x64 = xq_ptr.to(tl.pointer_type(tl.int64))
    for g in tl.static_range(UW // 32):
        gi = v * (UW // 32) + g
        if len(a) == UW // 32:  # a scale a group of 32
            s = tl.zeros_like(words[0])
            for w in tl.static_range(4):
                lo, hi = halves(_x_word(x64, gi * 4 + w, vmask, MASK))
                s = dp4a(words[g * 8 + 2 * w], lo, s, ASM)
                s = dp4a(words[g * 8 + 2 * w + 1], hi, s, ASM)
            term = s.to(tl.float32) * (a[g] * _x_group(xd_ptr, gi, vmask, MASK))
            if ZERO != 0 or OFFSET:
                xs = _x_group(xs_ptr, gi, vmask, MASK)
                if ZERO != 0:
                    term -= (a[g] * ZERO) * xs
                if OFFSET:
                    term -= b[g] * xs
        else:  # a scale (and offset) each 16: x's sums a half by dp4a
            term = tl.zeros_like(part)
            ones = tl.zeros_like(words[0]) + 0x01010101  # dp4a(ones, x) sums x's four codes
            for h in tl.static_range(2):
                s = tl.zeros_like(words[0])
                n = tl.zeros_like(words[0])
                for w in tl.static_range(2):
                    lo, hi = halves(_x_word(x64, gi * 4 + 2 * h + w, vmask, MASK))
                    s = dp4a(words[g * 8 + 4 * h + 2 * w], lo, s, ASM)
                    s = dp4a(words[g * 8 + 4 * h + 2 * w + 1], hi, s, ASM)
                    if ZERO != 0 or OFFSET:
                        n = dp4a(ones, lo, n, ASM)
                        n = dp4a(ones, hi, n, ASM)
                if ZERO != 0:
                    s -= ZERO * n  # exact in int32: |s| <= 16 * 128 * 127
                term += s.to(tl.float32) * a[2 * g + h]
                if OFFSET:
                    term -= n.to(tl.float32) * b[2 * g + h]
            term = term * _x_group(xd_ptr, gi, vmask, MASK)
        if MASK:
            term = tl.where(vmask, term, 0.0)  # a clamped unit's scale may be Inf or NaN
        part += term
    return part


@triton.jit
def _x_group(ptr, gi, vmask, MASK: tl.constexpr):
    """x̂'s value of group gi in `ptr` (its scale d or its sum s): 0 past K when MASK."""
    if MASK:
        return tl.load(ptr + gi, mask=vmask, other=0.0)
    return tl.load(ptr + gi)


@triton.jit
def _x_word(x64, i, vmask, MASK: tl.constexpr):
    """x̂'s int64 word i (eight codes): masked to 0 past K when MASK."""
    if MASK:
        return tl.load(x64 + i, mask=vmask, other=0)
    return tl.load(x64 + i)


@triton.jit
def _gemv_dp4a_kernel(xq_ptr, xd_ptr, xs_ptr, q_ptr, tab_ptr, out_ptr, part_ptr, count_ptr,
                      N, K, stride_om,
                      UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr,
                      BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                      BODY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
                      MASK: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    units = K // UW
    if SPLIT == 1:
        lo = 0
        hi = units
    else:
        # split K: program_id(2) takes its share of whole steps (none past the last one)
        per = tl.cdiv(tl.cdiv(units, BLOCK_U), SPLIT) * BLOCK_U
        lo = tl.program_id(2) * per
        hi = tl.minimum(lo + per, units)
    y = row_sums(xq_ptr + m * (K // 4), xd_ptr + m * (K // 32), xs_ptr + m * (K // 32), q_ptr, tab_ptr, rows,
                 N, K, lo, hi, UNIT, UW, UPB, BLOCK_HW, ZERO, OFFSET, BODY, BLOCK_N, BLOCK_U, MASK, ASM)
    if SPLIT == 1:
        tl.store(out_ptr + m * stride_om + rows, y, mask=rows < N)
    else:
        _sum_split(y, out_ptr + m * stride_om + rows, rows < N, part_ptr, count_ptr,
                   m * tl.num_programs(0) + pid_n, BLOCK_N, SPLIT)


@triton.jit
def row_sums(xq, xd, xs, q_ptr, tab_ptr, rows, N, K, lo, hi,
             UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr, BLOCK_HW: tl.constexpr,
             ZERO: tl.constexpr, OFFSET: tl.constexpr, BODY: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_U: tl.constexpr, MASK: tl.constexpr, ASM: tl.constexpr):
    """x̂'s row (xq, xd, xs at its first group) times the weight rows `rows` [BLOCK_N] over
    units lo .. hi: [BLOCK_N] float32, a program of the dp4a GEMV (also the router's,
    triton_kernels.router_gemv)."""
    units = K // UW
    # rows past N read row N - 1 (in bounds) and are not stored: no masks in the loop
    p_row = row_start(q_ptr, tl.minimum(rows, N - 1).to(tl.int64)[:, None] * (units // UPB),
                      BLOCK_HW, BODY)
    acc = tl.zeros((BLOCK_N, BLOCK_U), tl.float32)
    for v0 in range(lo, hi, BLOCK_U):
        v = (v0 + tl.arange(0, BLOCK_U))[None, :]
        acc += dot_units(q_ptr, p_row, v, v < units, xq, xd, xs, tab_ptr, UNIT, UW, UPB,
                         BLOCK_HW, ZERO, OFFSET, BODY, MASK, ASM)
    return tl.sum(acc, axis=1)  # the one cross-lane reduction


@triton.jit
def _sum_split(y, out, mask, part_ptr, count_ptr, slot, BLOCK_N: tl.constexpr,
               SPLIT: tl.constexpr):
    """Split K's reduction in the same launch: each program stores its partial sums, and
    the last of a tile's SPLIT programs to count itself in adds them in split order (the
    same bits whichever finishes last) and sets the count back to 0 for the next launch."""
    i = tl.arange(0, BLOCK_N)
    tl.store(part_ptr + (slot * SPLIT + tl.program_id(2)) * BLOCK_N + i, y)
    tl.debug_barrier()  # every lane's partial stored before the count says so
    if tl.atomic_add(count_ptr + slot, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
        total = tl.zeros((BLOCK_N,), tl.float32)
        for s in tl.static_range(SPLIT):
            # .cg: from L2, where the other programs' stores are, never a stale L1 line
            total += tl.load(part_ptr + (slot * SPLIT + s) * BLOCK_N + i, cache_modifier=".cg")
        tl.store(out, total, mask=mask)
        tl.atomic_xchg(count_ptr + slot, 0, sem="relaxed", scope="gpu")


MAX_SPLIT = 16


def split_for(tiles_n: int, steps: int, sms: int | None) -> int:
    """Split K's ways for a GEMV of `tiles_n` programs a row of x and `steps` K steps each,
    on a GPU of `sms` multiprocessors: 1 where the programs fill the GPU (or it is
    unknown), else enough to fill it, at most one way a step and MAX_SPLIT. Depends on
    neither M nor the data, so a row's result is the same in any batch."""
    if not sms or tiles_n >= sms or steps < 2:
        return 1
    return min(steps, -(-sms // tiles_n), MAX_SPLIT)


def multiprocessors(device: torch.device) -> int | None:
    """The GPU's multiprocessors (SMs, CUs); None off a GPU or under a fake device."""
    props = device_properties(device)
    return None if props is None else props.multi_processor_count


_COUNTS: dict = {}


def zeroed_counts(device: torch.device, n: int) -> torch.Tensor:
    """The counts of launches whose last program to finish completes their work (split K's
    tiles; the router GEMV's routing, triton_kernels.router_gemv; a DeltaNet layer's gated
    norm and window, triton_kernels.deltanet_decode) on `device`: zeros, kept
    (each launch leaves them at 0), one set a stream so that launches on two streams never
    share one. Made on the device, so a
    graph that captures their making zeroes them again on replay, which is harmless."""
    size = max(1024, 1 << (n - 1).bit_length())
    if faking():  # a trace's stand-in: a GPU holds them from its first launch on, and fills nothing a step
        return torch.empty(size, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, size)
    if key not in _COUNTS:
        # real ones even while torch.compile's fake implementations run this launcher
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            _COUNTS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTS[key]


def gemv_dp4a(x8: Q8X, q: torch.Tensor, fmt: str | quant.Format, N: int,
              tiles: tuple[int, int] | None = None, split: int | None = None) -> torch.Tensor:
    """(M, N) float32 = x̂ @ W.T for W's N rows of GGUF blocks in q (contiguous uint8,
    2-D or flat). tiles: (BLOCK_N rows, BLOCK_U units along K) a program, powers of two;
    by default triton_kernels.configs' "gemv" entry for the format and device. split: K
    split so many ways (one launch, the partial sums added in split order); by default the
    config's "split_k", an integer or "auto" (split_for)."""
    fmt = quant.get(fmt)
    u = unit(fmt)
    if u is None:
        raise ValueError(f"{fmt.name}: no int8 unit decode for this format; use path='gemv'")
    M = x8.q.shape[0]
    K = x8.q.shape[1] * 4
    out = torch.empty((M, N), dtype=torch.float32, device=q.device)
    if not (M and N):
        return out
    if K == 0:
        return out.zero_()
    block_n, block_u, split, warps = gemv_launch(fmt, q.device, N, K, tiles, split)
    tiles_n = triton.cdiv(N, block_n)
    units = K // u.weights
    part, counts = out, out  # unread when K is not split
    if split > 1:
        part = torch.empty(M * tiles_n * split * block_n, dtype=torch.float32, device=q.device)
        counts = zeroed_counts(q.device, M * tiles_n)
    _gemv_dp4a_kernel[(tiles_n, M, split)](
        x8.q, x8.d, x8.s, q.reshape(-1).view(torch.uint16), unit_table(fmt, q.device), out,
        part, counts, N, K, out.stride(0), **launch_args(fmt, u), BLOCK_N=block_n,
        BLOCK_U=block_u, MASK=units % block_u != 0, SPLIT=split, ASM=asm_for(q.device),
        num_warps=warps)
    return out


def gemv_launch(fmt: quant.Format, device, N: int, K: int, tiles: tuple[int, int] | None = None,
                split: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_U, split, num_warps) of gemv_dp4a's launch for an (N, K) weight on
    `device` (see gemv_dp4a): the one decision, which a launch that shares the GEMV's
    programs (triton_kernels.router_gemv) takes too."""
    cfg = configs.pick("gemv", fmt.name, device_name(device), configs.family(device), n=N)
    block_n, block_u = tiles if tiles is not None else (cfg["block_n"], cfg["block_u"])
    if split is None:
        split = cfg.get("split_k", 1)
        if split == "auto":
            split = split_for(triton.cdiv(N, block_n), triton.cdiv(K // unit(fmt).weights, block_u),
                              multiprocessors(device))
    if not (isinstance(split, int) and 1 <= split <= MAX_SPLIT):
        raise ValueError(f"{fmt.name}: split must be an integer from 1 to {MAX_SPLIT}, got {split!r}")
    return block_n, block_u, split, cfg.get("num_warps", 4)


def gemv_dp4a_torch(x8: Q8X, q: torch.Tensor, fmt: str | quant.Format, N: int) -> torch.Tensor:
    """gemv_dp4a's product in torch: x̂ @ W.T in float32."""
    from .dequant import dequantize_torch
    fmt = quant.get(fmt)
    K = x8.q.shape[1] * 4
    w = dequantize_torch(q.reshape(N, K // fmt.block_elems * fmt.block_bytes), fmt)
    return x8.dequantize() @ w.T
