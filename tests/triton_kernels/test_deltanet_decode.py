"""A DeltaNet layer's tokens, one after another, in one launch
(triton_kernels/deltanet_decode.py), through the interpreter, against the separate
launches it replaced.

A token of the launch is deltanet_conv_inputs, deltanet_step and deltanet_gated_norm bit
for bit: the same jit functions, the same sums in the same order (checked here for the
rows, their int8 form, the state and the new window, in place or not, heads of any width
and the tiled head order, several value-column blocks a head and one); T tokens in one
launch are T one-token launches; and T rows through the separate launches a verify took
(conv_step first) are the same bits too. So its accuracy is theirs,
each checked against float64 within its own float32 bound
(tests/triton_kernels/test_deltanet_inputs.py, test_deltanet.py); the torch twin is the
three torch twins one after another (checked equal to them here; each within its bound of
float64 in those tests).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.deltanet import deltanet_step, deltanet_step_torch
from triton_kernels.deltanet_decode import deltanet_decode, deltanet_decode_torch
from triton_kernels.conv import conv_step
from triton_kernels.deltanet_inputs import (deltanet_conv_inputs, deltanet_conv_inputs_torch, deltanet_gated_norm,
                                            deltanet_gated_norm_torch, deltanet_inputs)
from triton_kernels.int8 import quantize_x, quantize_x_torch


def layer(rng, Hk: int, rep: int, dk: int, dv: int, K: int, scale: float = 1.0, T: int = 1):
    """T tokens' projections (qkv, z, b, a column slices of their rows, as the model's), the
    conv's window and taps, the gates' parameters, the norm's weight and a state."""
    Hv = Hk * rep
    C = 2 * Hk * dk + Hv * dv
    f = (lambda *shape, s=1.0: torch.from_numpy((rng.standard_normal(shape) * s).astype(np.float32)))
    proj = f(T, C + Hv * dv + 2 * Hv, s=scale)
    qkv, z, b, a = proj.split([C, Hv * dv, Hv, Hv], dim=-1)
    a_coef = -torch.from_numpy(rng.uniform(0.01, 20, Hv).astype(np.float32))
    return dict(window=f(C, K - 1, s=scale), qkv=qkv, taps=f(C, K, s=0.5), b=b, a=a, dt_bias=f(Hv, s=4.0),
                a_coef=a_coef, k_heads=Hk, dk=dk, state=f(Hv, dk, dv), z=z, norm=f(dv), eps=1e-6)


def separate(conv_inputs, step, gated_norm, p):
    """The three launches (or twins) the one replaces: (rows, new window), the state in place."""
    q, k, v, g, beta, new = conv_inputs(p["window"], p["qkv"], p["taps"], p["b"], p["a"], p["dt_bias"],
                                        p["a_coef"], p["k_heads"], p["dk"])
    return gated_norm(step(q, k, v, g, beta, p["state"]), p["z"], p["norm"], p["eps"]), new


def run(f, p, **kw):
    return f(p["window"], p["qkv"], p["taps"], p["b"], p["a"], p["dt_bias"], p["a_coef"], p["k_heads"], p["dk"],
             p["state"], p["z"], p["norm"], p["eps"], **kw)


@settings(max_examples=examples(12), deadline=None)
@given(Hk=st.integers(1, 3), rep=st.integers(1, 3), dk=st.integers(1, 40), dv=st.sampled_from([1, 5, 16, 32, 37, 64]),
       K=st.integers(2, 4), scale=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2 ** 32 - 1))
def test_one_launch_is_the_three_bit_for_bit(Hk, rep, dk, dv, K, scale, seed):
    assert interpreter_on()
    p = layer(np.random.default_rng(seed), Hk, rep, dk, dv, K, scale)
    before = p["state"].clone()
    want, want_window = separate(deltanet_conv_inputs, deltanet_step, deltanet_gated_norm, p)
    want_state, p["state"] = p["state"], before.clone()
    rows, window = run(deltanet_decode, p)
    assert torch.equal(rows, want) and torch.equal(window, want_window) and torch.equal(p["state"], want_state)
    assert window is not p["window"]
    # in place (a CUDA graph's window), with the rows' int8 form where dv holds whole groups
    held, p["state"] = p["window"].clone(), before.clone()
    rows, window = run(deltanet_decode, {**p, "window": held}, quantize=True, in_place=True)
    assert window is held and torch.equal(held, want_window) and torch.equal(rows, want)
    assert torch.equal(p["state"], want_state)
    if dv % 32 == 0:  # quantize_x finds the launch's int8 rows, quantize_x's bits
        x8 = quantize_x(rows)
        assert all(torch.equal(a, b) for a, b in zip(x8, quantize_x_torch(want)))
    # the torch twin is the three twins
    p["state"] = before.clone()
    twin_rows, twin_window = run(deltanet_decode_torch, p)
    twin_state, p["state"] = p["state"], before.clone()
    three, three_window = separate(deltanet_conv_inputs_torch, deltanet_step_torch, deltanet_gated_norm_torch, p)
    assert torch.equal(twin_rows, three) and torch.equal(twin_window, three_window)
    assert torch.equal(twin_state, p["state"])


def separate_rows(p):
    """T tokens through the separate launches (the conv over the rows, deltanet_inputs, the
    recurrence's T tokens in one launch, the gated norm), as a verify ran them before
    deltanet_decode: (rows, new window), the state in place."""
    mixed, window = conv_step(p["window"], p["qkv"], p["taps"], 1)
    q, k, v, g, beta = deltanet_inputs(mixed, p["b"], p["a"], p["dt_bias"], p["a_coef"], p["k_heads"], p["dk"])
    return deltanet_gated_norm(deltanet_step(q, k, v, g, beta, p["state"]), p["z"], p["norm"], p["eps"]), window


def decoded(p):
    """The same T tokens as T decode steps: deltanet_decode one after another."""
    rows, window = [], p["window"]
    for t in range(p["qkv"].shape[0]):
        r, window = run(deltanet_decode, {**p, **{n: p[n][t:t + 1] for n in ("qkv", "z", "b", "a")},
                                          "window": window})
        rows.append(r)
    return torch.cat(rows), window


@settings(max_examples=examples(8), deadline=None)
@given(T=st.integers(2, 4), Hk=st.integers(1, 2), rep=st.integers(1, 3), dk=st.integers(1, 40),
       dv=st.sampled_from([5, 32, 37]), K=st.integers(2, 4), seed=st.integers(0, 2 ** 32 - 1))
def test_the_separate_launches_over_rows_are_decode_steps_bit_for_bit(T, Hk, rep, dk, dv, K, seed):
    """The separate launches over T rows (conv_step, deltanet_inputs, deltanet_step,
    deltanet_gated_norm) give T one-launch decode steps' rows, state and window: the
    separate launches stay the one launch's reference for rows too."""
    p = layer(np.random.default_rng(seed), Hk, rep, dk, dv, K, T=T)
    q = {**p, "state": p["state"].clone()}
    rows, window = separate_rows(p)
    want, want_window = decoded(q)
    assert torch.equal(rows, want) and torch.equal(window, want_window) and torch.equal(p["state"], q["state"])


@settings(max_examples=examples(8), deadline=None)
@given(T=st.integers(2, 5), Hk=st.integers(1, 2), rep=st.integers(1, 3), dk=st.integers(1, 40),
       dv=st.sampled_from([5, 32, 37]), K=st.integers(2, 4), in_place=st.booleans(),
       seed=st.integers(0, 2 ** 32 - 1))
def test_tokens_in_one_launch_are_one_token_launches_bit_for_bit(T, Hk, rep, dk, dv, K, in_place, seed):
    """What a speculative verify promises (its rows are the decode steps'; DeltaNetState.keep
    replays the kept ones through the same launch): T rows, read from the projection's rows
    by their stride, in one launch give T one-token launches' rows, state and window (moved
    on by T, whether T is below the window's span or not), and its int8 rows."""
    p = layer(np.random.default_rng(seed), Hk, rep, dk, dv, K, T=T)
    q = {**p, "state": p["state"].clone()}
    held = p["window"].clone()
    rows, window = run(deltanet_decode, {**p, "window": held}, quantize=True, in_place=in_place)
    want, want_window = decoded(q)
    assert torch.equal(rows, want) and torch.equal(window, want_window) and torch.equal(p["state"], q["state"])
    assert (window is held) == in_place
    if dv % 32 == 0:
        assert all(torch.equal(a, b) for a, b in zip(quantize_x(rows), quantize_x_torch(want)))


class _Counted:
    """A Triton kernel whose launches are counted, then run."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("in_place", [False, True])
def test_rows_past_32_bit_offsets_take_launches_one_after_another(monkeypatch, in_place):
    """More rows than a launch's 32-bit offsets reach (here made small: 2 rows a launch)
    run as several launches, each continuing the window the one before moved on: the one
    launch's bits, its int8 rows too."""
    from triton_kernels import deltanet_decode as module
    p = layer(np.random.default_rng(7), 2, 2, 16, 32, 4, T=9)
    one = {**p, "state": p["state"].clone(), "window": p["window"].clone()}
    want, want_window = run(deltanet_decode, one, quantize=True)
    counted = _Counted(module._decode_kernel)
    monkeypatch.setattr(module, "_decode_kernel", counted)
    monkeypatch.setattr(module, "OFFSETS", (2 + 4) * p["qkv"].stride(0))  # widest stride: the projection's row
    rows, window = run(deltanet_decode, p, quantize=True, in_place=in_place)
    assert len(counted.grids) == 5 and (window is p["window"]) == in_place
    assert torch.equal(rows, want) and torch.equal(window, want_window) and torch.equal(p["state"], one["state"])
    assert all(torch.equal(x, y) for x, y in zip(quantize_x(rows), quantize_x(want)))


def test_its_counts_are_left_at_zero_for_the_next_launch():
    """Each key head's last program sets its count back: a second token (a CUDA graph's
    replay) runs as the first, and the three launches agree with it again."""
    from triton_kernels.int8 import zeroed_counts
    p = layer(np.random.default_rng(3), 2, 3, 16, 64, 4)
    q = {**p, "state": p["state"].clone(), "window": p["window"].clone()}
    for _ in range(2):
        rows, p["window"] = run(deltanet_decode, p, in_place=True)
        want, q["window"] = separate(deltanet_conv_inputs, deltanet_step, deltanet_gated_norm, q)
        assert torch.equal(rows, want) and torch.equal(p["state"], q["state"])
    assert not zeroed_counts(torch.device("cpu"), 2)[:2].any()


def test_wrong_shapes_are_named():
    p = layer(np.random.default_rng(0), 1, 2, 8, 16, 4)
    with pytest.raises(ValueError, match="z .* do not fit 1 key heads of 8"):
        run(deltanet_decode, {**p, "z": p["z"][:, :-1]})
    with pytest.raises(ValueError, match=r"the tokens' qkv \(T, C\), taps \(C, K\) and window \(C, K - 1\)"):
        run(deltanet_decode, {**p, "window": p["window"][:, 1:]})
    with pytest.raises(ValueError, match=r"qkv \(2, 48\), b, a \(1, 2\)"):
        run(deltanet_decode, {**p, "qkv": p["qkv"].expand(2, -1)})


@pytest.mark.slow
def test_a_token_and_a_verifys_rows_compile_for_the_gpus_without_spills():
    """At Flash-Next's heads (16 key heads, 48 value heads of 128, 4 taps): one token and
    a verify's 4 rows compile for sm_90 and gfx942 with no spill. One token's T = 1 is a
    constant to a Triton launch (its specialization of an integer argument of 1, which the
    launches' replay takes too): its kernel has no token loop, and holds fewer registers
    (triton_kernels/NOTES.md gives the counts)."""
    from triton_kernels.analysis.launches import compile_calls, record
    from triton_kernels.ops import impl
    with record() as calls:
        for T in (1, 4):
            run(impl("deltanet_decode", "triton"), layer(np.random.default_rng(T), 16, 3, 128, 128, 4, T=T),
                quantize=True, in_place=True)
    results = compile_calls(calls)
    assert len(results) == 4 and not [r.problems for r in results if r.problems], results
    for target in ("sm_90", "gfx942"):
        one, rows = (r for r in results if r.target == target)
        assert "'T': 1" in one.constexprs and "'T'" not in rows.constexprs, (one.constexprs, rows.constexprs)
        assert one.regs < rows.regs, (target, one.regs, rows.regs)
