"""Mixture of experts: routing, token alignment per expert, and the grouped quantized
expert matmuls with SwiGLU and the routing weights fused.

    route(logits, top_k, norm_topk_prob=True) -> (weights float32 (T, k), ids int32 (T, k))
    moe_align_block_size(ids, num_experts, block_m)
        -> (sorted_token_ids, expert_ids, num_tokens_post_padded)
    moe(x, w_gate, w_up, w_down, fmt_gate, fmt_up, fmt_down, weights, ids) -> (T, H)

The math is transformers' Qwen4ExpTextTopKRouter and Qwen4ExpTextExperts: softmax over
all E experts in float32, the top k, renormalised to sum to one; then for each token t
and each of its k experts e, with routing weight w,

    y[t] += w * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t]))

Expert weights are GGUF blocks, uint8, one expert after another along axis 0:

    w_gate, w_up   (E, I, row_bytes(H))   gate and up may be the two halves of one fused
                                          (E, 2I, row_bytes(H)) tensor: views whose expert
                                          stride is 2I rows; no copy is made
    w_down         (E, H, row_bytes(I))

with row_bytes(n) = n / block_elems * block_bytes of that tensor's format. Each of the
three has its own format (llama.cpp's IQ3_XXS mixes put IQ3_XXS gate/up beside IQ4_XS
down). Rows must be contiguous; the expert and row strides may be anything that is a whole
number of blocks, and are passed to the kernels in blocks.

Token slots: slot s = t * k + j is token t's j-th choice. moe_align_block_size groups the
slots by expert, each group padded with the sentinel T * k to a multiple of block_m,
so that a block of block_m sorted slots belongs to one expert:

    sorted_token_ids  [ e0 e0 e0 pad | e2 e2 e2 e2 | e2 pad pad pad | ...     ]  (block_m = 4)
    expert_ids        [ 0            | 2           | 2              | ... -1  ]
    num_tokens_post_padded = the used length (a 1-element tensor: no host sync on CUDA)

Two Triton kernels then walk the blocks (grid: blocks x output tiles):

1. gate/up: [BLOCK_M slots, BLOCK_K of H] tiles of x (rows gathered by slot // k) times
   decoded [BLOCK_K, BLOCK_N] tiles of gate[e].T and of up[e].T, two float32
   accumulators; writes silu(gate) * up into the float32 (T * k, I) buffer `h`.
2. down: [BLOCK_M, BLOCK_K of I] tiles of h times decoded tiles of down[e].T; the epilogue
   multiplies each row by its slot's routing weight and writes the float32 (T * k, H)
   buffer, one row per slot.

In the formats with an int8 unit decode the same two launches decode a unit of each row a
step instead of each weight on its own (triton_kernels/moe_units.py: 11.4-24.0 main-loop
instructions a weight on sm_90 where these spend 27-86), in blocks of at most 32 slots;
batch-invariant mode keeps the per-weight kernels.

Decoding (at most MOE_DP4A_MAX_TOKENS tokens, every format with an int8 unit decode)
takes the dp4a path instead: x and then h are rounded to int8 per 32 values
(triton_kernels.int8.quantize_x) and each (slot, BLOCK_N rows) program runs the dp4a
GEMV's inner loop (int8.dot_units) over its expert's rows, gate and up in one loop; no
block alignment, no padding rows, one read of each chosen expert's weights a slot. The
gate/up programs write h in that int8 form themselves when BLOCK_N is a multiple of 32
(the default tiles): two launches, no float h.

The k rows of each token are then summed by torch in a fixed order: deterministic, unlike
atomic adds into (T, H), at the price of the (T, k, H) float32 buffer (420 MB for 4096
tokens of the real model: chunk long prefills). Slots whose expert id lies outside
[0, E) are dropped by the alignment and contribute nothing: expert parallelism marks the
experts another rank holds with -1.

Dot inputs follow qmatmul's GEMM (qmatmul.dot_types): on a GPU the model's dtype (moe's
`dtype`, else x's own: fp16/bf16 tensor cores, tf32 for float32 on NVIDIA; x and h are
rounded to it, as the dense expert tier's loop rounds a prompt's and as the
half-precision intermediate of vLLM's fused_moe is), float32 under the interpreter. An
expert store hands x over in float32 (the dp4a path quantizes it from there) and names its
dtype: a bf16 model's dot path (a prompt's; a decode's too for experts without int8 units,
and in batch-invariant mode) then multiplies bf16 on the tensor cores, not tf32 at half
their rate on NVIDIA, nor in float32 FMAs on RDNA3, whose WMMA takes no float32 (there
IQ3_XXS's gate/up spilled 524 bytes a lane at Flash-Next's widths). A block of BLOCK_M >=
16 rows is tl.dot's minimum; when decoding one token, each expert's block holds one live
row, and the kernels stay bound by reading the weight bytes, as a GEMV would be.

`moe_torch` is the CPU path: for each expert hit, dequantize_torch its three matrices and
run its slots through float32 torch matmuls; it writes the same (T, k, H) buffer and sums
it the same way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import quant

from . import configs, invariant
from .asm import asm_for
from .backend import device_name, is_fake, use_triton
from .decode import decoder, launch_args, table, unit, unit_table
from .dequant import check_blocks, dequantize_torch
from .gated_gemv import ROUNDING, gated_qmatmul_torch, gated_rows, rounded
from .gemv_pair import dp4a_launch, one_row_path
from .int8 import Q8X, dot_units, gemv_launch, int8_buffers, quantize_x, row_start, row_sums, store_groups
from . import moe_units
from .moe_align import aligns_in_one_launch, moe_align_block_size
from .moe_units import block_slots, suffixed, token_of
from .qmatmul import choose_path as choose_qmatmul_path, dot_types, gemv_tiles, qmatmul_torch

X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# BLOCK_N x BLOCK_K = 32 x 32 at 4 warps: larger tiles spill registers on sm_90 (64 x 64 in
# 16 of 23 formats; strata bench kernels --static). BLOCK_M follows the tokens each expert
# gets (see _default_tiles).
BLOCK_N_DEFAULT = 32
BLOCK_K_DEFAULT = 32
# At most this many tokens take the dp4a decode path (each slot reads its expert's rows
# once; past a few tokens, slots share experts and the tl.dot path reads them once a block).
MOE_DP4A_MAX_TOKENS = 4


# --- routing -----------------------------------------------------------------------------

@triton.jit
def _top_k(logit, offs, live, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, NORM: tl.constexpr):
    """(weights, ids) (K_PAD,) of one token's float32 logits (E_PAD,), lanes past TOP_K zero."""
    ex = tl.where(live, tl.exp(logit - tl.max(logit, axis=0)), 0.0)
    prob = ex / tl.sum(ex, axis=0)
    # Chosen on the logits: softmax is monotonic, and the logits order experts whose
    # probabilities round to the same float. Ties go to the lowest index. A NaN logit
    # ranks last, so that every id stays in range (its weight, NaN, shows the fault).
    key = tl.where(logit == logit, logit, float("-inf"))  # noqa: PLR0124 (false for NaN only)
    kk = tl.arange(0, K_PAD)
    top_w = tl.zeros((K_PAD,), dtype=tl.float32)
    top_i = tl.zeros((K_PAD,), dtype=tl.int32)
    free = live
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, key, float("-inf")), axis=0)
        # `free` keeps -inf logits choosable and padding lanes out
        pick = tl.min(tl.where(free & (key == best), offs, E_PAD), axis=0)
        top_i = tl.where(kk == i, pick, top_i)
        top_w = tl.where(kk == i, tl.sum(tl.where(offs == pick, prob, 0.0), axis=0), top_w)
        free = free & (offs != pick)
    if NORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    return top_w, top_i


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, hits_ptr, E, stride_t,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  NORM: tl.constexpr, COUNT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    live = offs < E
    logit = tl.load(logits_ptr + t * stride_t + offs, mask=live, other=float("-inf")).to(tl.float32)
    top_w, top_i = _top_k(logit, offs, live, TOP_K, K_PAD, E_PAD, NORM)
    kk = tl.arange(0, K_PAD)
    tl.store(weights_ptr + t * TOP_K + kk, top_w, mask=kk < TOP_K)
    tl.store(ids_ptr + t * TOP_K + kk, top_i, mask=kk < TOP_K)
    if COUNT:  # an expert store's tally of slots per expert (atomic: integers, any order)
        tl.atomic_add(hits_ptr + top_i, tl.full((K_PAD,), 1, tl.int64), mask=kk < TOP_K)


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_route(logits: torch.Tensor, top_k: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"route: logits must be a (tokens, experts) tensor, got {_shape(logits)}")
    if logits.dtype not in X_DTYPES:
        raise ValueError(f"route: logits must be float32, float16 or bfloat16, got {logits.dtype}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"route: top_k={top_k} must be between 1 and the {logits.shape[1]} experts")


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
          hits: torch.Tensor | None = None):
    """Top-k routing of (T, E) router logits -> (weights float32 (T, k), ids int32 (T, k)),
    highest probability first; weights renormalised to sum to one if norm_topk_prob.
    hits: an int64 (E,) tally on the logits' device, plus one for each slot routed to an
    expert (an expert store's hit counter, counted in this launch)."""
    _check_route(logits, top_k)
    if hits is not None and (hits.dtype != torch.int64 or tuple(hits.shape) != (logits.shape[1],)
                             or hits.device != logits.device):
        raise ValueError(f"route: hits must be an int64 ({logits.shape[1]},) tensor on {logits.device}, "
                         f"got {hits.dtype} {tuple(hits.shape)} on {hits.device}")
    if not use_triton(logits):
        return route_torch(logits, top_k, norm_topk_prob, hits)
    T, E = logits.shape
    if not logits.is_cuda and logits.dtype == torch.bfloat16:
        logits = logits.float()  # the interpreter holds bf16 as raw uint16; widening is exact
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, weights, ids, ids if hits is None else hits, E, logits.stride(0),
                            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(E),
                            NORM=norm_topk_prob, COUNT=hits is not None)
    return weights, ids


def route_torch(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
                hits: torch.Tensor | None = None):
    """transformers' Qwen4ExpTextTopKRouter after the linear layer, weights kept float32;
    `hits` as route's."""
    _check_route(logits, top_k)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if hits is not None:
        hits += torch.bincount(ids.reshape(-1), minlength=logits.shape[1])
    return weights, ids.to(torch.int32)


# --- expert matmuls ----------------------------------------------------------------------

@triton.jit
def _gate_up_kernel(x_ptr, wg_ptr, wu_ptr, tab_g_ptr, tab_u_ptr, h_ptr,
                    sorted_ptr, expert_ids_ptr, n_post_ptr,
                    n_slots, top_k, I, H, stride_xt, stride_xh,
                    gate_se, gate_sr, up_se, up_sr, stride_h,
                    DECODE_G: tl.constexpr, QK_G: tl.constexpr,
                    DECODE_U: tl.constexpr, QK_U: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_post_ptr):
        return  # past the used length: the grid is sized for the worst case
    e, slot, m_mask = block_slots(sorted_ptr, expert_ids_ptr, pid_m, n_slots, BLOCK_M)
    tok = token_of(slot, top_k)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    # block indices of row n of expert e: strides in blocks, so fused views need no copy
    g_row = e * gate_se + offs_n * gate_sr
    u_row = e * up_se + offs_n * up_sr
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        a = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = n_mask[:, None] & k_mask[None, :]
        # decoded [BLOCK_N, BLOCK_K], K fastest (each row's bytes are contiguous);
        # masked lanes read zero bytes, which decode to 0.0 in every format
        jg = tl.broadcast_to((offs_k % QK_G)[None, :], (BLOCK_N, BLOCK_K))
        wg = DECODE_G(wg_ptr, tab_g_ptr, g_row[:, None] + (offs_k // QK_G)[None, :], jg, w_mask)
        acc_g = tl.dot(a, tl.trans(wg.to(DOT_DTYPE)), acc_g, input_precision=INPUT_PRECISION)
        ju = tl.broadcast_to((offs_k % QK_U)[None, :], (BLOCK_N, BLOCK_K))
        wu = DECODE_U(wu_ptr, tab_u_ptr, u_row[:, None] + (offs_k // QK_U)[None, :], ju, w_mask)
        acc_u = tl.dot(a, tl.trans(wu.to(DOT_DTYPE)), acc_u, input_precision=INPUT_PRECISION)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out = h_ptr + slot.to(tl.int64)[:, None] * stride_h + offs_n[None, :]
    tl.store(out, h, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, wd_ptr, tab_ptr, rw_ptr, out_ptr,
                 sorted_ptr, expert_ids_ptr, n_post_ptr,
                 n_slots, H, I, stride_h, down_se, down_sr, stride_o,
                 g2_ptr, u2_ptr, q2_ptr, tab2_ptr, out2_ptr, N2, K2, blocks,
                 DECODE: tl.constexpr, QK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 PAIR: tl.constexpr, DECODE2: tl.constexpr, QK2: tl.constexpr, ROUND2: tl.constexpr,
                 BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PAIR and pid_m >= blocks:  # the shared expert's down GEMV (`pair`): gated_gemv's programs
        p = (pid_m - blocks) * tl.num_programs(1) + pid_n
        if p * BLOCK_N2 < N2:
            offs = p.to(tl.int64) * BLOCK_N2 + tl.arange(0, BLOCK_N2)
            acc = gated_rows(g2_ptr, u2_ptr, q2_ptr, tab2_ptr, 0, offs, 1, N2, K2, 0, 0,
                             DECODE2, QK2, True, ROUND2, 1, BLOCK_N2, BLOCK_K2)
            tl.store(out2_ptr + offs[None, :], rounded(acc, ROUND2), mask=(offs < N2)[None, :])
        return
    if pid_m * BLOCK_M >= tl.load(n_post_ptr):
        return
    e, slot, m_mask = block_slots(sorted_ptr, expert_ids_ptr, pid_m, n_slots, BLOCK_M)
    slot = slot.to(tl.int64)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    d_row = e * down_se + offs_n * down_sr
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a = tl.load(h_ptr + slot[:, None] * stride_h + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
        j = tl.broadcast_to((offs_k % QK)[None, :], (BLOCK_N, BLOCK_K))
        w = DECODE(wd_ptr, tab_ptr, d_row[:, None] + (offs_k // QK)[None, :], j,
                   n_mask[:, None] & k_mask[None, :])
        acc = tl.dot(a, tl.trans(w.to(DOT_DTYPE)), acc, input_precision=INPUT_PRECISION)
    # the routing weight scales the expert's output, as in transformers
    rw = tl.load(rw_ptr + slot, mask=m_mask, other=0.0)
    out = out_ptr + slot[:, None] * stride_o + offs_n[None, :]
    tl.store(out, acc * rw[:, None], mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gate_up_dp4a_kernel(xq_ptr, xd_ptr, xs_ptr, wg_ptr, wu_ptr, tab_g_ptr, tab_u_ptr, h_ptr,
                         hq_ptr, hd_ptr, hs_ptr,
                         ids_ptr, top_k, E, I, H, gate_se, gate_sr, up_se, up_sr, stride_h,
                         UNIT_G: tl.constexpr, UW_G: tl.constexpr, UPB_G: tl.constexpr,
                         HW_G: tl.constexpr, ZERO_G: tl.constexpr, OFFSET_G: tl.constexpr,
                         BODY_G: tl.constexpr,
                         UNIT_U: tl.constexpr, UW_U: tl.constexpr, UPB_U: tl.constexpr,
                         HW_U: tl.constexpr, ZERO_U: tl.constexpr, OFFSET_U: tl.constexpr,
                         BODY_U: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK: tl.constexpr,
                         QUANT: tl.constexpr, ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    if (e < 0) | (e >= E):  # an expert held elsewhere: the slot's h is zero (h is not cleared)
        _store_h(h_ptr, hq_ptr, hd_ptr, hs_ptr, slot, pid_n, tl.zeros((BLOCK_N,), tl.float32),
                 I, stride_h, BLOCK_N, QUANT)
        return
    tok = token_of(slot, top_k)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.minimum(rows, I - 1).to(tl.int64)[:, None]  # rows past I re-read row I - 1
    pg = row_start(wg_ptr, e * gate_se + r * gate_sr, HW_G, BODY_G)  # strides in blocks
    pu = row_start(wu_ptr, e * up_se + r * up_sr, HW_U, BODY_U)
    xq = xq_ptr + tok * (H // 4)
    xd = xd_ptr + tok * (H // 32)
    xs = xs_ptr + tok * (H // 32)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K // UW_G), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K // UW_U), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        vg = (k0 // UW_G + tl.arange(0, BLOCK_K // UW_G))[None, :]
        acc_g += dot_units(wg_ptr, pg, vg, vg < H // UW_G, xq, xd, xs, tab_g_ptr, UNIT_G, UW_G,
                           UPB_G, HW_G, ZERO_G, OFFSET_G, BODY_G, MASK, ASM)
        vu = (k0 // UW_U + tl.arange(0, BLOCK_K // UW_U))[None, :]
        acc_u += dot_units(wu_ptr, pu, vu, vu < H // UW_U, xq, xd, xs, tab_u_ptr, UNIT_U, UW_U,
                           UPB_U, HW_U, ZERO_U, OFFSET_U, BODY_U, MASK, ASM)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    _store_h(h_ptr, hq_ptr, hd_ptr, hs_ptr, slot, pid_n, g * tl.sigmoid(g) * u, I, stride_h,
             BLOCK_N, QUANT)


@triton.jit
def _store_h(h_ptr, hq_ptr, hd_ptr, hs_ptr, slot, pid_n, h, I, stride_h, BLOCK_N: tl.constexpr,
             QUANT: tl.constexpr):
    """A gate/up program's BLOCK_N values of h: in float32, or with QUANT (BLOCK_N a
    multiple of 32, so that a program holds whole groups) in the int8 form the down kernel
    reads, as quantize_x would write it, with no float copy and no launch of its own."""
    if QUANT:
        grp = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
        store_groups(hq_ptr, hd_ptr, hs_ptr, slot, grp, tl.reshape(h, (BLOCK_N // 32, 32)), I,
                     grp < I // 32)
    else:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(h_ptr + slot * stride_h + rows, h, mask=rows < I)


@triton.jit
def _down_dp4a_kernel(hq_ptr, hd_ptr, hs_ptr, wd_ptr, tab_ptr, rw_ptr, out_ptr, ids_ptr,
                      E, H, I, down_se, down_sr, stride_o,
                      xq2_ptr, xd2_ptr, xs2_ptr, q2_ptr, tab2_ptr, out2_ptr, N2, K2, n_slots,
                      UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr,
                      BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                      BODY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      MASK: tl.constexpr, ASM: tl.constexpr, PAIR: tl.constexpr,
                      UNIT2: tl.constexpr, UW2: tl.constexpr, UPB2: tl.constexpr, HW2: tl.constexpr,
                      ZERO2: tl.constexpr, OFFSET2: tl.constexpr, BODY2: tl.constexpr, BLOCK_N2: tl.constexpr,
                      BLOCK_U2: tl.constexpr, MASK2: tl.constexpr, ROUND2: tl.constexpr):
    pid_n = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    if PAIR:
        if slot >= n_slots:  # the shared expert's down GEMV (`pair`): gemv_dp4a's programs
            rows2 = ((slot - n_slots) * tl.num_programs(0) + pid_n) * BLOCK_N2 + tl.arange(0, BLOCK_N2)
            y2 = row_sums(xq2_ptr, xd2_ptr, xs2_ptr, q2_ptr, tab2_ptr, rows2, N2, K2, 0, K2 // UW2, UNIT2, UW2, UPB2,
                          HW2, ZERO2, OFFSET2, BODY2, BLOCK_N2, BLOCK_U2, MASK2, ASM)
            tl.store(out2_ptr + rows2, rounded(y2, ROUND2), mask=rows2 < N2)  # as QuantLinear.gated's dtype
            return
    e = tl.load(ids_ptr + slot).to(tl.int64)
    if (e < 0) | (e >= E):  # the slot's output is zero (the buffer is not cleared)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + slot * stride_o + cols, tl.zeros((BLOCK_N,), tl.float32), mask=cols < H)
        return
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.minimum(rows, H - 1).to(tl.int64)[:, None]
    p = row_start(wd_ptr, e * down_se + r * down_sr, BLOCK_HW, BODY)
    hq = hq_ptr + slot * (I // 4)
    hd = hd_ptr + slot * (I // 32)
    hs = hs_ptr + slot * (I // 32)
    acc = tl.zeros((BLOCK_N, BLOCK_K // UW), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        v = (k0 // UW + tl.arange(0, BLOCK_K // UW))[None, :]
        acc += dot_units(wd_ptr, p, v, v < I // UW, hq, hd, hs, tab_ptr, UNIT, UW, UPB, BLOCK_HW,
                         ZERO, OFFSET, BODY, MASK, ASM)
    # the routing weight scales the expert's output, as in transformers
    y = tl.sum(acc, axis=1) * tl.load(rw_ptr + slot)
    tl.store(out_ptr + slot * stride_o + rows, y, mask=rows < H)


# the dp4a MoE kernels' warps (their tiles are configs'); a GEMV joins the down launch
# only at the same count (down_pair_path)
MOE_DP4A_WARPS = 4


def down_pair_path(fmt_down, fmt2, device, N2: int, K2: int, path: str = "dp4a") -> bool:
    """Whether the shared expert's down GEMV, (N2, K2) in fmt2, runs in the routed experts'
    down launch of `path` (moe(pair=)), each keeping its own bits: on the dp4a path, fmt_down
    with int8 units and the GEMV dp4a, splitting no K, at the down kernel's warps; on the
    dot path of float experts (fmt_down without int8 units: the per-weight down kernel),
    the gated float GEMV (triton_kernels.gated_gemv) at the down kernel's warps."""
    fmt_down, fmt2 = quant.get(fmt_down), quant.get(fmt2)
    if path == "dot":
        return (unit(fmt_down) is None and choose_qmatmul_path(fmt2, 1) == "gemv" and K2 % fmt2.block_elems == 0
                and configs.float_gemv_warps(fmt2.name, device)
                == configs.num_warps("moe_down", fmt_down.name, device, "dot_num_warps"))
    return (path == "dp4a" and unit(fmt_down) is not None and one_row_path(fmt2, device, N2, K2) == "dp4a"
            and gemv_launch(fmt2, device, N2, K2)[3] == MOE_DP4A_WARPS)


def _moe_dp4a(x, w_gate, w_up, w_down, fmt_gate, fmt_up, fmt_down, weights, ids, per_slot,
              strides, T, H, I, E, k, tiles, pair=None):
    (gate_se, gate_sr), (up_se, up_sr), (down_se, down_sr) = strides
    dev = x.device

    def tiles_for(op, fmt):  # triton_kernels.configs: per op, format and device
        if tiles is not None:
            return tiles
        cfg = configs.pick(op, fmt.name, device_name(dev), configs.family(dev))
        return cfg["block_n"], cfg["block_k"]
    block_n, block_k = tiles_for("moe_gate_up", fmt_gate)
    ug, uu, ud = unit(fmt_gate), unit(fmt_up), unit(fmt_down)
    n_slots = T * k
    flat_ids = ids.reshape(-1).to(torch.int32).contiguous()
    x8 = quantize_x(x)
    # h's int8 form written by the gate/up programs themselves when each holds whole groups
    # of 32 (the default tiles), else h in float32 and quantize_x's launch: the same bits
    fused, h8 = int8_buffers(True, n_slots, I, block_n, flat_ids)
    h = flat_ids if fused else torch.empty((n_slots, I), dtype=torch.float32, device=dev)
    asm = asm_for(dev)
    _gate_up_dp4a_kernel[(triton.cdiv(I, block_n), n_slots)](
        x8.q, x8.d, x8.s, w_gate.view(torch.uint16), w_up.view(torch.uint16),
        unit_table(fmt_gate, dev), unit_table(fmt_up, dev), h, *h8, flat_ids, k, E, I, H,
        gate_se, gate_sr, up_se, up_sr, h.stride(0),
        **suffixed(launch_args(fmt_gate, ug), "_G"), **suffixed(launch_args(fmt_up, uu), "_U"),
        BLOCK_N=block_n, BLOCK_K=block_k, MASK=H % block_k != 0, QUANT=fused, ASM=asm,
        num_warps=MOE_DP4A_WARPS)
    h8 = Q8X(*h8) if fused else quantize_x(h)
    block_n, block_k = tiles_for("moe_down", fmt_down)
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    grid_n = triton.cdiv(H, block_n)
    two, extra, cx2 = (h8.q,) * 6 + (0, 0), 0, _NO_DOWN_PAIR
    if pair is not None:  # the shared expert's down GEMV's programs in extra slots
        product, q2, fmt2, N2, dtype2, out2 = pair
        (xq2, xd2, xs2, q2u, tab2), p2, d_cx = dp4a_launch(product, q2, quant.get(fmt2), N2)
        two, extra = (xq2, xd2, xs2, q2u, tab2, out2, N2, product.shape[1]), triton.cdiv(p2, grid_n)
        cx2 = dict(PAIR=True, ROUND2=ROUNDING[dtype2], **{_TWO.get(k_, k_ + "2"): v for k_, v in d_cx.items()
                                                           if k_ not in ("PAIR", "ASM")})
    _down_dp4a_kernel[(grid_n, n_slots + extra)](
        h8.q, h8.d, h8.s, w_down.view(torch.uint16), unit_table(fmt_down, dev), rw,
        per_slot, flat_ids, E, H, I, down_se, down_sr, per_slot.stride(0), *two, n_slots,
        **launch_args(fmt_down, ud), BLOCK_N=block_n, BLOCK_K=block_k,
        MASK=I % block_k != 0, ASM=asm, **cx2, num_warps=MOE_DP4A_WARPS)


# the float down kernel without a pair
_NO_FLOAT_PAIR = dict(PAIR=False, DECODE2=None, QK2=1, ROUND2=0, BLOCK_N2=1, BLOCK_K2=1)

# gemv_pair.dp4a_launch's constexprs as the down kernel names its second weight's
_TWO = {"BLOCK_HW": "HW2", "BLOCK_N2": "BLOCK_N2", "BLOCK_U": "BLOCK_U2"}
_NO_DOWN_PAIR = dict(PAIR=False, UNIT2=None, UW2=1, UPB2=1, HW2=1, ZERO2=0, OFFSET2=0, BODY2=0, BLOCK_N2=1,
                     BLOCK_U2=1, MASK2=False, ROUND2=0)


def _check_pair(pair: tuple, path: str, slots: bool, fmt_down: quant.Format, device) -> None:
    product, q2, fmt2, N2, dtype2, out2 = pair
    gated = isinstance(product, (tuple, list))
    rows = product if gated else (product,)
    K2 = rows[0].shape[-1]
    if (not slots or path != ("dot" if gated else "dp4a")
            or not down_pair_path(fmt_down, fmt2, device, N2, K2, path)):
        raise ValueError(f"moe: a shared expert's down GEMV ({quant.get(fmt2).name}, {N2} rows) joins only "
                         f"a {'dot' if gated else 'dp4a'} call that keeps its slots, where down_pair_path says "
                         f"so (path {path})")
    if any(r.dtype != torch.float32 or tuple(r.shape) != (1, K2) or r.stride(-1) != 1 for r in rows) \
            or tuple(out2.shape) != (1, N2) or out2.dtype != torch.float32 or not out2.is_contiguous():
        raise ValueError(f"moe: pair's input rows must be (1, {K2}) float32 with unit column stride and out2 "
                         f"(1, {N2}) contiguous float32; got {[tuple(r.shape) for r in rows]} and "
                         f"{tuple(out2.shape)} {out2.dtype}")


def _expert_strides(w: torch.Tensor, fmt: quant.Format, what: str) -> tuple[int, int]:
    """(expert stride, row stride) of w in blocks; ValueError if rows are not whole blocks."""
    se, sr, sb = w.stride()
    # the stride of an axis of length one is never used, and torch may report any
    se, sr = (se if w.shape[0] > 1 else 0), (sr if w.shape[1] > 1 else 0)
    if w.shape[2] and (sb != 1 or se % fmt.block_bytes or sr % fmt.block_bytes):
        raise ValueError(f"moe: {what} ({fmt.name}): rows must be contiguous and the expert "
                         f"and row strides whole {fmt.block_bytes}-byte blocks, got strides "
                         f"{tuple(w.stride())}; pass w.contiguous()")
    return se // fmt.block_bytes, sr // fmt.block_bytes


def _check(x, w_gate, w_up, w_down, fmt_gate, fmt_up, fmt_down, weights, ids):
    """Validate the operands; returns (T, H, I, E, k)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"moe: x must be a (tokens, hidden) tensor, got {_shape(x)}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"moe: x must be float32, float16 or bfloat16, got {x.dtype}")
    T, H = x.shape
    operands = (("w_gate", w_gate, fmt_gate), ("w_up", w_up, fmt_up), ("w_down", w_down, fmt_down))
    for what, w, fmt in operands:
        try:
            check_blocks(w, fmt)
        except ValueError as err:
            raise ValueError(f"moe: {what}: {err}") from None
        if w.dim() != 3:
            raise ValueError(f"moe: {what} ({fmt.name}) must be (experts, rows, row bytes), "
                             f"got shape {tuple(w.shape)}")
        # pinned host memory is read over PCIe through unified addressing (NVIDIA): what
        # `strata bench kernels` sets against staging the misses into VRAM
        if w.device != x.device and not (x.is_cuda and w.device.type == "cpu" and w.is_pinned()):
            raise ValueError(f"moe: {what} is on {w.device} but x is on {x.device} (weights in host "
                             f"memory must be pinned: tensor.pin_memory())")
    E, I = w_gate.shape[0], w_gate.shape[1]
    for what, w, fmt, rows, cols in (("w_gate", w_gate, fmt_gate, I, H), ("w_up", w_up, fmt_up, I, H),
                                     ("w_down", w_down, fmt_down, H, I)):
        if cols % fmt.block_elems:
            raise ValueError(f"moe: {what} ({fmt.name}) rows of {cols} weights are not whole "
                             f"{fmt.block_elems}-weight blocks")
        want = (E, rows, cols // fmt.block_elems * fmt.block_bytes)
        if tuple(w.shape) != want:
            raise ValueError(f"moe: {what} ({fmt.name}) has shape {tuple(w.shape)}, expected "
                             f"{want} for E={E} experts, hidden H={H}, intermediate I={I}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"moe: ids must be ({T}, top_k), got {_shape(ids)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"moe: ids must be integer expert ids, got {ids.dtype}")
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"moe: weights must have the shape of ids {tuple(ids.shape)}, "
                         f"got {_shape(weights)}")
    if not weights.dtype.is_floating_point:
        raise ValueError(f"moe: weights must be floating point, got {weights.dtype}")
    if weights.device != x.device or ids.device != x.device:
        raise ValueError(f"moe: weights ({weights.device}) and ids ({ids.device}) must be on "
                         f"x's device {x.device}")
    # a CPU check costs nothing; on CUDA it would wait for the router, and the alignment
    # drops out-of-range ids there anyway
    if not ids.is_cuda and ids.numel() and not is_fake(ids) and (int(ids.min()) < -1 or int(ids.max()) >= E):
        raise ValueError(f"moe: ids must lie in [0, {E}) (or be -1 for an expert held elsewhere), "
                         f"got {int(ids.min())}..{int(ids.max())}")
    return T, H, I, E, ids.shape[1]


def _default_tiles(n_slots: int, E: int) -> tuple[int, int, int]:
    # BLOCK_M near the mean tokens per expert: padding wastes less of each block; 16 is
    # tl.dot's minimum, 64 a usual tensor-core tile
    per_expert = -(-n_slots // E)
    block_m = min(64, max(16, triton.next_power_of_2(per_expert)))
    _, block_n, block_k = configs.tiles("moe_dot", (block_m, BLOCK_N_DEFAULT, BLOCK_K_DEFAULT))
    return block_m, block_n, block_k


def _dot_tiles(fmts, n_slots: int, E: int) -> tuple[int, int, int]:
    """The dot path's default tiles for n_slots over E experts. Batch-invariant: those of a
    64-row block whatever the slots, so that a row's sums (tl.dot's instruction shape among
    them) never follow the batch. The unit kernels (moe_units) take smaller blocks
    (moe_units.max_block_m)."""
    if invariant.enabled():
        return _default_tiles(64 * E, E)
    bm, bn, bk = _default_tiles(n_slots, E)
    units = [unit(f) for f in fmts]
    if None not in units:
        bm = min(bm, moe_units.max_block_m(units))
    return bm, bn, bk


def block_m_for(fmt_gate, fmt_up, fmt_down, tokens: int, tile_slots: int, E: int) -> int:
    """The BLOCK_M in which a moe() call of the default tiles aligns its slots (its path
    chosen for `tokens`, its tiles for `tile_slots` over E experts); 0 on the dp4a path,
    which aligns nothing."""
    if choose_path(fmt_gate, fmt_up, fmt_down, tokens) != "dot":
        return 0
    return _dot_tiles((quant.get(fmt_gate), quant.get(fmt_up), quant.get(fmt_down)), tile_slots, E)[0]


def choose_path(fmt_gate, fmt_up, fmt_down, tokens: int) -> str:
    """"dp4a" for at most MOE_DP4A_MAX_TOKENS tokens when all three formats have int8
    units, else "dot". A caller that splits a batch (an expert cache running groups) passes
    the whole batch's path, so that every part runs the arithmetic the whole would."""
    units = all(unit(quant.get(f)) is not None for f in (fmt_gate, fmt_up, fmt_down))
    if invariant.enabled():  # one path for any batch (triton_kernels.invariant): dp4a runs a
        return "dp4a" if units else "dot"  # program a slot, dot one tile (see moe below)
    return "dp4a" if units and tokens <= MOE_DP4A_MAX_TOKENS else "dot"


def moe(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
        fmt_gate, fmt_up, fmt_down, weights: torch.Tensor, ids: torch.Tensor, *,
        tiles: tuple[int, int, int] | None = None, path: str | None = None,
        tile_slots: int | None = None, slots: bool = False, aligned: tuple | None = None,
        pair: tuple | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Σ_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x (T, H); result (T, H) in x's dtype.
    slots: with the kernels, the weighted slots' rows unsummed instead, (T, k, H) float32
    (a dropped slot's row 0), for a later launch to sum (shared_expert.gated_add).
    pair: (product (1, K2) float32, q2, fmt2, N2, dtype2, out2 (1, N2) float32), on the
    dp4a path with `slots` where down_pair_path says so: the shared expert's down GEMV
    of its SwiGLU product runs in the down launch's extra programs and writes out2, the
    bits QuantLinear.gated gives (gemv_dp4a's, rounded to dtype2), a launch fewer. On the
    dot path of float experts ((g, u) (1, K2) float32 in the product's place) the gated
    GEMV of silu(g) * u likewise (gated_gemv's programs, its bits).

    path: "dot" (aligned blocks, tl.dot) or "dp4a" (int8 x, one GEMV a slot); None takes
    dp4a for at most MOE_DP4A_MAX_TOKENS tokens when all three formats have int8 units.
    tiles: for "dot" (BLOCK_M, BLOCK_N, BLOCK_K), powers of two >= 16; for "dp4a"
    (BLOCK_N, BLOCK_K), BLOCK_K a power of two >= 64. tile_slots: choose the "dot" tiles as
    for a call of that many slots (an expert store's subsets then run the resident call's
    blocks). dtype: the "dot" path's operand type on a GPU, a model's compute dtype (x and
    the SwiGLU product rounded to it, as the dense expert tier's loop rounds a prompt's);
    None: x's own. CPU tensors without the interpreter run moe_torch.
    """
    fmt_gate, fmt_up, fmt_down = quant.get(fmt_gate), quant.get(fmt_up), quant.get(fmt_down)
    T, H, I, E, k = _check(x, w_gate, w_up, w_down, fmt_gate, fmt_up, fmt_down, weights, ids)
    if not use_triton(x):
        if pair is not None:  # the shared expert's down GEMV as QuantLinear.gated's torch form
            product, q2, fmt2, N2, dtype2, out2 = pair
            out2.copy_(gated_qmatmul_torch(*product, q2, fmt2, True, dtype2) if isinstance(product, (tuple, list))
                       else qmatmul_torch(product, q2, fmt2, n=N2).to(dtype2))
        return moe_torch(x, w_gate, w_up, w_down, fmt_gate, fmt_up, fmt_down, weights, ids)
    n_slots = T * k
    has_units = all(unit(f) is not None for f in (fmt_gate, fmt_up, fmt_down))
    if path is None:
        path = choose_path(fmt_gate, fmt_up, fmt_down, T)
    if path not in ("dot", "dp4a"):
        raise ValueError(f"moe: path must be 'dot', 'dp4a' or None, got {path!r}")
    if path == "dp4a" and not has_units:
        names = [f.name for f in (fmt_gate, fmt_up, fmt_down) if unit(f) is None]
        raise ValueError(f"moe: path='dp4a' needs int8 unit decodes; {', '.join(names)} "
                         f"has none (use path='dot')")
    if pair is not None:
        _check_pair(pair, path, slots, fmt_down, x.device)
    if path == "dp4a":
        if tiles is not None and (len(tiles) != 2 or tiles[1] < 64
                                  or any(t < 1 or t & (t - 1) for t in tiles)):
            raise ValueError(f"moe: dp4a tiles must be (BLOCK_N, BLOCK_K), powers of two with "
                             f"BLOCK_K >= 64, got {tiles}")
    else:
        explicit = tiles
        if tiles is None:
            tiles = _dot_tiles((fmt_gate, fmt_up, fmt_down), tile_slots or n_slots, E)
        if len(tiles) != 3 or any(t < 16 or t & (t - 1) for t in tiles):
            raise ValueError(f"moe: tiles must be powers of two >= 16, got {tiles}")
    dev, out_dtype = x.device, x.dtype
    # a dropped slot's row is 0: the dp4a kernels write every slot's, the dot kernels skip
    # them, and the alignment's one program zeroes them (aligns_in_one_launch)
    alloc = (torch.empty if n_slots and H and I and (path == "dp4a" or aligned is not None
                                                     or aligns_in_one_launch(ids))
             else torch.zeros)
    per_slot = alloc((n_slots, H), dtype=torch.float32, device=dev)
    if n_slots and H and I:
        gate_se, gate_sr = _expert_strides(w_gate, fmt_gate, "w_gate")
        up_se, up_sr = _expert_strides(w_up, fmt_up, "w_up")
        down_se, down_sr = _expert_strides(w_down, fmt_down, "w_down")
        if path == "dp4a":
            _moe_dp4a(x, w_gate, w_up, w_down, fmt_gate, fmt_up, fmt_down, weights, ids, per_slot,
                      ((gate_se, gate_sr), (up_se, up_sr), (down_se, down_sr)), T, H, I, E, k, tiles, pair)
            return _slot_sum(per_slot.view(T, k, H), slots, out_dtype)
        block_m, block_n, block_k = tiles
        dot_dtype, precision = dot_types(x, dtype)
        if not x.is_cuda and x.dtype == torch.bfloat16:
            x = x.float()  # the interpreter holds bf16 as raw uint16; widening is exact
        if aligned is not None:
            sorted_ids, expert_ids, n_post, aligned_m = aligned
            if aligned_m != block_m:
                raise ValueError(f"moe: aligned in blocks of {aligned_m}, the tiles' are {block_m}")
        else:
            sorted_ids, expert_ids, n_post = moe_align_block_size(ids, E, block_m, zero_rows=per_slot)
        rw = weights.reshape(-1).to(torch.float32).contiguous()
        # on a GPU the SwiGLU product is stored in the dots' type (`dtype`, else x's): the bits
        # the down kernel's cast gave, half the bytes. A prompt's x is rounded to it once here,
        # not in each of the I / BLOCK_N programs that read its rows (half the bytes and
        # fewer registers there); a decode's few rows (float experts, FP8 and batch-invariant
        # mode take this path then) are rounded in the kernels, the same bits, a launch fewer
        low = (dtype or x.dtype) if x.is_cuda else torch.float32
        if x.is_cuda and T > MOE_DP4A_MAX_TOKENS:
            x = x.to(low)
        h = torch.empty((n_slots, I), dtype=low, device=dev)
        if has_units and not invariant.enabled():  # batch-invariant mode: the per-weight tiles
            moe_units.launch(x, w_gate, w_up, w_down, (fmt_gate, fmt_up, fmt_down),
                             (unit(fmt_gate), unit(fmt_up), unit(fmt_down)), h, rw, per_slot,
                             (sorted_ids, expert_ids, n_post), ((gate_se, gate_sr), (up_se, up_sr), (down_se, down_sr)),
                             (n_slots, k, H, I), block_m, None if explicit is None else block_n,
                             block_k, dot_dtype, precision, asm_for(dev))
            return _slot_sum(per_slot.view(T, k, H), slots, out_dtype)
        blocks = expert_ids.shape[0]
        _gate_up_kernel[(blocks, triton.cdiv(I, block_n))](
            x, w_gate, w_up, table(fmt_gate, dev), table(fmt_up, dev), h,
            sorted_ids, expert_ids, n_post, n_slots, k, I, H, x.stride(0), x.stride(1),
            gate_se, gate_sr, up_se, up_sr, h.stride(0),
            DECODE_G=decoder(fmt_gate), QK_G=fmt_gate.block_elems,
            DECODE_U=decoder(fmt_up), QK_U=fmt_up.block_elems,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
            num_warps=configs.num_warps("moe_gate_up", fmt_gate.name, dev, "dot_num_warps"))
        grid_n = triton.cdiv(H, block_n)
        two, extra, cx2 = (h,) * 5 + (0, 0), 0, _NO_FLOAT_PAIR
        if pair is not None:  # the shared expert's gated down GEMV's programs in extra blocks
            (g2, u2), q2, fmt2, N2, dtype2, out2 = pair
            fmt2 = quant.get(fmt2)
            _, block_n2, block_k2 = gemv_tiles(N2, dev, fmt2)
            two = (g2, u2, q2, table(fmt2, dev), out2, N2, g2.shape[1])
            extra = triton.cdiv(triton.cdiv(N2, block_n2), grid_n)
            cx2 = dict(PAIR=True, DECODE2=decoder(fmt2), QK2=fmt2.block_elems, ROUND2=ROUNDING[dtype2],
                       BLOCK_N2=block_n2, BLOCK_K2=block_k2)
        _down_kernel[(blocks + extra, grid_n)](
            h, w_down, table(fmt_down, dev), rw, per_slot,
            sorted_ids, expert_ids, n_post, n_slots, H, I, h.stride(0),
            down_se, down_sr, per_slot.stride(0), *two, blocks,
            DECODE=decoder(fmt_down), QK=fmt_down.block_elems,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision, **cx2,
            num_warps=configs.num_warps("moe_down", fmt_down.name, dev, "dot_num_warps"))
    return _slot_sum(per_slot.view(T, k, H), slots, out_dtype)


def _slot_sum(per_slot: torch.Tensor, slots: bool, dtype: torch.dtype) -> torch.Tensor:
    """The (T, k, H) slots' rows summed (T, H) in `dtype`, or as they are with `slots`."""
    return per_slot if slots else per_slot.sum(dim=1).to(dtype)


def moe_torch(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
              fmt_gate, fmt_up, fmt_down, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """moe() in torch: per expert hit, dequantize_torch its matrices, float32 matmuls."""
    fmt_gate, fmt_up, fmt_down = quant.get(fmt_gate), quant.get(fmt_up), quant.get(fmt_down)
    T, H, _, E, k = _check(x, w_gate, w_up, w_down, fmt_gate, fmt_up, fmt_down, weights, ids)
    per_slot = torch.zeros((T * k, H), dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1).to(torch.int64)
    xf = x.float()
    rw = weights.reshape(-1).float()
    kept = (flat >= 0) & (flat < E)
    for e in torch.unique(flat[kept]).tolist():
        slots = (flat == e).nonzero().squeeze(1)
        xe = xf[slots // k]
        g = invariant.linear(xe, dequantize_torch(w_gate[e], fmt_gate))
        u = invariant.linear(xe, dequantize_torch(w_up[e], fmt_up))
        y = invariant.linear(torch.nn.functional.silu(g) * u, dequantize_torch(w_down[e], fmt_down))
        per_slot[slots] = y * rw[slots, None]
    return per_slot.view(T, k, H).sum(dim=1).to(x.dtype)
