"""A DeltaNet layer's work around its recurrence (triton_kernels/deltanet_inputs.py): the
kernels, through the interpreter, and their torch twins (the CPU path's own ops), each
against float64 (u = 2^-24, gamma(n) = n u / (1 - n u)):

- SiLU x / (1 + exp(-x)): exp(-x) carries x's own rounding-free value but rounds a few
  ulp, and its relative error grows as |x| u near overflow's slope (its derivative is
  itself); 1 + e and the division round once each: within gamma(|x| + 4) of itself.
- q and k: the sum of squares of dk SiLU values errs by gamma(dk) plus twice their own
  relative error, the square root and the reciprocal halve it and add two roundings,
  the product (and q's scale) two more: |y - y64| <= gamma(dk + 2 (max|x| + 4) + 6) |y64|.
- beta = sigmoid(b): as SiLU, gamma(|b| + 4) |beta64|.
- g = a_coef softplus(a + dt_bias): the sum rounds once (a relative error of x that
  softplus' slope, below 1, keeps relative to softplus(x)), exp and log1p carry
  (|x| + 4) u, the product one more: gamma(2 |x| + 8) |g64|. The kernel's log1p is
  Goldberg's (exact to a few ulp); a plain log(1 + e) would fail this below x = -17.
- the gated norm o / sqrt(mean(o^2) + eps) w sigmoid(z): gamma(dv) of the mean, four
  roundings to the reciprocal, three products, the sigmoid's gamma(|z| + 4):
  gamma(dv + |z| + 12) |y64|.
- deltanet_conv_inputs (one token): the conv's output is conv_step's bit for bit (the same
  taps in the same order, no fused multiply-add: checked equal to conv_step_torch's), so
  q, k, v, g and beta take the bounds above with `mixed` that output; the new window is
  conv_step's exactly, also where it is written over the old one (in place, one program
  owning each channel).
Each row is computed by its own program: a row's result is the same in any batch (checked
bit for bit, the first row alone against the batch)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.conv import conv_step_torch
from triton_kernels.deltanet_inputs import (deltanet_conv_inputs, deltanet_conv_inputs_torch, deltanet_gated_norm,
                                            deltanet_gated_norm_torch, deltanet_inputs, deltanet_inputs_torch)

U = 2.0 ** -24


def gamma(n) -> torch.Tensor | float:
    return n * U / (1 - n * U)


def within(y: torch.Tensor, ref: torch.Tensor, bound) -> bool:
    return y.shape == ref.shape and bool(((y.double() - ref).abs() <= bound).all())


def data(rng, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


def reference(mixed, b, a, dt_bias, a_coef, Hk, dk):
    """float64: (q, k, v, g, beta) and their bounds."""
    m, b, a, dt, coef = (t.double() for t in (mixed, b, a, dt_bias, a_coef))
    T, Hv = b.shape
    s = m * torch.sigmoid(m)
    qk = s[:, :2 * Hk * dk].reshape(T, 2, Hk, dk)
    qk = qk / torch.sqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)
    heads = torch.arange(Hv) % Hk  # the tiled order
    q, k = qk[:, 0, heads] * dk ** -0.5, qk[:, 1, heads]
    v = s[:, 2 * Hk * dk:].reshape(T, Hv, -1)
    x = a + dt
    g = coef * torch.nn.functional.softplus(x)
    beta = torch.sigmoid(b)
    qk_err = gamma(dk + 2 * (m[:, :2 * Hk * dk].abs().max() + 4) + 6)
    v_err = gamma(m[:, 2 * Hk * dk:].abs() + 4).reshape(v.shape)
    return (q, k, v, g, beta), (qk_err * q.abs(), qk_err * k.abs(), v_err * v.abs(),
                                gamma(2 * x.abs() + 8) * g.abs(), gamma(b.abs() + 4) * beta)


@settings(max_examples=examples(20), deadline=None)
@given(T=st.integers(1, 3), Hk=st.integers(1, 3), rep=st.integers(1, 3), dk=st.integers(1, 40),
       dv=st.integers(1, 40), scale=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2 ** 32 - 1))
def test_the_recurrence_inputs_within_the_float32_bound(T, Hk, rep, dk, dv, scale, seed):
    assert interpreter_on()
    rng = np.random.default_rng(seed)
    Hv = Hk * rep
    W = 2 * Hk * dk + Hv * dv + 2 * Hv  # the projection's rows: b and a are column slices of them
    proj = data(rng, T, W, scale=scale)
    mixed, b, a = proj[:, :W - 2 * Hv], proj[:, W - 2 * Hv:W - Hv], proj[:, W - Hv:]
    mixed = mixed.contiguous()
    dt_bias, a_coef = data(rng, Hv, scale=4.0), -torch.from_numpy(rng.uniform(0.01, 20, Hv).astype(np.float32))
    refs, bounds = reference(mixed, b, a, dt_bias, a_coef, Hk, dk)
    for f in (deltanet_inputs, deltanet_inputs_torch):
        got = f(mixed, b, a, dt_bias, a_coef, Hk, dk)
        for name, y, ref, bound in zip("q k v g beta".split(), got, refs, bounds):
            assert y.dtype == torch.float32 and within(y, ref, bound), (f.__name__, name, (y.double() - ref).abs().max())
    first = deltanet_inputs(mixed[:1], b[:1], a[:1], dt_bias, a_coef, Hk, dk)
    assert all(torch.equal(x, y[:1]) for x, y in zip(first, deltanet_inputs(mixed, b, a, dt_bias, a_coef, Hk, dk)))


@settings(max_examples=examples(10), deadline=None)
@given(Hk=st.integers(1, 3), rep=st.integers(1, 3), dk=st.integers(1, 40), dv=st.integers(1, 40),
       K=st.integers(2, 4), scale=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2 ** 32 - 1))
def test_the_conv_and_inputs_in_one_launch_within_the_float32_bound(Hk, rep, dk, dv, K, scale, seed):
    rng = np.random.default_rng(seed)
    Hv = Hk * rep
    C = 2 * Hk * dk + Hv * dv
    proj = data(rng, 1, C + 2 * Hv, scale=scale)
    qkv, b, a = proj[:, :C], proj[:, C:C + Hv], proj[:, C + Hv:]
    window, taps = data(rng, C, K - 1, scale=scale), data(rng, C, K, scale=0.5)
    dt_bias, a_coef = data(rng, Hv, scale=4.0), -torch.from_numpy(rng.uniform(0.01, 20, Hv).astype(np.float32))
    mixed, new64 = conv_step_torch(window, qkv, taps)
    refs, bounds = reference(mixed, b, a, dt_bias, a_coef, Hk, dk)
    for f in (deltanet_conv_inputs, deltanet_conv_inputs_torch):
        *got, new = f(window, qkv, taps, b, a, dt_bias, a_coef, Hk, dk)
        assert torch.equal(new, new64), f.__name__
        for name, y, ref, bound in zip("q k v g beta".split(), got, refs, bounds):
            assert y.dtype == torch.float32 and within(y, ref, bound), (f.__name__, name, (y.double() - ref).abs().max())
    # the conv's output inside the launch is conv_step's: v = silu(mixed) as deltanet_inputs gives it
    want = deltanet_inputs(mixed, b, a, dt_bias, a_coef, Hk, dk)
    got = deltanet_conv_inputs(window, qkv, taps, b, a, dt_bias, a_coef, Hk, dk)
    assert torch.equal(got[2], want[2])
    # in place (a CUDA graph's window): the same outputs, the window moved on where it lies
    held = window.clone()
    again = deltanet_conv_inputs(held, qkv, taps, b, a, dt_bias, a_coef, Hk, dk, in_place=True)
    assert again[5] is held and torch.equal(held, new64)
    assert all(torch.equal(x, y) for x, y in zip(again[:5], got[:5]))


@settings(max_examples=examples(20), deadline=None)
@given(T=st.integers(1, 3), Hv=st.integers(1, 4), dv=st.integers(1, 150), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_the_gated_norm_within_the_float32_bound(T, Hv, dv, scale, seed):
    assert interpreter_on()
    rng = np.random.default_rng(seed)
    o, w = data(rng, T, Hv, dv, scale=scale), data(rng, dv)
    zs = data(rng, T, 2 * Hv * dv, scale=3.0)
    z = zs[:, Hv * dv:]  # a column slice, as the projection's z is
    o64, z64 = o.double(), z.double()
    ref = (o64 / torch.sqrt((o64 * o64).mean(-1, keepdim=True) + 1e-6) * w.double()
           * torch.sigmoid(z64.reshape(T, Hv, dv))).reshape(T, Hv * dv)
    bound = gamma(dv + z64.abs() + 12) * ref.abs()
    for f in (deltanet_gated_norm, deltanet_gated_norm_torch):
        assert within(f(o, z, w, 1e-6), ref, bound), f.__name__
    assert torch.equal(deltanet_gated_norm(o[:1], z[:1], w, 1e-6), deltanet_gated_norm(o, z, w, 1e-6)[:1])


@settings(max_examples=examples(10), deadline=None)
@given(T=st.integers(1, 3), Hv=st.integers(1, 4), G=st.integers(1, 5), seed=st.integers(0, 2 ** 32 - 1))
def test_the_gated_norm_quantizes_its_rows_as_quantize_x_does(T, Hv, G, seed):
    """With `quantize` the same rows, and their int8 form for the output projection's dp4a
    GEMV written in the launch, quantize_x's bits; quantize_x of the rows returns it."""
    from triton_kernels.int8 import quantize_x, quantize_x_torch
    rng = np.random.default_rng(seed)
    dv = 32 * G
    o, w, z = data(rng, T, Hv, dv), data(rng, dv), data(rng, T, Hv * dv, scale=3.0)
    y = deltanet_gated_norm(o, z, w, 1e-6, quantize=True)
    assert torch.equal(y, deltanet_gated_norm(o, z, w, 1e-6))
    x8 = quantize_x(y)
    assert quantize_x(y.reshape(T, -1)) is x8 and all(torch.equal(a, b) for a, b in zip(x8, quantize_x_torch(y)))


@pytest.mark.parametrize("T", [2, 5, 9])
@pytest.mark.parametrize("dv", [32, 37])
def test_the_torch_twin_gives_a_row_the_same_bits_in_any_batch_when_invariant(T, dv):
    """Batch-invariant (a decode step against a speculative verify's rows), the CPU path's
    inputs of row t are the same bits from one row as from T: ATen runs the last elements
    of a call, (T, Hv) of the decay's softplus and beta's sigmoid among them, through its
    scalar code, which rounds otherwise than its vector code (6-9% of softplus' values on
    AVX-512 and AVX2)."""
    from triton_kernels import invariant
    rng = np.random.default_rng(T * 100 + dv)
    Hk, rep, dk = 2, 6, 32
    Hv = Hk * rep
    for _ in range(20):
        W = 2 * Hk * dk + Hv * dv + 2 * Hv
        proj = data(rng, T, W, scale=3.0)
        mixed, b, a = proj[:, :W - 2 * Hv].contiguous(), proj[:, W - 2 * Hv:W - Hv], proj[:, W - Hv:]
        dt_bias, a_coef = data(rng, Hv), -torch.from_numpy(rng.uniform(0.01, 20, Hv).astype(np.float32))
        with invariant.batch_invariant():
            whole = deltanet_inputs_torch(mixed, b, a, dt_bias, a_coef, Hk, dk)
            for t in range(T):
                one = deltanet_inputs_torch(mixed[t:t + 1], b[t:t + 1], a[t:t + 1], dt_bias, a_coef, Hk, dk)
                for name, x, y in zip("q k v g beta".split(), one, whole):
                    assert torch.equal(x, y[t:t + 1]), (name, t)


def test_wrong_shapes_are_named():
    with pytest.raises(ValueError, match=r"deltanet_inputs: mixed \(1, 30\)"):
        deltanet_inputs(torch.zeros(1, 30), torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(4), torch.zeros(4), 1, 8)
    with pytest.raises(ValueError, match=r"deltanet_gated_norm: o \(1, 2, 4\), z \(1, 6\)"):
        deltanet_gated_norm(torch.zeros(1, 2, 4), torch.zeros(1, 6), torch.zeros(4), 1e-6)
