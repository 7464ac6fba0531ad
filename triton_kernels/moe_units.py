"""The MoE prefill's expert matmuls on int8 units: moe()'s "dot" path in the formats with
an int8 unit decode (triton_kernels.decode.UNITS).

The per-weight "dot" kernels (moe._gate_up_kernel, moe._down_kernel) decode each weight
of a [BLOCK_N, BLOCK_K] tile on its own: 28-75 main-loop instructions a weight on sm_90.
These decode one unit of each of BLOCK_N rows a step from the words and group scales the
dp4a kernels read (qmatmul.unit_tile, the unit GEMM's decode, so the device layout too)
and multiply the [BLOCK_N, unit] tile with one tl.dot, as qmatmul's unit GEMM does. In a
prefill of the real shape every expert is read (512 tokens x top-10 of 512 experts: ten
slots an expert) and each weight is decoded once a block of slots, so the decode, not the
tensor cores, sets the time: `strata bench kernels --static --ops moe_dot_gate_up,moe_dot_down`.

Same grid, same aligned blocks (moe_align_block_size), same h (in the dots' type) and
float32 slot rows as the per-weight kernels: only the order of the float32 sums differs (a
unit a step), within the dot path's bound (tests/triton_kernels/test_moe.py). Gate and up step through H by
the larger of their two units; a step of equal units loads x's tile once for both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import launch_args, unit_table
from .qmatmul import unit_tile

# [BLOCK_N rows, unit] a step, 4096 weights (128 rows of 32, 64 of 64, 32 of 128), in blocks
# of at most 32 slots (16 for the 128-weight units of Q2_K, Q3_K and Q6_K): 11.4-24.0 main-loop
# instructions a weight on sm_90, no spills. Larger blocks spill at this width (the
# gate/up's two accumulators), and fewer rows cost 1.5-3x as much: a unit a lane, so a
# narrower tile leaves lanes decoding the same rows (strata bench kernels --static --ops
# moe_dot_gate_up,moe_dot_down)
TILE_WEIGHTS = 128 * 32
UNIT_WARPS = 4
# two stages of loads in flight (AMD's default; NVIDIA's is three): compiled as launched (bf16
# x and h rows, x's stride 1, the widths multiples of 16), three spilled 8 bytes in Q6_K's
# gate/up on sm_90 at 128 registers; two spill in no format there, take 20-40% less shared
# memory, and count the same main-loop instructions a weight within a tenth (--static). The
# loop is short (H / a unit's weights steps), and each step's decode, not its loads, sets it.
UNIT_STAGES = 2


def unit_tiles(u) -> int:
    """BLOCK_N of the unit kernels for units of u.weights."""
    return TILE_WEIGHTS // u.weights


def max_block_m(units) -> int:
    """The most slots a block of the unit kernels holds for these units."""
    return 16 if max(u.weights for u in units) >= 128 else 32


@triton.jit
def block_slots(sorted_ptr, expert_ids_ptr, pid_m, n_slots, BLOCK_M: tl.constexpr):
    """A dot-path program's aligned block (moe_align_block_size): its expert, its BLOCK_M
    slots (int32: a gate/up kernel holds them across its loop for the store after it, and
    64-bit ones cost it registers and instructions) and which of them are live (padding
    holds the sentinel n_slots)."""
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return e, slot, slot < n_slots


@triton.jit
def token_of(slot, top_k):
    """The token (int64) of slots (slot = token * top_k + j), divided in 32 bits: slots
    stay below 2^31, and sm_90 has no 64-bit divide (ptxas calls a routine for one)."""
    return (slot.to(tl.int32) // top_k).to(tl.int64)


@triton.jit
def _gate_up_units_kernel(x_ptr, wg_ptr, wu_ptr, tab_g_ptr, tab_u_ptr, h_ptr,
                          sorted_ptr, expert_ids_ptr, n_post_ptr,
                          n_slots, top_k, I, H, stride_xt, stride_xh,
                          gate_se, gate_sr, up_se, up_sr, stride_h,
                          UNIT_G: tl.constexpr, UW_G: tl.constexpr, UPB_G: tl.constexpr,
                          HW_G: tl.constexpr, ZERO_G: tl.constexpr, OFFSET_G: tl.constexpr,
                          BODY_G: tl.constexpr,
                          UNIT_U: tl.constexpr, UW_U: tl.constexpr, UPB_U: tl.constexpr,
                          HW_U: tl.constexpr, ZERO_U: tl.constexpr, OFFSET_U: tl.constexpr,
                          BODY_U: tl.constexpr, STEP: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, ASM: tl.constexpr):
    # STEP weights of H a step: one tile of x for both, STEP / UW units of each row of each
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_post_ptr):
        return  # past the used length: the grid is sized for the worst case
    e, slot, m_mask = block_slots(sorted_ptr, expert_ids_ptr, pid_m, n_slots, BLOCK_M)
    x_row = x_ptr + token_of(slot, top_k)[:, None] * stride_xt
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.minimum(rows, I - 1).to(tl.int64)     # rows past I re-read row I - 1
    fg = e * gate_se + r * gate_sr               # each row's first block (strides in blocks)
    fu = e * up_se + r * up_sr
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, STEP):
        offs_k = k0 + tl.arange(0, STEP)
        a = tl.load(x_row + offs_k[None, :] * stride_xh, mask=m_mask[:, None], other=0.0).to(DOT_DTYPE)
        wg = unit_tile(wg_ptr, tab_g_ptr, fg, k0 // UW_G, STEP // UW_G, UNIT_G, UW_G, UPB_G, HW_G, ZERO_G,
                       OFFSET_G, BODY_G, ASM)
        acc_g = tl.dot(a, tl.trans(wg.to(DOT_DTYPE)), acc_g, input_precision=INPUT_PRECISION)
        wu = unit_tile(wu_ptr, tab_u_ptr, fu, k0 // UW_U, STEP // UW_U, UNIT_U, UW_U, UPB_U, HW_U, ZERO_U,
                       OFFSET_U, BODY_U, ASM)
        acc_u = tl.dot(a, tl.trans(wu.to(DOT_DTYPE)), acc_u, input_precision=INPUT_PRECISION)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out = h_ptr + slot.to(tl.int64)[:, None] * stride_h + rows[None, :]
    tl.store(out, h, mask=m_mask[:, None] & (rows < I)[None, :])


@triton.jit
def _down_units_kernel(h_ptr, wd_ptr, tab_ptr, rw_ptr, out_ptr,
                       sorted_ptr, expert_ids_ptr, n_post_ptr,
                       n_slots, H, I, stride_h, down_se, down_sr, stride_o,
                       UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr,
                       BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                       BODY: tl.constexpr, STEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, ASM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_post_ptr):
        return
    e, slot, m_mask = block_slots(sorted_ptr, expert_ids_ptr, pid_m, n_slots, BLOCK_M)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first = e * down_se + tl.minimum(rows, H - 1).to(tl.int64) * down_sr
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the slots held across the loop stay int32, widened where used: held as int64 they
    # cost up to 28 registers, and ptxas 12.8 (Triton 3.6) spilled IQ2_XXS's in the loop
    for k0 in range(0, I, STEP):
        offs_k = k0 + tl.arange(0, STEP)
        a = tl.load(h_ptr + slot.to(tl.int64)[:, None] * stride_h + offs_k[None, :], mask=m_mask[:, None],
                    other=0.0)
        w = unit_tile(wd_ptr, tab_ptr, first, k0 // UW, STEP // UW, UNIT, UW, UPB, BLOCK_HW, ZERO, OFFSET,
                      BODY, ASM)
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=INPUT_PRECISION)
    # the routing weight scales the expert's output, as in transformers
    slot = slot.to(tl.int64)
    rw = tl.load(rw_ptr + slot, mask=m_mask, other=0.0)
    out = out_ptr + slot[:, None] * stride_o + rows[None, :]
    tl.store(out, acc * rw[:, None], mask=m_mask[:, None] & (rows < H)[None, :])


def suffixed(args: dict, suffix: str) -> dict:
    """launch_args for one of a gate/up kernel's two weights: UNIT_G, HW_G, ..."""
    return {("HW" if k == "BLOCK_HW" else k) + suffix: v for k, v in args.items()}


def step(want: int, widths, K: int) -> int:
    """The weights of K a unit kernel's step takes: `want` (a launch's BLOCK_K) or the widest
    unit if more, halved until it divides K (K is whole blocks, so the widest unit does)."""
    s = max(want, *widths)
    while K % s:
        s //= 2
    return s


def launch(x, w_gate, w_up, w_down, fmts, units, h, rw, per_slot, aligned, strides, dims,
           block_m: int, block_n: int | None, block_k: int, dot_dtype, precision, asm: str):
    """The two unit launches of moe()'s dot path, over the aligned blocks it made. block_n
    None: unit_tiles'; block_k: the K step wanted (a unit a row on a GPU by default; more
    under the interpreter, whose time goes with the steps)."""
    (fg, fu, fd), (ug, uu, ud) = fmts, units
    (gate_se, gate_sr), (up_se, up_sr), (down_se, down_sr) = strides
    n_slots, k, H, I = dims
    sorted_ids, expert_ids, n_post = aligned
    dev, blocks = x.device, expert_ids.shape[0]
    bn_gu = block_n or unit_tiles(ug if ug.weights >= uu.weights else uu)
    bn_d = block_n or unit_tiles(ud)
    _gate_up_units_kernel[(blocks, triton.cdiv(I, bn_gu))](
        x, w_gate.view(torch.uint16), w_up.view(torch.uint16), unit_table(fg, dev), unit_table(fu, dev), h,
        sorted_ids, expert_ids, n_post, n_slots, k, I, H, x.stride(0), x.stride(1),
        gate_se, gate_sr, up_se, up_sr, h.stride(0),
        **suffixed(launch_args(fg, ug), "_G"), **suffixed(launch_args(fu, uu), "_U"),
        STEP=step(block_k, (ug.weights, uu.weights), H), BLOCK_M=block_m, BLOCK_N=bn_gu,
        DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision, ASM=asm, num_warps=UNIT_WARPS, num_stages=UNIT_STAGES)
    _down_units_kernel[(blocks, triton.cdiv(H, bn_d))](
        h, w_down.view(torch.uint16), unit_table(fd, dev), rw, per_slot,
        sorted_ids, expert_ids, n_post, n_slots, H, I, h.stride(0), down_se, down_sr, per_slot.stride(0),
        **launch_args(fd, ud), STEP=step(block_k, (ud.weights,), I), BLOCK_M=block_m, BLOCK_N=bn_d,
        DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision, ASM=asm, num_warps=UNIT_WARPS, num_stages=UNIT_STAGES)
