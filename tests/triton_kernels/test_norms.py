"""Rows at unit L2 norm (triton_kernels/norms.py, the torch form; the GPU path's is inside
triton_kernels/deltanet_inputs.py, tested in test_deltanet_inputs.py), against float64. Each result is x_i / sqrt(sum x^2 + eps): the sum
errs by at most gamma(D) of itself, the square root halves that, and the root, the
division and the product round once each, so |y - y64| <= gamma(D + 4) |y64|."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from triton_kernels.norms import l2norm_torch

U = 2.0 ** -24


@settings(max_examples=examples(25), deadline=None)
@given(rows=st.integers(1, 9), D=st.integers(1, 200), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_rows_at_unit_norm_within_the_float32_bound(rows, D, scale, seed):
    x = torch.from_numpy((np.random.default_rng(seed).standard_normal((rows, D)) * scale).astype(np.float32))
    x64 = x.double()
    ref = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) + 1e-6)
    bound = (D + 4) * U / (1 - (D + 4) * U) * ref.abs()
    y = l2norm_torch(x)
    assert y.shape == x.shape and bool(((y.double() - ref).abs() <= bound).all())
