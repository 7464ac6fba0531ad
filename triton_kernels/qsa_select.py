"""A decode graph's choice of QSA blocks in one launch: each query's `keep` best blocks
over its whole row of scores, in the order of a stable descending sort (of equal scores
the lower block first; unseen blocks, at -inf, last).

    qsa_select(scores (T, nb) float32, keep) -> sel int64 (T, keep)
    qsa_select_torch: triton_kernels.qsa.select_sorted's blocks (one stable sort)

`select_sorted` sorts the whole row, which on a GPU is three launches for a row of up to
4,096 blocks (the indices filled, the values copied, the sort in place: aten's small
sort) and a segmented radix sort of several past that (16K tokens in blocks of 4). The
kernel is one launch, a program a query, and keeps the same blocks in the same order, bit
for bit, on NVIDIA and AMD alike:

1. The row's scores are read once and held in registers as int32 keys that order as the
   floats do (a negative float's bits with their lower 31 flipped; -0 taken as +0, as a
   sort's comparisons take it). NaN is not a score (the indexer's sums of relu over
   finite rows) and is not ordered here.
2. The keep-th largest key K: the largest x with at least `keep` keys >= x, found by
   halving the int32 range 32 times, a block-wide count each time.
3. The blocks above K, and of those equal to K the first keep - #(above K) in block order:
   the sort's first `keep`. Their keys and blocks are written in block order to a scratch
   row.
4. Each chosen block's place: the chosen with a greater key, or an equal key and a lower
   block, counted over the scratch row (keep x keep comparisons, the row read from L1 a
   span at a time); sel[place] = block.

At Flash-Next's budget (2,048 of the indexer's tokens in blocks of 4: keep 512) and 32K
tokens of context (8,192 blocks: 512 lanes, 16 keys a lane) that is 34 block-wide sums and
262K comparisons. A row of more than SELECT_HELD blocks does not fit a program's registers,
and one program reading it from L2 once a halving would take longer than the radix sort's
passes over many SMs: such rows keep select_sorted's sort.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import rdna, use_triton, warp_lanes
from .qsa import select_sorted

SELECT_HELD = 8192  # the longest row a program holds (32K tokens in blocks of 4); longer: the sort
# on 32-lane AMD waves (RDNA3): gfx1100's compiler spilled 200-290 bytes a lane holding 8,192
# blocks of a row not a multiple of 16, at 16 warps and at 32
SELECT_HELD_RDNA = 4096
SELECT_SPAN = 512   # the places: the chosen compared a span of SPAN at a time (the scratch
SELECT_TILE = 16    # row, from L1) with TILE of them


@triton.jit
def _keys(s):
    """int32 keys of float32 scores: key(a) > key(b) exactly where a > b."""
    b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)  # -0 as +0
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _order(k, at):
    """Scratch entries' keys k at places `at` (0 <= at < 2^31) as 64-bit numbers that order
    them as the sort does: a greater key first, of equal keys the earlier place (the lower
    block). The place's part is positive: the least key's numbers do not wrap."""
    return (k.to(tl.int64) << 32) + (2147483647 - at)


@triton.jit
def _select_kernel(s_ptr, sel_ptr, tmp_ptr, NB, keep, stride_s, stride_o,
                   BLOCK: tl.constexpr, TILE: tl.constexpr, SPAN: tl.constexpr):
    # one program: query t's row, BLOCK >= NB (see the module for the steps)
    t = tl.program_id(0)
    tmp = tmp_ptr + t * 2 * keep  # the chosen: their keys, then their blocks
    c = tl.arange(0, BLOCK)
    live = c < NB
    # past the row: the int32 minimum, below every score's key (-inf's is -2^31 + 8,388,607),
    # so that no count below sees it (the bisection's mid and the keep-th key lie above it)
    k = tl.where(live, _keys(tl.load(s_ptr + t * stride_s + c, mask=live, other=0.0)), -2147483648)
    # 2. the largest x with at least `keep` keys >= x (x in the int32 range: held as int64)
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        up = tl.sum((k >= mid).to(tl.int32), axis=0) >= keep
        lo, hi = tl.where(up, mid, lo), tl.where(up, hi, mid - 1)
    kth = lo.to(tl.int32)
    above = tl.sum((k > kth).to(tl.int32), axis=0)
    # 3. the chosen, in block order, to the scratch row
    tie = k == kth
    chosen = (k > kth) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= keep - above))
    at = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(tmp + at, k, mask=chosen)
    tl.store(tmp + keep + at, c, mask=chosen)
    tl.debug_barrier()  # every lane's scratch entries written before any lane reads them
    # 4. each chosen block's place in the sort's order: how many of the chosen come before it
    for i0 in range(0, keep, TILE):
        i = i0 + tl.arange(0, TILE)
        pi = _order(tl.load(tmp + i, mask=i < keep, other=0), i)
        place = tl.zeros((TILE,), tl.int32)
        for j0 in range(0, keep, SPAN):
            j = j0 + tl.arange(0, SPAN)
            # past the row: the least key at the last places, which comes before none
            pj = _order(tl.load(tmp + j, mask=j < keep, other=-2147483648), j)
            place += tl.sum((pj[None, :] > pi[:, None]).to(tl.int32), axis=1)
        tl.store(sel_ptr + t * stride_o + place, tl.load(tmp + keep + i, mask=i < keep, other=0).to(tl.int64),
                 mask=i < keep)


def _check(scores: torch.Tensor, keep: int) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"qsa_select: scores must be float32 (T, n_blocks), got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    if not 0 <= keep <= scores.shape[1]:
        raise ValueError(f"qsa_select: keep must be 0 to the row's {scores.shape[1]} blocks, got {keep}")


def qsa_select_torch(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """sel (T, keep) int64: select_sorted's blocks (one stable sort of each row)."""
    _check(scores, keep)
    return select_sorted(scores, keep)[1]


def qsa_select(scores: torch.Tensor, keep: int, *, held: int = SELECT_HELD, tile: int = SELECT_TILE,
               span: int = SELECT_SPAN) -> torch.Tensor:
    """qsa_select_torch's blocks in one launch (see the module), for rows whose width (the
    next power of two) is at most `held` blocks; longer rows, and CPU tensors without the
    interpreter, run qsa_select_torch."""
    _check(scores, keep)
    width = triton.next_power_of_2(scores.shape[1])
    if not use_triton(scores):
        return select_sorted(scores, keep)[1]
    lanes = warp_lanes(scores.device)
    if width > (min(held, SELECT_HELD_RDNA) if rdna(scores.device) else held):
        return select_sorted(scores, keep)[1]
    T, nb = scores.shape
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    sel = torch.empty(T, keep, dtype=torch.int64, device=scores.device)
    tmp = torch.empty(T, 2, keep, dtype=torch.int32, device=scores.device)  # each row's chosen, in block order
    if T and keep:
        chosen = triton.next_power_of_2(keep)
        tile, span = min(tile, chosen), min(span, chosen)
        _select_kernel[(T,)](scores, sel, tmp, nb, keep, scores.stride(0), sel.stride(0), BLOCK=width,
                             TILE=tile, SPAN=span, num_warps=_warps(width, tile, span, lanes))
    return sel


def _warps(width: int, tile: int, span: int, lanes: int) -> int:
    """Warps a program (of `lanes` lanes each): 512 lanes for a row of 8,192 blocks (16 keys
    a lane: 16 warps of 32, 8 of 64 on CDNA; sm_89's ptxas spilled 24 bytes at 8 warps of
    32, gfx942's 60-80 at 16 of 64); 8 warps for 4,096 blocks, or for 4,096 and more places
    compared at once (tile x span: at 4 warps 16 x 512 spilled 8 bytes on sm_90 and sm_89
    at 257 to 2,048 blocks, and 16 x 256 on Triton 3.6's sm_90); else 4
    (tests/triton_kernels/test_qsa_select.py compiles each)."""
    if width >= 8192:
        return 512 // lanes
    return 8 if width >= 4096 or tile * span >= 4096 else 4
