"""quantize -> dequantize stays within a bound derived per format.

Notation: amax = largest |x| of a block, u16(v) = max(2^-11 |v|, 2^-25) the largest error
of rounding v to fp16 (half an ulp, or half the subnormal spacing), SLACK = 2^-22 amax
for float32 rounding inside the codecs.

  F32      exact.
  F16      |x - fp16(x)| <= u16(x).
  BF16     |x - bf16(x)| <= max(2^-8 |x|, 2^-134).
  Q8_0     d = amax/127, q = round(x/d): |x - d16 q| <= d/2 + 127 u16(d) + SLACK.
  Q4_0     d = -x_max/8 (the signed extreme), x/d in [-8, 8], q - 8 clipped to 7:
           <= |d| + 8 u16(d) + SLACK.
  Q4_1     d = (max - min)/15, q = round((x - min)/d):
           <= d/2 + 15 u16(d) + u16(min) + SLACK.
  IQ4_NL   d = -x_max/127, nearest of the 16 values: half the widest gap (24/2) inside,
           up to 127 - 113 = 14 past the top: <= 14 |d| + 127 u16(d) + SLACK.
  IQ3_*    per group of four, with t the target (|x|, negated where IQ3_XXS keeps a wrong
           sign for parity) and db the stored scale: the group ends on the grid entry
           nearest t/db, so ||t - db g|| <= db R + ||t - clip(t, 0, db top)||, where R is the
           grid's covering radius over [0, top]^4 (computed below on a lattice of step h:
           R <= R_lattice + h) and the second term is what lies outside the grid's box.

A second round trip provably changes no value for F32, F16, BF16 (casts are idempotent),
Q8_0, Q4_0 and IQ4_NL (the scale comes from the extreme weight, which decodes to exactly
d16 times the extreme code, so the second pass finds d16 again and every code again);
not for Q4_1 (d16*15 + m16 rounds) nor the IQ3 formats (a search).
"""
import functools

import numpy as np
import pytest
from hypothesis import example, given, strategies as st

import quant
from quant import iq3

F16_UNIT = 2.0 ** -11


def u16(v):
    return np.maximum(F16_UNIT * np.abs(v), 2.0 ** -25)


def weights(block_elems: int, max_blocks: int = 2, bound: float = 1e4):
    elems = st.floats(-bound, bound, width=32)
    return st.integers(1, max_blocks).flatmap(
        lambda n: st.lists(elems, min_size=n * block_elems, max_size=n * block_elems)
    ).map(lambda v: np.array(v, dtype=np.float32).reshape(-1, block_elems))


def legacy_bound(name: str, x: np.ndarray) -> np.ndarray:
    """Per-block bound on |x - dequantize(quantize(x))| for the 32-weight formats."""
    amax = np.abs(x).max(-1, keepdims=True).astype(np.float64)
    slack = 2.0 ** -22 * amax
    if name == "Q8_0":
        d = amax / 127
        return d / 2 + 127 * u16(d) + slack
    if name == "Q4_0":
        d = amax / 8
        return d + 8 * u16(d) + slack
    if name == "Q4_1":
        lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
        d = (hi.astype(np.float64) - lo) / 15
        return d / 2 + 15 * u16(d) + u16(lo) + 2.0 ** -22 * (np.abs(lo) + np.abs(hi))
    if name == "IQ4_NL":
        d = amax / 127
        return 14 * d + 127 * u16(d) + slack
    raise KeyError(name)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "IQ4_NL"])
def test_legacy_round_trip_within_bound(name):
    fmt = quant.get(name)

    @given(weights(32))
    @example(np.zeros((1, 32), np.float32))
    @example(np.linspace(-3, 5, 32, dtype=np.float32)[None])
    @example(np.array([[1e-7] * 31 + [-2e-6]], np.float32))  # fp16-subnormal scale
    def prop(x):
        err = np.abs(fmt.dequantize(fmt.quantize(x)).astype(np.float64) - x)
        assert (err <= legacy_bound(name, x)).all()
    prop()


def test_float_round_trips_within_half_an_ulp():
    @given(weights(1, max_blocks=64, bound=65504))
    def prop(x):
        f32, f16, bf16 = (quant.get(n) for n in ("F32", "F16", "BF16"))
        assert np.array_equal(f32.dequantize(f32.quantize(x)), x)
        assert (np.abs(f16.dequantize(f16.quantize(x)) - x) <= u16(x)).all()
        assert (np.abs(bf16.dequantize(bf16.quantize(x)) - x) <= np.maximum(2.0 ** -8 * np.abs(x), 2.0 ** -134)).all()
    prop()


@functools.lru_cache(maxsize=None)
def covering_radius(name: str) -> float:
    """Upper bound on the distance from any point of [0, top]^4 to the nearest grid entry."""
    grid = (iq3.XXS_GRID if name == "IQ3_XXS" else iq3.S_GRID).astype(np.float64)
    top = grid.max()
    h = 4.0 if name == "IQ3_XXS" else 1.0
    axis = np.arange(0, top + h, h).clip(max=top)
    pts = np.stack(np.meshgrid(*[axis] * 4, indexing="ij"), -1).reshape(-1, 4)
    d2 = (pts * pts).sum(1)[:, None] - 2 * pts @ grid.T + (grid * grid).sum(1)
    # every point of the box is within h (half the 4-cube's diagonal) of a lattice point
    return float(np.sqrt(np.maximum(d2.min(1), 0)).max()) + h


@pytest.mark.parametrize("name", ["IQ3_XXS", "IQ3_S"])
def test_iq3_round_trip_within_grid_bound(name):
    fmt = quant.get(name)
    grid = iq3.XXS_GRID if name == "IQ3_XXS" else iq3.S_GRID
    sub_scales = iq3.xxs_sub_scales if name == "IQ3_XXS" else iq3.s_sub_scales
    top, radius = float(grid.max()), covering_radius(name)

    @given(weights(256, max_blocks=2, bound=1e3))
    @example(np.zeros((1, 256), np.float32))
    @example(np.full((1, 256), -0.5, np.float32))
    @example(np.r_[np.full(255, 1e-3), 40.0].astype(np.float32)[None])
    def prop(x):
        q = fmt.quantize(x)
        deq = fmt.dequantize(q).astype(np.float64)
        db = np.repeat(sub_scales(q.reshape(-1, fmt.block_bytes)).astype(np.float64), 32, axis=1)
        t = x * np.where(deq < 0, -1.0, 1.0)                     # target magnitudes
        outside = t - np.clip(t, 0, db * top)
        group = lambda v: np.sqrt((v.reshape(-1, 4) ** 2).sum(-1))
        err = group(x - deq)
        bound = group(db) / 2 * radius + group(outside) + group(db) / 2 * top * 2.0 ** -8
        assert (err <= bound * (1 + 1e-6)).all()
    prop()


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "IQ4_NL"])
def test_second_round_trip_changes_nothing(name):
    fmt = quant.get(name)
    once = lambda x: fmt.dequantize(fmt.quantize(x))

    @given(weights(fmt.block_elems, max_blocks=3 if fmt.block_elems > 1 else 64))
    @example(np.array([[1e-7] * 31 + [-2e-6]], np.float32).reshape(-1, fmt.block_elems))
    def prop(x):
        first = once(x)
        assert np.array_equal(once(first), first)  # -0 == 0: a zero scale may drop a sign
    prop()
