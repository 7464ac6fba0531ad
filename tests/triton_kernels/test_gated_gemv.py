"""A GEMV with its input's gate in its launch (triton_kernels/gated_gemv.py), through the
interpreter: bit for bit the two launches it replaces (silu_mul or sigmoid_mul, the cast
to the GEMV's dtype, qmatmul's GEMV: the same expressions, the bfloat16 rounding done on
the bits as torch's cast rounds), and within the float32 bound of a float64 reference for
its torch twin: the gate as tests/triton_kernels/test_shared_expert.py bounds it
(gamma(8 + |g|) relative), then the cast (half an ulp of dtype), then a dot of K products
(gamma(K + 2) of sum |x| |w|), the result's own rounding on top."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quant
from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.dequant import dequantize_torch
from triton_kernels.gated_gemv import gated_qmatmul, gated_qmatmul_torch
from triton_kernels.qmatmul import qmatmul
from triton_kernels.shared_expert import sigmoid_mul, silu_mul

U = 2.0 ** -24
EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def gamma(n):
    return n * U / (1 - n * U)


@settings(max_examples=examples(16), deadline=None)
@given(M=st.integers(1, 5), N=st.integers(1, 40), kb=st.integers(1, 3), silu=st.booleans(),
       fmt=st.sampled_from(["F32", "F16", "BF16", "FP8_E4M3"]), dtype=st.sampled_from(list(EPS)),
       seed=st.integers(0, 2 ** 32 - 1))
def test_gated_gemv_is_the_gate_then_the_gemv(M, N, kb, silu, fmt, dtype, seed):
    assert interpreter_on()
    f = quant.get(fmt)
    K = kb * max(f.block_elems, 32)
    rng = np.random.default_rng(seed)
    q = torch.from_numpy(f.quantize(rng.standard_normal((N, K)).astype(np.float32)).reshape(N, -1))
    both = torch.from_numpy((rng.standard_normal((M, 3 * K)) * 3).astype(np.float32))
    g, u = both[:, :K], both[:, K:2 * K]  # column ranges of one projection's rows, as the engine's
    got = gated_qmatmul(g, u, q, fmt, silu, dtype)
    want = qmatmul((silu_mul if silu else sigmoid_mul)(g, u).to(dtype), q, fmt)
    assert got.dtype == dtype and torch.equal(got, want)
    # the torch twin and the kernel against float64
    g64, u64 = g.double(), u.double()
    s = 1 / (1 + torch.exp(-g64))
    x64 = (g64 * s if silu else s) * u64
    w64 = dequantize_torch(q, f).double().reshape(N, K)
    y64 = x64 @ w64.T
    dx = x64.abs() * (gamma(8 + g64.abs()) + EPS[dtype] * (1 + gamma(8 + g64.abs())))
    bound = (dx @ w64.abs().T + gamma(K + 2) * ((x64.abs() + dx) @ w64.abs().T)) * (1 + EPS[dtype]) \
        + EPS[dtype] * y64.abs() + 1e-30
    for out in (got, gated_qmatmul_torch(g, u, q, fmt, silu, dtype)):
        assert ((out.double() - y64).abs() <= bound).all()


@settings(max_examples=examples(8), deadline=None)
@given(M=st.integers(1, 2), N=st.integers(1, 40), kb=st.integers(1, 3), silu=st.booleans(),
       fmt=st.sampled_from(["Q8_0", "Q4_K"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_on_the_dp4a_path_the_gemv_rounds_the_float32_product(M, N, kb, silu, fmt, dtype, seed):
    """Formats with int8 units: the product in float32 (its launch quantizes it for the GEMV
    on a GPU: int8.attach), the dp4a GEMV, then the cast."""
    f = quant.get(fmt)
    K = kb * f.block_elems
    rng = np.random.default_rng(seed)
    g, u = (torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32)) for _ in range(2))
    q = torch.from_numpy(f.quantize(rng.standard_normal((N, K)).astype(np.float32)))
    got = gated_qmatmul(g, u, q, fmt, silu, dtype)
    want = qmatmul((silu_mul if silu else sigmoid_mul)(g, u), q, fmt, path="dp4a").to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
