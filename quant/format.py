"""`Format`: one GGUF tensor type, its block geometry and its numpy codec.

A format works on blocks: `block_elems` weights stored in `block_bytes` bytes. Arrays of
quantized data are uint8 with the blocks laid end to end along the last axis, as GGUF
stores a row; the leading axes are rows. `dequantize` and `quantize` keep the leading
axes and convert the last one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

DequantFn = Callable[[np.ndarray], np.ndarray]
QuantFn = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]
# blocks a step of Format.requantize: 8192 x 32 float32 weights, 1 MiB
REQUANTIZE_BLOCKS = 8192


@dataclass(frozen=True)
class Format:
    name: str
    type_id: int  # the ggml type id, as in GGUF tensor infos
    block_elems: int
    block_bytes: int
    # (n_blocks, block_bytes) uint8 -> (n_blocks, block_elems) float32
    dequantize_blocks: DequantFn = field(repr=False)
    # (n_blocks, block_elems) float32, importance of the same shape or None -> blocks
    quantize_blocks: QuantFn = field(repr=False)
    # named lookup tables (grids, value tables) as numpy arrays; the kernels upload these
    tables: Mapping[str, np.ndarray] = field(default_factory=dict, repr=False)
    # byte offsets of the fp16 scale fields inside a block (d, and Q4_1's m)
    scale_offsets: tuple[int, ...] = ()
    # where the fp16 scale is no plain field (IQ1_M spreads its bits over four words):
    # blocks (n, block_bytes) -> (n,) float16, and (blocks, (n,) float16) -> None, in place
    read_scale: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)
    write_scale: Callable[[np.ndarray, np.ndarray], None] | None = field(default=None, repr=False)
    # the order of the bytes: "gguf" as files hold them, or a device layout
    # (triton_kernels.layout) whose codec repacks around the GGUF one
    layout: str = "gguf"
    # the codec on weights as columns of 32, where the format has one: the 32-weight
    # formats decode (n_blocks, block_bytes) uint8 -> (32, n_blocks) float32, and they and
    # the K-quants encode (32, n) -> (n 32 / block_elems, block_bytes) blocks, without an
    # importance
    dequantize_cols: DequantFn | None = field(default=None, repr=False)
    quantize_cols: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_elems

    def row_bytes(self, n_elems: int) -> int:
        """Bytes of a row of `n_elems` weights; ValueError if not whole blocks."""
        if n_elems % self.block_elems:
            raise ValueError(
                f"{self.name}: a row of {n_elems} weights is not a whole number of "
                f"{self.block_elems}-weight blocks")
        return n_elems // self.block_elems * self.block_bytes

    def check_bytes(self, data: np.ndarray) -> np.ndarray:
        """Validate quantized data: uint8 (or raw bytes), whole blocks along the last axis."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = np.frombuffer(data, dtype=np.uint8)
        if not isinstance(data, np.ndarray):
            raise ValueError(f"{self.name}: quantized data must be a uint8 numpy array, "
                             f"got {type(data).__name__}")
        if data.dtype != np.uint8:
            raise ValueError(f"{self.name}: quantized data must be uint8 bytes, got dtype "
                             f"{data.dtype}; view it with .view(np.uint8) if it holds raw blocks")
        if data.ndim == 0 or data.shape[-1] % self.block_bytes:
            n = data.shape[-1] if data.ndim else 0
            raise ValueError(
                f"{self.name}: {n} bytes per row is not a whole number of blocks; expected a "
                f"multiple of {self.block_bytes} bytes ({self.block_elems} weights a block)")
        return data

    def dequantize(self, data: np.ndarray) -> np.ndarray:
        """Quantized bytes (..., k * block_bytes) -> float32 (..., k * block_elems)."""
        data = self.check_bytes(data)
        lead = data.shape[:-1]
        blocks = np.ascontiguousarray(data).reshape(-1, self.block_bytes)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf scales propagate
            out = self.dequantize_blocks(blocks)
        return out.reshape(*lead, data.shape[-1] // self.block_bytes * self.block_elems)

    def requantize(self, data: np.ndarray, src: Format) -> np.ndarray:
        """Rows of `src` blocks (..., k * src.block_bytes) in this format, without an
        importance: `quantize(src.dequantize(data))`, by way of columns of 32 where both
        formats have a column codec (the weights are never laid out in rows)."""
        data = src.check_bytes(data)
        if src.dequantize_cols is None or self.quantize_cols is None:
            return self.quantize(src.dequantize(data))
        lead, n = data.shape[:-1], data.shape[-1] // src.block_bytes
        per = self.block_elems // src.block_elems     # source blocks a block
        if n % per:
            raise ValueError(self._bad_rows(n * src.block_elems))
        blocks = np.ascontiguousarray(data).reshape(-1, src.block_bytes)
        out = np.empty((blocks.shape[0] // per, self.block_bytes), np.uint8)
        # a chunk's columns (1 MiB of float32) stay in cache through every pass of the two
        # codecs: twice as fast as whole tensors, whose temporaries go out to memory; a
        # chunk holds whole blocks, since rows do (REQUANTIZE_BLOCKS is a multiple of 8)
        for a in range(0, blocks.shape[0], REQUANTIZE_BLOCKS):
            with np.errstate(invalid="ignore", over="ignore"):
                x = src.dequantize_cols(blocks[a:a + REQUANTIZE_BLOCKS])
            _check_finite(self.name, x)
            with np.errstate(over="ignore", invalid="ignore"):
                out[a // per:(a + REQUANTIZE_BLOCKS) // per] = self.quantize_cols(x)
        return out.reshape(*lead, n // per * self.block_bytes)

    def _bad_rows(self, n: int) -> str:
        return (f"{self.name}: rows of {n} weights cannot be quantized; expected a multiple "
                f"of {self.block_elems} weights ({self.block_bytes} bytes a block)")

    def quantize(self, x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
        """Float array (..., k * block_elems) -> quantized bytes (..., k * block_bytes).

        `importance`, where the format uses it, weighs each weight's squared error; it is
        broadcast against `x` (one value per column, as an importance matrix gives, or one
        per weight)."""
        x = np.asarray(x)
        if x.dtype.kind != "f":
            raise ValueError(f"{self.name}: quantize takes floating-point weights, got dtype {x.dtype}")
        if x.ndim == 0 or x.shape[-1] % self.block_elems:
            raise ValueError(self._bad_rows(x.shape[-1] if x.ndim else 0))
        x = np.ascontiguousarray(x, dtype=np.float32)
        _check_finite(self.name, x)
        lead = x.shape[:-1]
        blocks = x.reshape(-1, self.block_elems)
        w = None
        if importance is not None:
            w = np.broadcast_to(np.asarray(importance, dtype=np.float32), x.shape)
            w = np.ascontiguousarray(w).reshape(-1, self.block_elems)
        with np.errstate(over="ignore", invalid="ignore"):  # subnormal scales: see legacy._codes
            out = self.quantize_blocks(blocks, w)
        assert out.dtype == np.uint8 and out.shape == (blocks.shape[0], self.block_bytes)
        return out.reshape(*lead, x.shape[-1] // self.block_elems * self.block_bytes)


def _check_finite(name: str, x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: the weights hold NaN or Inf; quantize only finite values")


def column_extreme(x: np.ndarray) -> np.ndarray:
    """(n, S) -> (S,): the signed value of largest magnitude of each column, the first of
    equals (as gguf-py's argmax; a column of zeros gives its first, +0 or -0). From the
    column's largest and smallest, as numpy's argmax down a column is ten times slower;
    only where they are a and -a (or both zero) does the order decide."""
    hi, lo = x.max(axis=0), x.min(axis=0)
    v = np.where(hi >= -lo, hi, lo)
    tie = np.flatnonzero(hi == -lo)
    if tie.size:
        v[tie] = x[np.abs(x[:, tie]).argmax(axis=0), tie]
    return v


_BYTE_PLACES = np.array([1, 1 << 8, 1 << 16, 1 << 24], np.uint32)


def byte_rows(c: np.ndarray) -> np.ndarray:
    """(k, n) uint8 -> (n, k), C-contiguous: the transpose that turns fields kept as
    columns into blocks. numpy makes rows of k bytes from columns one element at a time
    (2 ns a byte here), so four bytes of a column go as one little-endian uint32 word,
    five times faster; k need not be a multiple of four."""
    k, n = c.shape
    k4 = -(-k // 4) * 4
    if k4 != k:
        c = np.concatenate([c, np.zeros((k4 - k, n), np.uint8)])
    words = np.einsum("abn,b->an", c.reshape(k4 // 4, 4, n).astype(np.uint32), _BYTE_PLACES)
    out = np.ascontiguousarray(words.astype("<u4", copy=False).T).view(np.uint8)
    return out if k4 == k else np.ascontiguousarray(out[:, :k])


def fp16_to_f32(two_bytes: np.ndarray) -> np.ndarray:
    """(n, 2) little-endian fp16 bytes -> (n, 1) float32."""
    return np.ascontiguousarray(two_bytes).view(np.float16).astype(np.float32)


def f32_to_fp16_bytes(x: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) fp16 bytes, rounded to nearest even."""
    return np.ascontiguousarray(x, dtype=np.float32).astype(np.float16).view(np.uint8)


def chunked(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], block_bytes: int, chunk: int,
            ones_for_none: bool = True) -> QuantFn:
    """A quantize_blocks that runs `fn` over `chunk` blocks at a time (bounding a search's
    temporaries). No importance means every weight counts the same (`ones_for_none`), or
    is passed on as None (the IQ3 search then weighs by x^2, as llama.cpp does)."""
    def quantize(x: np.ndarray, w):
        if w is None and ones_for_none:
            w = np.ones_like(x)
        parts = [fn(x[i:i + chunk], None if w is None else w[i:i + chunk]) for i in range(0, x.shape[0], chunk)]
        return np.concatenate(parts, axis=0) if parts else np.zeros((0, block_bytes), np.uint8)
    return quantize


def digit_rows(text: tuple[str, ...]) -> np.ndarray:
    """A table written as whitespace-separated entries of decimal digits, one digit a value
    (the grid tables' level indices) -> (entries, digits) uint8, parsed at once."""
    entries = "".join(text).split()
    digits = np.frombuffer("".join(entries).encode("ascii"), dtype=np.uint8) - np.uint8(ord("0"))
    return digits.reshape(len(entries), -1)
