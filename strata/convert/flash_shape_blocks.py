"""flash-shape's random but valid blocks (strata.convert.flash_shape says what they hold):
a tensor's bytes made piece by piece, each piece from its own generator on a thread of
its own, so that the written files and the model built in memory
(strata.convert.flash_shape_memory) hold the same bytes, made on every core at once."""
from __future__ import annotations

import collections
import functools
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

import quant

if TYPE_CHECKING:
    from .flash_shape import Spec

PIECE_BYTES = 64 << 20  # bytes made and written at a time

# formats whose codes are not symmetric about zero (Q4_0's (q - 8) averages -0.5, IQ4_NL's
# table -5.9 of 127) and whose llama.cpp quantizers write scales of either sign: random codes
# under scales of one sign would give every weight of a matrix the same mean, and a matrix
# whose weights share a mean adds the sum of its input to every output; through the layers
# that common part outgrew each token's own and sent every token to the same experts
SIGNED_SCALES = ("Q4_0", "IQ4_NL")


@functools.cache
def unit_rms(fmt_name: str) -> float:
    """The RMS of a format's weights in random blocks whose fp16 scale is 1 (sub-block
    scales and codes random): the scale that gives an RMS of s is s / unit_rms."""
    fmt = quant.get(fmt_name)
    raw = _random_bytes(np.random.default_rng(1), 4096 * fmt.block_bytes).reshape(4096, fmt.block_bytes)
    for off in fmt.scale_offsets:
        raw[:, off:off + 2] = np.array([1.0], np.float16).view(np.uint8)
    return float(np.sqrt(np.mean(fmt.dequantize(raw) ** 2)))


def _random_bytes(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    # the bit generator's raw words: about 4x faster than integers(0, 256, dtype=uint8)
    return rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]


def random_blocks(fmt: quant.Format, n_blocks: int, std: float, rng: np.random.Generator,
                  out: np.ndarray | None = None) -> np.ndarray:
    """(n_blocks, block_bytes) uint8: random codes, fp16 scales of [0.75, 1.25] x the scale
    of a weight RMS `std` (of random sign for SIGNED_SCALES: weights of mean zero), from a
    table indexed by a random byte of its own (the PLE table is 1.6 billion blocks); made
    in `out` (n_blocks * block_bytes uint8) where given."""
    if fmt.read_scale is not None or not fmt.scale_offsets:
        raise ValueError(f"{fmt.name}: random blocks are made for formats with plain fp16 scale fields")
    raw = _random_bytes(rng, n_blocks * fmt.block_bytes).reshape(n_blocks, fmt.block_bytes)
    if out is not None:
        out.reshape(n_blocks, fmt.block_bytes)[:] = raw
        raw = out.reshape(n_blocks, fmt.block_bytes)
    i = np.arange(256)
    d = std / unit_rms(fmt.name) * (0.75 + (i & 127) / 254)
    if fmt.name in SIGNED_SCALES:
        d = np.where(i & 128, -d, d)
    table = d.astype(np.float16)
    pick = _random_bytes(rng, n_blocks)
    halves = fmt.block_bytes % 2 == 0 and all(off % 2 == 0 for off in fmt.scale_offsets)
    for off in fmt.scale_offsets:
        if halves:  # a 2-byte store a block, 5x faster than two byte columns
            raw.view(np.float16)[:, off // 2] = table[pick]
        else:
            raw[:, off:off + 2] = table.view(np.uint8).reshape(256, 2)[pick]
    return raw


def _floats(spec: Spec, rng: np.random.Generator) -> np.ndarray:
    size = int(np.prod(spec.shape))
    kind = spec.init[0]
    if kind == "norm":
        x = 1 + 0.02 * rng.standard_normal(size)
    elif kind == "uniform":
        x = rng.uniform(-spec.init[1], spec.init[1], size)
    elif kind == "ssm_a":
        x = -rng.uniform(1, 16, size)
    elif kind == "ones":
        x = np.ones(size)
    else:
        x = spec.init[1] * rng.standard_normal(size)
    return quant.get(spec.fmt).quantize(x.astype(np.float32)).reshape(-1)


def tensor_rng(seed: int, name: str, piece: int | None = None) -> np.random.Generator:
    """The generator tensor `name` draws from: its own (seed, CRC-32 of its name), and for
    a quantized tensor's `piece` that piece's own, so that pieces are made in parallel."""
    key = [seed, zlib.crc32(name.encode())]
    return np.random.default_rng(key if piece is None else [*key, piece])


def _workers() -> int:
    # numpy's bit generators let go of the GIL while they draw: one thread a core
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _pieces(spec: Spec, piece_bytes: int) -> tuple[quant.Format, int, int]:
    """(format, blocks a piece, pieces) of a quantized tensor."""
    fmt = quant.get(spec.fmt)
    per = max(1, piece_bytes // fmt.block_bytes)
    return fmt, per, -(-(spec.nbytes // fmt.block_bytes) // per)


def _make_piece(spec: Spec, seed: int, piece_bytes: int, i: int, out: np.ndarray | None = None) -> np.ndarray:
    fmt, per, _ = _pieces(spec, piece_bytes)
    k = min(per, spec.nbytes // fmt.block_bytes - i * per)
    return random_blocks(fmt, k, spec.init[1], tensor_rng(seed, spec.name, i), out).reshape(-1)


def tensor_pieces(spec: Spec, seed: int, piece_bytes: int = PIECE_BYTES,
                  on_piece=None) -> Iterator[np.ndarray]:
    """The tensor's bytes in pieces of whole blocks, at most about `piece_bytes` each, in
    order, the next ones made on other threads meanwhile; `on_piece(nbytes)` once a piece
    is written (the writer writes a piece before it asks for the next)."""
    fmt = quant.get(spec.fmt)
    if fmt.block_elems == 1:
        yield _floats(spec, tensor_rng(seed, spec.name))
        return
    n, workers = _pieces(spec, piece_bytes)[2], _workers()
    with ThreadPoolExecutor(workers) as pool:
        ahead = collections.deque()
        for i in range(n):
            while len(ahead) < workers + 1 and i + len(ahead) < n:
                ahead.append(pool.submit(_make_piece, spec, seed, piece_bytes, i + len(ahead)))
            piece = ahead.popleft().result()
            yield piece
            if on_piece is not None:
                on_piece(piece.size)


def tensor_data(spec: Spec, seed: int, piece_bytes: int = PIECE_BYTES) -> np.ndarray:
    """The tensor's blocks, uint8 (rows, row bytes) as a GGUF file holds them: the bytes
    the writer writes for it (tensor_pieces'), each piece made in place on a thread of
    its own (on the 16 cores of a GPU machine the 85 GB of flash-shape are made in a
    fraction of the time one thread takes)."""
    fmt = quant.get(spec.fmt)
    out = np.empty((int(np.prod(spec.shape[:-1], dtype=np.int64)), fmt.row_bytes(spec.shape[-1])), np.uint8)
    if fmt.block_elems == 1:
        out.reshape(-1)[:] = _floats(spec, tensor_rng(seed, spec.name)).view(np.uint8)
        return out
    flat, (_, per, n) = out.reshape(-1), _pieces(spec, piece_bytes)
    step = per * fmt.block_bytes
    with ThreadPoolExecutor(_workers()) as pool:
        list(pool.map(lambda i: _make_piece(spec, seed, piece_bytes, i, flat[i * step:(i + 1) * step]), range(n)))
    return out
