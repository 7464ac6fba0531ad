"""Rows staged where a lookup missed: the expert cache's misses copied into a step's
staging rows, decided on the device from the lookup itself.

    stage_rows(src (E, B) uint8, dst (R, B) uint8, ids (n,), slots (n,), first)
        for j < n with slots[j] < 0:  dst[first + j] = src[ids[j]]

A step of the expert cache (strata.storage.expert_cache) looks its routed experts up in
the table expert -> VRAM slot (-1: not held) and hands the MoE kernels the slots, and for
each miss a staging row this op fills from the expert's bytes in host memory. On NVIDIA
`src` is pinned host memory, which the kernel reads over PCIe through unified addressing
(Triton takes such a pointer as any other); a hit's program loads nothing. So the step
never asks the host which experts missed, and a CUDA graph can hold it.

Rows are copied as 32-bit words where B allows (16-byte accesses a lane once the block
is contiguous), else bytes. `stage_rows_torch` is the same copy in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton

BLOCK = 1024  # words a program copies


@triton.jit
def _stage_kernel(src_ptr, dst_ptr, ids_ptr, slots_ptr, first, row_words, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1)
    e = tl.load(ids_ptr + j).to(tl.int64)
    words = tl.where(tl.load(slots_ptr + j) < 0, row_words, 0)  # a hit copies nothing
    offs = b * BLOCK + tl.arange(0, BLOCK)
    live = offs < words
    v = tl.load(src_ptr + e * row_words + offs, mask=live)
    tl.store(dst_ptr + (first + j).to(tl.int64) * row_words + offs, v, mask=live)


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


def _words(t: torch.Tensor, row_bytes: int) -> torch.Tensor:
    flat = t.view(-1).view(torch.uint8)
    return flat.view(torch.int32) if row_bytes % 4 == 0 else flat


def stage_rows(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, first: int) -> None:
    """dst[first + j] = src[ids[j]] where slots[j] < 0 (see the module); in place."""
    _check(src, dst, ids, slots, first)
    if not use_triton(dst):
        return stage_rows_torch(src, dst, ids, slots, first)
    n = ids.numel()
    row_bytes = dst[0].numel() * dst.element_size()
    if n and row_bytes:
        s, d = _words(src, row_bytes), _words(dst, row_bytes)
        row_words = row_bytes // s.element_size()
        _stage_kernel[(n, triton.cdiv(row_words, BLOCK))](s, d, ids, slots, first, row_words, BLOCK=BLOCK)


def stage_rows_torch(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
                     first: int) -> None:
    _check(src, dst, ids, slots, first)
    missed = (slots < 0).nonzero().flatten()
    if missed.numel():
        dst[first + missed.to(dst.device)] = src[ids[missed].to(src.device)].to(dst.device)
