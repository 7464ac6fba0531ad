"""One token of the gated delta rule (triton_kernels/deltanet.py): the kernel, through the
interpreter, and its torch twin, each against a float64 reference of the same math.

Bound: float32 rounds each step once (the decay, the delta, the write) and each sum over
dk (kv and o) in some order, so each result lies within gamma(n) = n u / (1 - n u),
u = 2^-24, times the sum of its terms' magnitudes, with n = dk + 3 for kv and the state
and 2 dk + 6 for o (its sum reads the written state). A wrong index, head or gate gives
errors of the values' own size."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.deltanet import deltanet_step, deltanet_step_torch

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def reference(q, k, v, g, beta, s):
    """(o, new state, bound on o, bound on the state) in float64."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, s))
    dk = s.shape[1]
    s1 = s * g.exp()[:, None, None]
    kv = (s1 * k[..., None]).sum(1)
    kv_abs = (s1.abs() * k.abs()[..., None]).sum(1)
    d = (v - kv) * beta[:, None]
    s2 = s1 + k[..., None] * d[:, None, :]
    # the written state: its own rounding, the decay's, and the delta's error through |k|
    s_err = gamma(dk + 3) * (s1.abs() + k.abs()[..., None] * beta.abs()[:, None, None]
                             * (v.abs() + kv_abs)[:, None, :])
    o = (s2 * q[..., None]).sum(1)
    o_err = gamma(2 * dk + 6) * ((s2.abs() + s_err) * q.abs()[..., None]).sum(1) + (s_err * q.abs()[..., None]).sum(1)
    return o, s2, o_err, s_err


@settings(max_examples=examples(25), deadline=None)
@given(Hv=st.integers(1, 4), dk=st.sampled_from([8, 16, 24, 32]), dv=st.sampled_from([8, 32, 40, 64]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_one_token_agrees_with_the_float64_rule(Hv, dk, dv, seed):
    assert interpreter_on()
    rng = np.random.default_rng(seed)
    f = (lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32)))
    q, k, v = f(Hv, dk), f(Hv, dk), f(Hv, dv)
    g = -torch.from_numpy(rng.uniform(0, 2, Hv).astype(np.float32))   # a decay: exp(g) in (0.13, 1]
    beta = torch.from_numpy(rng.uniform(0, 1, Hv).astype(np.float32))
    s0 = f(Hv, dk, dv)
    o_ref, s_ref, o_err, s_err = reference(q, k, v, g, beta, s0)
    for step in (deltanet_step, deltanet_step_torch):
        s = s0.clone()
        o = step(q, k, v, g, beta, s)
        assert o.shape == (Hv, dv) and o.dtype == torch.float32
        assert bool(((s.double() - s_ref).abs() <= s_err).all()), (step.__name__, (s.double() - s_ref).abs().max())
        assert bool(((o.double() - o_ref).abs() <= o_err).all()), (step.__name__, (o.double() - o_ref).abs().max())


@settings(max_examples=examples(15), deadline=None)
@given(T=st.integers(1, 5), Hv=st.integers(1, 3), dk=st.sampled_from([8, 24]), dv=st.sampled_from([8, 40]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_tokens_at_once_are_one_token_steps(T, Hv, dk, dv, seed):
    """A leading token axis: the T tokens in one launch give the T one-token calls' outputs
    and state bit for bit (the state stays float32 between them), in both twins; so a
    verify's rows are decode steps'."""
    rng = np.random.default_rng(seed)
    f = (lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32)))
    q, k, v = f(T, Hv, dk), f(T, Hv, dk), f(T, Hv, dv)
    g = -torch.from_numpy(rng.uniform(0, 2, (T, Hv)).astype(np.float32))
    beta = torch.from_numpy(rng.uniform(0, 1, (T, Hv)).astype(np.float32))
    s0 = f(Hv, dk, dv)
    for step in (deltanet_step, deltanet_step_torch):
        s_all, s_one = s0.clone(), s0.clone()
        o_all = step(q, k, v, g, beta, s_all)
        o_one = torch.stack([step(q[t], k[t], v[t], g[t], beta[t], s_one) for t in range(T)])
        assert o_all.shape == (T, Hv, dv) and torch.equal(o_all, o_one) and torch.equal(s_all, s_one), step.__name__


def test_a_wrong_shape_is_named():
    s = torch.zeros(2, 8, 8)
    with pytest.raises(ValueError, match=r"deltanet_step: k must be float32 \(2, 8\)"):
        deltanet_step(torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(2, 8), torch.zeros(2), torch.zeros(2), s)
