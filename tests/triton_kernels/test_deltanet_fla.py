"""fla-core's gated-delta-rule kernels (triton_kernels/deltanet_fla.py) in Strata's layouts,
through the interpreter on CPU tensors, against Strata's recurrence and float64.

Bound: each token's rounding errors are those of tests/triton_kernels/test_deltanet.py's
one-token bound (gamma(dk + 3) of the state's terms, gamma(2 dk + 6) of the output's). The
map a token applies to the state, S -> exp(g) (I - beta k k^T) S, has operator norm at most
1 (k unit, beta in [0, 1], g <= 0), so an error made at one token never grows after it:
the state's error per head, in the Frobenius norm, is at most the sum over tokens of each
token's bound (taken in that norm), and an output's is its own token's bound plus |q| times
the state's error so far. Both fla's kernels and Strata's torch step must lie within it of
float64. A wrong layout (heads, K against V, the state's transpose, the decay's sign or
the scale) gives errors of the values' own size.

fla's chunked kernels (prefill) stop under the interpreter: first in Triton's autotuner
(it benchmarks on a GPU), and with its configs pinned to one, in the state pass
(fla/ops/common/chunk_delta_h.py:176 calls `.to` on the loop index, a Python int in the
interpreter). Here they are checked through the arguments Strata gives them
(`chunk_arguments`); on a GPU, `test_on_the_gpu_fla_chunks_match_strata_chunked` runs them
(pytest -m cuda, step 1 of scripts/gpu_check.sh, with fla-core's wheels in .whl/).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.triton_kernels.test_deltanet import reference
from triton_kernels.backend import interpreter_on
from triton_kernels.deltanet import deltanet_step, deltanet_step_torch
from triton_kernels.deltanet_fla import chunk_arguments, deltanet_path, fla_installed

pytestmark = pytest.mark.skipif(not fla_installed(), reason="fla-core not installed (pip install strata-engine[cuda])")
interpreted = pytest.mark.skipif(not interpreter_on(), reason="fla's kernels run on the CPU under TRITON_INTERPRET=1")


def inputs(T: int, H: int, dk: int, dv: int, seed: int = 0):
    """What triton_kernels.deltanet_inputs gives: q, k unit (q scaled), g <= 0, beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    f = (lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32)))
    q = torch.nn.functional.normalize(f(T, H, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(f(T, H, dk), dim=-1)
    g = -torch.from_numpy(rng.uniform(0, 1, (T, H)).astype(np.float32))
    beta = torch.from_numpy(rng.uniform(0, 1, (T, H)).astype(np.float32))
    return q, k, f(T, H, dv), g, beta, f(H, dk, dv)


def bounded_reference(q, k, v, g, beta, s0):
    """float64 outputs (T, H, dv), final state, and their bounds (see the module)."""
    s, acc = s0.double(), torch.zeros(s0.shape[0], dtype=torch.float64)
    outs, errs = [], []
    for t in range(q.shape[0]):
        o, s, o_err, s_err = reference(q[t], k[t], v[t], g[t], beta[t], s)
        acc = acc + s_err.pow(2).sum((1, 2)).sqrt()
        outs.append(o)
        errs.append(o_err + q[t].double().norm(dim=-1, keepdim=True) * acc[:, None])
    return torch.stack(outs), s, torch.stack(errs), acc


@interpreted
def test_fla_fused_recurrent_matches_strata_recurrence_within_the_bound():
    """T = 64 tokens, 2 heads of 32: fla's public fused_recurrent over all of them and
    Strata's torch step, both within the bound of float64. fla's chunked kernels (a
    prompt's) take the same layouts (`chunk_arguments`) and stop under the interpreter: its
    fused recurrence shows here that the layouts Strata gives fla are the ones it reads."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    q, k, v, g, beta, s0 = inputs(64, 2, 32, 32)
    o64, s64, o_err, s_err = bounded_reference(q, k, v, g, beta, s0)

    def check(name, o, s):
        assert o.shape == o64.shape and o.dtype == torch.float32, name
        assert bool(((o.double() - o64).abs() <= o_err).all()), (name, (o.double() - o64).abs().max())
        assert bool(((s.double() - s64).pow(2).sum((1, 2)).sqrt() <= s_err).all()), name

    # by keyword: fla 0.6.0's fifth argument is gk (a decay per key channel), not beta
    o, final = fused_recurrent_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None], scale=1.0,
                                                initial_state=s0[None].clone(), output_final_state=True)
    check("fla fused_recurrent", o[0], final[0])
    s_torch = s0.clone()
    check("Strata's torch step", deltanet_step_torch(q, k, v, g, beta, s_torch), s_torch)


def test_the_chunked_kernels_get_strata_tensors_as_fla_lays_them_out():
    q, k, v, g, beta, s0 = inputs(5, 3, 8, 16)
    a = chunk_arguments(q, k, v, g, beta, s0)
    assert a["q"].shape == a["k"].shape == (1, 5, 3, 8) and a["v"].shape == (1, 5, 3, 16)
    assert a["g"].shape == a["beta"].shape == (1, 5, 3) and torch.equal(a["g"][0], g)
    assert a["initial_state"].shape == (1, 3, 8, 16) and a["initial_state"].data_ptr() == s0.data_ptr()
    assert a["scale"] == 1.0 and not a["use_qk_l2norm_in_kernel"] and a["output_final_state"]


def test_fla_is_taken_on_cuda_with_triton_kernels_only():
    assert deltanet_path("cuda", "triton")[0] == "fla-core"
    assert deltanet_path("cpu", "triton")[0] == deltanet_path("cuda", "torch")[0] == "strata"


@pytest.mark.cuda(ci="fla's chunked kernels stop under the interpreter (the module says where); CI checks "
                     "the arguments Strata gives them and fla's fused recurrence against Strata's (this file)")
def test_on_the_gpu_fla_chunks_match_strata_chunked():
    """Prefill through fla's chunked kernels (CUDA) against Strata's chunked form in float64,
    200 tokens (chunks of 64 and a partial one), 4 heads of 128. Bound: relative, 2^-7 of
    the outputs' and the state's magnitudes per head: fla's chunk kernels take their dots
    in tf32 on a GPU (inputs rounded to 2^-11), over sums of 64 to 128 terms through a few
    dependent products (the WY transform, the state pass, the output); a wrong layout errs
    by the values' own size. Strata's one-token kernel (float32, no dots) token by token: 2^-14,
    float32's error over 200 steps of sums of 128 terms with room to spare."""
    from strata.nn.deltanet import chunked
    from triton_kernels.deltanet_fla import deltanet_chunk_fla
    q, k, v, g, beta, s0 = inputs(200, 4, 128, 128)
    s64 = s0.double()
    o64 = chunked(q.double(), k.double(), v.double(), g.double(), beta.double(), s64)
    s = s0.cuda()
    o = deltanet_chunk_fla(*(x.cuda() for x in (q, k, v, g, beta)), s).cpu().double()
    rel = (lambda a, b: ((a - b).norm() / b.norm()).item())
    assert rel(o, o64) < 2 ** -7 and rel(s.cpu().double(), s64) < 2 ** -7
    step_state = s0.cuda()
    o_step = deltanet_step(*(x.cuda() for x in (q, k, v, g, beta)), step_state).cpu().double()
    assert rel(o_step, o64) < 2 ** -14 and rel(step_state.cpu().double(), s64) < 2 ** -14


def test_an_fla_that_does_not_import_falls_back_saying_why(monkeypatch):
    """fla-core installed but failing to import (a dependency missing where wheels were
    installed with --no-deps, a Triton it does not take): a GPU load runs Strata's DeltaNet
    kernels and its plan line says why, where every DeltaNet layer's forward would raise."""
    import importlib

    from triton_kernels import deltanet_fla
    real = importlib.import_module

    def import_module(name, package=None):
        if name.startswith("fla."):
            raise ModuleNotFoundError("No module named 'einops'")
        return real(name, package)
    for f in (deltanet_fla.fla_import_error, deltanet_fla._path):
        f.cache_clear()
    monkeypatch.setattr(importlib, "import_module", import_module)
    try:
        kernels, why = deltanet_path("cuda", "triton")
        assert kernels == "strata" and "fla-core is installed but does not import (ModuleNotFoundError: " \
            "No module named 'einops')" in why, why
    finally:
        for f in (deltanet_fla.fla_import_error, deltanet_fla._path):
            f.cache_clear()
