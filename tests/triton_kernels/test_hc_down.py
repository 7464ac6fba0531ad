"""A hyper-connection's down projection in the launch that writes the streams
(triton_kernels/hc_down.py), through the interpreter, and hc_mix finishing it:

- the write is hc_write's bits (a read writes nothing: y is x), a MoE block's parts'
  within hc_write_moe's torch bound;
- each chunk's sum of y^2 within gamma(BH) of its float64 value;
- each chunk's rows' sums are a GEMV of BH columns of w * y: the dp4a one (w * y rounded
  to int8 per 32 as quantize_x rounds it) within its bound (tests/triton_kernels/
  test_int8.py, K = BH), the float one (w * y rounded to the GEMV's dtype) within
  gamma(BH) of the products' magnitudes, against float64 from those inputs and the
  decoded weight;
- hc_mix finishes both and the normed streams from the sums: within hc_mix's bound grown
  by the norm's scale's and the sums' roundings (the test's docstring).
Each row is its own programs': the first token alone gives the batch's first row.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import quant
from tests.tiers import examples
from tests.triton_kernels.test_hyperconn import gamma
from tests.triton_kernels.test_int8 import U, assert_within, reference
from triton_kernels.hc_down import Down, hc_down, hc_down_torch, plan
from triton_kernels.hyperconn import hc_mix, hc_write_torch
from triton_kernels.int8 import Q8X, quantize_x_torch
from triton_kernels.shared_expert import gated_add_torch

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "Q4_K", "Q6_K", "IQ3_XXS", "BF16", "F16", "F32"]


def _rand(rng, *shape, scale=1.0):
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


@settings(max_examples=examples(40), deadline=None)
@given(fmt=st.sampled_from(FORMATS), T=st.integers(1, 3), S=st.integers(1, 4),
       H=st.sampled_from([64, 128, 256, 320, 512, 768]), N=st.integers(1, 40),
       mode=st.sampled_from(["read", "write", "moe"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_hc_down_writes_and_sums_each_chunk_within_the_gemv_bound(fmt, T, S, H, N, mode, dtype, seed):
    """dp4a formats: each chunk within test_int8's GEMV bound at K = BH; float ones (the
    float GEMV's input w * y rounded to dtype first, exactly as the reference takes it): a
    sum of BH products within gamma(BH) of the sum of their magnitudes."""
    fmt = quant.get(fmt)
    cpu = torch.device("cpu")
    assume(S * H % fmt.block_elems == 0 and plan(fmt, cpu, N, S, H, T) is not None)
    p = plan(fmt, cpu, N, S, H, T)
    assert p.kind == ("gemv" if fmt.block_elems == 1 else "dp4a")
    rng = np.random.default_rng(seed)
    x, w = _rand(rng, T, S * H), 1 + _rand(rng, S, H, scale=0.1)
    qn = fmt.quantize(rng.standard_normal((N, S * H)).astype(np.float32) / 10)
    q = torch.from_numpy(qn.copy())
    inj = torch.from_numpy(rng.uniform(0, 2, (T, S)).astype(np.float32)) if mode != "read" else None
    out = {"read": None, "write": _rand(rng, T, H),
           "moe": (_rand(rng, T, 3, H), _rand(rng, T, 1), _rand(rng, T, H))}[mode]
    y, d = hc_down(x, w, 1e-6, q, fmt, N, out, inj, dtype)
    yt, dt = hc_down_torch(x, w, 1e-6, q, fmt, N, out, inj, dtype)
    bh = p.bh
    C = H // bh
    assert d.ss.shape == (T, S * C) and d.part.shape == (T, S * C, N) and d.chunks == C
    if mode == "read":
        assert y is x
    elif mode == "write":
        assert torch.equal(y, hc_write_torch(x, out, inj)) and torch.equal(y, yt)
    else:
        torch.testing.assert_close(y, hc_write_torch(x, gated_add_torch(*out), inj), rtol=1e-5,
                                   atol=1e-5 * float(x.abs().max() + 1))
    y64 = y.double().reshape(T, S * C, bh)
    assert ((d.ss.double() - (y64 ** 2).sum(-1)).abs() <= gamma(bh) * (y64 ** 2).sum(-1)).all()
    # a row's programs read no other row: the first token alone gives the batch's first row
    one, d1 = hc_down(x[:1], w, 1e-6, q, fmt, N, None if out is None else
                      (tuple(o[:1] for o in out) if mode == "moe" else out[:1]), None if inj is None else inj[:1],
                      dtype)
    assert torch.equal(one, y[:1]) and torch.equal(d1.ss, d.ss[:1]) and torch.equal(d1.part, d.part[:1])
    # the chunks' sums from the launch's own y: w * y as its GEMV rounds it
    z = (y.reshape(T, S, H) * w).reshape(T, S * H)
    if p.kind == "gemv":
        W = torch.from_numpy(fmt.dequantize(qn)).double().reshape(N, S * C, bh)
        zc = z.to(dtype).double().reshape(T, S * C, bh)
        ref, mag = torch.einsum("tcb,ncb->tcn", zc, W), torch.einsum("tcb,ncb->tcn", zc.abs(), W.abs())
        for got in (d.part, dt.part):
            assert_within(got, ref, gamma(bh) * mag + bh * 2.0 ** -149, "float chunks")
        return
    z8 = quantize_x_torch(z)
    groups = bh // 32
    for k in range(S * C):
        keep = torch.zeros(S * H // 32)
        keep[k * groups:(k + 1) * groups] = 1
        ref, _, t = reference(Q8X(z8.q, z8.d * keep, z8.s * keep), qn, fmt)
        assert_within(d.part[:, k], ref, 2 * (bh / 16 + 8) * U * t + bh * 2.0 ** -149, f"chunk {k}")
        assert_within(dt.part[:, k], ref, 2 * (bh / 16 + 8) * U * t + bh * 2.0 ** -149, f"torch chunk {k}")


@settings(max_examples=examples(20), deadline=None)
@given(T=st.integers(1, 3), S=st.integers(1, 4), C=st.integers(1, 5), H_per=st.sampled_from([32, 64]),
       R=st.sampled_from([8, 16]), injects=st.booleans(), seed=st.integers(0, 2 ** 32 - 1),
       scale=st.sampled_from([0.1, 1.0, 30.0]))
def test_hc_mix_finishes_hc_downs_sums_within_the_float32_bound(T, S, C, H_per, R, injects, seed, scale):
    """hc_mix of a Down (and hc_mix_torch's, through down_both_torch) against float64 from the
    same sums. The scale inv_s (C sums, the division, eps, the square root, the reciprocal:
    within gamma(C + 6), a GPU's division taking 2 ulp), so xn = y inv_s w within
    rel_xn = gamma(C + 8) of itself and both within gamma(C + S + 8) sum_s inv_s sum_c |part|;
    then test_hyperconn's hc_mix bound with the gates' error grown by silu's slope (at most
    1.1) times both's / S, and each term's by |xn| rel_xn; the injection weights' by
    sigmoid's slope (1/4) twice both's / S."""
    from triton_kernels.hyperconn import hc_mix_torch
    rng = np.random.default_rng(seed)
    H = C * H_per
    N = R + (S if injects else 0)
    y = _rand(rng, T, S * H)
    ss = torch.from_numpy(rng.uniform(0.5, 4, (T, S * C)).astype(np.float32) * H_per)
    d = Down(y, ss, _rand(rng, T, S * C, N, scale=scale), 1 + _rand(rng, S, H, scale=0.1), 1e-6)
    w_up = _rand(rng, S * H, R, scale=0.3).double()
    inv = 1 / torch.sqrt(ss.double().reshape(T, S, C).sum(-1) / H + 1e-6)           # (T, S)
    part = d.part.double().reshape(T, S, C, N)
    both = (part.sum(2) * inv[:, :, None]).sum(1)                                     # (T, N)
    dboth = gamma(C + S + 8) * (part.abs().sum(2) * inv[:, :, None]).sum(1)
    xn = (y.double().reshape(T, S, H) * inv[:, :, None] * d.w.double()).reshape(T, S * H)
    rel_xn = gamma(C + 8)
    v = both / S
    sig = 1 / (1 + torch.exp(-v))
    a64, ref_inj = (v * sig)[:, :R], (2 * sig)[:, R:]
    rel = (8 + v.abs()) * U / (1 - (8 + v.abs()) * U)
    da = rel[:, :R] * a64.abs() + 1.1 * dboth[:, :R] / S
    wa = a64.abs() @ w_up.abs().T
    du = da @ w_up.abs().T + gamma(R) * (1 + float(rel[:, :R].max())) * wa
    terms = (xn / (1 + torch.exp(-(a64 @ w_up.T)))).reshape(T, S, H)
    g = gamma(S + 8)
    mean = lambda t: t.reshape(T, S, H).mean(1)  # noqa: E731
    bound = (1 + g) * (mean(xn.abs() * du) / 4 + rel_xn * mean(xn.abs())) + g * terms.abs().mean(1)
    inj_bound = rel[:, R:] * ref_inj.abs() + 0.5 * dboth[:, R:] / S + 1e-36
    for f in (hc_mix, hc_mix_torch):
        out, inj = f(d, w_up.float(), None, R, S)
        assert ((out.double() - terms.mean(1)).abs() <= bound).all(), f.__name__
        assert inj.shape == (T, N - R) and ((inj.double() - ref_inj).abs() <= inj_bound).all(), f.__name__
    one = hc_mix(d[:1], w_up.float(), None, R, S)
    assert all(torch.equal(a, b[:1]) for a, b in zip(one, hc_mix(d, w_up.float(), None, R, S)))


@settings(max_examples=examples(10), deadline=None)
@given(T=st.integers(1, 3), S=st.integers(1, 4), C=st.integers(1, 4), R=st.sampled_from([8, 16]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_hc_mix_of_a_down_quantizes_its_output_as_quantize_x_does(T, S, C, R, seed):
    """hc_mix(quantize=True) of a Down writes the block's input as int8.quantize_x would."""
    from triton_kernels.int8 import quantize_x
    rng = np.random.default_rng(seed)
    H = 32 * C
    d = Down(_rand(rng, T, S * H), torch.from_numpy(rng.uniform(1, 4, (T, S * C)).astype(np.float32) * 32),
             _rand(rng, T, S * C, R + S), 1 + _rand(rng, S, H, scale=0.1), 1e-6)
    y, _ = hc_mix(d, _rand(rng, S * H, R, scale=0.3), None, R, S, quantize=True)
    assert all(torch.equal(a, b) for a, b in zip(quantize_x(y), quantize_x_torch(y)))


def test_hc_down_refuses_what_it_cannot_take():
    """A down weight it has no launch for, and MoE parts hc_write_moe would refuse, stop
    with what to do, before any launch."""
    import pytest
    rng = np.random.default_rng(0)
    x, w = _rand(rng, 1, 2 * 64), _rand(rng, 2, 64)
    q = torch.from_numpy(quant.get("Q8_0").quantize(rng.standard_normal((8, 128)).astype(np.float32)))
    parts = (_rand(rng, 1, 3, 64).bfloat16(), _rand(rng, 1, 1), _rand(rng, 1, 64))
    with pytest.raises(ValueError, match=r"hc_write_moe: routed must be float32"):
        hc_down(x, w, 1e-6, q, "Q8_0", 8, parts, torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"takes no launch for 40 tokens; ask takes\(\) first"):
        hc_down(x.expand(40, -1).contiguous(), w, 1e-6, q, "Q8_0", 8)
