"""int8 activations and the dp4a GEMV (triton_kernels/int8.py), through the interpreter.

quantize_x
    The kernel equals quantize_x_torch bit for bit (q, d, s), for float32, float16 and
    bfloat16 x, any finite values: all-zero groups, groups with one nonzero value, exact
    ties (x / d = k + 1/2), raw bit patterns (subnormals and huge values), column-major x.
    Then, per group of 32 with d = fl(max|x| / 127), against x̂ = d * code taken exactly
    (float64):

        |code| <= 127,  code = clamp(round-half-away(fl(x / d)), -127, 127),
        s == fl(d * Σcode),  |x̂ - x| <= d/2 * (1 + 2^-17) + 2^-143

    Why 2^-17: v = fl(x / d) errs by at most half an ulp of v, and |v| < 128 (|x| <=
    max|x| and d is max|x| / 127 rounded once), so |v - x/d| <= 2^-18 and |code - x/d| <=
    1/2 + 2^-18. A value just below k + 1/2 whose quotient rounds up to the tie and then
    away comes close to it, so 1 + 2^-20 would be too tight (v in [16, 128) has half-ulps
    2^-20 .. 2^-18; test_rounding_error_exceeds_half_d_by_more_than_2_pow_minus_20).
    Why 2^-143: d = 0 only when max|x| <= 127 * 2^-150 (then x̂ = 0); and when max|x| <
    127 * 255 * 2^-150 (about 2^-135, float32 subnormals only) d = fl(max|x| / 127) is a
    subnormal that may round down by up to half its step 2^-149, so max|x| / d can round
    to 127.5 or more: the clamp keeps the code at ±127, and the clamped value is off by at
    most 127 * (max|x| / 127 - d) <= 127 * 2^-150 < 2^-143
    (test_tiny_float32_group_clamps_its_code).

gemv_dp4a, against ref = x̂ @ W.T in float64 (x̂ exact from q and d, W = fmt.dequantize(q),
the numpy codec). Elementwise:

    |y - ref| <= 2 * (K/16 + 8) * u * T + K * 2^-149,     u = 2^-24

Why: each 32-weight group's dp4a sum Σ code_i * q_i is an exact int32 (|.| <= 32 * 128 *
127 < 2^24, so also exact in float32). The kernel forms per group

    t_g = fl(s_int * fl(a_g * d_g)) - fl((a_g * ZERO) * xs_g) - fl(b_g * xs_g)

(xs_g itself float32-rounded once from d_g * Σq; a_g * ZERO and the formats' a, b are
exact: at most 11 + 6 + 5 significant bits), then adds the G = K/32 terms in float32 in
some order (part += term, acc += part across K steps, tl.sum across lanes). Treating the
two parts of each t_g as separate summands, that is at most 2G + 3 roundings on partial
sums bounded by T = Σ_g |a_g d_g| Σ_i |c_i q_i| + |a_g ZERO + b_g| |xs_g|, so |y - ref| <=
gamma_(K/16+3) * T < (K/16 + 8) * u * T (Higham 3.1; K <= 768 so K*u/16 is tiny); the
factor 2 is margin, as in test_qmatmul. The codes c are not visible from outside, so T is
bounded from the block bytes:

    no ZERO, no offset, or a ZERO taken in int32 (Q6_K's: s - 32 n is exact), so that
    a * c is the weight exactly (Q8_0, IQ4_NL, IQ3_XXS, IQ3_S, Q3_K, Q6_K, the IQ2 and
    IQ1 formats, IQ4_XS):
        T = S = |x̂| @ |W|.T
    Q4_0, Q5_0 (codes 0..15 or 0..31, ZERO 8 or 16, weight d * (c - ZERO)):
        T <= Σ_blocks 23 |d| (or 47 |d|) Σ_(i in block) |x̂_i|      (d = fp16 at bytes 0-1)
    Q4_1, Q5_1 (weight d * c + m):
        T <= Σ_blocks (15 |d| + |m|) (or 31 |d| + |m|) Σ_(i in block) |x̂_i|  (d, m: 0-1, 2-3)
    Q4_K, Q5_K (codes 0..15 or 0..31, a = d * sc, b = dmin * m, sc, m <= 63):
        T <= Σ_blocks (945 |d| + 63 |dmin|) (or 1953 |d| + ...) Σ_(i in block) |x̂_i|  (0-1, 2-3)
    Q2_K (codes 0..3, sc, m <= 15; d, dmin at bytes 80-81, 82-83):
        T <= Σ_blocks (45 |d| + 15 |dmin|) Σ_(i in block) |x̂_i|
    (S alone is no bound where the two parts cancel: a Q5_0 block of codes all 16 is all
    zero weights, S = 0, while the kernel's s * a * d and 16 * a * xs each round: a
    Hypothesis example found y = -2^-26 there.)

K * 2^-149 covers products that would underflow (none do at these ranges: fp16 scales of
at most 1/8, x in [-1, 1]).

gemv_dp4a_torch is x̂ @ W.T as one float32 torch matmul: test_qmatmul's float32 bound,
|y - ref| <= 2 * (K + 2) * u * S, covers it (x̂ rounds once to float32, u * S, and the
K-term dot product gamma_K * S).

Sizes: the interpreter runs each program's unrolled unit decode op by op (0.1 - 0.35 s a
K step), so each example gets a budget of program-steps (programs along N times M times K
steps); N, M are drawn within it, and the tiles are parametrised so that every format
runs each tile shape. Examples per (format, tile) are few (3, 54 in all), and a failing
one is reported unshrunk; the file takes under a minute on one core.
"""
import numpy as np
import pytest
import torch
import triton
from hypothesis import Phase, given, settings, strategies as st
from tests.tiers import examples

import quant
from tests.triton_kernels.test_qmatmul import weights
from triton_kernels.backend import interpreter_on
from triton_kernels import layout
from triton_kernels.decode import UNITS
from triton_kernels.layout.split import has_split
from triton_kernels import int8
from triton_kernels.int8 import (MAX_SPLIT, Q8X, gemv_dp4a, gemv_dp4a_torch, quantize_x, quantize_x_torch,
                                 split_for)

U = 2.0 ** -24
DOT_FORMATS = [quant.get(name) for name in UNITS]
OTHER_FORMATS = [f for f in quant.FORMATS.values() if f.name not in UNITS]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TILES = [(16, 8), (4, 2), (8, 1)]


def test_the_interpreter_is_on():
    assert interpreter_on()  # else quantize_x and gemv_dp4a on CPU tensors take torch paths


# --- activations ---------------------------------------------------------------------------

KINDS = ["zero", "one", "normal", "tiny", "bits", "ties"]
_FINITE_MAX = {torch.float32: 3.4e38, torch.float16: 65504.0, torch.bfloat16: 3.38e38}
_EXP_RANGE = {torch.float32: (-150, 127), torch.float16: (-26, 15), torch.bfloat16: (-135, 127)}
# subnormal maxima (float32's reach the clamp: test_tiny_float32_group_clamps_its_code)
_TINY_EXP = {torch.float32: (-150, -127), torch.float16: (-26, -15), torch.bfloat16: (-135, -127)}
_TIE_EXP = {torch.float32: (-100, 100), torch.float16: (-10, 8), torch.bfloat16: (-100, 100)}


def _raw_finite(rng, dtype, n) -> torch.Tensor:
    """n values of dtype from random bit patterns, the non-finite ones made finite."""
    if dtype == torch.float32:
        bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
        expo = np.uint32(0x7F800000)
        bits = np.where(bits & expo == expo, bits ^ np.uint32(0x40000000), bits)
        return torch.from_numpy(bits.view(np.float32).copy())
    bits = rng.integers(0, 2 ** 16, n).astype(np.uint16)
    expo = np.uint16(0x7C00 if dtype == torch.float16 else 0x7F80)
    bits = np.where(bits & expo == expo, bits ^ np.uint16(0x4000), bits)
    return torch.from_numpy(bits.view(np.int16).copy()).view(dtype)


def _group(rng, kind: str, dtype) -> torch.Tensor:
    """32 values of dtype."""
    if kind == "zero":
        return torch.from_numpy(np.where(rng.random(32) < 0.5, -0.0, 0.0)).to(dtype)
    if kind == "bits":
        return _raw_finite(rng, dtype, 32)
    if kind == "ties":  # d = 2^e exactly, most values (k + 1/2) * 2^e: x/d an exact tie
        e = int(rng.integers(*_TIE_EXP[dtype]))
        k = rng.integers(-127, 127, 32) + 0.5
        k[rng.integers(32)] = 127.0 * rng.choice([-1, 1])
        return torch.from_numpy(np.ldexp(k, e)).to(dtype)
    lo, hi = (_TINY_EXP if kind == "tiny" else _EXP_RANGE)[dtype]
    v = np.ldexp(rng.standard_normal(32), int(rng.integers(lo, hi + 1)))
    v = np.clip(v, -_FINITE_MAX[dtype], _FINITE_MAX[dtype])
    g = torch.from_numpy(v).to(dtype)
    if kind == "one":  # one nonzero value (or a raw bit pattern) at a random place
        one = g[0] if rng.random() < 0.5 else _raw_finite(rng, dtype, 1)[0]
        g = torch.zeros(32, dtype=dtype)
        g[rng.integers(32)] = one
    return g


@st.composite
def activations(draw, dtype, max_m=5, max_groups=12) -> torch.Tensor:
    """(M, 32 g) finite x of dtype, each group of 32 of a kind drawn by Hypothesis; column-
    major half the time."""
    m = draw(st.integers(1, max_m))
    g = draw(st.integers(1, max_groups))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=m * g, max_size=m * g))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    x = torch.stack([_group(rng, k, dtype) for k in kinds]).reshape(m, 32 * g)
    assert torch.isfinite(x).all()
    if draw(st.booleans()):
        x = x.T.contiguous().T
    return x


def codes_of(x8: Q8X) -> torch.Tensor:
    """(M, K) int8 codes as int64."""
    return x8.q.contiguous().view(torch.int8).long()


def xhat64(x8: Q8X) -> torch.Tensor:
    """x̂ = d * code, exactly (8 x 24 significant bits fit a float64)."""
    M = x8.q.shape[0]
    return (codes_of(x8).double().view(M, -1, 32) * x8.d.double()[:, :, None]).view(M, -1)


# --- quantize_x ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_x_kernel_equals_torch_bit_for_bit(dtype):
    @given(activations(dtype))
    @settings(max_examples=examples(30))
    def prop(x):
        M, K = x.shape
        got, want = quantize_x(x), quantize_x_torch(x)
        assert got.q.shape == (M, K // 4) and got.d.shape == got.s.shape == (M, K // 32)
        assert got.q.dtype == torch.int32 and got.d.dtype == got.s.dtype == torch.float32
        assert torch.equal(got.q, want.q)
        # bits, not values: -0.0 vs 0.0 would pass torch.equal
        assert torch.equal(got.d.view(torch.int32), want.d.view(torch.int32))
        assert torch.equal(got.s.view(torch.int32), want.s.view(torch.int32))
    prop()


def _round_away_f32(v: np.ndarray) -> np.ndarray:
    a = np.floor(np.abs(v) + np.float32(0.5))
    return np.where(v < 0, -a, a)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantization_error_codes_and_sums(dtype):
    @given(activations(dtype))
    @settings(max_examples=examples(30))
    def prop(x):
        M, K = x.shape
        x8 = quantize_x(x)
        xg = x.double().view(M, K // 32, 32)
        code = codes_of(x8).view(M, K // 32, 32)
        d = x8.d
        # d is max|x| / 127, rounded once in float32
        x32 = x.float().numpy().reshape(M, K // 32, 32)
        d_np = np.abs(x32).max(axis=2) / np.float32(127)
        assert np.array_equal(d.numpy(), d_np)
        # codes: round half away from zero of fl(x / d), clamped to ±127; 0 where d = 0
        v = x32 / np.where(d_np == 0, np.float32(1), d_np)[:, :, None]
        want_code = np.where(d_np[:, :, None] == 0, 0, np.clip(_round_away_f32(v), -127, 127))
        assert np.array_equal(code.numpy(), want_code)
        assert (code.abs() <= 127).all()
        # s = d * Σcode, the float32 product of the stored codes' sum
        s_want = (d * code.sum(dim=2).float())
        assert torch.equal(x8.s.view(torch.int32), s_want.view(torch.int32))
        # |x̂ - x| <= d/2 (1 + 2^-17) + 2^-143; d = 0 gives x̂ = 0
        xh = xhat64(x8).view(M, K // 32, 32)
        err = (xh - xg).abs()
        bound = (d.double() / 2 * (1 + 2.0 ** -17) + 2.0 ** -143)[:, :, None].expand_as(err)
        bad = err > bound
        assert not bad.any(), (f"{int(bad.sum())} values off: err {err[bad][:4].tolist()} "
                               f"vs {bound[bad][:4].tolist()}")
        assert (xh[(d == 0)] == 0).all()
        # dequantize() is x̂ rounded once to float32
        assert torch.equal(x8.dequantize(), xhat64(x8).float())
    prop()


def test_zero_and_single_value_groups():
    x = torch.zeros(2, 96)
    x[0, 40] = -3.0        # group 1 of row 0: one value -> code -127, d = 3/127
    x[1, 95] = 2.0 ** -20  # last group of row 1
    x[1, 0:32] = -0.0
    for x8 in (quantize_x(x), quantize_x_torch(x)):
        code = codes_of(x8)
        assert code[0, 40] == -127 and code[1, 95] == 127
        assert int((code != 0).sum()) == 2
        d = torch.zeros(2, 3)
        d[0, 1] = torch.tensor(3.0) / 127
        d[1, 2] = torch.tensor(2.0 ** -20) / 127
        assert torch.equal(x8.d, d) and not x8.d.signbit().any()
        assert torch.equal(x8.s, d * torch.tensor([[0, -127, 0], [0, 0, 127]]).float())


def test_ties_round_away_from_zero():
    k = torch.arange(-126, 127, dtype=torch.float32)  # 253 values; ties at k + 1/2
    x = torch.zeros(1, 288)
    x[0, :253] = k + 0.5 * torch.sign(k)
    x[0, ::32] = 127.0   # d = 1 in every group: x / d = x exactly
    want = torch.where(x[0] > 0, torch.floor(x[0] + 0.5), -torch.floor(-x[0] + 0.5))
    for x8 in (quantize_x(x), quantize_x_torch(x)):
        assert (x8.d == 1).all()
        assert torch.equal(codes_of(x8)[0].float(), want)
        assert torch.equal(codes_of(x8)[0, 1:5], torch.tensor([-126, -125, -124, -123]))  # -125.5 -> -126


def test_rounding_error_exceeds_half_d_by_more_than_2_pow_minus_20():
    # x / d rounds to float32 before round-half-away: the error bound needs its 2^-17
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 0.9877637028694153, -0.6805458664894104  # both exact float32
    for x8 in (quantize_x(x), quantize_x_torch(x)):
        d = x8.d[0, 0].double()
        assert codes_of(x8)[0, 1] == -88
        excess = (xhat64(x8)[0, 1] - x[0, 1].double()).abs() / (d / 2) - 1
        assert 2.0 ** -20 < excess <= 2.0 ** -17


@pytest.mark.parametrize("fn", [quantize_x, quantize_x_torch], ids=lambda f: f.__name__)
def test_tiny_float32_group_clamps_its_code(fn):
    x = torch.zeros(1, 64)
    x[0, 0] = 2.0 ** -140           # subnormal; 2^-140 / 127 rounds to 4 * 2^-149 = 2^-147,
    x[0, 32] = -(2.0 ** -140)       # so x / d = 128: clamped to 127 (int8 would wrap to -128)
    x8 = fn(x)
    assert x8.d[0, 0] == 2.0 ** -147
    assert codes_of(x8)[0, 0] == 127 and codes_of(x8)[0, 32] == -127
    assert torch.equal(x8.s[0], x8.d[0] * torch.tensor([127.0, -127.0]))
    xh = xhat64(x8)[0]
    assert xh[0] == 127 * 2.0 ** -147 and xh[32] == -127 * 2.0 ** -147
    assert (xh - x[0].double()).abs().max() <= 2.0 ** -143


@pytest.mark.parametrize("fn", [quantize_x, quantize_x_torch], ids=lambda f: f.__name__)
def test_quantize_x_rejects_bad_shapes(fn):
    for bad in (torch.zeros(64), torch.zeros(2, 40), torch.zeros(1, 2, 32)):
        with pytest.raises(ValueError, match=r"quantize_x: x must be \(M, K\) with K a multiple of 32"):
            fn(bad)


@pytest.mark.parametrize("fn", [quantize_x, quantize_x_torch], ids=lambda f: f.__name__)
def test_quantize_x_empty(fn):
    x8 = fn(torch.zeros(0, 64))
    assert x8.q.shape == (0, 16) and x8.d.shape == x8.s.shape == (0, 2)
    x8 = fn(torch.zeros(3, 0))
    assert x8.q.shape == (3, 0) and x8.d.shape == x8.s.shape == (3, 0)


# --- the dp4a GEMV ---------------------------------------------------------------------------

# T's bound per block for the formats with a ZERO or an offset (the docstring): (factor,
# byte offset of an fp16 field) pairs, summed
SCALE_BOUND = {"Q4_0": ((23, 0),), "Q5_0": ((47, 0),), "Q4_1": ((15, 0), (1, 2)), "Q5_1": ((31, 0), (1, 2)),
               "Q2_K": ((45, 80), (15, 82)), "Q4_K": ((945, 0), (63, 2)), "Q5_K": ((1953, 0), (63, 2))}


def reference(x8: Q8X, q: np.ndarray, fmt):
    """(ref, S, T): x̂ @ W.T in float64, |x̂| @ |W|.T, and the bound T of the docstring."""
    w = torch.from_numpy(fmt.dequantize(q)).double()
    xh = xhat64(x8)
    ref, s = xh @ w.T, xh.abs() @ w.abs().T
    if fmt.name in SCALE_BOUND:
        n, nb = q.shape[0], q.shape[1] // fmt.block_bytes
        blk = q.reshape(n, nb, fmt.block_bytes)
        f16 = lambda off: torch.from_numpy(blk[:, :, off:off + 2].copy().view(np.float16)[..., 0]
                                           .astype(np.float64)).abs()
        per_block = sum(c * f16(off) for c, off in SCALE_BOUND[fmt.name])  # (n, nb)
        xsum = xh.abs().view(xh.shape[0], nb, fmt.block_elems).sum(dim=2)           # (m, nb)
        t = xsum @ per_block.T
        assert (t >= s * (1 - 1e-12)).all()  # the bound is no looser than S itself
    else:
        t = s
    return ref, s, t


def assert_within(y, ref, tol, what):
    assert y.dtype == torch.float32 and y.shape == ref.shape, what
    err = (y.double() - ref).abs()
    bad = ~(err <= tol)  # NaN counts as bad
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outputs off; worst "
                           f"err {err[bad].max().item():.3g} vs tol {tol[bad].min().item():.3g}")


def gemv_x(rng, m: int, K: int) -> torch.Tensor:
    """x in [-1, 1], with some all-zero groups and some single-value groups."""
    x = rng.uniform(-1, 1, (m, K // 32, 32))
    kind = rng.random((m, K // 32))
    x[kind < 0.15] = 0.0
    one = kind > 0.85
    keep = np.zeros_like(x, dtype=bool)
    keep[..., 7] = True
    x[one] = np.where(keep[one], x[one], 0.0)
    return torch.from_numpy(x.reshape(m, K)).float()


# program-steps an example may take (programs along N * M * K steps), by the interpreter's
# cost of one K step for the format (IQ4_NL's table lookups are 12 byte permutes a word)
# shrinking a failure through the interpreter takes minutes: report the example as found
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
STEP_BUDGET = {"Q8_0": 12, "Q4_0": 12, "Q4_1": 12, "Q5_0": 8, "Q5_1": 8, "IQ4_NL": 4, "IQ4_XS": 4,
               "Q2_K": 4, "Q3_K": 4, "Q4_K": 5, "Q5_K": 4, "Q6_K": 4, "IQ3_XXS": 8, "IQ3_S": 8,
               "IQ2_XXS": 8, "IQ2_XS": 8, "IQ2_S": 8, "IQ1_S": 8, "IQ1_M": 8}


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("fmt", DOT_FORMATS, ids=lambda f: f.name)
def test_gemv_dp4a_agrees_with_the_reference(fmt, tiles):
    unit_weights = UNITS[fmt.name].weights
    block_n, block_u = tiles

    @given(nb=st.integers(1, 3), seed=st.integers(0, 2 ** 32 - 1), data=st.data())
    @settings(max_examples=examples(3), phases=NO_SHRINK)
    def prop(nb, seed, data):
        K = nb * fmt.block_elems
        steps = triton.cdiv(K // unit_weights, block_u)
        programs = max(1, STEP_BUDGET[fmt.name] // steps)
        m = data.draw(st.integers(1, min(3, programs)), label="m")
        n = data.draw(st.integers(1, min(40, block_n * max(1, programs // m))), label="n")
        # the split device layout (triton_kernels.layout) where the format has one: n rows
        # rounded up to whole tiles of four blocks
        split = has_split(fmt) and data.draw(st.booleans(), label="split")
        n = -(-n // 4) * 4 if split else n
        q = data.draw(weights(fmt, n, nb), label="q")
        x8 = quantize_x_torch(gemv_x(np.random.default_rng(seed), m, K))
        ref, _, t = reference(x8, q, fmt)
        held, f = (layout.pack(q, fmt), layout.split_format(fmt)) if split else (q, fmt)
        y = gemv_dp4a(x8, torch.from_numpy(held), f, n, tiles=tiles)
        tol = 2 * (K / 16 + 8) * U * t + K * 2.0 ** -149
        assert_within(y, ref, tol, f"gemv_dp4a m={m} n={n} K={K}")
    prop()


# split K's sums do not depend on the format: the quick tier takes the first formats with
# units and Q6_K (a 128-weight unit, a scale a 16), the full suite every one
QUICK_SPLIT = ("Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "Q4_K", "IQ3_XXS", "IQ3_S", "Q6_K")


@pytest.mark.parametrize("fmt", [f if f.name in QUICK_SPLIT else pytest.param(f, marks=pytest.mark.slow)
                                 for f in DOT_FORMATS], ids=lambda f: f.name)
def test_split_k_agrees_with_the_reference_and_repeats_its_bits(fmt):
    """K split over up to 5 programs a tile, summed in the launch: the same bound as one
    program (each split adds one rounding a row, well inside the K / 16 allowance), the
    same bits on a second call, and the per-tile counts back at zero."""
    unit_weights = UNITS[fmt.name].weights

    @given(nb=st.integers(1, 3), split=st.integers(2, 5), seed=st.integers(0, 2 ** 32 - 1),
           data=st.data())
    @settings(max_examples=examples(2), phases=NO_SHRINK)
    def prop(nb, split, seed, data):
        K = nb * fmt.block_elems
        m = data.draw(st.integers(1, 2), label="m")
        n = data.draw(st.integers(1, 9), label="n")
        q = data.draw(weights(fmt, n, nb), label="q")
        x8 = quantize_x_torch(gemv_x(np.random.default_rng(seed), m, K))
        ref, _, t = reference(x8, q, fmt)
        units = K // unit_weights
        tiles = (4, 1 if units < 8 else 2)  # 1-12 K steps: some splits get none
        y = gemv_dp4a(x8, torch.from_numpy(q), fmt, n, tiles=tiles, split=split)
        assert_within(y, ref, 2 * (K / 16 + 8) * U * t + K * 2.0 ** -149, f"split {split} n={n} K={K}")
        assert torch.equal(gemv_dp4a(x8, torch.from_numpy(q), fmt, n, tiles=tiles, split=split), y)
        assert all(not c.any() for c in int8._COUNTS.values())
    prop()


def test_split_k_fills_an_idle_gpu_and_nothing_else():
    assert split_for(tiles_n=64, steps=10, sms=132) == 3      # 64 programs: three ways
    assert split_for(tiles_n=8, steps=10, sms=132) == 10      # no more ways than steps
    assert split_for(tiles_n=2, steps=100, sms=132) == MAX_SPLIT
    assert split_for(tiles_n=512, steps=10, sms=132) == 1     # the GPU is full
    assert split_for(tiles_n=64, steps=1, sms=132) == 1       # one step: nothing to split
    assert split_for(tiles_n=64, steps=10, sms=None) == 1     # no GPU (the interpreter)
    fmt, x8 = quant.get("Q8_0"), quantize_x_torch(torch.ones((1, 64)))
    q = torch.zeros((2, 68), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q8_0: split must be an integer from 1 to 16, got 0"):
        gemv_dp4a(x8, q, fmt, 2, split=0)


@pytest.mark.parametrize("fmt", DOT_FORMATS, ids=lambda f: f.name)
def test_gemv_dp4a_torch_agrees_with_the_reference(fmt):
    @given(m=st.integers(1, 3), n=st.integers(1, 40), nb=st.integers(1, 3),
           seed=st.integers(0, 2 ** 32 - 1), data=st.data())
    @settings(max_examples=examples(25))
    def prop(m, n, nb, seed, data):
        K = nb * fmt.block_elems
        q = data.draw(weights(fmt, n, nb))
        x8 = quantize_x_torch(gemv_x(np.random.default_rng(seed), m, K))
        ref, s, _ = reference(x8, q, fmt)
        y = gemv_dp4a_torch(x8, torch.from_numpy(q), fmt, n)
        assert_within(y, ref, 2 * (K + 2) * U * s + K * 2.0 ** -149, "gemv_dp4a_torch")
        # flat weight bytes give the same product
        assert torch.equal(gemv_dp4a_torch(x8, torch.from_numpy(q.reshape(-1)), fmt, n), y)
    prop()


def test_gemv_dp4a_ragged_k_and_flat_weights():
    # K = 3 units with a step of 2 (masked last step) and of 8 (one masked step), and the
    # same weights flat: equal bits (the interpreter is deterministic)
    fmt = quant.get("Q4_0")
    rng = np.random.default_rng(3)
    q = fmt.quantize(rng.standard_normal((5, 96)).astype(np.float32))
    x8 = quantize_x(torch.from_numpy(rng.uniform(-1, 1, (2, 96)).astype(np.float32)))
    ref, _, t = reference(x8, q, fmt)
    tol = 2 * (96 / 16 + 8) * U * t
    for tiles in [(4, 2), (16, 8)]:
        y = gemv_dp4a(x8, torch.from_numpy(q), fmt, 5, tiles=tiles)
        assert_within(y, ref, tol, f"tiles {tiles}")
    assert torch.equal(gemv_dp4a(x8, torch.from_numpy(q.reshape(-1)), fmt, 5, tiles=(16, 8)), y)


@pytest.mark.parametrize("m,k,n", [
    pytest.param(2, 0, 3, id="K=0"),
    pytest.param(2, 64, 0, id="N=0"),
    pytest.param(0, 64, 3, id="M=0"),
])
@pytest.mark.parametrize("fn", [gemv_dp4a, gemv_dp4a_torch], ids=lambda f: f.__name__)
def test_gemv_dp4a_empty(fn, m, k, n):
    fmt = quant.get("Q8_0")
    x8 = Q8X(torch.zeros((m, k // 4), dtype=torch.int32), torch.zeros(m, k // 32), torch.zeros(m, k // 32))
    y = fn(x8, torch.zeros((n, k // 32 * fmt.block_bytes), dtype=torch.uint8), fmt, n)
    assert y.shape == (m, n) and y.dtype == torch.float32 and not y.any()


@pytest.mark.parametrize("fmt", OTHER_FORMATS, ids=lambda f: f.name)
def test_gemv_dp4a_rejects_formats_without_a_unit_decode(fmt):
    K = max(256, fmt.block_elems)
    x8 = quantize_x_torch(torch.ones(1, K))
    q = torch.zeros((2, K // fmt.block_elems * fmt.block_bytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"^{fmt.name}: no int8 unit decode for this format"):
        gemv_dp4a(x8, q, fmt, 2)


@pytest.mark.slow  # 7 kernels x 2 targets compiled in a child: about 20 s
def test_the_launches_that_quantize_what_they_write_compile_for_both_gpus():
    """On a GPU the hyper-connections' norms, reads and norming writes, the gates and DeltaNet's
    gated norm write their output's int8 form too (int8.attach); under the interpreter the
    engine asks none of them to (its tensors are on the CPU), so here each is called with
    `quantize` and compiled for sm_90 and gfx942 as a GPU would launch it: no error, no
    spill."""
    from triton_kernels.analysis.launches import compile_calls, record
    from triton_kernels.ops import impl
    r = np.random.default_rng(0)

    def t(*shape):
        return torch.from_numpy(r.standard_normal(shape).astype(np.float32))
    T, S, H, R, K, Hv, dv = 1, 4, 64, 8, 2, 2, 64
    with record() as calls:
        impl("hc_norm", "triton")(t(T, S * H), t(S, H), 1e-6, quantize=True)
        impl("hc_mix", "triton")(t(T, R + S), t(S * H, R), t(T, S * H), R, S, quantize=True)
        impl("hc_write_norm", "triton")(t(T, S * H), t(T, H), t(T, S), t(S, H), 1e-6, quantize=True)
        impl("hc_write_moe", "triton")(t(T, S * H), t(T, K, H), t(T, 1), t(T, H), t(T, S), t(S, H), 1e-6,
                                       quantize=True)
        impl("silu_mul", "triton")(t(T, H), t(T, H), quantize=True)
        impl("sigmoid_mul", "triton")(t(T, H), t(T, H), quantize=True)
        impl("deltanet_gated_norm", "triton")(t(T, Hv, dv), t(T, Hv * dv), t(dv), 1e-6, quantize=True)
    results = compile_calls(calls, ("sm_90", "gfx942"))
    assert not [r for r in results if r.problems], [(r.kernel, r.target, r.problems) for r in results]
    assert {(r.kernel, r.target) for r in results} >= {
        (k, g) for k in ("_norm_kernel", "_mix_kernel", "_write_norm_kernel", "_write_moe_kernel",
                         "_silu_mul_kernel", "_gated_norm_kernel") for g in ("sm_90", "gfx942")}
    assert all("'QUANT': True" in r.constexprs for r in results), [r.constexprs for r in results]
