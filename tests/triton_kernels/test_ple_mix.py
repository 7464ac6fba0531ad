"""The PLE block's one-token kernel (triton_kernels/ple_mix.py) through the interpreter, and
its torch twin, against float64 (u = 2^-24, gamma(n) = n u / (1 - n u)). Per stream:

- kn, q: each within gamma(H + 6) of itself (the hc_norm bound, the same operations).
- the gate's dot d = sum(kn q) / sqrt(H): the inputs' errors (2 gamma(H + 6)), the
  product's rounding, the sum's gamma(H - 1) of the terms' magnitudes, sqrt(H) and the
  division one each: |d - d64| <= gamma(3H + 14) sum |kn64 q64| / sqrt(H) = dd.
- g = signed_sqrt(d) = sqrt(max(|d|, 1e-6)) sign(d) (the square root rounds once): with
  D = |d64|, c in [max(1e-6, D - dd), max(1e-6, D + dd)] and g within [sqrt(c_lo)(1 - u),
  sqrt(c_hi)(1 + u)] of d64's sign, or anywhere in +-sqrt(c_hi)(1 + u) when dd >= D (the
  sign may flip). The sigmoid is increasing and its computation (exp's few ulp, 1 + e, the
  division) within gamma(8): sigma in [sigma(g_lo)(1 - gamma(8)), sigma(g_hi)(1 + gamma(8))].
- gv = sigma v: that range times v, and one rounding: gamma(1) |gv|.
- normed = norm_conv(gv) = f(sigma) = sigma v w / sqrt(sigma^2 mean(v^2) + eps), increasing in
  sigma > 0 for each channel's sign: within the range of f over sigma's, plus gamma(H + 8)
  of it (the norm's gamma(H + 6), gv's rounding carried into the numerator and the rms).
- the conv's y = sum_j f_j w_j: its last input normed's error times its tap, and gamma(2K)
  of sum |f_j w_j| for the K products and K - 1 sums.
- silu(y): slope at most 1.1, so |y|'s error times 1.1, plus gamma(8) |silu(y)|.
- out = (x + gv) + silu(y): the errors of gv and silu, and gamma(2) (|x| + |gv| + |silu|).
- the new window: the old one's columns shifted exactly, normed as its last column.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.ple_mix import ple_mix, ple_mix_torch

U = 2.0 ** -24
EPS = 1e-6


def gamma(n):
    return n * U / (1 - n * U)


def data(rng, *shape, scale=1.0) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


def reference_and_bound(x, k, v, wk, wq, wc, taps, window, S, dil):
    """(out64, window64, out bound, window bound) as the module docstring derives them."""
    C = x.shape[1]
    H, K = C // S, taps.shape[1]
    d = lambda t: t.double()  # noqa: E731
    x, k, v, wk, wq, wc, taps, window = map(d, (x, k, v, wk, wq, wc, taps, window))
    xs, ks = x.reshape(S, H), k.reshape(S, H)

    def norm(t, w):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + EPS) * w.reshape(S, H)

    kn, q = norm(ks, wk), norm(xs, wq)
    dot = (kn * q).sum(-1) / H ** 0.5
    dd = gamma(3 * H + 14) * (kn * q).abs().sum(-1) / H ** 0.5
    D = dot.abs()
    c_lo, c_hi = (D - dd).clamp_min(EPS), (D + dd).clamp_min(EPS)
    sgn = torch.sign(dot)
    flip = dd >= D
    a, b = torch.sqrt(c_lo) * (1 - U), torch.sqrt(c_hi) * (1 + U)
    g_lo = torch.where(flip, -b, torch.where(sgn > 0, a, -b))
    g_hi = torch.where(flip, b, torch.where(sgn > 0, b, -a))
    sig = lambda g: 1 / (1 + torch.exp(-g))  # noqa: E731
    s64 = sig(torch.sqrt(D.clamp_min(EPS)) * sgn)
    s_lo, s_hi = sig(g_lo) * (1 - gamma(8)), sig(g_hi) * (1 + gamma(8))
    vv = v.reshape(1, H)
    gv64 = s64[:, None] * vv
    e_gv = (torch.maximum(s_hi - s64, s64 - s_lo)[:, None] + gamma(1) * s_hi[:, None]) * vv.abs()

    def f(s):
        gv = s[:, None] * vv
        return gv / torch.sqrt((gv * gv).mean(-1, keepdim=True) + EPS) * wc.reshape(S, H)

    n64, n_lo, n_hi = f(s64), f(s_lo), f(s_hi)
    e_n = torch.maximum((n_lo - n64).abs(), (n_hi - n64).abs()) + gamma(H + 8) * torch.maximum(n_lo.abs(), n_hi.abs())
    n64, e_n = n64.reshape(C), e_n.reshape(C)
    full = torch.cat([window, n64[:, None]], 1)
    span = window.shape[1]
    y = sum(full[:, j * dil] * taps[:, j] for j in range(K))
    mag = sum((full[:, j * dil].abs() + (e_n if j * dil == span else 0)) * taps[:, j].abs() for j in range(K))
    e_y = e_n * taps[:, -1].abs() + gamma(2 * K) * mag
    silu = y * sig(y)
    e_silu = 1.1 * e_y + gamma(8) * (silu.abs() + 1.1 * e_y)
    out64 = x[0] + gv64.reshape(C) + silu
    bound = e_gv.reshape(C) + e_silu + gamma(2) * (x[0].abs() + gv64.abs().reshape(C) + e_gv.reshape(C)
                                                   + silu.abs() + e_silu)
    win64 = torch.cat([window[:, 1:], n64[:, None]], 1)
    win_bound = torch.cat([torch.zeros_like(window[:, 1:]), e_n[:, None]], 1)
    return out64[None], win64, bound[None], win_bound


@settings(max_examples=examples(15), deadline=None)
@given(S=st.integers(1, 4), H=st.integers(1, 200), K=st.integers(2, 4), dil=st.integers(1, 3),
       seed=st.integers(0, 2 ** 32 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_ple_mix_within_the_float32_bound(S, H, K, dil, seed, scale):
    assert interpreter_on()
    rng = np.random.default_rng(seed)
    C = S * H
    x, k, v = data(rng, 1, C, scale=scale), data(rng, 1, C), data(rng, 1, H, scale=scale)
    wk, wq, wc = data(rng, C), data(rng, C), data(rng, C)
    taps, window = data(rng, C, K), data(rng, C, (K - 1) * dil)
    out64, win64, bound, win_bound = reference_and_bound(x, k, v, wk, wq, wc, taps, window, S, dil)
    for fn in (ple_mix, ple_mix_torch):
        out, win = fn(x, k, v, wk, wq, wc, taps, window, S, EPS, dil)
        assert out.shape == (1, C) and win.shape == window.shape, fn.__name__
        assert bool(((out.double() - out64).abs() <= bound).all()), fn.__name__
        assert bool(((win.double() - win64).abs() <= win_bound).all()), fn.__name__


@settings(max_examples=examples(8), deadline=None)
@given(S=st.integers(1, 3), H=st.integers(1, 70), K=st.integers(2, 4), dil=st.integers(1, 3), T=st.integers(1, 4),
       seed=st.integers(0, 2 ** 32 - 1))
def test_tokens_at_once_are_one_token_steps_and_in_place_too(S, H, K, dil, T, seed):
    """T tokens in one launch: the T one-token launches' outputs and window bit for bit (a
    verify's rows are decode steps'); in_place (a decode graph's held window): the same
    bits, the new window written over the one given, which is returned; both twins."""
    rng = np.random.default_rng(seed)
    C = S * H
    x, k, v = data(rng, T, C), data(rng, T, C), data(rng, T, H)
    rest = [data(rng, C), data(rng, C), data(rng, C), data(rng, C, K)]
    window = data(rng, C, (K - 1) * dil)
    out, win = ple_mix(x, k, v, *rest, window, S, EPS, dil)
    held, rows = window.clone(), []
    for t in range(T):
        o, same = ple_mix(x[t:t + 1], k[t:t + 1], v[t:t + 1], *rest, held, S, EPS, dil, in_place=True)
        assert same is held
        rows.append(o)
    assert torch.equal(torch.cat(rows), out) and torch.equal(held, win)
    want = ple_mix_torch(x, k, v, *rest, window, S, EPS, dil)
    held = window.clone()
    got = ple_mix_torch(x, k, v, *rest, held, S, EPS, dil, in_place=True)
    assert got[1] is held and torch.equal(got[0], want[0]) and torch.equal(held, want[1])
