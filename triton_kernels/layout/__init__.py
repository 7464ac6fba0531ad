"""Device layouts: a weight's blocks repacked once where they land on a GPU, and the one
decision of which layout a weight takes.

    choose(fmt, device, blocks, slab_blocks=None) -> the format a weight is held in there
    place(q, fmt, device, held)                   -> GGUF blocks q on `device`, in held's layout

One layout today, split (split.py: four blocks' quants, then their scales, for 8-byte
loads), for Q8_0, Q4_0, Q5_0, IQ4_NL, IQ3_XXS, IQ3_S, Q3_K and Q6_K weights on a GPU. The
format object carries it (`fmt.layout`): the kernels pick their decode by it, and the
numpy codec and the torch twins unpack first, so nothing reads split bytes as GGUF ones. Token embeddings
and the PLE table are gathered by rows and stay in GGUF order; so does whatever does not
hold whole tiles (a weight of 18 blocks, an expert of an odd count).

STRATA_LAYOUT: "gguf" keeps GGUF order everywhere (to compare), "split" takes the layout
on any device, the CPU's interpreter included (what the tests use); unset: split on a GPU.
"""
from __future__ import annotations

import os

import torch

import quant

from ..backend import to_device
from .split import TILE_BLOCKS, body_bytes, has_split, pack, split_format, unpack

__all__ = ["choose", "place", "pack", "unpack", "gguf_bytes", "body_bytes", "split_format", "TILE_BLOCKS"]

# bytes repacked at a time: the temporary a gather of a large weight needs
_CHUNK_BYTES = 64 << 20


def _wanted(device) -> bool:
    mode = os.environ.get("STRATA_LAYOUT", "")
    if mode not in ("", "gguf", "split"):
        raise ValueError(f"STRATA_LAYOUT={mode!r}: use 'gguf', 'split' or leave it unset")
    if mode:
        return mode == "split"
    return torch.device(device).type == "cuda"


def choose(fmt: quant.Format, device, blocks: int, slab_blocks: int | None = None) -> quant.Format:
    """The format a weight of `blocks` blocks takes on `device`: split where the format has
    it, the device wants it and the weight (and each expert's slab of `slab_blocks`) holds
    whole tiles; else `fmt` as it is."""
    fmt = quant.get(fmt)
    whole = blocks % TILE_BLOCKS == 0 and (slab_blocks is None or slab_blocks % TILE_BLOCKS == 0)
    # the kernels find a split block with int32 arithmetic (decode/split.py: block_ptr)
    small = blocks * fmt.block_bytes < 1 << 31
    if fmt.layout == "gguf" and has_split(fmt) and whole and small and _wanted(device):
        return split_format(fmt)
    return fmt


def place(q: torch.Tensor, fmt: quant.Format, device, held: quant.Format,
          non_blocking: bool = False) -> torch.Tensor:
    """GGUF blocks `q` of `fmt` on `device`, in the layout of `held` (from `choose`). The
    repack runs where the bytes land (a gather on the device, a chunk at a time), so the
    host's copy, which may be a file's pages, is never written."""
    out = to_device(q, device, non_blocking=non_blocking)
    if held.layout == quant.get(fmt).layout:
        return out
    if out is q:
        out = q.clone()  # to_device returns q itself where it lies: maybe a file's pages
    return pack_(out, held)


def pack_(q: torch.Tensor, fmt: quant.Format) -> torch.Tensor:
    """Repack GGUF blocks into `fmt`'s layout in place, a chunk of tiles at a time."""
    tile = TILE_BLOCKS * fmt.block_bytes
    flat = q.view(-1, tile)
    step = max(1, _CHUNK_BYTES // tile)
    for i in range(0, flat.shape[0], step):
        flat[i:i + step] = pack(flat[i:i + step], fmt)
    return q


def gguf_bytes(q, fmt: quant.Format):
    """`q` in GGUF order, and the GGUF format: unpacked if `fmt` is a device layout."""
    if fmt.layout == "gguf":
        return q, fmt
    return unpack(q, fmt), quant.get(fmt.name)
