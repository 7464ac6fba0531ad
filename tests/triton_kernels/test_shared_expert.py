"""The shared expert's kernels (triton_kernels/shared_expert.py) through the interpreter,
and their torch twins, against float64 (u = 2^-24, gamma(n) = n u / (1 - n u)):

- silu_mul: exp(-g) carries g's magnitude as a relative error |g| u (its derivative is
  itself; g is exact here) with a few ulp of exp's own; 1 + e, the division and the
  product round once each: within gamma(8 + |g|) of |y64|, plus 1e-36 absolute (exp(-g)
  overflows below g = -88.7, where both give 0 for a value under 3e-37).
- sigmoid_mul: sigmoid(g) within gamma(6 + |g|) of itself (as above, without silu's
  product), the product once more: within gamma(8 + |g|) of |y64|, plus 1e-36 absolute.
- gated_add: s = sigmoid(gate) within gamma(6 + |gate|) of itself (as above), the product
  and the sum round once each: |y - y64| <= gamma(2) (|a| + |s b|) + gamma(8 + |gate|) |s b|.
  With K rows a token (a (T, K, N), the MoE's slots) summed first, K - 1 more additions:
  gamma(K + 1) (sum |a_j| + |s b|) + gamma(8 + |gate|) |s b|.
Each token's row is its own program: a row's result is the same in any batch (checked bit
for bit).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.shared_expert import (gated_add, gated_add_torch, sigmoid_mul, sigmoid_mul_torch, silu_mul,
                                         silu_mul_torch)

U = 2.0 ** -24


def gamma(n):
    return n * U / (1 - n * U)


def data(seed: int, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32))


shapes = dict(T=st.integers(1, 3), N=st.integers(1, 1100), seed=st.integers(0, 2 ** 32 - 1),
              scale=st.sampled_from([0.1, 1.0, 30.0]))


@settings(max_examples=examples(20), deadline=None)
@given(**shapes)
def test_silu_mul_within_the_float32_bound(T, N, seed, scale):
    assert interpreter_on()
    gu = data(seed, T, 2 * N, scale=scale)   # g and u: the two halves of a fused projection's rows
    g, u = gu[:, :N], gu[:, N:]
    g64, u64 = g.double(), u.double()
    ref = g64 / (1 + torch.exp(-g64)) * u64
    bound = gamma(8) * ref.abs() + (g64.abs() * U / (1 - (8 + g64.abs()) * U)) * ref.abs() + 1e-36
    # below -88.72 exp(-g) overflows float32: the product is 0 there (its true value, |g u| e^g,
    # is under 1e-34 for these inputs)
    bound = torch.where(g64 < -math.log(torch.finfo(torch.float32).max), ref.abs(), bound)
    for f in (silu_mul, silu_mul_torch):
        y = f(g, u)
        assert y.shape == (T, N) and bool(((y.double() - ref).abs() <= bound).all()), f.__name__
    assert torch.equal(silu_mul(g[:1], u[:1]), silu_mul(g, u)[:1])


@settings(max_examples=examples(15), deadline=None)
@given(**shapes)
def test_sigmoid_mul_within_the_float32_bound(T, N, seed, scale):
    gu = data(seed, T, 2 * N, scale=scale)   # g a column slice of a fused projection's rows
    g, u = gu[:, :N], data(seed + 1, T, N)
    g64 = g.double()
    ref = u.double() / (1 + torch.exp(-g64))
    bound = ((8 + g64.abs()) * U / (1 - (8 + g64.abs()) * U)) * ref.abs() + 1e-36
    for f in (sigmoid_mul, sigmoid_mul_torch):
        y = f(g, u)
        assert y.shape == (T, N) and bool(((y.double() - ref).abs() <= bound).all()), f.__name__
    assert torch.equal(sigmoid_mul(g[:1], u[:1]), sigmoid_mul(g, u)[:1])


@settings(max_examples=examples(20), deadline=None)
@given(**shapes, K=st.sampled_from([0, 1, 3, 8]))
def test_gated_add_within_the_float32_bound(T, N, seed, scale, K):
    """K = 0: a (T, N); else a (T, K, N), per-slot rows summed in the launch."""
    a = data(seed, T, N) if K == 0 else data(seed, T, K, N)
    b = data(seed + 1, T, N)
    gate = data(seed + 2, T, N + 1, scale=scale)[:, N:]   # the fused projection's last column
    s64 = 1 / (1 + torch.exp(-gate.double()))
    a64, a_abs = (a.double(), a.double().abs()) if K == 0 else (a.double().sum(1), a.double().abs().sum(1))
    ref = a64 + s64 * b.double()
    sb = (s64 * b.double()).abs()
    g = gate.double().abs()
    bound = gamma(max(K, 1) + 1) * (a_abs + sb) + ((8 + g) * U / (1 - (8 + g) * U)) * sb
    for f in (gated_add, gated_add_torch):
        y = f(a, gate, b)
        assert y.shape == (T, N) and bool(((y.double() - ref).abs() <= bound).all()), f.__name__
    assert torch.equal(gated_add(a[:1], gate[:1], b[:1]), gated_add(a, gate, b)[:1])


@settings(max_examples=examples(10), deadline=None)
@given(T=st.integers(1, 3), G=st.integers(1, 40), silu=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_the_gates_quantize_their_product_as_quantize_x_does(T, G, silu, seed):
    """With `quantize` the product is the same, and its int8 form (for a dp4a GEMV) written
    in the launch has quantize_x's bits; quantize_x of the product returns it."""
    from triton_kernels.int8 import quantize_x, quantize_x_torch
    rng = np.random.default_rng(seed)
    g, u = (torch.from_numpy(rng.standard_normal((T, 32 * G)).astype(np.float32)) for _ in range(2))
    f = silu_mul if silu else sigmoid_mul
    y = f(g, u, quantize=True)
    assert torch.equal(y, f(g, u))
    x8 = quantize_x(y)
    assert quantize_x(y.reshape(T, -1)) is x8 and all(torch.equal(a, b) for a, b in zip(x8, quantize_x_torch(y)))
