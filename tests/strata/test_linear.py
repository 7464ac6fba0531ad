"""QuantLinear: fused, mixed-format and int4-packed weights against x @ W.T in float64."""
import numpy as np
import pytest
import torch

import quant
from strata.nn.linear import DenseBudget, QuantLinear
from strata.tensors import QTensor


def qt(name: str, fmt: str, n: int, k: int, seed: int) -> QTensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    f = quant.get(fmt)
    return QTensor(name, f, (n, k), f.quantize(w))


def reference(parts, x):
    w = np.concatenate([p.numpy() for p in parts]).astype(np.float64)
    return x.double().numpy() @ w.T


@pytest.mark.parametrize("fmts", [("Q4_0",), ("Q4_1", "Q4_1"), ("IQ4_NL", "Q8_0", "Q4_K"), ("IQ3_XXS", "Q2_K")])
def test_fused_and_mixed_weights_in_f32(fmts):
    parts = [qt(f"w{i}", f, 32 + 16 * i, 256, i) for i, f in enumerate(fmts)]
    # dequantized, the formats no longer matter: one dense matmul; past the budget, a
    # mixed layer runs its parts (each dequantized per call)
    for lin, mode in ((QuantLinear(parts, torch.float32), "dense"),
                      (QuantLinear(parts, torch.float32, budget=DenseBudget(mib=0)),
                       "parts" if len(set(fmts)) > 1 else "stream")):
        assert lin.mode == mode
        x = torch.randn(5, 256)
        y = lin(x)
        # f32 matmul of K=256 terms: well inside 1e-5 of the output's scale
        assert np.abs(y.double().numpy() - reference(parts, x)).max() <= 1e-5 * (1 + np.abs(reference(parts, x)).max())


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1"])
def test_int4_packed_bf16_path(fmt):
    part = qt("w", fmt, 64, 256, 7)
    lin = QuantLinear(part, torch.bfloat16)
    assert lin.mode == "int4"
    x = torch.randn(3, 256)
    ref = reference([part], x)
    # bf16 activations and scales (8 significant bits): each product is off by up to about
    # 2 * 2^-8 of its size, so the sum by 2^-7 of sum |x||w|
    bound = 2.0 ** -7 * (x.abs().double().numpy() @ np.abs(part.numpy()).astype(np.float64).T)
    assert (np.abs(lin(x).double().numpy() - ref) <= bound + 1e-6).all()


def test_dense_budget_falls_back_to_per_call_dequantization():
    part = qt("w", "Q8_0", 64, 256, 3)
    lin = QuantLinear(part, torch.float32, budget=DenseBudget(mib=0))
    assert lin.mode == "stream"
    x = torch.randn(2, 256)
    assert np.abs(lin(x).double().numpy() - reference([part], x)).max() <= 1e-5


@pytest.mark.parametrize("fmt", ["Q8_0", "IQ3_XXS", "Q5_K"])
def test_large_int8_code_weights_are_held_as_codes(fmt, monkeypatch):
    import strata.nn.linear as linear
    monkeypatch.setattr(linear, "INT8_MIN_WEIGHTS", 64 * 256)
    part = qt("w", fmt, 64, 256, 5)
    lin = QuantLinear(part, torch.bfloat16)
    assert lin.mode == "int8" and lin.codes.dtype == torch.int8
    # 1 byte a code and 4 a group scale (+ 4 an offset): under bfloat16's 2 bytes a weight
    assert lin.held_bytes() <= 1.5 * 64 * 256
    x = torch.randn(1, 256)
    ref = reference([part], x)
    # one row: the file's weights in float32 (triton_kernels.codes: gamma_K sum |x||w|)
    k = 256
    gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    bound = gamma * (x.abs().double().numpy() @ np.abs(part.numpy()).astype(np.float64).T)
    assert (np.abs(lin(x).double().numpy() - ref) <= bound).all()
    # small weights stay dense (bfloat16's matmul is faster than the codes' pass there), and
    # all do without compiles (the codes' eager matmul decodes the weight every call)
    assert QuantLinear(qt("v", fmt, 32, 256, 6), torch.bfloat16).mode == "dense"
    monkeypatch.setenv("STRATA_CPU_COMPILE", "0")
    assert QuantLinear(part, torch.bfloat16).mode == "dense"
