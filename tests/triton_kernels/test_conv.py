"""The depthwise causal conv over T tokens (triton_kernels/conv.py; a short window in one
token block, a prompt in several): the kernel, through the interpreter, equals its torch
twin bit for bit (the same products and sums, each rounded on its own), the twin equals
strata.nn.deltanet.causal_conv's torch result bit for bit, and a token's output and the
window left are the same whether the tokens come at once or one by one (a verify's rows
are one-token steps'), also with the window moved on in place."""
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
@given(C=st.integers(1, 300), T=st.one_of(st.integers(1, 6), st.sampled_from([16, 17, 40])), K=st.integers(2, 5),
       dilation=st.integers(1, 3),
       strided=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_tokens_equal_the_torch_conv_and_one_token_steps(C, T, K, dilation, strided, seed):
    assert interpreter_on()
    rng = np.random.default_rng(seed)
    f = (lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32)))
    window, w = f(C, (K - 1) * dilation), f(C, K)
    x = f(T, C + 3)[:, :C] if strided else f(T, C)  # (a column slice of a projection's rows)
    y, out = conv_step(window, x, w, dilation)
    y_t, out_t = conv_step_torch(window, x, w, dilation)
    y_c, out_c = causal_conv(window, x, w, dilation)
    assert torch.equal(y, y_t) and torch.equal(out, out_t)
    assert torch.equal(y_t, y_c) and torch.equal(out_t, out_c)
    for fn in (conv_step, conv_step_torch):
        held, rows = window.clone(), []
        for t in range(T):  # one by one, in place
            y1, same = fn(held, x[t:t + 1], w, dilation, in_place=True)
            assert same is held
            rows.append(y1)
        assert torch.equal(torch.cat(rows), y) and torch.equal(held, out), fn.__name__
        held = window.clone()  # all at once, in place
        y1, same = fn(held, x, w, dilation, in_place=True)
        assert same is held and torch.equal(y1, y) and torch.equal(held, out), fn.__name__


def test_the_conv_names_its_shapes():
    with np.testing.assert_raises_regex(ValueError, r"conv_step: window \(4, 3\), x \(2, 5\) and taps \(4, 4\) "
                                                    r"do not fit tokens \(T, 4\) of a conv of 4 taps, dilation 1"):
        conv_step(torch.zeros(4, 3), torch.zeros(2, 5), torch.zeros(4, 4))
