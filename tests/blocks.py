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
    if fmt.write_scale is not None:
        fmt.write_scale(arr, np.array(draw(st.lists(scales, min_size=n, max_size=n)), dtype=np.float16))
    return arr


def with_scale(fmt: quant.Format, rest: int, scale: float, n: int = 1) -> np.ndarray:
    """n blocks whose bytes are all `rest` except the scales, which are `scale`."""
    arr = np.full((n, fmt.block_bytes), rest, dtype=np.uint8)
    for off in fmt.scale_offsets:
        arr[:, off:off + 2] = np.array([scale] * n, dtype=np.float16).view(np.uint8).reshape(n, 2)
    if fmt.write_scale is not None:
        fmt.write_scale(arr, np.full(n, scale, dtype=np.float16))
    return arr


def with_first_scale(fmt: quant.Format, rest: int, first: float, others: float = 0.0) -> np.ndarray:
    """One block whose first scale (d) is `first`, its other scales (Q4_1's m, the K-quants'
    dmin) `others`, its other bytes `rest`: d = -0 with m = +0 gives d * q + m = +0, which a
    decode that negates m as 0 - m writes as -0."""
    arr = with_scale(fmt, rest, others)
    if fmt.scale_offsets:
        off = fmt.scale_offsets[0]
        arr[:, off:off + 2] = np.array([first], dtype=np.float16).view(np.uint8)
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
    n = 512 if fmt.name == "IQ3_S" else 256  # IQ3_S indices have 9 bits
    arr = rng.integers(0, 256, (n, fmt.block_bytes), dtype=np.uint8)
    # every byte value at every non-scale byte position (grid low bits, signs, nibbles)
    arr[:256, :] = (np.arange(256)[:, None] + np.arange(fmt.block_bytes)) % 256
    if fmt.name == "IQ3_S":  # every 9-bit index: rows 256.. set the high bit everywhere
        arr[256:, 2:66] = arr[:256, 2:66]
        arr[256:, 66:74] = 0xFF
        arr[:256, 66:74] = 0x00
    if fmt.name in _CODE_ROWS:  # codes that span bytes: 256 more blocks built from codes
        arr = np.concatenate([arr, _CODE_ROWS[fmt.name]()])
    n = arr.shape[0]
    d = (rng.standard_normal(n) * 0.1).astype(np.float16)
    for off in fmt.scale_offsets:
        arr[:, off:off + 2] = d.view(np.uint8).reshape(n, 2)
    if fmt.write_scale is not None:
        fmt.write_scale(arr, d)
    return arr


def _codes(k: int, levels: int, div: int = 1) -> np.ndarray:
    """(256, k): row r gives field i the code (r // div + i) % levels, so that over 256 rows
    every field takes every value (with div = 16, every pair with the div = 1 field too)."""
    return (np.arange(256)[:, None] // div + np.arange(k)) % levels


def _code_rows_table():
    from quant import kquants as kq
    from quant.legacy import pack_q5
    one = np.ones(256, np.float32)
    return {
        "Q5_0": lambda: np.concatenate([np.zeros((256, 2), np.uint8), pack_q5(_codes(32, 32))], -1),
        "Q5_1": lambda: np.concatenate([np.zeros((256, 4), np.uint8), pack_q5(_codes(32, 32))], -1),
        "Q2_K": lambda: kq.pack_q2_k(one, one, _codes(16, 16), _codes(16, 16, 16), _codes(256, 4)),
        "Q3_K": lambda: kq.pack_q3_k(one, _codes(16, 64), _codes(256, 8) - 4),
        "Q4_K": lambda: kq.pack_q4_k(one, one, _codes(8, 64), _codes(8, 64, 4), _codes(256, 16)),
        "Q5_K": lambda: kq.pack_q5_k(one, one, _codes(8, 64), _codes(8, 64, 4), _codes(256, 32)),
        "Q6_K": lambda: kq.pack_q6_k(one, _codes(16, 256) - 128, _codes(256, 64)),
    }


_CODE_ROWS = _code_rows_table()


def has_scales(fmt: quant.Format) -> bool:
    """Whether the format has fp16 scales that the strategies set (plain fields or not)."""
    return bool(fmt.scale_offsets) or fmt.write_scale is not None


def first_scale(fmt: quant.Format, arr: np.ndarray) -> np.ndarray:
    """(n,) float16: each block's d (its first plain scale field, or the spread one)."""
    if fmt.read_scale is not None:
        return fmt.read_scale(arr)
    off = fmt.scale_offsets[0]
    return arr[:, off:off + 2].copy().view(np.float16)[:, 0]


def _grid_rows_table():
    """256 blocks each for the grid formats whose indices span bytes: group g of row r takes
    index (32 r + g) mod the grid size, so every index occurs; the fields beside it (sign
    index, delta sign, scale) take codes that vary with r and g."""
    g = np.arange(32)
    idx = np.arange(256)[:, None] * 32 + g                             # (256, 32)
    u16 = lambda v: v.astype("<u2").view(np.uint8)
    zeros = lambda k: np.zeros((256, k), np.uint8)
    nib = lambda lo, hi: (lo | (hi << 4)).astype(np.uint8)

    def iq2_xs():
        qs = (idx % 512) | (((idx // 512 + g) % 128) << 9)
        return np.concatenate([zeros(2), u16(qs), nib(_codes(8, 16), _codes(8, 16, 16))], -1)

    def iq2_s():
        i = idx % 1024
        qh = (i >> 8).reshape(256, 8, 4) << np.array([0, 2, 4, 6])
        return np.concatenate([zeros(2), (i & 0xFF).astype(np.uint8), _codes(32, 256).astype(np.uint8),
                               qh.sum(-1).astype(np.uint8), nib(_codes(8, 16), _codes(8, 16, 16))], -1)

    def iq1_s():
        i = idx % 2048
        hi = ((i >> 8).reshape(256, 8, 4) << np.array([0, 3, 6, 9])).sum(-1)
        qh = hi | (_codes(8, 8) << 12) | (_codes(8, 2, 8) << 15)
        return np.concatenate([zeros(2), (i & 0xFF).astype(np.uint8), u16(qh)], -1)

    def iq1_m():
        i = idx % 2048
        n4 = (i >> 8) | (_codes(32, 2, 8) << 3)
        words = (_codes(16, 8).reshape(256, 4, 4) << np.array([0, 3, 6, 9])).sum(-1)
        return np.concatenate([(i & 0xFF).astype(np.uint8), nib(n4[:, 0::2], n4[:, 1::2]), u16(words)], -1)

    return {"IQ2_XS": iq2_xs, "IQ2_S": iq2_s, "IQ1_S": iq1_s, "IQ1_M": iq1_m}


_CODE_ROWS.update(_grid_rows_table())
