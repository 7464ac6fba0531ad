"""QSA (query-sparse attention): the indexer's block scores, the choice of blocks, and
attention over the chosen blocks only, the gather fused into the attention.

    qsa_scores(q, blocks, start, ratio) -> scores float32 (T, nb)
    select_blocks(scores, start, ratio, keep) -> sel int64 (T, keep), -1 where unused
    select_sorted(scores, keep) -> (best, sel) (T, keep): a graph's choice over a whole row
    qsa_attention(q, k, v, sel, start, ratio[, k_scale, v_scale]) -> out float32 (H, T, D)
                 gate= (T, H*D) -> sigmoid(gate) * out as rows (T, H*D): the output projection's
                                   input, sigmoid_mul's bits, its int8 attached (D % 32 == 0)
    qsa_pool(idx, idx_scale, pos, ratio, w, eps, cos, sin, blocks)   a graph's block keys, in place
    token_mask(sel, start, ratio, n) -> bool (T, n): the tokens a selection attends to

Queries are T consecutive tokens at positions p = start .. start+T-1. The keys are cut
into blocks of `ratio` tokens; query p sees the n_p = (p + 1) // ratio complete blocks
before it and the open tail, tokens n_p * ratio .. p (at most ratio - 1 of them):

    keys     | b0 | b1 | b2 | b3 | b4 | b5 |tail p|
    sel[p]     --   x    --   x    x    --          keep = 3 of n_p = 6 blocks
    attends         b1        b3   b4      + tail

Scores (transformers' Qwen4ExpTextQSAIndexer): q (n_idx, T, d) are the indexer's normed,
roped queries, blocks (nb, d) the pooled, normed, roped block keys;

    score[t, b] = sum_h relu(q[h, t] . blocks[b]) / sqrt(d)     for b < n_p, else -inf

Selection: the `keep` best blocks of each query, all of them while n_p <= keep (then the
unused slots hold -1). relu makes exact-zero scores common, so ties decide which blocks
are kept, and the reference breaks them with torch.topk over a row of exactly n_p scores;
topk's choice among equal values depends on the row's length (padding a row with -inf
changes it). select_blocks therefore runs torch.topk over each group of queries that see
the same n_p (consecutive queries, at most `ratio` of them; rows of equal length in one
call choose as single rows do). It has no Triton twin: a kernel would choose among ties
by its own order, not topk's, and the kept blocks would differ from the reference's.

A decode graph cannot cut a row to n_p (its shapes are fixed): `select_sorted` sorts each
query's whole row (unseen blocks at -inf, sorted last) stably, so that of equal scores
the lower block is kept (triton_kernels.qsa_select keeps the same blocks in one launch). On NVIDIA GPUs that is topk's own choice: its kernels take the
values above the k-th, then of those equal to it the first in index order, by prefix sums
in both its single- and multi-block forms (aten/src/ATen/native/cuda/TensorTopK.cu,
gatherTopK), so there the eager step and the graph keep the same blocks
(tests/triton_kernels/test_cuda.py checks it on a GPU). ROCm's single-block form reserves
its output by warp atomics, in no set order. On the CPU topk's choice among equal values
moves with the row's length (a partial sort), so the graph's step, which runs there only
in tests, can keep another block than the eager step where a tie straddles the cut.

Attention: for each query head h (kv head h // (H / Hkv)), softmax(q . k / sqrt(D)) over
the chosen blocks' tokens and the tail, times v. K and V are the layer's cache,
(Hkv, N, D) in the cache's dtype (float32, bfloat16, float16, or int8 codes with
`k_scale`/`v_scale` (Hkv, N, 1), one scale a row: strata.nn.kv), read in place: the
kernel gathers each chosen block's rows itself, ratio rows a block, and accumulates in
float32 with an online softmax; the torch twin gathers them into (slice, S, D) buffers,
S = keep * ratio + ratio - 1 slots, a small slice of queries at a time.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import configs, invariant
from .backend import use_triton
from .int8 import Q8X, attach, int8_buffers, store_groups
from .rope import norm_rope_torch, norm_rope_values, partner_of
from .shared_expert import gate as gate_product
from .shared_expert import sigmoid_mul_torch

# Tiles, 4 warps (tests/triton_kernels/analysis/test_static.py: no spills on sm_90 and gfx942): the
# scores' program reads 64 block keys, its dot has the n_idx heads padded to 4 columns, not
# 16 (sm_90: 15 instructions a key value; padded to 16, about twice that); the attention
# reads 16 token slots an iteration
SCORES_BLOCK_N = 64
ATTN_BLOCK_S = 16


# float32 elements the torch twin of the scores holds in one temporary (a slice of queries;
# 4 MiB: measured no slower than larger slices, and the relu and the sum read it from cache)
TORCH_TILE_ELEMS = 1 << 20
# bytes of K (and of V) the attention's torch twin gathers a slice of queries: they stay in
# the CPU's cache until the matmuls read them back
TORCH_QUERY_TILE_BYTES = 1 << 20


def visible_blocks(start: int, T: int, ratio: int, device=None) -> torch.Tensor:
    """n_p = (p + 1) // ratio for p = start .. start+T-1 (int64)."""
    return torch.div(torch.arange(start + 1, start + T + 1, device=device), ratio, rounding_mode="floor")


# --- block scores ---------------------------------------------------------------------------

def _check_scores(q, blocks, ratio):
    if q.dim() != 3 or blocks.dim() != 2 or q.shape[-1] != blocks.shape[-1]:
        raise ValueError(f"qsa_scores: q must be (n_idx, T, d) and blocks (nb, d) with the same d, got "
                         f"{tuple(q.shape)} and {tuple(blocks.shape)}")
    if ratio < 1:
        raise ValueError(f"qsa_scores: ratio (tokens a block) must be >= 1, got {ratio}")


def qsa_scores_torch(q: torch.Tensor, blocks: torch.Tensor, start: int, ratio: int) -> torch.Tensor:
    """The reference's scores: one matmul of all heads' queries against the blocks (the
    block keys are read once), relu, summed over the heads, then divided by sqrt(d)."""
    _check_scores(q, blocks, ratio)
    n_idx, T, d = q.shape
    nb = blocks.shape[0]
    if invariant.enabled():  # fixed-shape products: a score does not depend on T or nb
        out = invariant.scores(q, blocks)
    else:
        out = torch.empty(T, nb, dtype=torch.float32, device=q.device)
        kt = blocks.float().T
        step = max(1, TORCH_TILE_ELEMS // max(1, n_idx * nb))
        for a in range(0, T, step):
            b = min(T, a + step)
            s = (q[:, a:b].float().reshape(-1, d) @ kt).view(n_idx, b - a, nb).relu_()
            torch.sum(s, dim=0, out=out[a:b])
    out /= math.sqrt(d)
    n = visible_blocks(start, T, ratio)
    if T > 1 or int(n[0]) < nb:  # a decode step sees every block it is given
        out.masked_fill_(torch.arange(nb, device=q.device)[None, :] >= n.to(q.device)[:, None], float("-inf"))
    return out


@triton.jit
def _qsa_scores_kernel(q_ptr, blk_ptr, out_ptr, T, NB, start, ratio, sqrt_d,
                       stride_qh, stride_qt, stride_bn, stride_ot,
                       N_IDX: tl.constexpr, NI_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                       BLOCK_N: tl.constexpr, START_PTR: tl.constexpr):
    # one program: query t against BLOCK_N block keys, which meet all its heads in one dot:
    # the heads are the columns of q (D, NI_P2) (columns past n_idx are zero and add
    # relu(0) = 0), the block keys read once
    t, pid_n = tl.program_id(0), tl.program_id(1)
    dd = tl.arange(0, D_P2)
    hh = tl.arange(0, NI_P2)
    qm = tl.load(q_ptr + hh[None, :] * stride_qh + t * stride_qt + dd[:, None],
                 mask=(hh < N_IDX)[None, :] & (dd < D)[:, None], other=0.0).to(tl.float32)
    b = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.load(blk_ptr + b[:, None] * stride_bn + dd[None, :],
                 mask=(b < NB)[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
    s = tl.sum(tl.maximum(tl.dot(kb, qm, input_precision="ieee"), 0.0), axis=1)
    n_vis = (_first(start, START_PTR) + t + 1) // ratio
    s = tl.where(b < n_vis, s / sqrt_d, float("-inf"))
    tl.store(out_ptr + t * stride_ot + b, s, mask=b < NB)


@triton.jit
def _first(start, START_PTR: tl.constexpr):
    """The first query's position: `start` itself, or read from the device (START_PTR)."""
    if START_PTR:  # (one return: the compiler types both branches' returns alike)
        first = tl.load(start).to(tl.int32)
    else:
        first = start
    return first


def _start(start: int | torch.Tensor, name: str) -> bool:
    """Whether `start` is a device tensor (one element, read by the kernel: a decode graph's
    position, which the host never reads) rather than an int."""
    if isinstance(start, torch.Tensor):
        if start.numel() != 1 or start.dtype.is_floating_point:
            raise ValueError(f"{name}: a tensor start must hold one integer, got {start.dtype} {tuple(start.shape)}")
        return True
    return False


def qsa_scores(q: torch.Tensor, blocks: torch.Tensor, start: int | torch.Tensor, ratio: int, *,
               block_n: int = SCORES_BLOCK_N) -> torch.Tensor:
    """score[t, b] (T, nb) float32, -inf past query t's visible blocks (see the module).
    `start` may be a one-element device tensor with the Triton kernel (a decode graph's
    position). CPU tensors without the interpreter run qsa_scores_torch."""
    _check_scores(q, blocks, ratio)
    on_device = _start(start, "qsa_scores")
    if not use_triton(q):  # (a tensor start is on the host here)
        return qsa_scores_torch(q, blocks, int(start) if on_device else start, ratio)
    n_idx, T, d = q.shape
    nb = blocks.shape[0]
    q = q.contiguous() if q.stride(-1) != 1 else q
    blocks = blocks.contiguous() if blocks.stride(-1) != 1 else blocks
    out = torch.empty(T, nb, dtype=torch.float32, device=q.device)
    if T and nb:
        grid = (T, triton.cdiv(nb, block_n))
        # warps: configs' "qsa_scores", 4, and 8 on 32-lane AMD waves ("rdna"), whose compiler
        # holds the dot's operands in registers as CDNA's does, over half the lanes: gfx1100
        # spilled 68 bytes a lane at 4 warps, none at 8 (141 registers)
        _qsa_scores_kernel[grid](q, blocks, out, T, nb, start, ratio, math.sqrt(d), q.stride(0), q.stride(1),
                                 blocks.stride(0), out.stride(0), N_IDX=n_idx,
                                 NI_P2=max(4, triton.next_power_of_2(n_idx)), D=d,
                                 D_P2=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n,
                                 START_PTR=on_device, num_warps=configs.num_warps("qsa_scores", "", q.device))
    return out


# --- choosing the blocks --------------------------------------------------------------------

def select_blocks(scores: torch.Tensor, start: int, ratio: int, keep: int) -> torch.Tensor:
    """sel (T, keep) int64: each query's `keep` best visible blocks (all of them, then -1,
    while it sees no more than `keep`). Ties break as torch.topk over exactly the query's
    n_p scores (see the module); queries with equal n_p share one call."""
    T = scores.shape[0]
    dev = scores.device
    n = visible_blocks(start, T, ratio)  # on the host: the groups are found there
    few = int((n <= keep).sum())  # n is non-decreasing: the first `few` queries keep all
    if T and not few and int(n[-1]) == int(n[0]):  # one group, all choosing (a decode step): its topk alone
        return scores[:, :int(n[0])].topk(keep, dim=-1).indices
    sel = torch.full((T, keep), -1, dtype=torch.int64, device=dev)
    slots = torch.arange(keep)
    if few:
        sel[:few] = torch.where(slots[None, :] < n[:few, None], slots[None, :], -1).to(dev)
    a = few
    while a < T:
        nb = int(n[a])
        b = min(T, a + (nb + 1) * ratio - 1 - (start + a))  # the queries that see nb blocks
        sel[a:b] = scores[a:b, :nb].topk(keep, dim=-1).indices
        a = b
    return sel


def select_sorted(scores: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(best scores, sel) (T, keep): each row's `keep` best blocks over the whole row,
    of equal scores the lower block (see the module); -inf ones (unseen) last. One sort
    launch, whatever the row's visible length: a graph's choice."""
    best, sel = scores.sort(dim=-1, descending=True, stable=True)
    return best[:, :keep], sel[:, :keep]


def token_mask(sel: torch.Tensor, start: int, ratio: int, n: int) -> torch.Tensor:
    """bool (T, n): True where query t attends to token j: the tokens of its chosen blocks
    and its open tail (the dense-masked form of a selection, as the reference builds it)."""
    T = sel.shape[0]
    dev = sel.device
    tok = torch.arange(n, device=dev)
    pos = torch.arange(start, start + T, device=dev)
    n_vis = visible_blocks(start, T, ratio, dev)
    chosen = torch.zeros(T, n // ratio + 1, dtype=torch.bool, device=dev)
    live = (sel >= 0) & (sel < n_vis[:, None])  # a block not yet visible counts as -1
    chosen.scatter_(1, torch.where(live, sel, n // ratio), True)
    by_block = chosen[:, :n // ratio].repeat_interleave(ratio, dim=1)
    mask = torch.zeros(T, n, dtype=torch.bool, device=dev)
    mask[:, :by_block.shape[1]] = by_block
    tail = (tok[None, :] >= (n_vis * ratio)[:, None]) & (tok[None, :] <= pos[:, None])
    return mask | tail


# --- pooling the block keys in a decode graph ----------------------------------------------

def _check_pool(idx, idx_scale, pos, ratio, w, cos, sin, blocks):
    if idx.dim() != 2 or blocks.dim() != 2 or blocks.shape[1] != idx.shape[1] or w.shape != (idx.shape[1],):
        raise ValueError(f"qsa_pool: idx must be (capacity, d), blocks (n_blocks, d) and w (d,), got "
                         f"{tuple(idx.shape)}, {tuple(blocks.shape)}, {tuple(w.shape)}")
    if (idx.dtype == torch.int8) != (idx_scale is not None):
        raise ValueError("qsa_pool: int8 indexer keys need idx_scale (and only they do)")
    if pos.dim() != 1 or ratio < 1:
        raise ValueError(f"qsa_pool: pos must be (T,) and ratio >= 1, got {tuple(pos.shape)} and {ratio}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] > idx.shape[1] or cos.shape[1] % 2:
        raise ValueError(f"qsa_pool: cos and sin must be (positions, rope_dim), rope_dim even and at most "
                         f"{idx.shape[1]}, got {tuple(cos.shape)}")
    if blocks.dtype != torch.float32 or w.dtype != torch.float32 or cos.dtype != torch.float32:
        raise ValueError("qsa_pool: blocks, w, cos and sin are float32")


def qsa_pool_torch(idx: torch.Tensor, idx_scale: torch.Tensor | None, pos: torch.Tensor, ratio: int,
                   w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, blocks: torch.Tensor) -> None:
    """blocks[p // ratio] = the pooled key of the block each position p (T,) lies in: the
    mean of its `ratio` raw indexer keys (rows of idx (capacity, d) as stored, past the
    capacity the last; int8 rows times idx_scale), RMS-normed times w, roped at the block's
    first position by the cos and sin tables (positions, rope_dim). In place; the block of
    a position not yet complete is pooled too (its rows past p are zero: a graph's held
    buffers), and no query sees it until it is complete (GatedAttention._blocks)."""
    _check_pool(idx, idx_scale, pos, ratio, w, cos, sin, blocks)
    block = pos // ratio
    first = block * ratio
    rows = (first[:, None] + torch.arange(ratio, device=pos.device)).clamp(max=idx.shape[0] - 1)  # (T, r)
    raw = idx[rows].float() if idx_scale is None else idx[rows].float() * idx_scale[rows].float()
    key = norm_rope_torch(raw.mean(dim=1).unsqueeze(1), w, eps, cos[first], sin[first])[0]
    blocks.index_copy_(0, block, key)


@triton.jit
def _qsa_pool_kernel(idx_ptr, scale_ptr, pos_ptr, w_ptr, cos_ptr, sin_ptr, blocks_ptr, C, D, R, ratio, eps,
                     stride_i, stride_s, stride_b, BD: tl.constexpr, SCALED: tl.constexpr):
    # one program a position; positions in one block write the same key (the same rows read)
    p = tl.load(pos_ptr + tl.program_id(0))
    blk = p // ratio
    first = blk * ratio
    c = tl.arange(0, BD)
    partner = partner_of(c, R)
    x = tl.zeros((BD,), tl.float32)
    xp = tl.zeros((BD,), tl.float32)
    for j in range(0, ratio):
        row = tl.minimum(first + j, C - 1)
        v = tl.load(idx_ptr + row * stride_i + c, mask=c < D, other=0).to(tl.float32)
        vp = tl.load(idx_ptr + row * stride_i + partner, mask=c < R, other=0).to(tl.float32)
        if SCALED:
            s = tl.load(scale_ptr + row * stride_s).to(tl.float32)
            v, vp = v * s, vp * s
        x += v
        xp += vp
    out = norm_rope_values(x / ratio, xp / ratio, w_ptr, cos_ptr + first * R, sin_ptr + first * R, D, R, eps, BD)
    tl.store(blocks_ptr + blk * stride_b + c, out, mask=c < D)


def qsa_pool(idx: torch.Tensor, idx_scale: torch.Tensor | None, pos: torch.Tensor, ratio: int,
             w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, blocks: torch.Tensor) -> None:
    """qsa_pool_torch in one launch, positions read from the device (a decode graph's
    QSA layer: what torch takes five launches for). CPU tensors without the interpreter
    run qsa_pool_torch."""
    _check_pool(idx, idx_scale, pos, ratio, w, cos, sin, blocks)
    if not use_triton(idx):
        return qsa_pool_torch(idx, idx_scale, pos, ratio, w, eps, cos, sin, blocks)
    if idx.stride(-1) != 1 or blocks.stride(-1) != 1:
        raise ValueError("qsa_pool: idx and blocks must be contiguous along d")
    scaled = idx_scale is not None
    scale = idx_scale if scaled else idx  # unread without SCALED
    if pos.numel():
        _qsa_pool_kernel[(pos.numel(),)](idx, scale, pos, w.contiguous(), cos.contiguous(), sin.contiguous(), blocks,
                                         idx.shape[0], idx.shape[1], cos.shape[1], ratio, eps, idx.stride(0),
                                         scale.stride(0), blocks.stride(0), BD=triton.next_power_of_2(idx.shape[1]),
                                         SCALED=scaled)


# --- attention over the chosen blocks -------------------------------------------------------

def _check_scales(k, k_scale, v_scale):
    if (k_scale is None) != (v_scale is None) or (k.dtype == torch.int8) != (k_scale is not None):
        raise ValueError("qsa_attention: int8 K and V need k_scale and v_scale (and only they do)")
    if k_scale is not None and (k_scale.shape != (*k.shape[:2], 1) or v_scale.shape != k_scale.shape):
        raise ValueError(f"qsa_attention: scales must be {(*k.shape[:2], 1)}, got {tuple(k_scale.shape)}, "
                         f"{tuple(v_scale.shape)}")


def _check_attention(q, k, v, sel, start, ratio):
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"qsa_attention: q must be (H, T, D), k and v (Hkv, N, D) alike, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    H, T, _ = q.shape
    if H % k.shape[0]:
        raise ValueError(f"qsa_attention: {H} query heads do not share {k.shape[0]} kv heads evenly")
    if sel.dim() != 2 or sel.shape[0] != T:
        raise ValueError(f"qsa_attention: sel must be ({T}, keep), got {tuple(sel.shape)}")
    if not isinstance(start, torch.Tensor) and start + T > k.shape[1]:  # (a graph's holds its capacity)
        raise ValueError(f"qsa_attention: queries up to position {start + T - 1} need that many "
                         f"cached keys, the cache holds {k.shape[1]}")
    if ratio < 1:
        raise ValueError(f"qsa_attention: ratio (tokens a block) must be >= 1, got {ratio}")


def _slots(sel: torch.Tensor, start: int, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's S = keep * ratio + ratio - 1 slots: the token (T, S) int64 (0 where
    unused) and whether it is used (T, S): its blocks' tokens, then its tail's."""
    T, keep = sel.shape
    dev = sel.device
    j = torch.arange(ratio, device=dev)
    pos = torch.arange(start, start + T, device=dev)
    blk = (sel[:, :, None] * ratio + j).reshape(T, keep * ratio)
    n_vis = visible_blocks(start, T, ratio, dev)
    tail = (n_vis * ratio)[:, None] + j[:ratio - 1]
    chosen = (sel >= 0) & (sel < n_vis[:, None])  # a block not yet visible counts as -1
    ok = torch.cat([chosen.repeat_interleave(ratio, dim=1), tail <= pos[:, None]], dim=1)
    return torch.where(ok, torch.cat([blk, tail], dim=1), 0), ok


def qsa_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: torch.Tensor,
                        start: int, ratio: int, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per kv head and slice of queries: gather the slots' K and V rows, then scores,
    softmax and values as batched matmuls with the kv head's query heads as the rows. A
    slice gathers about TORCH_QUERY_TILE_BYTES of K, so that the matmuls read it back
    from the CPU's cache (measured on 2 cores, 512 queries at 32K: 34 ms a layer, against
    49 ms gathering whole blocks and joining the tails, and 120 ms for one SDPA call over a
    (Hkv, T, S, D) gather with a boolean mask)."""
    _check_attention(q, k, v, sel, start, ratio)
    _check_scales(k, k_scale, v_scale)
    H, T, D = q.shape
    Hkv = k.shape[0]
    G = H // Hkv
    tok, ok = _slots(sel, start, ratio)
    S = tok.shape[1]
    bias = torch.zeros(ok.shape, device=q.device).masked_fill_(~ok, float("-inf"))[:, None, :]  # (T, 1, S)
    out = torch.empty(Hkv, G, T, D, dtype=torch.float32, device=q.device)
    qf = q.float().view(Hkv, G, T, D).transpose(1, 2)                                        # (Hkv, T, G, D)
    step = max(1, TORCH_QUERY_TILE_BYTES // (S * D * 4))
    for h in range(Hkv):
        kh, vh = k[h], v[h]  # (N, D), rows contiguous: index_select copies rows, not the cache
        for a in range(0, T, step):
            b = min(T, a + step)
            idx = tok[a:b].reshape(-1)
            kg = kh.index_select(0, idx).view(b - a, S, D).float()
            vg = vh.index_select(0, idx).view(b - a, S, D).float()
            if k_scale is not None:  # int8 rows times their scales
                kg *= k_scale[h].index_select(0, idx).view(b - a, S, 1).float()
                vg *= v_scale[h].index_select(0, idx).view(b - a, S, 1).float()
            s = torch.baddbmm(bias[a:b].expand(b - a, G, S), qf[h, a:b], kg.transpose(1, 2), alpha=D ** -0.5)
            out[h, :, a:b] = torch.bmm(torch.softmax(s, dim=-1), vg).transpose(0, 1)
    return out.view(H, T, D)


@triton.jit
def _qsa_attention_kernel(q_ptr, k_ptr, v_ptr, sel_ptr, out_ptr, ks_ptr, vs_ptr, gate_ptr, x8q_ptr, x8d_ptr, x8s_ptr,
                          start, ratio, keep, sm_scale,
                          stride_qh, stride_qt, stride_kh, stride_kn, stride_vh, stride_vn,
                          stride_st, stride_oh, stride_ot, stride_sh, stride_sn, stride_gt,
                          G: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, BLOCK_S: tl.constexpr,
                          SCALED: tl.constexpr, START_PTR: tl.constexpr, GATE: tl.constexpr, QUANT: tl.constexpr):
    # one program: query t, query head h (kv head h // G). Slot s < keep * ratio is token
    # sel[t, s // ratio] * ratio + s % ratio (none where the block id is -1 or not yet
    # visible: a graph's sorted scores put the unseen blocks last); slot keep * ratio + j
    # is tail token n_p * ratio + j (none past p). The dots are products summed along d:
    # one query row would waste 15 of tl.dot's 16.
    t, h = tl.program_id(0), tl.program_id(1)
    hk = h // G
    pos = _first(start, START_PTR) + t
    n_vis = (pos + 1) // ratio
    dd = tl.arange(0, D_P2)
    d_ok = dd < D
    q = tl.load(q_ptr + h * stride_qh + t * stride_qt + dd, mask=d_ok, other=0.0).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros((D_P2,), tl.float32)
    in_blocks = keep * ratio
    n_slots = in_blocks + ratio - 1
    for s0 in range(0, n_slots, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        is_blk = s < in_blocks
        blk = tl.load(sel_ptr + t * stride_st + s // ratio, mask=is_blk, other=-1)
        tok = tl.where(is_blk, blk * ratio + s % ratio, n_vis * ratio + (s - in_blocks))
        ok = tl.where(is_blk, (blk >= 0) & (blk < n_vis), tok <= pos) & (s < n_slots)
        kv_mask = ok[:, None] & d_ok[None, :]
        kt = tl.load(k_ptr + hk * stride_kh + tok[:, None] * stride_kn + dd[None, :],
                     mask=kv_mask, other=0.0).to(tl.float32)
        if SCALED:  # int8 rows: one scale a row (k_scale and v_scale share their strides)
            kt = kt * tl.load(ks_ptr + hk * stride_sh + tok * stride_sn, mask=ok, other=0.0).to(tl.float32)[:, None]
        qk = tl.where(ok, tl.sum(kt * q[None, :], axis=1) * sm_scale, float("-inf"))  # (BLOCK_S,)
        m_new = tl.maximum(m_i, tl.max(qk, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no slot yet: nothing to rescale
        p = tl.exp(qk - m_safe)
        alpha = tl.exp(m_i - m_safe)
        vt = tl.load(v_ptr + hk * stride_vh + tok[:, None] * stride_vn + dd[None, :],
                     mask=kv_mask, other=0.0).to(tl.float32)
        if SCALED:
            vt = vt * tl.load(vs_ptr + hk * stride_sh + tok * stride_sn, mask=ok, other=0.0).to(tl.float32)[:, None]
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)
    if GATE:  # the output projection's input, as sigmoid_mul computes it from these rows
        out = gate_product(tl.load(gate_ptr + t * stride_gt + h * D + dd, mask=d_ok, other=0.0), out, False)
    tl.store(out_ptr + h * stride_oh + t * stride_ot + dd, out, mask=d_ok)
    if QUANT:  # and as int8.quantize_x writes the row (T, H*D): this head's D // 32 groups
        i = tl.arange(0, D_P2 // 32)
        store_groups(x8q_ptr, x8d_ptr, x8s_ptr, t, h * (D // 32) + i, tl.reshape(out, (D_P2 // 32, 32)),
                     tl.num_programs(1) * D, i < D // 32)


def qsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: torch.Tensor,
                  start: int | torch.Tensor, ratio: int, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, *, block_s: int = ATTN_BLOCK_S,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """out (H, T, D) float32: each query attends its chosen blocks and its tail (see the
    module); K and V read in place from the cache. A block id past the query's visible
    blocks counts as -1. `start` may be a one-element device tensor with the Triton kernel
    (a decode graph's position; the cache then must hold it, unchecked). With `gate`
    (T, H*D) float32 rows: the gated attention's output projection input instead,
    sigmoid_mul(gate, out as rows (T, H*D)) with its bits, and with D a multiple of 32
    its int8 attached (int8.attach) for a dp4a GEMV: the launch of sigmoid_mul taken in.
    CPU tensors without the interpreter run qsa_attention_torch."""
    _check_attention(q, k, v, sel, start, ratio)
    _check_scales(k, k_scale, v_scale)
    H, T, D = q.shape
    if gate is not None and (gate.dtype != torch.float32 or tuple(gate.shape) != (T, H * D)
                             or (D > 1 and gate.stride(1) != 1)):
        raise ValueError(f"qsa_attention: gate must be float32 rows ({T}, {H * D}) with unit column stride, got "
                         f"{gate.dtype} {tuple(gate.shape)}")
    on_device = _start(start, "qsa_attention")
    if not use_triton(q):  # (a tensor start is on the host here)
        out = qsa_attention_torch(q, k, v, sel, int(start) if on_device else start, ratio, k_scale, v_scale)
        return out if gate is None else sigmoid_mul_torch(gate, out.transpose(0, 1).reshape(T, H * D))
    Hkv = k.shape[0]
    G = H // Hkv
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("qsa_attention: q, k and v must be contiguous along head_dim")
    # gated, the rows (T, H*D) are stored through the (H, T, D) view of them
    out = (torch.empty(H, T, D, dtype=torch.float32, device=q.device) if gate is None else
           torch.empty(T, H * D, dtype=torch.float32, device=q.device))
    view = out if gate is None else out.view(T, H, D).transpose(0, 1)
    quantize, x8 = int8_buffers(gate is not None, T, H * D, D, out)
    sel = sel.contiguous()
    if T:
        scaled = k_scale is not None
        if scaled and k_scale.stride() != v_scale.stride():
            v_scale = v_scale.contiguous()
            k_scale = k_scale.contiguous()
        ks, vs = (k_scale, v_scale) if scaled else (k, v)  # unread without SCALED
        _qsa_attention_kernel[(T, H)](q, k, v, sel, out, ks, vs, out if gate is None else gate, *x8,
                                      start, ratio, sel.shape[1], D ** -0.5,
                                      q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                      v.stride(0), v.stride(1), sel.stride(0), view.stride(0), view.stride(1),
                                      ks.stride(0) if scaled else 0, ks.stride(1) if scaled else 0,
                                      0 if gate is None else gate.stride(0),
                                      G=G, D=D, D_P2=triton.next_power_of_2(D), BLOCK_S=block_s, SCALED=scaled,
                                      START_PTR=on_device, GATE=gate is not None, QUANT=quantize)
    return attach(out, Q8X(*x8)) if quantize else out
