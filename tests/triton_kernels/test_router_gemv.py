"""The router GEMV with its routing in the last program (triton_kernels/router_gemv.py),
through the interpreter: the two launches it replaces (qmatmul's one-row GEMV, dp4a or
float, then route_align on its output) bit for bit, counters and the shared expert's
SwiGLU with its int8 included (from the output's last rows or an earlier launch's), in
GGUF order and in the split device layout; with a second weight in a dp4a format (a
pair: a released file's F32 routers beside the shared expert's quantized gate and up),
the float GEMV, the pair's dp4a GEMV and route_align; its torch twin's product within the bound of
its activations: on the dp4a path |x̂ - x| <= d / 2 a value (d its group's scale), so
|out - out_twin| <= |W| |x̂ - x| plus float32 rounding of two K-term sums, gamma(K) of
|W| |x| each (u = 2^-24, gamma(n) = n u / (1 - n u)); on the float path the two sums'
rounding alone, and the output's rounding to `dtype` (half an ulp of it: 2^-9 relative
for bfloat16, 2^-12 for float16) on both sides."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quant
from tests.tiers import examples
from tests.triton_kernels.test_gemv_pair import weight
from triton_kernels import layout
from triton_kernels.dequant import dequantize_torch
from triton_kernels.int8 import quantize_x, quantize_x_torch
from triton_kernels.layout.split import TILE_BLOCKS, has_split
from triton_kernels.qmatmul import qmatmul
from triton_kernels.route_align import route_align
from triton_kernels.router_gemv import pair_path, path, router_gemv, router_gemv_torch

U = 2.0 ** -24


@settings(max_examples=examples(12), deadline=None)
@given(fmt=st.sampled_from(["Q8_0", "Q4_0", "IQ4_NL", "Q4_K", "F32", "BF16", "F16"]), split=st.booleans(),
       E=st.integers(2, 70), k_frac=st.floats(0, 1), shared=st.sampled_from([0, 32, 64]), apart=st.booleans(),
       extra=st.integers(0, 9), kb=st.integers(1, 3), block_m=st.sampled_from([0, 16]), cache=st.booleans(),
       count=st.booleans(), norm=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_router_gemv_is_the_gemv_and_route_align_launches(fmt, split, E, k_frac, shared, apart, extra, kb, block_m,
                                                          cache, count, norm, dtype, seed):
    rng = np.random.default_rng(seed)
    f = quant.get(fmt)
    dp4a = f.name in ("Q8_0", "Q4_0", "IQ4_NL", "Q4_K")
    # the shared expert's gate and up: the output's last rows, or (apart) an earlier launch's
    gu = torch.from_numpy(rng.standard_normal((1, 2 * shared + 5)).astype(np.float32))
    ext = (gu[:, 5:5 + shared], gu[:, 5 + shared:]) if shared and apart else None
    if ext is not None:
        shared = 0
    K = kb * max(f.block_elems, 64)
    N = E + extra + 2 * shared  # the router, more rows (the shared expert's gate), its SwiGLU's gate and up
    split = split and has_split(f) and (N * K // f.block_elems) % TILE_BLOCKS == 0
    raw = f.quantize(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K)).reshape(N, -1)
    q = torch.from_numpy(layout.pack(raw, f) if split else raw).reshape(-1)
    qf = layout.split_format(f) if split else f
    x = torch.from_numpy(rng.standard_normal((1, K)).astype(np.float32) * 3)
    k = max(1, min(E, round(k_frac * E)))
    lut = torch.from_numpy(np.where(rng.random(E) < 0.5, rng.integers(0, 9, E), -1)) if cache else None
    first, rows = 9, (9 + k if cache else E)
    counters = [torch.from_numpy(rng.integers(0, 5, E)) for _ in range(3)]  # hits, routed, missed
    assert path(qf, x.device, N, K) == ("dp4a" if dp4a else "gemv")

    def tallies():
        hits, routed, missed = (c.clone() for c in counters)
        return (hits if count else None, lut, routed if cache else None, missed if cache else None), (hits, routed,
                                                                                                     missed)

    (hits, lut_, routed, missed), fused_t = tallies()
    got = router_gemv(x, q, qf, N, k, norm, block_m, rows, E, shared, hits, lut_, routed, missed, first, ext, dtype)
    (hits, lut_, routed, missed), apart_t = tallies()
    out = qmatmul(x if dp4a else x.to(dtype), q, qf, n=N).float()  # as QuantLinear.forward runs it
    swiglu = (out[:, N - 2 * shared:N - shared], out[:, N - shared:]) if shared else ext
    want = (out, *route_align(out[:, :E], k, norm, block_m, rows, hits, lut_, routed, missed, first, swiglu))
    assert len(got) == len(want) == 9
    for i, (a, b) in enumerate(zip(got, want)):
        if i != 7 or block_m:  # without an alignment its length is never written (nothing reads it)
            assert torch.equal(a, b), i
    for a, b in zip(fused_t, apart_t):
        assert torch.equal(a, b)
    if swiglu is not None:  # the product's int8 attached, as route_align's
        assert all(torch.equal(a, b) for a, b in zip(quantize_x(got[-1]), quantize_x(want[-1].clone())))
    # the torch twin: the product within the int8 activations' bound (module docstring)
    twin = router_gemv_torch(x, q, qf, N, k, norm, block_m, rows, E, shared, *tallies()[0], first, ext, dtype)
    w = dequantize_torch(q, qf, torch.float32, compiled=False).reshape(N, K).double().abs()
    xs = x if dp4a else x.to(dtype).float()
    err = (quantize_x_torch(x).dequantize().double() - x.double()).abs() if dp4a else torch.zeros_like(x).double()
    gamma = K * U / (1 - K * U)
    bound = (err @ w.T) + 2 * gamma * (xs.double().abs() @ w.T)
    if not dp4a and dtype != torch.float32:  # each side rounded to bfloat16 once more
        bound = bound + 2 ** -8 * (twin[0].double().abs() + got[0].double().abs())
    assert bool(((twin[0].double() - got[0].double()).abs() <= bound).all())


@settings(max_examples=examples(8), deadline=None)
@given(fmt=st.sampled_from(["F32", "BF16", "F16"]), fmt2=st.sampled_from(["Q8_0", "Q4_0", "IQ4_NL", "Q4_K"]),
       split=st.booleans(), E=st.integers(2, 40), extra=st.integers(0, 3), shared=st.sampled_from([0, 32]),
       n2=st.integers(1, 40), kb=st.integers(1, 2), block_m=st.sampled_from([0, 16]), cache=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 32 - 1))
def test_a_pairs_rows_join_the_float_launch_with_their_own_gemvs_bits(fmt, fmt2, split, E, extra, shared, n2, kb,
                                                                      block_m, cache, dtype, seed):
    """router_gemv(pair=): the float GEMV's rows, then the pair's as its own dp4a GEMV
    gives them, routed as route_align routes the first's (the shared expert's SwiGLU from
    the pair's rows where `shared`: its gate and up are the pair); the torch twin's pair
    rows within the dp4a bound of the module docstring."""
    rng = np.random.default_rng(seed)
    K = kb * 256
    N, N2 = E + extra, 2 * shared if shared else n2
    q, qf = weight(rng, fmt, N, K, False)
    q2, qf2 = weight(rng, fmt2, N2, K, split)
    x = torch.from_numpy(rng.standard_normal((1, K)).astype(np.float32) * 3)
    assert pair_path(qf, x.device, N, K, qf2, N2)
    k = max(1, E // 3)
    lut = torch.from_numpy(np.where(rng.random(E) < 0.5, rng.integers(0, 9, E), -1)) if cache else None
    rows = 9 + k if cache else E

    def tallies():
        return (None, lut, *((torch.zeros(E, dtype=torch.long),) * 2 if cache else (None, None)))

    got = router_gemv(x, q, qf, N, k, True, block_m, rows, E, shared, *tallies(), 9, None, dtype, (q2, qf2, N2))
    out = torch.cat([qmatmul(x.to(dtype), q, qf, n=N).float(), qmatmul(x, q2, qf2, n=N2).float()], dim=1)
    swiglu = (out[:, N:N + shared], out[:, N + shared:]) if shared else None
    want = (out, *route_align(out[:, :E], k, True, block_m, rows, *tallies(), 9, swiglu))
    for i, (a, b) in enumerate(zip(got, want)):
        if i != 7 or block_m:  # without an alignment its length is never written
            assert torch.equal(a, b), i
    twin = router_gemv_torch(x, q, qf, N, k, True, block_m, rows, E, shared, *tallies(), 9, None, dtype,
                             (q2, qf2, N2))[0][:, N:]
    w = dequantize_torch(q2, qf2, torch.float32, compiled=False).reshape(N2, K).double().abs()
    err = (quantize_x_torch(x).dequantize().double() - x.double()).abs()
    bound = err @ w.T + 2 * (K * U / (1 - K * U)) * (x.double().abs() @ w.T)
    assert bool(((twin.double() - got[0][:, N:].double()).abs() <= bound).all())


def test_a_projection_the_launch_does_not_take_is_refused(monkeypatch):
    """qmatmul's GEMM (batch-invariant mode's for float formats) goes to the two launches
    (`path` says so); wrong shapes are named."""
    from triton_kernels import invariant
    f = quant.get("F32")
    q = torch.zeros(64 * 64 * 4, dtype=torch.uint8)
    assert path(f, torch.device("cpu"), 64, 64) == "gemv"
    with invariant.batch_invariant(True):
        assert path(f, torch.device("cpu"), 64, 64) is None
        with pytest.raises(ValueError, match="takes no fused launch"):
            router_gemv(torch.zeros(1, 64), q, f, 64, 2, True, 0, 8, 8)
    with pytest.raises(ValueError, match="do not fit N=64"):
        router_gemv(torch.zeros(1, 64), q, f, 64, 2, True, 0, 8, 8, shared=30)
    # a pair in a float format has no dp4a GEMV to join the launch with
    assert not pair_path(f, torch.device("cpu"), 64, 64, f, 64)
    with pytest.raises(ValueError, match="does not join the launch"):
        router_gemv(torch.zeros(1, 64), q, f, 64, 2, True, 0, 8, 8, pair=(q, f, 64))
