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


def test_a_mixed_projection_is_a_matmul_a_run_of_one_format():
    """The routers beside the shared expert's gate and up (a released file's MoE input
    projection: llama-quantize leaves the routers F32): each run of consecutive weights in
    one format is one fused matmul, and `outputs` gives each weight's rows unjoined, the
    joined forward's values."""
    parts = [qt("router", "F32", 64, 256, 0), qt("shexp_router", "F32", 1, 256, 1), qt("gate", "Q8_0", 32, 256, 2),
             qt("up", "Q8_0", 32, 256, 3), qt("last", "F32", 8, 256, 4)]
    lin = QuantLinear(parts, torch.float32, budget=DenseBudget(mib=0), kernels="torch")
    assert lin.mode == "parts" and [m.splits if m.mode != "parts" else None for m in lin.parts] == [
        [64, 1], [32, 32], [8]]
    x = torch.randn(3, 256)
    y = lin(x)
    outs = lin.outputs(x)
    assert [o.shape[1] for o in outs] == [64, 1, 32, 32, 8]
    assert torch.equal(torch.cat(outs, dim=-1), y)
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


@pytest.mark.slow  # Inductor compiles, 14 s cold; the quick tier compiles the codes' pass in test_codes.py
@pytest.mark.parametrize("fmt", ["Q8_0", "IQ3_XXS", "Q5_K"])
def test_large_int8_code_weights_are_held_as_codes(fmt, monkeypatch):
    import strata.nn.linear as linear
    monkeypatch.setattr(linear, "INT8_MIN_WEIGHTS", 64 * 256)
    monkeypatch.setattr(linear, "cpu_int8_vectors", lambda: True)
    monkeypatch.setenv("STRATA_CPU_COMPILE", "1")  # every compile at its first call
    part = qt("w", fmt, 64, 256, 5)
    lin = QuantLinear(part, torch.bfloat16)
    assert lin.mode == "int8" and lin.codes.dtype == torch.int8
    # 1 byte a code and 4 a group scale (+ 4 an offset): under bfloat16's 2 bytes a weight
    assert lin.held_bytes() <= 1.5 * 64 * 256
    x = torch.randn(1, 256)
    ref = reference([part], x)
    # one row: the file's weights in float32 (triton_kernels.cpu.codes: gamma_K sum |x||w|)
    k = 256
    gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    bound = gamma * (x.abs().double().numpy() @ np.abs(part.numpy()).astype(np.float64).T)
    assert (np.abs(lin(x).double().numpy() - ref) <= bound).all()
    # small weights stay dense (bfloat16's matmul is faster than the codes' pass there), and
    # all do without compiles at the first call (the codes' eager matmul decodes the weight
    # every call, and by default the compiled pass comes later or never)
    assert QuantLinear(qt("v", fmt, 32, 256, 6), torch.bfloat16).mode == "dense"
    for mode in ("0", "auto"):
        monkeypatch.setenv("STRATA_CPU_COMPILE", mode)
        assert QuantLinear(part, torch.bfloat16).mode == "dense"
    # without AVX-512 the codes' compiled pass loads int8 through memcpy: dense is faster
    monkeypatch.setenv("STRATA_CPU_COMPILE", "1")
    monkeypatch.setattr(linear, "cpu_int8_vectors", lambda: False)
    assert QuantLinear(part, torch.bfloat16).mode == "dense"


@pytest.mark.parametrize("mode", ["dense", "stream"])
def test_prefill_upcasts_bf16_weights_where_the_cpu_has_no_bf16_dot(mode, monkeypatch):
    """Without bfloat16 dot products, 8 rows or more run in float32 with the bfloat16
    weight upcast: x is not rounded to bfloat16, so the product is within float32's
    gamma_K sum |x||w| of float64's on the held weight (bfloat16 when dense; the file's own,
    dequantized into float32 for the call, when streamed). With them, or for fewer rows,
    x is rounded to bfloat16 (about 2^-9 of each term)."""
    part = qt("w", "Q8_0", 64, 256, 9)
    budget = DenseBudget(mib=0) if mode == "stream" else None
    lin = QuantLinear(part, torch.bfloat16, budget=budget)
    assert lin.mode == mode
    w = torch.from_numpy(part.numpy())
    w = (w.to(torch.bfloat16) if mode == "dense" else w).double()
    x = torch.randn(8, 256, dtype=torch.float64).float()
    exact = x.double() @ w.T
    k = 256
    bound = k * 2.0 ** -24 / (1 - k * 2.0 ** -24) * (x.abs().double() @ w.abs().T)
    monkeypatch.setenv("STRATA_CPU_BF16", "0")
    assert ((lin(x).double() - exact).abs() <= bound).all()
    monkeypatch.setenv("STRATA_CPU_BF16", "1")   # x in bfloat16: far outside float32's bound
    assert ((lin(x).double() - exact).abs() > bound).any()
    monkeypatch.setenv("STRATA_CPU_BF16", "0")   # one row (decode) stays in bfloat16
    assert ((lin(x[:1]).double() - exact[:1]).abs() > bound[:1]).any()



@pytest.mark.slow  # an Inductor compile; the quick tier compiles the head's loop in test_cpu_compile's background test
def test_a_large_dense_weights_one_row_product_is_one_compiled_loop(monkeypatch):
    """One row through a large dense weight (a head) takes the compiled loop `_gemv`:
    float32 sums of the held weight times x, x not rounded to bfloat16, so within float32's
    gamma_K sum |x||w| of float64's product with the held weight."""
    import strata.nn.linear as linear
    import triton_kernels.cpu.compiled as compiled
    monkeypatch.setenv("STRATA_CPU_COMPILE", "1")
    monkeypatch.setattr(compiled, "broken", [])
    monkeypatch.setattr(linear, "INT8_MIN_WEIGHTS", 64 * 256)
    monkeypatch.setattr(linear, "cpu_int8_vectors", lambda: False)
    calls = []
    gemv = linear._GEMV
    monkeypatch.setattr(linear, "_GEMV", lambda *a: calls.append(1) or gemv(*a))
    part = qt("w", "Q8_0", 64, 256, 11)
    lin = QuantLinear(part, torch.bfloat16)
    assert lin.mode == "dense"
    x = torch.randn(1, 256)
    w = lin.weight.double()
    k = 256
    bound = k * 2.0 ** -24 / (1 - k * 2.0 ** -24) * (x.abs().double() @ w.abs().T)
    assert ((lin(x).double() - x.double() @ w.T).abs() <= bound).all() and calls == [1]
