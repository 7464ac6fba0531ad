"""One token of the depthwise causal conv (triton_kernels/conv.py): the kernel, through the
interpreter, equals its torch twin bit for bit (the same products and sums, each rounded on
its own), and the twin equals strata.nn.deltanet.causal_conv's one-token result bit for bit."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.nn.deltanet import causal_conv
from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.conv import conv_step, conv_step_torch


@settings(max_examples=examples(25), deadline=None)
@given(C=st.integers(1, 300), K=st.integers(2, 5), dilation=st.integers(1, 3), seed=st.integers(0, 2 ** 32 - 1))
def test_one_token_equals_the_torch_conv(C, K, dilation, seed):
    assert interpreter_on()
    rng = np.random.default_rng(seed)
    f = (lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32)))
    window, x, w = f(C, (K - 1) * dilation), f(1, C), f(C, K)
    y, out = conv_step(window, x, w, dilation)
    y_t, out_t = conv_step_torch(window, x, w, dilation)
    y_c, out_c = causal_conv(window, x, w, dilation)
    assert torch.equal(y, y_t) and torch.equal(out, out_t)
    assert torch.equal(y_t, y_c) and torch.equal(out_t, out_c)
