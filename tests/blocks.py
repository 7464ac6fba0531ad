"""Hypothesis strategies for quantized blocks, and bit-level comparison."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import quant

# Finite fp16 scales: Hypothesis favours the edges (0, -0, subnormals, +-65504).
finite_f16 = st.floats(width=16, allow_nan=False, allow_infinity=False)
special_f16 = st.sampled_from([float("nan"), float("inf"), float("-inf")])


@st.composite
def blocks(draw, fmt: quant.Format, max_blocks: int = 3, scales=finite_f16, min_blocks: int = 1) -> np.ndarray:
    """(n, block_bytes) uint8: every byte drawn freely, then the fp16 scale fields set from
    `scales` (float formats keep their raw bytes: every bit pattern, NaN and Inf included)."""
    n = draw(st.integers(min_blocks, max_blocks))
    raw = draw(st.binary(min_size=n * fmt.block_bytes, max_size=n * fmt.block_bytes))
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(n, fmt.block_bytes).copy()
    for off in fmt.scale_offsets:
        d = np.array(draw(st.lists(scales, min_size=n, max_size=n)), dtype=np.float16)
        arr[:, off:off + 2] = d.view(np.uint8).reshape(n, 2)
    return arr


def with_scale(fmt: quant.Format, rest: int, scale: float, n: int = 1) -> np.ndarray:
    """n blocks whose bytes are all `rest` except the scales, which are `scale`."""
    arr = np.full((n, fmt.block_bytes), rest, dtype=np.uint8)
    for off in fmt.scale_offsets:
        arr[:, off:off + 2] = np.array([scale] * n, dtype=np.float16).view(np.uint8).reshape(n, 2)
    return arr


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (payloads may differ)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return False
    uint = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return np.array_equal(a[~nan_a].view(uint), b[~nan_b].view(uint))


def exhaustive_blocks(fmt: quant.Format) -> np.ndarray:
    """Blocks that together hold every code of the format: every grid index, sign pattern,
    scale nibble and quant value (every bit pattern for F16 and BF16)."""
    rng = np.random.default_rng(fmt.type_id)
    if fmt.block_elems == 1:
        if fmt.block_bytes == 2:
            return np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
        return rng.integers(0, 256, (4096, 4), dtype=np.uint8)
    n = 256 if fmt.block_bytes != 110 else 512  # IQ3_S indices have 9 bits
    arr = rng.integers(0, 256, (n, fmt.block_bytes), dtype=np.uint8)
    # every byte value at every non-scale byte position (grid low bits, signs, nibbles)
    arr[:256, :] = (np.arange(256)[:, None] + np.arange(fmt.block_bytes)) % 256
    if fmt.name == "IQ3_S":  # every 9-bit index: rows 256.. set the high bit everywhere
        arr[256:, 2:66] = arr[:256, 2:66]
        arr[256:, 66:74] = 0xFF
        arr[:256, 66:74] = 0x00
    d = (rng.standard_normal(n) * 0.1).astype(np.float16)
    for off in fmt.scale_offsets:
        arr[:, off:off + 2] = d.view(np.uint8).reshape(n, 2)
    return arr
