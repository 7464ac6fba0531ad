"""The split layout: GGUF blocks regrouped in fours so that a lane loads quants 8 bytes at a time.

GGUF blocks are only 2-byte aligned (Q8_0 34 bytes, Q4_0 and IQ4_NL 18, Q5_0 22, IQ3_XXS 98,
IQ3_S and Q3_K 110, Q6_K 210), so a kernel reading them in place loads 2 bytes a lane at a
time. The split layout takes every four consecutive blocks (a tile) and writes their
bodies, the quant bytes, first and their heads, the fp16 scale (and IQ3_S's scale nibbles,
Q5_0's fifth bits, the K-quants' sub-block scales), after:

    GGUF    | d0 q0 | d1 q1 | d2 q2 | d3 q3 |
    split   | q0 | q1 | q2 | q3 | d0 | d1 | d2 | d3 |

A tile is as long as its four blocks, so a tensor keeps its shape and size. Every body
length is a multiple of 8 and 4 x block_bytes is too, so a tile and each body in it start
8-byte aligned where the tensor does. Block b's body lies at byte

    (b // 4) * TILE + (b % 4) * BODY,  its head at  (b // 4) * TILE + 4 * BODY + (b % 4) * HEAD

(TILE = 4 * block_bytes, HEAD = block_bytes - BODY): a kernel finds any block from its
flat index alone, whatever the rows and expert strides (decode/split.py). Tiles run over
the flat block index, so a tensor must hold whole tiles and start at one: a view of rows
or experts is one when it starts at a multiple of four blocks, which for these sizes is
exactly when its first byte is 8-byte aligned (34k, 18k, 22k, 98k, 110k and 210k are
multiples of 8 only for k a multiple of 4).

Q4_K (144 bytes, quants from byte 16) is 16-byte aligned as GGUF stores it: its kernels
read it in place with 8-byte loads and it has no split layout.

`pack` and `unpack` take numpy arrays or torch tensors (any device) of whole tiles and
return the other layout: a byte permutation within each tile, so the round trip is exact
(tests/triton_kernels/test_layout.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

import quant

NAME = "split"
TILE_BLOCKS = 4

# a block's head: its byte ranges in GGUF order; the body is every other byte, in order
# (one run of them)
HEADS: dict[str, tuple[tuple[int, int], ...]] = {
    "Q8_0": ((0, 2),),
    "Q4_0": ((0, 2),),
    "Q5_0": ((0, 6),),               # d and the fifth bits (qh); the nibbles are the body
    "IQ4_NL": ((0, 2),),
    "IQ3_XXS": ((0, 2),),
    "IQ3_S": ((0, 2), (106, 110)),   # d, then the four scale bytes after the signs
    "Q3_K": ((96, 110),),            # the scales and d after hmask and qs
    "Q6_K": ((192, 210),),           # the scales and d after ql and qh
}


def has_split(fmt: quant.Format) -> bool:
    return fmt.name in HEADS


def body_bytes(fmt: quant.Format) -> int:
    """BODY: the quant bytes of a block (a multiple of 8)."""
    return fmt.block_bytes - sum(b - a for a, b in HEADS[fmt.name])


def _body_start(fmt: quant.Format) -> int:
    """Where a block's body starts in GGUF order: after the first head where one leads the
    block, else at byte 0."""
    first = HEADS[fmt.name][0]
    return first[1] if first[0] == 0 else 0


def _ranges(fmt: quant.Format) -> list[tuple[int, int, int]]:
    """The layout as byte ranges: (GGUF offset in the tile, split offset, length)."""
    heads = HEADS[fmt.name]
    body, head = body_bytes(fmt), fmt.block_bytes - body_bytes(fmt)
    out = []
    for i in range(TILE_BLOCKS):
        src = i * fmt.block_bytes
        out.append((src + _body_start(fmt), i * body, body))  # the body: every byte between the heads
        at = TILE_BLOCKS * body + i * head
        for a, b in heads:
            out.append((src + a, at, b - a))
            at += b - a
    return out


def permutation(fmt: quant.Format) -> np.ndarray:
    """For each byte of a split tile, the byte of the GGUF tile it comes from (the layout's
    definition, byte by byte)."""
    perm = np.empty(TILE_BLOCKS * fmt.block_bytes, np.int64)
    for src, dst, n in _ranges(fmt):
        perm[dst:dst + n] = np.arange(src, src + n)
    return perm


def _check(data, fmt: quant.Format) -> int:
    tile = TILE_BLOCKS * fmt.block_bytes
    n = data.size if isinstance(data, np.ndarray) else data.numel()
    if n % tile:
        raise ValueError(f"{fmt.name}: the split layout regroups blocks in fours, but the tensor "
                         f"holds {n // fmt.block_bytes} blocks ({n} bytes); keep it in GGUF order")
    return tile


def _permute(data, fmt: quant.Format, inverse: bool):
    """Strided copies over every tile at once, in halfwords (every range is 2-byte
    aligned): the four bodies in one copy, each head range in one; a gather of each byte
    runs at a quarter of the speed on a CPU."""
    tile = _check(data, fmt)
    body, head = body_bytes(fmt) // 2, (fmt.block_bytes - body_bytes(fmt)) // 2
    if isinstance(data, np.ndarray):
        src = np.ascontiguousarray(data).view(np.int16).reshape(-1, tile // 2)
        out = np.empty_like(src)
    else:
        src = data.contiguous().view(torch.int16).view(-1, tile // 2)
        out = torch.empty_like(src)
    n = src.shape[0]
    gguf, split = (out, src) if inverse else (src, out)
    blocks = gguf.reshape(n, TILE_BLOCKS, fmt.block_bytes // 2)
    bodies = split[:, :TILE_BLOCKS * body].reshape(n, TILE_BLOCKS, body)
    heads = split[:, TILE_BLOCKS * body:].reshape(n, TILE_BLOCKS, head)
    pairs = [(bodies, blocks[:, :, _body_start(fmt) // 2:][:, :, :body])]
    at = 0
    for a, b in HEADS[fmt.name]:
        pairs.append((heads[:, :, at:at + (b - a) // 2], blocks[:, :, a // 2:b // 2]))
        at += (b - a) // 2
    for s_part, g_part in pairs:
        if inverse:
            g_part[...] = s_part
        else:
            s_part[...] = g_part
    return (out.view(np.uint8) if isinstance(out, np.ndarray) else out.view(torch.uint8)).reshape(data.shape)


def pack(data, fmt: quant.Format):
    """GGUF blocks -> the split layout (same shape, dtype uint8)."""
    return _permute(data, quant.get(fmt.name), inverse=False)


def unpack(data, fmt: quant.Format):
    """The split layout -> GGUF blocks."""
    return _permute(data, quant.get(fmt.name), inverse=True)


def split_format(fmt: quant.Format) -> quant.Format:
    """`fmt` with layout "split": its numpy codec packs and unpacks around the GGUF one, so
    every reader of (bytes, format) pairs stays right; kernels pick their decode by it."""
    base = quant.get(fmt.name)
    if not has_split(base):
        raise ValueError(f"{base.name}: no split layout (formats with one: {', '.join(HEADS)})")
    return dataclasses.replace(
        base, layout=NAME,
        dequantize_blocks=lambda blocks: base.dequantize_blocks(unpack(blocks, base).reshape(blocks.shape)),
        quantize_blocks=lambda x, w: pack(base.quantize_blocks(x, w), base),
        scale_offsets=(), read_scale=None, write_scale=None, dequantize_cols=None, quantize_cols=None)
