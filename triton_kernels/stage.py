"""Rows staged where a lookup missed: the expert cache's misses copied into a step's
staging rows, decided on the device from the lookup itself.

    stage_rows(src (E, B) uint8, dst (R, B) uint8, ids (n,), slots (n,), first)
        for j < n with slots[j] < 0:  dst[first + j] = src[ids[j]]
    src and dst may be lists of up to three such pairs (an expert's gate, up and down,
    each of its own B): all staged in one launch

A step of the expert cache (strata.storage.expert_cache) looks its routed experts up in
the table expert -> VRAM slot (-1: not held) and hands the MoE kernels the slots, and for
each miss a staging row this op fills from the expert's bytes in host memory. On NVIDIA
`src` is pinned host memory, which the kernel reads over PCIe through unified addressing
(Triton takes such a pointer as any other); a hit's program loads nothing. So the step
never asks the host which experts missed, and a CUDA graph can hold it.

Rows are copied as 32-bit words where every pair's B allows (16-byte accesses a lane once
the block is contiguous), else bytes. `stage_rows_torch` is the same copy in torch.

    cache_lookup(ids (n,), lut (E,) int64, routed (E,), missed (E,) int64, first)
        -> slots = lut[ids] (n,) int64, local = slots where >= 0 else first + j (n,), ids' dtype;
           routed[ids] += 1, missed[ids where slots < 0] += 1, in place

the lookup before it and its counters in one program (seven launches in torch: a gather,
a comparison and a choice, two scatter-adds and the miss mask's two).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .host_memory import host_readable

BLOCK = 1024  # words a program copies


@triton.jit
def _stage_kernel(src0, dst0, src1, dst1, src2, dst2, ids_ptr, slots_ptr, first, words0, words1, words2,
                  BLOCK: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1)
    m = tl.program_id(2)  # which pair: a decode step stages its three matrices in one launch
    src, dst, row_words = src0, dst0, words0
    if m == 1:
        src, dst, row_words = src1, dst1, words1
    if m == 2:
        src, dst, row_words = src2, dst2, words2
    e = tl.load(ids_ptr + j).to(tl.int64)
    words = tl.where(tl.load(slots_ptr + j) < 0, row_words, 0)  # a hit copies nothing
    offs = b * BLOCK + tl.arange(0, BLOCK)
    live = offs < words
    v = tl.load(src + e * row_words + offs, mask=live)
    tl.store(dst + (first + j).to(tl.int64) * row_words + offs, v, mask=live)


@triton.jit
def _lookup_kernel(ids_ptr, lut_ptr, routed_ptr, missed_ptr, slots_ptr, local_ptr, n, first, BN: tl.constexpr):
    j = tl.arange(0, BN)
    live = j < n
    e = tl.load(ids_ptr + j, mask=live, other=0).to(tl.int64)
    s = tl.load(lut_ptr + e, mask=live, other=0)
    tl.store(slots_ptr + j, s, mask=live)
    tl.store(local_ptr + j, tl.where(s >= 0, s, first + j), mask=live)
    one = tl.full((BN,), 1, tl.int64)  # the counters: integers, in any order
    tl.atomic_add(routed_ptr + e, one, mask=live)
    tl.atomic_add(missed_ptr + e, one, mask=live & (s < 0))


def cache_lookup(ids: torch.Tensor, lut: torch.Tensor, routed: torch.Tensor, missed: torch.Tensor,
                 first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, local ids) of routed `ids` (n,) in the table `lut`, the counters added to in
    place (see the module); every id in [0, E)."""
    E = lut.shape[0]
    if ids.dim() != 1 or ids.dtype.is_floating_point or any(
            t.dtype != torch.int64 or tuple(t.shape) != (E,) for t in (lut, routed, missed)):
        raise ValueError(f"cache_lookup: ids must be 1-D integers and lut, routed, missed int64 ({E},); got ids "
                         f"{ids.dtype} {tuple(ids.shape)}, routed {routed.dtype} {tuple(routed.shape)}, missed "
                         f"{missed.dtype} {tuple(missed.shape)}")
    if not use_triton(lut):
        return cache_lookup_torch(ids, lut, routed, missed, first)
    n = ids.numel()
    slots = torch.empty(n, dtype=torch.int64, device=lut.device)
    local = torch.empty(n, dtype=ids.dtype, device=lut.device)
    if n:
        _lookup_kernel[(1,)](ids, lut, routed, missed, slots, local, n, first,
                             BN=max(16, triton.next_power_of_2(n)))
    return slots, local


def cache_lookup_torch(ids: torch.Tensor, lut: torch.Tensor, routed: torch.Tensor, missed: torch.Tensor,
                       first: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = lut[ids]
    local = torch.where(slots >= 0, slots, torch.arange(first, first + ids.numel(), device=lut.device))
    routed.index_add_(0, ids.long(), torch.ones_like(slots))
    missed.index_add_(0, ids.long(), (slots < 0).long())
    return slots, local.to(ids.dtype)


def _pairs(src, dst) -> tuple[list, list]:
    srcs = [src] if isinstance(src, torch.Tensor) else list(src)
    dsts = [dst] if isinstance(dst, torch.Tensor) else list(dst)
    if not 1 <= len(srcs) <= 3 or len(srcs) != len(dsts):
        raise ValueError(f"stage_rows: one to three (src, dst) pairs, got {len(srcs)} src and {len(dsts)} dst")
    return srcs, dsts


def _check(src, dst, ids, slots, first):
    if src.dim() < 2 or dst.dim() < 2 or src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"stage_rows: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} "
                         f"{dst.dtype} must be rows of one shape and dtype")
    if ids.shape != slots.shape or ids.dim() != 1:
        raise ValueError(f"stage_rows: ids {tuple(ids.shape)} and slots {tuple(slots.shape)} must be one 1-D shape")
    if not 0 <= first or first + ids.numel() > dst.shape[0]:
        raise ValueError(f"stage_rows: rows {first}..{first + ids.numel()} do not fit dst's {dst.shape[0]}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("stage_rows: src and dst must be contiguous")


def _words(t: torch.Tensor, as_words: bool) -> torch.Tensor:
    flat = t.view(-1).view(torch.uint8)
    return flat.view(torch.int32) if as_words else flat


def stage_rows(src, dst, ids: torch.Tensor, slots: torch.Tensor, first: int) -> None:
    """dst[first + j] = src[ids[j]] where slots[j] < 0 (see the module); in place. src and
    dst: a tensor each, or lists of up to three, staged in one launch."""
    srcs, dsts = _pairs(src, dst)
    for s, d in zip(srcs, dsts):
        _check(s, d, ids, slots, first)
    if not use_triton(dsts[0]):
        return stage_rows_torch(srcs, dsts, ids, slots, first)
    if dsts[0].device.type != "cpu" and any(s.device.type == "cpu" and not host_readable(s) for s in srcs):
        raise ValueError("stage_rows: a source lies in pageable host memory, which a GPU kernel cannot "
                         "read: pin it (tensor.pin_memory(), or triton_kernels.host_memory)")
    n = ids.numel()
    row_bytes = [d[0].numel() * d.element_size() for d in dsts]
    if not n or not max(row_bytes):
        return None
    as_words = all(r % 4 == 0 for r in row_bytes)
    s = [_words(t, as_words) for t in srcs]
    d = [_words(t, as_words) for t in dsts]
    words = [r // s[0].element_size() for r in row_bytes]
    m = len(s)
    s, d, words = s + [s[0]] * (3 - m), d + [d[0]] * (3 - m), words + [0] * (3 - m)
    _stage_kernel[(n, triton.cdiv(max(words), BLOCK), m)](s[0], d[0], s[1], d[1], s[2], d[2], ids, slots, first,
                                                         *words, BLOCK=BLOCK)
    return None


def stage_rows_torch(src, dst, ids: torch.Tensor, slots: torch.Tensor, first: int) -> None:
    srcs, dsts = _pairs(src, dst)
    missed = (slots < 0).nonzero().flatten()
    for s, d in zip(srcs, dsts):
        _check(s, d, ids, slots, first)
        if missed.numel():
            d[first + missed.to(d.device)] = s[ids[missed].to(s.device)].to(d.device)
