"""norm_rope (triton_kernels/rope.py) through the interpreter, and its torch twin, against
float64 (u = 2^-24, gamma(n) = n u / (1 - n u)).

The norm, as hc_norm's (tests/triton_kernels/test_hyperconn.py): y within gamma(D + 6) of
|y64|, and so the partner value y' of each roped dim. The rotation y cos + y' sin adds two
products, each rounding once, and their sum once; cos and sin are the same float32 rows in
both: |out - out64| <= gamma(D + 9) (|y64 cos| + |y'64 sin|). Each (token, head) row is its
own program: a row's result is the same in any batch (checked bit for bit).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.rope import norm_rope, norm_rope_torch

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def data(seed: int, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32))


def reference(x, w, eps, cos, sin):
    x64, R = x.double(), cos.shape[1]
    y = (x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w.double()).transpose(0, 1)  # (Hx, T, D)
    half = R // 2
    partner = torch.cat([-y[..., half:R], y[..., :half]], dim=-1)
    c, s = cos.double(), sin.double()
    out = y.clone()
    out[..., :R] = y[..., :R] * c + partner * s
    mag = y.abs().clone()
    mag[..., :R] = (y[..., :R] * c).abs() + (partner * s).abs()
    return out, mag


@settings(max_examples=examples(15), deadline=None)
@given(T=st.integers(1, 3), Hx=st.integers(1, 3), D=st.sampled_from([8, 24, 64, 128]),
       rope_frac=st.sampled_from([0.25, 0.5, 1.0]), strided=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 2 ** 32 - 1))
def test_norm_rope_within_the_float32_bound(T, Hx, D, rope_frac, strided, scale, seed):
    assert interpreter_on()
    R = max(2, int(D * rope_frac) // 2 * 2)
    # q is the first half of each head's (q, gate) columns in the fused projection: a strided view
    x = data(seed, T, Hx, 2 * D, scale=scale)[..., :D] if strided else data(seed, T, Hx, D, scale=scale)
    w = data(seed + 1, D)
    ang = data(seed + 2, T, R)
    cos, sin = ang.cos(), ang.sin()
    ref, mag = reference(x, w, 1e-6, cos, sin)
    for f in (norm_rope, norm_rope_torch):
        y = f(x, w, 1e-6, cos, sin)
        assert y.shape == (Hx, T, D) and y.dtype == torch.float32, f.__name__
        assert bool(((y.double() - ref).abs() <= gamma(D + 9) * mag).all()), f.__name__
    assert torch.equal(norm_rope(x[:1], w, 1e-6, cos[:1], sin[:1]), norm_rope(x, w, 1e-6, cos, sin)[:, :1])


def test_norm_rope_names_its_shapes():
    x = torch.zeros(2, 3, 16)
    with pytest.raises(ValueError, match=r"norm_rope: cos and sin must be \(tokens, rope_dim\), rope_dim even"):
        norm_rope(x, torch.ones(16), 1e-6, torch.zeros(2, 7), torch.zeros(2, 7))
    with pytest.raises(ValueError, match=r"norm_rope: x must be \(tokens, heads, head_dim\) with w \(head_dim,\)"):
        norm_rope(x, torch.ones(8), 1e-6, torch.zeros(2, 8), torch.zeros(2, 8))


@settings(max_examples=examples(15), deadline=None)
@given(T=st.integers(1, 3), Hq=st.integers(1, 4), Hk=st.integers(1, 3), D=st.sampled_from([8, 24, 64]),
       rope_frac=st.sampled_from([0.25, 0.5, 1.0]), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_norm_rope2_is_two_norm_ropes_in_one_launch(T, Hq, Hk, D, rope_frac, scale, seed):
    """q (a strided view, as the fused projection's) and k with their own weights: each the
    bits of its own norm_rope, so within norm_rope's float32 bound; the torch twin is
    norm_rope_torch twice, within the same bound."""
    from triton_kernels.rope import norm_rope2, norm_rope2_torch
    R = max(2, int(D * rope_frac) // 2 * 2)
    q = data(seed, T, Hq, 2 * D, scale=scale)[..., :D]
    k = data(seed + 1, T, Hk, D, scale=scale)
    wq, wk = data(seed + 2, D), data(seed + 3, D)
    ang = data(seed + 4, T, R)
    cos, sin = ang.cos(), ang.sin()
    qo, ko = norm_rope2(q, wq, k, wk, 1e-6, cos, sin)
    assert torch.equal(qo, norm_rope(q, wq, 1e-6, cos, sin)) and torch.equal(ko, norm_rope(k, wk, 1e-6, cos, sin))
    for x, w, y in zip((q, k), (wq, wk), norm_rope2_torch(q, wq, k, wk, 1e-6, cos, sin)):
        ref, mag = reference(x, w, 1e-6, cos, sin)
        assert bool(((y.double() - ref).abs() <= gamma(D + 9) * mag).all())


@settings(max_examples=examples(10), deadline=None)
@given(T=st.integers(1, 3), N=st.integers(1, 9), D=st.sampled_from([8, 24, 64]),
       rope_frac=st.sampled_from([0.5, 1.0]), seed=st.integers(0, 2 ** 32 - 1), data_=st.data())
def test_with_positions_the_rows_are_read_from_the_tables(T, N, D, rope_frac, seed, data_):
    """pos (T,): cos and sin are tables (N, R) and token t takes row pos[t], read by the
    kernel (a graph's step: no gather) — the bits of the call given those rows, in both
    ops and both twins; repeated positions and the first and last rows included."""
    from triton_kernels.rope import norm_rope2, norm_rope2_torch
    R = max(2, int(D * rope_frac) // 2 * 2)
    pos = torch.tensor(data_.draw(st.lists(st.one_of(st.sampled_from([0, N - 1]), st.integers(0, N - 1)),
                                           min_size=T, max_size=T)))
    x = data(seed, T, 3, 2 * D)[..., :D]
    k = data(seed + 1, T, 2, D)
    w, wk = data(seed + 2, D), data(seed + 3, D)
    ang = data(seed + 4, N, R)
    cos, sin = ang.cos(), ang.sin()
    for f in (norm_rope, norm_rope_torch):
        assert torch.equal(f(x, w, 1e-6, cos, sin, pos), f(x, w, 1e-6, cos[pos], sin[pos])), f.__name__
    for f in (norm_rope2, norm_rope2_torch):
        got, want = f(x, w, k, wk, 1e-6, cos, sin, pos), f(x, w, k, wk, 1e-6, cos[pos], sin[pos])
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f.__name__


def test_positions_are_one_integer_a_token():
    x, t = torch.zeros(2, 3, 16), torch.zeros(5, 8)
    with pytest.raises(ValueError, match=r"norm_rope: pos must be \(2,\) integers, one per token, got "
                                         r"torch.int64 \(3,\)"):
        norm_rope(x, torch.ones(16), 1e-6, t, t, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"norm_rope: cos and sin must be tables \(positions, rope_dim\)"):
        norm_rope(x, torch.ones(16), 1e-6, torch.zeros(5, 7), torch.zeros(5, 7), torch.zeros(2, dtype=torch.long))
