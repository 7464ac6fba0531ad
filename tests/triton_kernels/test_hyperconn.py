"""The hyper-connections' kernels (triton_kernels/hyperconn.py), through the interpreter,
and their torch twins, against float64 (u = 2^-24, gamma(n) = n u / (1 - n u)):

- hc_norm: the sum of squares errs by gamma(H) of itself, the mean, eps, the square root
  and the division add a rounding each, and the two products one each: |y - y64| <=
  gamma(H + 6) |y64|.
- hc_gates: v = both / S rounds once, and exp(-v) carries that rounding as a relative
  error |v| u of its own (its derivative is itself), with a few ulp of exp's; 1 + e, the
  division and the product (silu) or the doubling round once each: within gamma(8 + |v|)
  of |y64|, plus 1e-36 absolute: below v = -88.7 exp(-v) overflows float32, and both give
  0 for a value under 3e-37.
- hc_combine: each term xn / (1 + exp(-u)) within gamma(4) of itself (as above, u exact
  here), the sum of S terms gamma(S) of their magnitudes, the mean one more: |y - y64| <=
  gamma(S + 8) * mean |terms64|.
- hc_mix: the gates a as hc_gates (relative error rel_a = gamma(8 + |v|)); the up row
  u = sum_r w_r a_r, R products summed, errs by at most du = sum |w| |a64| rel_a +
  gamma(R) (1 + max rel_a) sum |w| |a64| (the computed a's error carried, then the sum's
  own; tl.sum's tree and an FMA round no more often); sigmoid's slope is at most 1/4, so
  a term xn sigmoid(u) moves by at most |xn| du / 4 before hc_combine's own roundings
  (gamma(S + 8) of the terms, as above): |y - y64| <= (1 + gamma(S + 8)) mean(|xn| du) / 4
  + gamma(S + 8) mean |terms64|. Its injection weights are hc_gates' (the same bound).
- hc_write: x + w o: the product and the sum round once each (or once, fused):
  |y - y64| <= gamma(2) (|x| + |w o|).
Each row is computed by its own program: a row's result is the same in any batch (checked
bit for bit, the first row alone against the batch).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quant
from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.hyperconn import (hc_combine, hc_combine_torch, hc_gates, hc_gates_torch, hc_mix, hc_mix_torch,
                                      hc_norm, hc_norm_torch,
                                      hc_write, hc_write_norm, hc_write_norm_torch, hc_write_torch)

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    return y.shape == ref.shape and bool(((y.double() - ref).abs() <= bound).all())


def data(seed: int, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32))


shapes = dict(T=st.integers(1, 3), S=st.integers(1, 4), H=st.integers(1, 300), seed=st.integers(0, 2 ** 32 - 1))


@settings(max_examples=examples(20), deadline=None)
@given(**shapes, scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_hc_norm_within_the_float32_bound(T, S, H, seed, scale):
    assert interpreter_on()
    x, w = data(seed, T, S * H, scale=scale), data(seed + 1, S, H)
    x64 = x.double().reshape(T, S, H)
    ref = (x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6) * w.double()).reshape(T, S * H)
    for f in (hc_norm, hc_norm_torch):
        assert within(f(x, w, 1e-6), ref, gamma(H + 6) * ref.abs()), f.__name__
    assert torch.equal(hc_norm(x[:1], w, 1e-6), hc_norm(x, w, 1e-6)[:1])


@settings(max_examples=examples(20), deadline=None)
@given(T=st.integers(1, 3), S=st.integers(1, 4), R=st.integers(1, 70), injects=st.booleans(),
       seed=st.integers(0, 2 ** 32 - 1), scale=st.sampled_from([0.1, 1.0, 30.0]))
def test_hc_gates_within_the_float32_bound(T, S, R, injects, seed, scale):
    both = data(seed, T, R + (S if injects else 0), scale=scale)
    v = both.double() / S
    sig = 1 / (1 + torch.exp(-v))
    ref_a, ref_inj = (v * sig)[:, :R], (2 * sig)[:, R:]
    rel = (8 + v.abs()) * U / (1 - (8 + v.abs()) * U)
    for f in (hc_gates, hc_gates_torch):
        a, inj = f(both, R, S)
        assert within(a, ref_a, rel[:, :R] * ref_a.abs() + 1e-36), f.__name__
        assert within(inj, ref_inj, rel[:, R:] * ref_inj.abs() + 1e-36), f.__name__
    one = hc_gates(both[:1], R, S)
    assert all(torch.equal(p, q[:1]) for p, q in zip(one, hc_gates(both, R, S)))


@settings(max_examples=examples(20), deadline=None)
@given(**shapes)
def test_hc_combine_within_the_float32_bound(T, S, H, seed):
    up, xn = data(seed, T, S * H, scale=3.0), data(seed + 1, T, S * H)
    terms = (xn.double() / (1 + torch.exp(-up.double()))).reshape(T, S, H)
    ref = terms.mean(1)
    for f in (hc_combine, hc_combine_torch):
        assert within(f(up, xn, S), ref, gamma(S + 8) * terms.abs().mean(1)), f.__name__
    assert torch.equal(hc_combine(up[:1], xn[:1], S), hc_combine(up, xn, S)[:1])


@settings(max_examples=examples(15), deadline=None)
@given(T=st.integers(1, 3), S=st.integers(1, 4), H=st.integers(1, 200), R=st.integers(1, 40), injects=st.booleans(),
       seed=st.integers(0, 2 ** 32 - 1), scale=st.sampled_from([0.1, 1.0, 30.0]))
def test_hc_mix_within_the_float32_bound(T, S, H, R, injects, seed, scale):
    both = data(seed, T, R + (S if injects else 0), scale=scale)
    w, xn = data(seed + 1, S * H, R), data(seed + 2, T, S * H)
    v = both.double() / S
    sig = 1 / (1 + torch.exp(-v))
    a64, ref_inj = (v * sig)[:, :R], (2 * sig)[:, R:]
    rel = (8 + v.abs()) * U / (1 - (8 + v.abs()) * U)
    rel_a = rel[:, :R]
    wa = a64.abs() @ w.double().abs().T                                   # (T, S*H)
    du = (rel_a * a64.abs()) @ w.double().abs().T + gamma(R) * (1 + float(rel_a.max())) * wa
    terms = (xn.double() / (1 + torch.exp(-(a64 @ w.double().T)))).reshape(T, S, H)
    ref = terms.mean(1)
    g = gamma(S + 8)
    bound = (1 + g) * (xn.double().abs() * du).reshape(T, S, H).mean(1) / 4 + g * terms.abs().mean(1)
    for f in (hc_mix, hc_mix_torch):
        y, inj = f(both, w, xn, R, S)
        assert within(y, ref, bound), f.__name__
        assert within(inj, ref_inj, rel[:, R:] * ref_inj.abs() + 1e-36), f.__name__
    one = hc_mix(both[:1], w, xn[:1], R, S)
    assert all(torch.equal(p, q[:1]) for p, q in zip(one, hc_mix(both, w, xn, R, S)))


@settings(max_examples=examples(10), deadline=None)
@given(T=st.integers(1, 3), S=st.integers(1, 4), H=st.integers(1, 80), blocks=st.integers(1, 3),
       fmt=st.sampled_from(["Q4_0", "Q8_0", "IQ4_NL", "Q5_0", "BF16", "F16"]), split=st.booleans(),
       seed=st.integers(0, 2 ** 32 - 1))
def test_hc_mix_reads_the_up_weight_in_its_blocks_as_its_float32_values(T, S, H, blocks, fmt, split, seed):
    """w_up as the file holds it (`fmt`; in the split device layout too), decoded in the
    launch: bit for bit the result from its dequantized float32 values, the torch twin's
    too. A row must be whole blocks."""
    from triton_kernels import layout
    from triton_kernels.dequant import dequantize_torch
    from triton_kernels.layout.split import TILE_BLOCKS, has_split
    f = quant.get(fmt)
    R = blocks * f.block_elems
    split = split and has_split(f) and (S * H * blocks) % TILE_BLOCKS == 0  # whole tiles
    raw = f.quantize(data(seed, S * H, R).numpy()).reshape(-1, f.block_bytes)
    q = torch.from_numpy(layout.pack(raw, f) if split else raw).reshape(-1)
    qf = layout.split_format(f) if split else f
    w = dequantize_torch(q, qf, torch.float32, compiled=False).reshape(S * H, R)
    both, xn = data(seed + 1, T, R + S), data(seed + 2, T, S * H)
    for fn in (hc_mix, hc_mix_torch):
        got, want = fn(both, q, xn, R, S, fmt=qf), fn(both, w, xn, R, S)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), fn.__name__
    with pytest.raises(ValueError, match="whole number a row"):
        hc_mix(both[:, 1:], q, xn, R - 1, S, fmt=qf)


@settings(max_examples=examples(10), deadline=None)
@given(T=st.integers(1, 3), S=st.integers(1, 4), G=st.integers(1, 5), R=st.integers(1, 40),
       seed=st.integers(0, 2 ** 32 - 1), scale=st.sampled_from([1e-30, 1.0, 30.0]))
def test_hc_mix_quantizes_its_output_as_quantize_x_does(T, S, G, R, seed, scale):
    """With `quantize` the launch also writes its output as int8.quantize_x would, bit for
    bit (a program's BLOCK_H columns, whole groups of 32), and quantize_x of the output, or
    of a view of all of it, gives that without a launch; a write to the output ends it."""
    from triton_kernels.int8 import quantize_x, quantize_x_torch
    H = 32 * G
    both = data(seed, T, R + S, scale=scale)
    w, xn = data(seed + 1, S * H, R), data(seed + 2, T, S * H, scale=scale)
    plain, _ = hc_mix(both, w, xn, R, S)
    y, _ = hc_mix(both, w, xn, R, S, quantize=True)
    assert torch.equal(y, plain)
    x8 = quantize_x(y)
    assert all(torch.equal(a, b) for a, b in zip(x8, quantize_x_torch(y)))
    assert quantize_x(y.reshape(T, H)) is x8 and quantize_x(y.view(-1).view(T, H)) is x8
    with torch.inference_mode():  # no version there: found by the storage alone
        yi, _ = hc_mix(both, w, xn, R, S, quantize=True)
        assert quantize_x(yi.reshape(T, H)) is not None
        assert all(torch.equal(a, b) for a, b in zip(quantize_x(yi), x8))
    y.mul_(2.0)
    again = quantize_x(y)
    assert again is not x8 and all(torch.equal(a, b) for a, b in zip(again, quantize_x_torch(y)))


@settings(max_examples=examples(10), deadline=None)
@given(T=st.integers(1, 3), S=st.integers(1, 4), G=st.integers(1, 5), K=st.integers(1, 3),
       seed=st.integers(0, 2 ** 32 - 1), scale=st.sampled_from([1e-30, 1.0, 30.0]))
def test_the_norming_writes_quantize_the_norm_as_quantize_x_does(T, S, G, K, seed, scale):
    """hc_write_norm and hc_write_moe with `quantize`: the same (y, xn), and xn's int8 form
    (the next read's down projection's input) written in the launch, quantize_x's bits;
    hc_norm (a read with no write before it) the same for its xn."""
    from triton_kernels.hc_moe_write import hc_write_moe
    from triton_kernels.int8 import quantize_x, quantize_x_torch
    H = 32 * G
    x, out, inj = data(seed, T, S * H, scale=scale), data(seed + 1, T, H), data(seed + 2, T, S)
    w = data(seed + 3, S, H)
    routed, gate, shared = data(seed + 4, T, K, H), data(seed + 5, T, 1), data(seed + 6, T, H)
    for f, args in ((hc_write_norm, (x, out, inj, w, 1e-6)), (hc_write_moe, (x, routed, gate, shared, inj, w, 1e-6))):
        y0, xn0 = f(*args)
        y, xn = f(*args, quantize=True)
        assert torch.equal(y, y0) and torch.equal(xn, xn0), f.__name__
        x8 = quantize_x(xn)
        assert quantize_x(xn.view(T, S * H)) is x8, f.__name__
        assert all(torch.equal(a, b) for a, b in zip(x8, quantize_x_torch(xn))), f.__name__
    xn = hc_norm(x, w, 1e-6, quantize=True)
    assert torch.equal(xn, hc_norm(x, w, 1e-6))
    assert all(torch.equal(a, b) for a, b in zip(quantize_x(xn), quantize_x_torch(xn)))
    assert quantize_x(xn) is quantize_x(xn.view(T, S * H))


@settings(max_examples=examples(20), deadline=None)
@given(**shapes, dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_hc_write_within_the_float32_bound(T, S, H, seed, dtype):
    x, out, inj = data(seed, T, S * H), data(seed + 1, T, H).to(dtype), data(seed + 2, T, S).abs()
    wo = (inj.double().unsqueeze(-1) * out.double().unsqueeze(1)).reshape(T, S * H)
    ref = x.double() + wo
    for f in (hc_write, hc_write_torch):
        assert within(f(x, out, inj), ref, gamma(2) * (x.double().abs() + wo.abs())), f.__name__
    assert torch.equal(hc_write(x[:1], out[:1], inj[:1]), hc_write(x, out, inj)[:1])


@settings(max_examples=examples(15), deadline=None)
@given(**shapes)
def test_hc_write_norm_gives_the_two_kernels_bits(T, S, H, seed):
    """The fused write and norm against hc_write then hc_norm (each held to float64 above):
    the same bits, through the interpreter and in torch."""
    x, out, inj, w = data(seed, T, S * H), data(seed + 1, T, H), data(seed + 2, T, S).abs(), data(seed + 3, S, H)
    y = hc_write(x, out, inj)
    y2, xn = hc_write_norm(x, out, inj, w, 1e-6)
    assert torch.equal(y2, y) and torch.equal(xn, hc_norm(y, w, 1e-6))
    yt, xnt = hc_write_norm_torch(x, out, inj, w, 1e-6)
    assert torch.equal(yt, hc_write_torch(x, out, inj)) and torch.equal(xnt, hc_norm_torch(yt, w, 1e-6))


@settings(max_examples=examples(20), deadline=None)
@given(**shapes, K=st.integers(0, 4), norm=st.booleans())
def test_hc_write_moe_gives_gated_add_and_the_writes_bits(T, S, H, K, norm, seed):
    """The MoE's last sum and the write (and norm) in one launch: the bits of gated_add's
    launch and then hc_write's (hc_write_norm's); its torch twin within the bound of
    gated_add_torch then hc_write_torch (and hc_norm_torch): the same ops in torch."""
    from triton_kernels.hc_moe_write import hc_write_moe, hc_write_moe_torch
    from triton_kernels.shared_expert import gated_add, gated_add_torch
    x, inj = data(seed, T, S * H), data(seed + 1, T, S).abs()
    proj = data(seed + 2, T, H + 1)  # the gate a column of a wider projection, as the engine's
    gate, shared = proj[:, H:], data(seed + 3, T, H)
    routed = data(seed + 4, T, K, H) if K else data(seed + 4, T, H)
    w = data(seed + 5, S, H) if norm else None
    y, xn = hc_write_moe(x, routed, gate, shared, inj, w, 1e-6)
    out = gated_add(routed, gate, shared)
    if norm:
        y2, xn2 = hc_write_norm(x, out, inj, w, 1e-6)
        assert torch.equal(xn, xn2)
    else:
        y2 = hc_write(x, out, inj)
        assert xn.numel() == 0
    assert torch.equal(y, y2)
    yt, xnt = hc_write_moe_torch(x, routed, gate, shared, inj, w, 1e-6)
    want = hc_write_torch(x, gated_add_torch(routed, gate, shared), inj)
    assert torch.equal(yt, want)
    if norm:
        assert torch.equal(xnt, hc_norm_torch(want, w, 1e-6))
        torch.testing.assert_close(xn, xnt, rtol=gamma(H + 8) * 4 + 1e-6, atol=1e-6)
    torch.testing.assert_close(y, yt, rtol=1e-5, atol=1e-5 * float(x.abs().max() + 1))
