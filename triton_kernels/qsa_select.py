"""A decode graph's choice of QSA blocks in one launch: each query's `keep` best blocks
over its whole row of scores, in the order of a stable descending sort (of equal scores
the lower block first; unseen blocks, at -inf, last).

    qsa_select(scores (T, nb) float32, keep) -> sel int64 (T, keep)
    qsa_select_torch: triton_kernels.qsa.select_sorted's blocks (one stable sort)

`select_sorted` sorts the whole row, which on a GPU is three launches for a row of up to
4096 blocks (the indices filled, the values copied, the sort in place: aten's small sort)
and a radix sort of several passes past that (16K tokens in blocks of 4). This kernel is
one launch at any length, a program a query, and keeps the same blocks in the same order,
bit for bit, on NVIDIA and AMD alike:

1. Scores become int32 keys that order as the floats do (a negative float's bits with
   their lower 31 flipped; -0 taken as +0, as a sort's comparisons take it). NaN is not
   a score (the indexer's sums of relu over finite rows) and is not ordered here.
2. The keep-th largest key K: the largest x with at least `keep` keys >= x, found by
   halving the int32 range 32 times, a count over the row each time.
3. The blocks above K, and of those equal to K the first keep - #(above K) in block order:
   the sort's first `keep`. They are written in block order to a scratch row.
4. Each chosen block's place: the chosen blocks with a greater key, or an equal key and a
   lower block, counted over the scratch row (keep x keep comparisons); sel[place] = block.

At Flash-Next's shape (2,048 of the indexer's tokens in blocks of 4: keep 512; 32K tokens
of context: 8,192 blocks) a query's row is read once into registers (8 warps, 32 keys a
lane), the 32 halvings are sums over them, and the places take 262K comparisons; a row
past SELECT_HELD blocks is read again from L2 for each of its 34 passes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .qsa import select_sorted

SELECT_HELD = 8192   # rows up to this many blocks are read once and held in registers
SELECT_BLOCK = 1024  # longer rows: scores a step of a pass over the row
SELECT_TILE = 64     # chosen blocks a side of a tile of the places' comparisons


@triton.jit
def _keys(s):
    """int32 keys of float32 scores: key(a) > key(b) exactly where a > b."""
    b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)  # -0 as +0
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _count(row, NB, x, held, BLOCK: tl.constexpr, HELD: tl.constexpr, ABOVE: tl.constexpr):
    """How many of the row's keys are >= x (ABOVE: > x): from `held`, the whole row's keys
    in registers, or read from the row a step of BLOCK at a time."""
    if HELD:
        c = tl.arange(0, BLOCK)
        hit = held > x if ABOVE else held >= x
        n = tl.sum((hit & (c < NB)).to(tl.int32), axis=0)
    else:
        n = 0
        for c0 in range(0, NB, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            k = _keys(tl.load(row + c, mask=c < NB, other=0.0))
            hit = k > x if ABOVE else k >= x
            n += tl.sum((hit & (c < NB)).to(tl.int32), axis=0)
    return n


@triton.jit
def _select_kernel(s_ptr, sel_ptr, tmp_ptr, NB, keep, stride_s, stride_o,
                   BLOCK: tl.constexpr, TILE: tl.constexpr, HELD: tl.constexpr):
    # one program: query t's row (see the module for the steps); HELD: the row's keys read
    # once and kept in registers (BLOCK >= NB), else each pass reads it again from L2
    t = tl.program_id(0)
    row = s_ptr + t * stride_s
    tmp = tmp_ptr + t * stride_o
    held = _keys(tl.load(row + tl.arange(0, BLOCK), mask=HELD & (tl.arange(0, BLOCK) < NB), other=0.0))
    # 2. the largest x with at least `keep` keys >= x (x in the int32 range: held as int64)
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        up = _count(row, NB, mid, held, BLOCK, HELD, False) >= keep
        lo, hi = tl.where(up, mid, lo), tl.where(up, hi, mid - 1)
    kth = lo.to(tl.int32)
    above = _count(row, NB, kth, held, BLOCK, HELD, True)
    # 3. the chosen blocks, in block order, to the scratch row
    ties, placed = 0, 0
    for c0 in range(0, NB, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        live = c < NB
        k = held if HELD else _keys(tl.load(row + c, mask=live, other=0.0))
        tie = (k == kth) & live
        tie_at = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        chosen = ((k > kth) & live) | (tie & (tie_at < keep - above))
        tl.store(tmp + placed + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, c, mask=chosen)
        ties += tl.sum(tie.to(tl.int32), axis=0)
        placed += tl.sum(chosen.to(tl.int32), axis=0)
    tl.debug_barrier()  # every lane's scratch entries written before any lane reads them
    # 4. each chosen block's place in the sort's order
    for i0 in range(0, keep, TILE):
        i = i0 + tl.arange(0, TILE)
        bi = tl.load(tmp + i, mask=i < keep, other=0)
        ki = _keys(tl.load(row + bi, mask=i < keep, other=0.0))
        place = tl.zeros((TILE,), tl.int32)
        for j0 in range(0, keep, TILE):
            j = j0 + tl.arange(0, TILE)
            kj = _keys(tl.load(row + tl.load(tmp + j, mask=j < keep, other=0), mask=j < keep, other=0.0))
            first = (kj[None, :] > ki[:, None]) | ((kj[None, :] == ki[:, None]) & (j[None, :] < i[:, None]))
            place += tl.sum((first & (j < keep)[None, :]).to(tl.int32), axis=1)
        tl.store(sel_ptr + t * stride_o + place, bi.to(tl.int64), mask=i < keep)


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


def qsa_select(scores: torch.Tensor, keep: int, *, held: int = SELECT_HELD, block: int = SELECT_BLOCK,
               tile: int = SELECT_TILE) -> torch.Tensor:
    """qsa_select_torch's blocks in one launch (see the module). CPU tensors without the
    interpreter run qsa_select_torch."""
    _check(scores, keep)
    if not use_triton(scores):
        return qsa_select_torch(scores, keep)
    T, nb = scores.shape
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    sel = torch.empty(T, keep, dtype=torch.int64, device=scores.device)
    tmp = torch.empty(T, keep, dtype=torch.int32, device=scores.device)  # each row's chosen, in block order
    if T and keep:
        width = triton.next_power_of_2(nb)
        on_chip = width <= held
        _select_kernel[(T,)](scores, sel, tmp, nb, keep, scores.stride(0), sel.stride(0),
                             BLOCK=width if on_chip else min(block, width), TILE=min(tile, triton.next_power_of_2(keep)),
                             HELD=on_chip, num_warps=8 if on_chip and width >= 4096 else 4)
    return sel
