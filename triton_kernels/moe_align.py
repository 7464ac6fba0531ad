"""Token slots grouped by expert, each group padded to a multiple of block_m: what the MoE
"dot" kernels (triton_kernels.moe) walk in blocks of one expert.

    moe_align_block_size(ids, num_experts, block_m)
        -> (sorted_token_ids, expert_ids, num_tokens_post_padded)

For a decode step's few slots (at most ALIGN_MAX_SLOTS) one Triton program computes all
three outputs; in torch the same takes some 28 launches (a count, a sort, cumulative sums,
a scatter, a search), a third of a flash-tiny decode step's launches on a GPU. Longer
batches (prefill) take the torch version, `moe_align_block_size_torch`, whose cost is the
sort's, not the launches'. Both give the same tensors (tests/triton_kernels/test_moe.py).

The one program works on slot pairs. With key_i the slot's expert (num_experts for a slot
whose id is out of range: another rank's expert, dropped),

    rank_i   = #{j < i : key_j = key_i}          its place inside its expert's group
    count_i  = #{j : key_j = key_i}              the group's size, padded_i to block_m
    start_i  = sum of padded_j over the first slots j (rank_j = 0) of the experts below key_i
    dest_i   = start_i + rank_i                  where slot i lands in sorted_token_ids

and each output position p (or block b) looks up the slot whose dest is p (the group that
holds b * block_m): (positions x slots) comparisons, ALIGN_CHUNK positions at a time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton

# n x n slot pairs in one program's registers: 128 x 128 int32 (16k, 128 a thread of 4 warps)
ALIGN_MAX_SLOTS = 128
ALIGN_CHUNK = 64


def _check(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if num_experts < 1:
        raise ValueError(f"moe_align_block_size: num_experts must be >= 1, got {num_experts}")
    if block_m < 1:
        raise ValueError(f"moe_align_block_size: block_m must be >= 1, got {block_m}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"moe_align_block_size: ids must be an integer tensor, got {ids.dtype}")


def _length(n: int, num_experts: int, block_m: int) -> int:
    """The used length's bound, from shapes alone: at most min(E, n) groups, each padded by
    fewer than block_m (so that CUDA callers size their grids without a host sync)."""
    return n + min(num_experts, n) * (block_m - 1)


def aligns_in_one_launch(ids: torch.Tensor) -> bool:
    """Whether moe_align_block_size runs its one Triton program for these ids (then its
    `zero_rows` are zeroed there, not left to the caller)."""
    return use_triton(ids) and 0 < ids.numel() <= ALIGN_MAX_SLOTS


def moe_align_block_size(ids: torch.Tensor, num_experts: int, block_m: int,
                         zero_rows: torch.Tensor | None = None):
    """Token slots grouped by expert, each group padded to a multiple of block_m.

    ids: (T, k) expert ids (any integer dtype). Returns, all int32 on ids' device:
    - sorted_token_ids (L,): the slots t * k + j of expert 0 in ascending order, padded
      with the sentinel T * k up to a multiple of block_m, then expert 1's, ...; the tail
      past num_tokens_post_padded is sentinel too;
    - expert_ids (ceil(L / block_m),): the expert of each block of block_m entries; experts
      without tokens own no block; blocks past num_tokens_post_padded hold -1;
    - num_tokens_post_padded (1,): the used length, a multiple of block_m.
    L = T*k + min(E, T*k) * (block_m - 1) bounds the used length without looking at the
    ids. Slots whose id lies outside [0, num_experts) are left out (expert parallelism
    marks other ranks' experts -1).

    zero_rows: a float32 (T * k, H) tensor of per-slot rows with unit column stride; where
    the one program runs (`aligns_in_one_launch`) it zeroes the rows of the slots left out
    (the rows a MoE's dot kernels never write), in the same launch. Else untouched.
    """
    _check(ids, num_experts, block_m)
    n = ids.numel()
    if not aligns_in_one_launch(ids):
        return moe_align_block_size_torch(ids, num_experts, block_m)
    if zero_rows is not None and (zero_rows.dim() != 2 or zero_rows.shape[0] != n or zero_rows.dtype != torch.float32
                                  or (zero_rows.shape[1] > 1 and zero_rows.stride(1) != 1)):
        raise ValueError(f"moe_align_block_size: zero_rows must be float32 ({n}, H) with unit column stride, got "
                         f"{zero_rows.dtype} {tuple(zero_rows.shape)}")
    length = _length(n, num_experts, block_m)
    n_blocks = -(-length // block_m)
    dev = ids.device
    flat = ids.reshape(-1)
    sorted_ids = torch.empty(length, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    n_post = torch.empty(1, dtype=torch.int32, device=dev)
    zero = zero_rows is not None and zero_rows.shape[1] > 0
    _align_kernel[(1,)](flat, sorted_ids, expert_ids, n_post, zero_rows if zero else flat,
                        zero_rows.shape[1] if zero else 0, zero_rows.stride(0) if zero else 0,
                        n, num_experts, length, n_blocks,
                        N_PAD=max(16, triton.next_power_of_2(n)), BLOCK_M=block_m, CHUNK=ALIGN_CHUNK, ZERO=zero)
    return sorted_ids, expert_ids, n_post


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, n_post_ptr, rows_ptr, H, stride_r,
                  n, E, length, n_blocks,
                  N_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, ZERO: tl.constexpr):
    i = tl.arange(0, N_PAD)
    raw = tl.load(ids_ptr + i, mask=i < n, other=-1)
    align_slots(raw, n, E, sorted_ptr, expert_ids_ptr, n_post_ptr, rows_ptr, H, stride_r, length, n_blocks,
                N_PAD, BLOCK_M, CHUNK, ZERO)


@triton.jit
def align_slots(raw, n, E, sorted_ptr, expert_ids_ptr, n_post_ptr, rows_ptr, H, stride_r, length, n_blocks,
                N_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, ZERO: tl.constexpr):
    """The alignment of the slots' ids `raw` (N_PAD,) held in registers (lanes from n on: -1);
    the router's kernel runs it on the ids it has just chosen (triton_kernels.route_align)."""
    i = tl.arange(0, N_PAD)
    kept = (i < n) & (raw >= 0) & (raw < E)
    key = tl.where(kept, raw, E).to(tl.int32)
    # (slot i, slot j): i along axis 0, j along axis 1
    same = (key[:, None] == key[None, :]) & kept[:, None] & kept[None, :]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first = kept & (rank == 0)
    below = first[None, :] & (key[None, :] < key[:, None])
    start = tl.sum(tl.where(below, padded[None, :], 0), axis=1)
    end = start + padded
    dest = tl.where(kept, start + rank, -1)
    tl.store(n_post_ptr, tl.sum(tl.where(first, padded, 0), axis=0))
    # position p: the slot whose dest is p, else the sentinel n
    for p0 in range(0, length, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        hit = dest[None, :] == p[:, None]
        slot = tl.sum(tl.where(hit, i[None, :], 0), axis=1)
        found = tl.max(hit.to(tl.int32), axis=1) > 0
        tl.store(sorted_ptr + p, tl.where(found, slot, n), mask=p < length)
    # block b: the expert whose group holds its first position, else -1
    for b0 in range(0, n_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        s = b * BLOCK_M
        own = first[None, :] & (start[None, :] <= s[:, None]) & (s[:, None] < end[None, :])
        e = tl.sum(tl.where(own, key[None, :], 0), axis=1)
        found = tl.max(own.to(tl.int32), axis=1) > 0
        tl.store(expert_ids_ptr + b, tl.where(found, e, -1), mask=b < n_blocks)
    if ZERO:  # the left-out slots' rows, which no later kernel writes
        dropped = (i < n) & (kept == 0)
        for h0 in range(0, H, CHUNK):
            h = h0 + tl.arange(0, CHUNK)
            at = rows_ptr + i[:, None].to(tl.int64) * stride_r + h[None, :]
            tl.store(at, tl.zeros((N_PAD, CHUNK), tl.float32), mask=dropped[:, None] & (h[None, :] < H))


def moe_align_block_size_torch(ids: torch.Tensor, num_experts: int, block_m: int):
    """moe_align_block_size in torch ops: a count, a stable sort and a scatter, on any
    device and any number of slots."""
    _check(ids, num_experts, block_m)
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    length = _length(n, num_experts, block_m)
    # dropped slots take the key num_experts: they sort after every expert's group
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    # counted into a fixed size: bincount's size is the largest id's, which CUDA reads back
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).index_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)                           # end of each expert's padded group
    order = torch.argsort(key, stable=True)           # slots by expert, ascending within one
    sorted_key = key[order]
    kept = sorted_key < num_experts
    e = sorted_key.clamp(max=num_experts - 1)
    first = counts.cumsum(0) - counts                 # each expert's first place in `order`
    rank = torch.arange(n, device=dev) - first[e]
    # dropped slots land in n spare entries past `length`, cut off below (distinct
    # destinations: a scatter with repeated indices is not deterministic on CUDA)
    dest = torch.where(kept, ends[e] - padded[e] + rank, length + torch.arange(n, device=dev))
    sorted_ids = torch.full((length + n,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    n_blocks = -(-length // block_m)
    starts = torch.arange(n_blocks, device=dev) * block_m
    # the block starting at p belongs to the first expert whose group ends after p
    block_expert = torch.searchsorted(ends, starts, right=True)
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids[:length], expert_ids, ends[-1:].to(torch.int32)
