"""MoE: routing against transformers' router, the alignment's invariants, and the expert
matmuls (both Triton kernels through the interpreter, and moe_torch) against a float64
per-expert loop over the numpy codec's weights, for every format.

Reference: for each expert hit, W = fmt.dequantize(blocks) (the numpy codec, which the
decode functions and dequantize_torch match bit for bit), then in float64 with x's exact
values: g = x W_g^T, u = x W_u^T, h = silu(g) u, y_slot = w (h W_d^T), y = sum over the
k slots. A float64 reference leaves all the rounding to the side under test, so the bound
below is one-sided (an fp32 reference would need it twice).

Tolerance, elementwise, propagated through the same steps with u = 2^-24 and, as in
test_qmatmul, gamma(n) = 2 (n + 2) u for a float32 sum of n products in any order (Higham
3.1: gamma_n = n u / (1 - n u) < 1.0001 n u at these sizes; the factor 2 is margin):

    dg = gamma(H) |x| |W_g|^T              du likewise          (kernel 1's dots)
    ds = 1.1 dg + 8 u (|silu(g)| + 1.1 dg)  |silu'| <= 1.0999; exp, 1 +, /, * round
    dh = (1 + u) (|silu(g)| du + (|u| + du) ds) + u |h|
    dy_slot = (1 + u) |w| (dh |W_d|^T + gamma(I) (|h| + dh) |W_d|^T) + u |y_slot|
    dy = sum dy_slot + gamma(k) sum (|y_slot| + dy_slot)        (the sum over k)

and a float16 (bfloat16) result adds its final rounding: 2^-11 (2^-8) relative, 2^-25
absolute among the subnormals. The interpreter runs no FMA contraction and its tl.dot
takes float32 inputs ("ieee"); on a GPU the dots round x, the weights and h to x's dtype
(tf32 for float32 x), a looser bound these tests do not check.

Ranges: scales chosen so that |weight| <= 1/16 (test_qmatmul's bounds, which give 64,
divided by 1024) and x in [-1, 1] keep g, u and h moderate; the routing weights, drawn in
[0, 1/k], are then scaled by a power of two so that sum_j |w_j| |h| |W_d|^T, a bound on
|y|, lies in (2^13, 2^14]: float16 results fill their normal range and stay finite.
(Without it the cubic SwiGLU path gives |y| near 1e-4..1e-6, float16 subnormals.)

Sizes stay small because the interpreter is slow: its cost goes with the weights an
example decodes (the tl.dot path: about 0.1 s an expert of a 256-weight format, H = I =
256) or with the slots (the dp4a path: a program or two a slot, 0.05-0.1 s each). So
256-weight formats take H in {256, 512}, I = 256 and up to two experts, 32-weight ones
H, I in {32, 64, 96} and up to four, the float formats any size; a few tokens, and now and
then a slot marked -1. Each property runs EXAMPLES examples a format. The routing cases
(empty experts, one expert for all, top_k = E, one token, ragged blocks) are also tested
by name with cheap formats.
"""
import importlib
import math
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers import examples

import quant
from tests.blocks import has_scales
from triton_kernels import layout, moe, moe_align_block_size, moe_align_block_size_torch, moe_torch, route
from triton_kernels.backend import interpreter_on
from triton_kernels.decode import UNITS
from triton_kernels.layout.split import has_split
from triton_kernels.moe import route_torch

FORMATS = list(quant.FORMATS.values())
U = 2.0 ** -24
# test_qmatmul's scale bounds give |w| <= 64; 1024 times smaller gives |w| <= 1/16
SCALE_BOUND = {"Q4_K": 2.0 ** -4, "Q5_K": 2.0 ** -5, "Q6_K": 2.0 ** -6, "IQ4_XS": 2.0 ** -6}
# gate, up, down: the real model's mix is in test_edge_cases_with_the_real_models_formats
MIXES = [("IQ3_S", "IQ3_XXS", "Q4_K"), ("Q4_0", "Q8_0", "IQ4_NL"), ("Q8_0", "IQ4_NL", "IQ3_S")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def gamma(n: int) -> float:
    return 2 * (n + 2) * U


def quantized(fmt, shape: tuple, rng) -> np.ndarray:
    """uint8 (*shape[:-1], row bytes) of random blocks with |weight| <= 1/16: free bytes
    and scales uniform in the format's bound; float formats quantize uniform weights.
    Drawn from a seed: the tensors are too large for Hypothesis' own byte buffer."""
    *lead, cols = shape
    if not has_scales(fmt):
        return fmt.quantize(rng.uniform(-1 / 16, 1 / 16, shape).astype(np.float32))
    n = math.prod(lead) * cols // fmt.block_elems
    arr = rng.integers(0, 256, (n, fmt.block_bytes), dtype=np.uint8)
    bound = SCALE_BOUND.get(fmt.name, 1 / 8) / 1024
    for off in fmt.scale_offsets:
        d = rng.uniform(-bound, bound, n).astype(np.float16)
        arr[:, off:off + 2] = d.view(np.uint8).reshape(n, 2)
    if fmt.write_scale is not None:
        fmt.write_scale(arr, rng.uniform(-bound, bound, n).astype(np.float16))
    return arr.reshape(*lead, cols // fmt.block_elems * fmt.block_bytes)


def swiglu(xe, Wg, Wu):
    """(h, dh), float64: silu(x W_g^T) (x W_u^T) and the float32 error bound of the kernel's
    h (the docstring's dg, du, ds, dh)."""
    H = xe.shape[1]
    g, up = xe @ Wg.T, xe @ Wu.T
    dg = gamma(H) * (xe.abs() @ Wg.abs().T)
    du = gamma(H) * (xe.abs() @ Wu.abs().T)
    s = torch.nn.functional.silu(g)
    ds = 1.1 * dg + 8 * U * (s.abs() + 1.1 * dg)
    h = s * up
    return h, (1 + U) * (s.abs() * du + (up.abs() + du) * ds) + U * h.abs()


def slot_terms(x, wg, wu, wd, fmts, ids):
    """Per slot, for a routing weight of one, float64 (T, k, H): the expert's output
    h W_d^T, its absolute sum |h| |W_d|^T, and its error bound (the docstring's dy_slot
    before the weight); zero for slots whose id is -1."""
    fg, fu, fd = fmts
    T, H = x.shape
    xd = torch.from_numpy(x.double().numpy())
    y1, a1, e1 = (torch.zeros((T, ids.shape[1], H), dtype=torch.float64) for _ in range(3))
    idn = ids.numpy()
    for e in np.unique(idn[idn >= 0]):
        t, j = np.nonzero(idn == e)
        Wg, Wu, Wd = (torch.from_numpy(f.dequantize(w[e])).double()
                      for f, w in ((fg, wg), (fu, wu), (fd, wd)))
        h, dh = swiglu(xd[t], Wg, Wu)
        y1[t, j] = h @ Wd.T
        a1[t, j] = h.abs() @ Wd.abs().T
        e1[t, j] = dh @ Wd.abs().T + gamma(Wg.shape[0]) * (a1[t, j] + dh @ Wd.abs().T)
    return y1, a1, e1


def reference(terms, weights):
    """(ref, bound), both (T, H): the float64 sum over the k slots and the error bound."""
    y1, _, e1 = terms
    w = weights.double()[:, :, None]
    y = w * y1
    dy = (1 + U) * w.abs() * e1 + U * y.abs()
    return y.sum(1), dy.sum(1) + gamma(y.shape[1]) * (y.abs() + dy).sum(1)


def scaled(weights, terms):
    """weights times the power of two (exact) that brings max over tokens of
    sum_j |w_j| |h| |W_d|^T, which bounds |y|, into (2^13, 2^14]: float16 results then
    fill its normal range without overflowing."""
    a = float((weights.double()[:, :, None].abs() * terms[1]).sum(1).max()) if weights.numel() else 0.0
    if a == 0:
        return weights
    return weights * 2.0 ** min(60, max(-60, math.floor(math.log2(2 ** 14 / a))))


def assert_close(y, ref, bound, dtype, what: str):
    assert y.dtype == dtype and y.shape == ref.shape, f"{what}: {y.dtype} {tuple(y.shape)}"
    if dtype == torch.float16:
        bound = bound + 2.0 ** -11 * (ref.abs() + bound) + 2.0 ** -25
    elif dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (ref.abs() + bound) + 2.0 ** -133
    err = (y.double() - ref).abs()
    bad = ~(err <= bound)  # NaN counts as bad
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outputs off; worst err "
                           f"{err[bad].max().item():.3g} vs bound {bound[bad].min().item():.3g}")


def make(fmts, E, H, I, T, seed, dtype=torch.float32):
    rng = np.random.default_rng(seed)
    fg, fu, fd = fmts
    wg, wu = quantized(fg, (E, I, H), rng), quantized(fu, (E, I, H), rng)
    wd = quantized(fd, (E, H, I), rng)
    x = torch.from_numpy(rng.uniform(-1, 1, (T, H)).astype(np.float32)).to(dtype)
    return x, wg, wu, wd, rng


def check(fmts, x, wg, wu, wd, weights, ids, tiles=None):
    """moe (interpreter) and moe_torch both within the bound of the float64 loop, for the
    routing weights scaled by a power of two (see scaled)."""
    terms = slot_terms(x, wg, wu, wd, fmts, ids)
    weights = scaled(weights, terms)
    ref, bound = reference(terms, weights)
    args = (torch.from_numpy(wg), torch.from_numpy(wu), torch.from_numpy(wd), *fmts, weights, ids)
    # the float bound is the dot path's; the dp4a path (int8 x and h) has its own test below
    assert_close(moe(x, *args, tiles=tiles, path="dot"), ref, bound, x.dtype, "moe")
    assert_close(moe_torch(x, *args), ref, bound, x.dtype, "moe_torch")


def routing_weights(rng, T, k):
    return torch.from_numpy(rng.uniform(0, 1 / k, (T, k)).astype(np.float32))


def sizes(fmt):
    if fmt.block_elems == 256:
        return st.sampled_from([256, 512]), st.just(256)
    if fmt.block_elems == 32:
        return st.sampled_from([32, 64, 96]), st.sampled_from([32, 64, 96])
    return st.integers(1, 48), st.integers(1, 40)


def tile_choices(fmt):
    """Tiles whose K step is shorter than a block (16 of 32 weights, 128 of 256), tiles
    whose step spans blocks, ragged last tiles (H or I of 96, a float format's odd sizes)
    and, except for the 256-weight formats, the defaults."""
    if fmt.block_elems == 256:
        # the interpreter's time goes with the number of tile operations: 256-wide tiles
        # run a 256-weight format fastest; the defaults are checked on the cheaper formats
        return [(16, 128, 128), (16, 256, 256)]
    return [None, (16, 64, 16), (32, 32, 64)]


@st.composite
def routings(draw, E: int, max_t: int):
    """(T, k) ids, k distinct experts per token as top-k gives; sometimes every token
    takes the same experts (one expert for all, most experts empty), sometimes one slot
    is -1 (an expert another rank holds: it contributes nothing)."""
    T = draw(st.integers(1, max_t))
    k = draw(st.integers(1, E))
    pick = st.permutations(range(E)).map(lambda p: p[:k])
    rows = [draw(pick)] * T if draw(st.booleans()) else draw(st.lists(pick, min_size=T, max_size=T))
    ids = torch.tensor(rows, dtype=torch.int32)
    if draw(st.integers(0, 3)) == 0:
        ids[draw(st.integers(0, T - 1)), draw(st.integers(0, k - 1))] = -1
    return ids


# examples of each property a format (a fresh draw each run outside CI, whose profile is
# derandomised)
EXAMPLES = 25
# the quick tier's dp4a formats (every one, and the mixes, in the full suite)
QUICK_DP4A = ("Q4_0", "IQ3_XXS")


def test_the_interpreter_is_on():
    assert interpreter_on()  # else moe() and route() on CPU tensors would test the torch path


# --- the expert matmuls --------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kernel_and_torch_agree_with_the_reference(fmt):
    H_st, I_st = sizes(fmt)
    big = fmt.block_elems == 256

    @given(E=st.integers(1, 2 if big else 4), H=H_st, I=I_st, dtype=st.sampled_from(DTYPES),
           tiles=st.sampled_from(tile_choices(fmt)), seed=st.integers(0, 2 ** 32 - 1), data=st.data())
    @settings(max_examples=examples(EXAMPLES))
    def prop(E, H, I, dtype, tiles, seed, data):
        ids = data.draw(routings(E, 3 if big else 6))
        fmts = (fmt, fmt, fmt)
        x, wg, wu, wd, rng = make(fmts, E, H, I, ids.shape[0], seed, dtype)
        check(fmts, x, wg, wu, wd, routing_weights(rng, *ids.shape), ids, tiles)
    prop()


@pytest.mark.parametrize("names", MIXES, ids="-".join)
def test_gate_up_and_down_in_different_formats(names):
    fmts = tuple(quant.get(n) for n in names)
    H = max(f.block_elems for f in fmts[:2])
    I = fmts[2].block_elems
    x, wg, wu, wd, rng = make(fmts, 4, H, I, 5, seed=len(names[0]) + I)
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [1, 0], [2, 3]], dtype=torch.int32)
    tiles = (16, 128, 128) if H == 256 else None  # as tile_choices, for the interpreter's sake
    check(fmts, x, wg, wu, wd, routing_weights(rng, 5, 2), ids, tiles)


CHEAP = tuple(quant.get(n) for n in ("Q4_0", "Q8_0", "IQ4_NL"))
CASES = {
    # E, T, ids (one row per token), BLOCK_M
    "experts_without_tokens": (8, 5, [[2, 5]] * 3 + [[5, 2]] * 2, 16),
    "one_expert_takes_every_token": (8, 9, [[3]] * 9, 16),
    "one_expert_in_every_token": (4, 6, [[0, 1], [2, 0], [0, 3], [1, 0], [0, 2], [3, 0]], 16),
    "top_k_equals_the_expert_count": (4, 3, [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]], 16),
    "a_single_token": (8, 1, [[6, 1, 4]], 16),
    "slots_not_a_multiple_of_block_m": (5, 7, [[i % 5, (i + 2) % 5, (i + 4) % 5] for i in range(7)], 16),
    "an_expert_over_two_blocks": (2, 17, [[0, 1]] * 17, 16),
    "blocks_of_32": (3, 9, [[i % 3, (i + 1) % 3] for i in range(9)], 32),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_routing_edge_cases(case):
    E, T, rows, block_m = CASES[case]
    ids = torch.tensor(rows, dtype=torch.int32)
    x, wg, wu, wd, rng = make(CHEAP, E, 64, 32, T, seed=T)
    # BLOCK_K = 64 > I = 32: the down kernel's one K step is ragged
    check(CHEAP, x, wg, wu, wd, routing_weights(rng, T, ids.shape[1]), ids, tiles=(block_m, 32, 64))


def test_edge_cases_with_the_real_models_formats():
    fmts = tuple(quant.get(n) for n in ("IQ3_XXS", "IQ3_XXS", "IQ4_XS"))
    x, wg, wu, wd, rng = make(fmts, 3, 256, 256, 1, seed=3)
    ids = torch.tensor([[2, 0, 1]], dtype=torch.int32)  # one token, top_k = E
    check(fmts, x, wg, wu, wd, routing_weights(rng, 1, 3), ids, tiles=(16, 128, 128))


def test_experts_marked_minus_one_are_skipped():
    x, wg, wu, wd, rng = make(CHEAP, 4, 32, 32, 4, seed=7)
    ids = torch.tensor([[0, -1], [-1, 2], [3, 0], [-1, -1]], dtype=torch.int32)
    weights = routing_weights(rng, 4, 2)
    check(CHEAP, x, wg, wu, wd, weights, ids)
    args = (torch.from_numpy(wg), torch.from_numpy(wu), torch.from_numpy(wd), *CHEAP, weights, ids)
    assert not moe(x, *args)[3].any() and not moe_torch(x, *args)[3].any()


def test_no_tokens():
    x, wg, wu, wd, _ = make(CHEAP, 4, 32, 32, 0, seed=0)
    args = (torch.from_numpy(wg), torch.from_numpy(wu), torch.from_numpy(wd), *CHEAP,
            torch.zeros((0, 2)), torch.zeros((0, 2), dtype=torch.int32))
    assert moe(x, *args).shape == moe_torch(x, *args).shape == (0, 32)


@pytest.mark.parametrize("fn", [moe, moe_torch])
def test_fused_gate_up_and_strided_experts_need_no_copy(fn):
    """gate and up as the halves of one (E, 2I, row bytes) tensor, and every other expert
    of a larger tensor: views with expert strides of 2I rows and 2 experts."""
    fmt = quant.get("IQ4_NL")
    rng = np.random.default_rng(5)
    E, H, I, T = 3, 64, 32, 6
    fused = torch.from_numpy(quantized(fmt, (2 * E, 2 * I, H), rng))[::2]
    down = torch.from_numpy(quantized(fmt, (2 * E, H, I), rng))[1::2]
    gate, up = fused[:, :I], fused[:, I:]
    assert not gate.is_contiguous() and not down.is_contiguous()
    x = torch.from_numpy(rng.uniform(-1, 1, (T, H)).astype(np.float32))
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [2, 0], [1, 2], [0, 1]], dtype=torch.int32)
    weights = routing_weights(rng, T, 2)
    want = fn(x, gate.contiguous(), up.contiguous(), down.contiguous(), fmt, fmt, fmt, weights, ids)
    # the interpreter and torch are deterministic: the same computation gives the same bits
    assert torch.equal(fn(x, gate, up, down, fmt, fmt, fmt, weights, ids), want)


def test_cpu_tensors_without_the_interpreter_take_the_torch_path(monkeypatch):
    x, wg, wu, wd, rng = make(CHEAP, 4, 32, 32, 3, seed=1)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    args = (torch.from_numpy(wg), torch.from_numpy(wu), torch.from_numpy(wd), *CHEAP,
            routing_weights(rng, 3, 2), ids)
    logits = torch.from_numpy(rng.standard_normal((3, 4)).astype(np.float32))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch.equal(moe(x, *args), moe_torch(x, *args))
    for a, b in zip(route(logits, 2), route_torch(logits, 2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fn", [moe, moe_torch])
def test_bad_input_raises_value_error_naming_the_tensor(fn):
    fmt = quant.get("Q4_0")
    wg = torch.zeros((4, 32, 36), dtype=torch.uint8)   # E=4, I=32, H=64
    wd = torch.zeros((4, 64, 18), dtype=torch.uint8)
    x = torch.zeros((2, 64))
    w, ids = torch.full((2, 2), 0.5), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"moe: w_down \(Q4_0\) has shape \(4, 32, 18\), expected \(4, 64, 18\)"):
        fn(x, wg, wg, wd[:, :32], fmt, fmt, fmt, w, ids)
    with pytest.raises(ValueError, match=r"moe: w_up \(Q8_0\) has shape \(4, 32, 34\), expected \(4, 32, 68\)"):
        fn(x, wg, torch.zeros((4, 32, 34), dtype=torch.uint8), wd, fmt, "Q8_0", fmt, w, ids)
    with pytest.raises(ValueError, match=r"moe: w_up: Q4_1: 36 bytes per row is not a whole number of blocks"):
        fn(x, wg, wg, wd, fmt, "Q4_1", fmt, w, ids)
    with pytest.raises(ValueError, match=r"moe: w_gate \(Q4_0\) rows of 40 weights are not whole 32-weight blocks"):
        fn(torch.zeros((2, 40)), wg, wg, wd, fmt, fmt, fmt, w, ids)
    with pytest.raises(ValueError, match=r"moe: ids must lie in \[0, 4\) \(or be -1 .*\), got 1\.\.4"):
        fn(x, wg, wg, wd, fmt, fmt, fmt, w, ids + 1)
    with pytest.raises(ValueError, match=r"moe: weights must have the shape of ids \(2, 2\), got \(2, 3\)"):
        fn(x, wg, wg, wd, fmt, fmt, fmt, torch.zeros((2, 3)), ids)
    with pytest.raises(ValueError, match=r"moe: x must be float32, float16 or bfloat16, got torch.int32"):
        fn(x.int(), wg, wg, wd, fmt, fmt, fmt, w, ids)
    with pytest.raises(ValueError, match=r"moe: w_gate: Q4_0: quantized data must be a uint8 tensor"):
        fn(x, wg.float(), wg, wd, fmt, fmt, fmt, w, ids)


def test_rows_that_are_not_whole_blocks_apart_are_refused():
    fmt = quant.get("Q4_0")
    base = torch.zeros((4, 32, 37), dtype=torch.uint8)
    wg = base[:, :, :36]  # rows 37 bytes apart: not whole 18-byte blocks
    with pytest.raises(ValueError, match=r"moe: w_gate \(Q4_0\): rows must be contiguous .* pass w.contiguous\(\)"):
        moe(torch.zeros((2, 64)), wg, wg.contiguous(), torch.zeros((4, 64, 18), dtype=torch.uint8),
            fmt, fmt, fmt, torch.full((2, 1), 1.0), torch.zeros((2, 1), dtype=torch.int32))


# --- routing -----------------------------------------------------------------------------

def transformers_router(logits: torch.Tensor, top_k: int, norm: bool):
    """Qwen4ExpTextTopKRouter itself, its linear layer made the identity (hidden = E)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextTopKRouter
    E = logits.shape[1]
    cfg = types.SimpleNamespace(num_experts_per_tok=top_k, num_experts=E, norm_topk_prob=norm,
                                hidden_size=E)
    router = Qwen4ExpTextTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        _, scores, indices = router(logits)
    return scores, indices


@st.composite
def logit_rows(draw):
    """(T, E) float32 logits; sometimes from a few values only, so that ties occur."""
    E = draw(st.integers(1, 64))
    T = draw(st.integers(1, 9))
    values = (st.sampled_from([-1.0, 0.0, 0.5, 3.0]) if draw(st.booleans())
              else st.floats(-30, 30, width=32))
    rows = draw(st.lists(st.lists(values, min_size=E, max_size=E), min_size=T, max_size=T))
    return torch.tensor(rows, dtype=torch.float32)


@given(logits=logit_rows(), k_frac=st.floats(0, 1), norm=st.booleans())
@settings(max_examples=examples(40))
def test_route_matches_transformers_router(logits, k_frac, norm):
    T, E = logits.shape
    # k up to the real model's 10 (the kernel unrolls its k steps: the interpreter pays
    # for each), and top_k = E whenever E <= 10
    k = 1 + int(k_frac * (min(E, 10) - 1))
    ref_w, ref_ids = transformers_router(logits, k, norm)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    # Both sides start from the same float32 logits, and l - max is the same operation on
    # each; exp errs by at most 2 ulp (numpy's and torch's vectorised float32 exp), then
    # the sum over E, the divide, the sum over k and the renormalising divide: each
    # weight is within (E + k + 8) u of the exact value, relative, so the two are within
    # twice that; rtol doubles it again as margin.
    rtol = 4 * (E + k + 8) * U
    for f in (route, route_torch):
        hits = torch.arange(E, dtype=torch.int64)  # a tally counted on: each slot adds one
        weights, ids = f(logits, k, norm, hits=hits)
        assert torch.equal(hits, torch.arange(E) + torch.bincount(ids.reshape(-1).long(), minlength=E))
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32
        assert weights.shape == ids.shape == (T, k)
        assert ((ids >= 0) & (ids < E)).all()
        assert all(len(set(r)) == k for r in ids.tolist())
        # the chosen experts' probabilities are the top k, highest first: equal ids up to
        # ties (whose order and choice at the k-th place are free, as in torch.topk)
        top = torch.sort(probs, dim=-1, descending=True).values
        assert torch.allclose(probs.gather(1, ids.long()), top[:, :k], rtol=rtol, atol=0)
        assert torch.allclose(weights, ref_w, rtol=rtol, atol=0)
        for t in range(T):
            p = top[t, :k + 1]
            if not (p[:-1] - p[1:] <= rtol * p[:-1]).any():  # no near ties in this row
                assert ids[t].tolist() == ref_ids[t].tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_route_takes_half_logits_in_float32(dtype):
    logits = torch.randn((5, 16), generator=torch.Generator().manual_seed(0)).to(dtype)
    for fn in (route, route_torch):
        got, want = fn(logits, 4), fn(logits.float(), 4)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_route_minus_infinity_and_nan():
    # masked experts (-inf) are chosen last, and only when k demands them
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    for fn in (route, route_torch):
        w, ids = fn(logits, 3)
        assert ids[0, :2].tolist() == [2, 0] and ids[0, 2] in (1, 3)
        assert w[0, 2] == 0 and torch.allclose(w.sum(), torch.tensor(1.0))
    # a NaN logit: the ids stay distinct experts, the weights NaN (the fault shows)
    for fn in (route, route_torch):
        w, ids = fn(torch.tensor([[0.0, float("nan"), 1.0, 2.0]]), 2)
        assert len(set(ids[0].tolist())) == 2 and ((ids >= 0) & (ids < 4)).all() and w.isnan().all()


def test_route_bad_input():
    with pytest.raises(ValueError, match=r"route: top_k=5 must be between 1 and the 4 experts"):
        route(torch.zeros((2, 4)), 5)
    with pytest.raises(ValueError, match=r"route: logits must be a \(tokens, experts\) tensor, got \(4,\)"):
        route(torch.zeros(4), 1)


# --- alignment ---------------------------------------------------------------------------

ALIGNS = {"triton": moe_align_block_size, "torch": moe_align_block_size_torch}


@pytest.mark.parametrize("impl", ALIGNS)
@given(E=st.integers(1, 12), T=st.integers(0, 20), k=st.integers(1, 4),
       block_m=st.sampled_from([1, 2, 4, 16, 64]), data=st.data())
@settings(max_examples=examples(100))
def test_align_groups_every_slot_once_in_blocks_of_one_expert(impl, E, T, k, block_m, data):
    """The one-program kernel (at most ALIGN_MAX_SLOTS slots: T * k <= 80 here) and the
    torch version each against the definition."""
    ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, E - 1), min_size=k, max_size=k),
                                          min_size=T, max_size=T)), dtype=torch.int32).reshape(T, k)
    sorted_ids, expert_ids, n_post = ALIGNS[impl](ids, E, block_m)
    n = T * k
    flat = ids.reshape(-1).tolist()
    counts = [flat.count(e) for e in range(E)]
    length = n + min(E, n) * (block_m - 1)
    assert sorted_ids.dtype == expert_ids.dtype == n_post.dtype == torch.int32
    assert sorted_ids.shape == (length,) and expert_ids.shape == (-(-length // block_m),)
    used = int(n_post[0])
    # each expert's group is padded to the next multiple of block_m, no more
    assert used == sum(-(-c // block_m) * block_m for c in counts) <= length
    groups = sorted_ids[:used].reshape(-1, block_m).tolist() if used else []
    blocks = expert_ids.tolist()
    # a block holds one expert's slots, ascending, then sentinels; experts ascend
    assert blocks[:len(groups)] == sorted(blocks[:len(groups)])
    for e, block in zip(blocks, groups):
        live = [s for s in block if s != n]
        assert 0 <= e < E and live and block == live + [n] * (block_m - len(live))
        assert all(flat[s] == e for s in live) and live == sorted(live)
    # experts without tokens own no block; the tail is sentinel and -1
    assert [blocks[:len(groups)].count(e) for e in range(E)] == [-(-c // block_m) for c in counts]
    assert all(b == -1 for b in blocks[len(groups):])
    assert (sorted_ids[used:] == n).all()
    # every slot with an expert id in range appears exactly once; -1 slots never
    live = sorted(s for s in sorted_ids.tolist() if s != n)
    assert live == [s for s in range(n) if flat[s] >= 0]


@given(E=st.integers(1, 600), n=st.integers(1, 128), block_m=st.sampled_from([1, 16, 64]),
       out_of_range=st.integers(0, 3), seed=st.integers(0, 2 ** 32 - 1), dtype=st.sampled_from([torch.int32, torch.int64]))
@settings(max_examples=examples(60))
def test_the_align_kernel_gives_the_torch_tensors(E, n, block_m, out_of_range, seed, dtype):
    """Up to ALIGN_MAX_SLOTS slots over as many experts as Flash-Next's 512 and more, ids out
    of range on both sides (dropped): the same three tensors, bit for bit."""
    from triton_kernels.moe_align import ALIGN_MAX_SLOTS
    assert n <= ALIGN_MAX_SLOTS
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-out_of_range, E + out_of_range, (n,), generator=g, dtype=dtype)
    rows = torch.full((n, 1 + seed % 80), float("nan"))  # per-slot rows: the left-out ones zeroed
    got, want = moe_align_block_size(ids, E, block_m, zero_rows=rows), moe_align_block_size_torch(ids, E, block_m)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), (ids, a, b)
    dropped = (ids < 0) | (ids >= E)
    assert bool((rows[dropped] == 0).all()) and bool(rows[~dropped].isnan().all())


def test_align_matches_vllms_documented_example():
    # vLLM's moe_align_block_size docstring: experts 1..4 of 5, block size 4
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, expert_ids, n_post = moe_align_block_size(ids, 5, 4)
    assert int(n_post[0]) == 16
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert expert_ids[:4].tolist() == [1, 2, 3, 4] and (expert_ids[4:] == -1).all()


def test_align_bad_input():
    with pytest.raises(ValueError, match=r"moe_align_block_size: ids must be an integer tensor, got torch.float32"):
        moe_align_block_size(torch.zeros((2, 2)), 4, 16)
    with pytest.raises(ValueError, match=r"moe_align_block_size: block_m must be >= 1, got 0"):
        moe_align_block_size(torch.zeros((2, 2), dtype=torch.int32), 4, 0)


# --- the dp4a decode path -------------------------------------------------------------------
# x and h rounded to int8 per 32 values (triton_kernels.int8.quantize_x), then one GEMV a
# slot. Reference in float64 through the same roundings: x̂ = quantize_x_torch(x) (the
# kernel's quantize_x gives the same bits, test_int8.py), g = x̂ W_g^T, u = x̂ W_u^T,
# h = silu(g) u, ĥ = quantize_x_torch(h), y_slot = ĥ W_d^T. The kernel's h differs from
# the float64 one by at most dh (the bound of the dot path above, with x̂ for x), so its
# ĥ lies within d + 2 max(dh) of the reference's at each element (each within half a step
# of its own h; the steps d, d' = max|h| / 127 differ by max(dh) / 127): the down
# product's error is that times |W_d|, plus its own float32 sum, gamma(I) (|ĥ| + Δĥ) |W_d|^T.

DP4A_FORMATS = [quant.get(n) for n in ("Q8_0", "Q4_0", "IQ4_NL", "Q4_K", "IQ3_XXS", "IQ3_S")]


def dp4a_reference(x, wg, wu, wd, fmts, ids, weights):
    from triton_kernels.int8 import quantize_x_torch
    fg, fu, fd = fmts
    T, H = x.shape
    xh = quantize_x_torch(x.float()).dequantize().double()
    k = ids.shape[1]
    y1, e1 = (torch.zeros((T, k, H), dtype=torch.float64) for _ in range(2))
    idn = ids.numpy()
    for e in np.unique(idn[idn >= 0]):
        t, j = np.nonzero(idn == e)
        Wg, Wu, Wd = (torch.from_numpy(f.dequantize(w[e])).double()
                      for f, w in ((fg, wg), (fu, wu), (fd, wd)))
        h, dh = swiglu(xh[t], Wg, Wu)
        q = quantize_x_torch(h.float())
        hh = q.dequantize().double()
        I = h.shape[1]
        d = q.d.double().repeat_interleave(32, dim=1)
        dh_max = dh.view(len(t), I // 32, 32).amax(dim=2).repeat_interleave(32, dim=1)
        dhh = 1.001 * d + 2 * dh_max
        y1[t, j] = hh @ Wd.T
        e1[t, j] = dhh @ Wd.abs().T + gamma(I) * ((hh.abs() + dhh) @ Wd.abs().T)
    return reference((y1, None, e1), weights)


@pytest.mark.parametrize("fmts", [(f, f, f) if f.name in QUICK_DP4A else pytest.param((f, f, f), marks=pytest.mark.slow)
                                  for f in DP4A_FORMATS] + [
    pytest.param(tuple(quant.get(n) for n in names), marks=pytest.mark.slow) for names in MIXES],
    ids=lambda fs: "-".join(f.name for f in fs))
def test_dp4a_path_agrees_with_the_rounded_reference(fmts):
    big = max(f.block_elems for f in fmts) == 256

    # The interpreter's time goes with the number of programs, each slot's own: wide
    # tiles (one or two programs a slot) for the 256-weight formats, the defaults (16
    # rows) or one program a slot on small sizes; K of 96 against steps of 64 or 512 takes
    # the masked path, 96 rows against 128 a partial tile.
    @given(E=st.integers(1, 3), H=st.sampled_from([256, 512] if big else [64, 96]),
           I=st.sampled_from([256] if big else [64, 96]), T=st.integers(1, 2),
           dtype=st.sampled_from(DTYPES),
           tiles=st.sampled_from([(256, 512)] if big else [None, (128, 64)]),
           seed=st.integers(0, 2 ** 32 - 1), data=st.data())
    @settings(max_examples=examples(EXAMPLES))
    def prop(E, H, I, T, dtype, tiles, seed, data):
        k = data.draw(st.integers(1, E))
        rows = [data.draw(st.permutations(range(E)))[:k] for _ in range(T)]
        ids = torch.tensor(rows, dtype=torch.int32)
        if data.draw(st.booleans()):
            ids[data.draw(st.integers(0, T - 1)), 0] = -1  # an expert another rank holds: nothing
        x, wg, wu, wd, rng = make(fmts, E, H, I, T, seed, dtype)
        weights = routing_weights(rng, T, k)
        ref, bound = dp4a_reference(x, wg, wu, wd, fmts, ids, weights)
        # the split device layout (triton_kernels.layout) where a format has one: every
        # expert's slab here is whole tiles of four blocks
        held = [(w, f) for w, f in zip((wg, wu, wd), fmts)]
        if data.draw(st.booleans(), label="split"):
            held = [(layout.pack(w, f), layout.split_format(f)) if has_split(f) else (w, f) for w, f in held]
        args = (*(torch.from_numpy(w) for w, _ in held), *(f for _, f in held), weights, ids)
        assert_close(moe(x, *args, tiles=tiles, path="dp4a"), ref, bound, x.dtype, "moe dp4a")
    prop()


# the unit formats DP4A_FORMATS leaves out, each alone, and a mix of a scale a 16 with Q6_K's
# ZERO (gate), a scale and a minimum a 16 (up: x's sums a 16 by dp4a) and a ZERO a 32 (down)
OTHER_DP4A = [(f, f, f) for f in (quant.get(n) for n in UNITS) if f not in DP4A_FORMATS] + [
    tuple(quant.get(n) for n in ("Q6_K", "Q2_K", "Q5_0"))]


@pytest.mark.slow
@pytest.mark.parametrize("fmts", OTHER_DP4A, ids=lambda fs: "-".join(f.name for f in fs))
def test_dp4a_path_of_the_other_unit_formats_agrees_with_the_rounded_reference(fmts):
    """The other formats' units (per 16 or 32 weights, ZERO, minimums, grids), GGUF order or
    split, at the smallest sizes their blocks allow (the interpreter's time goes with the
    programs): the bound of test_dp4a_path_agrees_with_the_rounded_reference."""
    big = max(f.block_elems for f in fmts) == 256

    @given(E=st.integers(1, 2), dtype=st.sampled_from(DTYPES), split=st.booleans(),
           seed=st.integers(0, 2 ** 32 - 1), data=st.data())
    @settings(max_examples=examples(4))
    def prop(E, dtype, split, seed, data):
        k = data.draw(st.integers(1, E))
        ids = torch.tensor([data.draw(st.permutations(range(E)))[:k]], dtype=torch.int32)
        H, I = (256, 256) if big else (64, 96)
        x, wg, wu, wd, rng = make(fmts, E, H, I, 1, seed, dtype)
        weights = routing_weights(rng, 1, k)
        ref, bound = dp4a_reference(x, wg, wu, wd, fmts, ids, weights)
        held = [(w, f) for w, f in zip((wg, wu, wd), fmts)]
        if split:
            held = [(layout.pack(w, f), layout.split_format(f)) if has_split(f) else (w, f) for w, f in held]
        args = (*(torch.from_numpy(w) for w, _ in held), *(f for _, f in held), weights, ids)
        tiles = (256, 512) if big else None
        assert_close(moe(x, *args, tiles=tiles, path="dp4a"), ref, bound, x.dtype, "moe dp4a")
    prop()


@pytest.mark.parametrize("fmt", ["Q8_0", "IQ4_NL"])
def test_gate_up_programs_of_whole_groups_write_h_as_quantize_x_would(fmt, monkeypatch):
    """With BLOCK_N a multiple of 32 the gate/up programs write h's int8 form themselves
    (no float h, no quantize_x launch of it); with 16 rows a program, h goes through
    quantize_x. A row's sums do not depend on BLOCK_N, so the two give the same bits, an
    expert held elsewhere (-1) included."""
    moe_module = importlib.import_module("triton_kernels.moe")  # the package's moe is the function
    calls = []
    real = moe_module.quantize_x
    monkeypatch.setattr(moe_module, "quantize_x", lambda t: calls.append(tuple(t.shape)) or real(t))
    fmts = (quant.get(fmt),) * 3
    x, wg, wu, wd, rng = make(fmts, 3, 64, 96, 2, seed=11)
    args = (torch.from_numpy(wg), torch.from_numpy(wu), torch.from_numpy(wd), *fmts)
    ids = torch.tensor([[2, 0], [-1, 1]], dtype=torch.int32)
    w = routing_weights(rng, 2, 2)
    fused = moe(x, *args, w, ids, tiles=(32, 64), path="dp4a")
    assert calls == [(2, 64)]  # x's only
    unfused = moe(x, *args, w, ids, tiles=(16, 64), path="dp4a")
    assert calls[1:] == [(2, 64), (4, 96)]  # x's, then h's
    assert torch.equal(fused, unfused)


def test_decoding_takes_the_dp4a_path_and_prefill_the_dot_path():
    fmts = (quant.get("Q8_0"),) * 3
    x, wg, wu, wd, rng = make(fmts, 4, 64, 64, 6, seed=3)
    args = (torch.from_numpy(wg), torch.from_numpy(wu), torch.from_numpy(wd), *fmts)
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [2, 1], [0, 2], [3, 2]], dtype=torch.int32)
    w = routing_weights(rng, 6, 2)
    one = moe(x[:1], *args, w[:1], ids[:1])
    assert torch.equal(one, moe(x[:1], *args, w[:1], ids[:1], path="dp4a"))
    assert not torch.equal(one, moe(x[:1], *args, w[:1], ids[:1], path="dot"))
    assert torch.equal(moe(x, *args, w, ids), moe(x, *args, w, ids, path="dot"))
    with pytest.raises(ValueError, match=r"moe: path='dp4a' needs int8 unit decodes; FP8_E4M3 has none"):
        f8 = quant.get("FP8_E4M3")
        moe(x[:1], torch.from_numpy(quantized(f8, (4, 64, 64), rng)), args[1], args[2], f8,
            *fmts[1:], w[:1], ids[:1], path="dp4a")
    with pytest.raises(ValueError, match=r"moe: path must be 'dot', 'dp4a' or None, got 'x'"):
        moe(x[:1], *args, w[:1], ids[:1], path="x")


@settings(max_examples=examples(6), deadline=None)
@given(fmts=st.sampled_from([("Q4_0", "Q4_0", "Q8_0"), ("IQ4_NL", "IQ4_NL", "Q4_0")]),
       fmt2=st.sampled_from(["Q4_0", "Q8_0", "IQ4_NL"]), n2=st.integers(1, 96), kb2=st.integers(1, 2),
       dtype2=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 32 - 1))
def test_the_shared_experts_down_gemv_joins_the_down_launch_with_its_own_bits(fmts, fmt2, n2, kb2, dtype2, seed):
    """moe(pair=) on the dp4a path: the routed slots' rows are the call's without the pair,
    and out2 is the shared expert's down GEMV as QuantLinear.gated runs it on its product
    (qmatmul's dp4a GEMV, rounded to dtype2), from the down launch's extra programs."""
    from triton_kernels import qmatmul
    from triton_kernels.int8 import quantize_x
    from triton_kernels.moe import down_pair_path
    fmts = tuple(quant.get(f) for f in fmts)
    x, wg, wu, wd, rng = make(fmts, 3, 64, 64, 1, seed)
    ids = torch.from_numpy(rng.integers(0, 3, (1, 2)))
    weights = routing_weights(rng, 1, 2)
    K2 = 32 * kb2 * 2
    f2 = quant.get(fmt2)
    q2 = torch.from_numpy(quantized(f2, (n2, K2), rng).reshape(-1))
    product = torch.from_numpy(rng.standard_normal((1, K2)).astype(np.float32))
    quantize_x(product)  # as the router's launch attaches its int8 (the pair reads either)
    assert down_pair_path(fmts[2], f2, x.device, n2, K2)
    args = (torch.from_numpy(wg), torch.from_numpy(wu), torch.from_numpy(wd), *fmts, weights, ids)
    out2 = torch.empty(1, n2)
    got = moe(x, *args, path="dp4a", slots=True, pair=(product, q2, f2, n2, dtype2, out2))
    assert torch.equal(got, moe(x, *args, path="dp4a", slots=True))
    assert torch.equal(out2, qmatmul(product, q2, f2, n=n2).to(dtype2).float())
    with pytest.raises(ValueError, match="joins only a dp4a call that keeps its slots"):
        moe(x, *args, path="dp4a", pair=(product, q2, f2, n2, dtype2, out2))


@settings(max_examples=examples(6), deadline=None)
@given(fmts=st.sampled_from([("BF16", "BF16", "BF16"), ("F16", "F16", "F32")]),
       fmt2=st.sampled_from(["BF16", "F16", "F32", "FP8_E4M3"]), n2=st.integers(1, 96), kb2=st.integers(1, 3),
       dtype2=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 32 - 1))
def test_the_shared_experts_gated_down_gemv_joins_the_float_down_launch_with_its_own_bits(fmts, fmt2, n2, kb2,
                                                                                        dtype2, seed):
    """moe(pair=) of float experts (the dot path's per-weight down kernel): the routed
    slots' rows are the call's without the pair, and out2 is the shared expert's down GEMV
    of silu(g) * u as QuantLinear.gated runs it (gated_qmatmul's launch, rounded to
    dtype2), from the down launch's extra programs. g and u are column ranges of one row,
    as the router's output holds them."""
    from triton_kernels.gated_gemv import gated_qmatmul
    from triton_kernels.moe import down_pair_path
    fmts = tuple(quant.get(f) for f in fmts)
    x, wg, wu, wd, rng = make(fmts, 3, 64, 64, 1, seed)
    ids = torch.from_numpy(rng.integers(0, 3, (1, 2)))
    weights = routing_weights(rng, 1, 2)
    K2 = 32 * kb2
    f2 = quant.get(fmt2)
    q2 = torch.from_numpy(quantized(f2, (n2, K2), rng).reshape(n2, -1))
    row = torch.from_numpy(rng.standard_normal((1, 3 * K2)).astype(np.float32))
    g, u = row[:, K2:2 * K2], row[:, 2 * K2:]
    assert down_pair_path(fmts[2], f2, x.device, n2, K2, "dot")
    args = (torch.from_numpy(wg), torch.from_numpy(wu), torch.from_numpy(wd), *fmts, weights, ids)
    out2 = torch.empty(1, n2)
    got = moe(x, *args, path="dot", slots=True, pair=((g, u), q2, f2, n2, dtype2, out2))
    assert torch.equal(got, moe(x, *args, path="dot", slots=True))
    assert torch.equal(out2, gated_qmatmul(g, u, q2, f2, True, dtype2).float())
    with pytest.raises(ValueError, match="joins only a dot call that keeps its slots"):
        moe(x, *args, path="dot", pair=((g, u), q2, f2, n2, dtype2, out2))


def test_weights_in_host_memory_must_be_pinned():
    """With x on a GPU, moe() takes weights in pinned host memory (read over PCIe; on a
    device, test_cuda.py checks their bits and `strata bench kernels` times it), and refuses
    pageable ones, saying what to do. Checked on fake CUDA: the refusal comes before any
    launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    fg, fd = quant.get("IQ3_XXS"), quant.get("IQ4_NL")
    E, H, I, k = 4, 256, 256, 2
    with FakeTensorMode():
        x = torch.empty(1, H, device="cuda")
        wg = torch.empty(E, I, H // fg.block_elems * fg.block_bytes, dtype=torch.uint8)  # pageable host memory
        wd = torch.empty(E, H, I // fd.block_elems * fd.block_bytes, dtype=torch.uint8)
        ids, w = torch.zeros(1, k, dtype=torch.int64, device="cuda"), torch.ones(1, k, device="cuda")
        assert not wg.is_pinned()
        with pytest.raises(ValueError, match=r"w_gate is on cpu but x is on cuda.*must be pinned: tensor.pin_memory\(\)"):
            moe(x, wg, wg, wd, fg, fg, fd, w, ids, path="dp4a")
