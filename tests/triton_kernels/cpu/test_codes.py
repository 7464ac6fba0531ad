"""Int8 codes and group scales (dequant.int8_parts) and their matmul (triton_kernels.cpu.codes).

The parts: scale * code (+ offset) in float32 equals the numpy reference's weights bit for
bit, for every format that has them, on blocks Hypothesis draws (every byte free, every
finite fp16 scale, subnormals and +-65504 included).

The matmul's bound, against float64 on the same weights: each product w x is rounded once
and K of them are summed in float32 in Inductor's order, so |y - y64| <= gamma_K sum|w x|,
gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability, 3.1). Rows past
GEMV_ROWS take bfloat16 (the dense path's numerics): weights and x rounded to 8
significant bits, each product off by at most 2^-8 of its size and so the sum by
2^-7 sum|w||x| (plus the float32 sum's gamma_K).
"""
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers import examples

import quant
import triton_kernels.cpu.codes as codes_mod
from tests.blocks import blocks, same_bits
from triton_kernels.cpu.codes import GEMV_ROWS, codes_matmul, codes_matmul_torch, codes_weight
from triton_kernels.dequant import INT8_FORMATS, int8_parts

FORMATS = [quant.get(n) for n in INT8_FORMATS]


def compiled_broken():
    import triton_kernels.cpu.compiled as compiled
    return compiled.broken


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_parts_rebuild_the_reference_weights_bit_for_bit(fmt):
    @given(blocks(fmt, max_blocks=4), st.integers(1, 2))
    @settings(max_examples=examples(40))
    def prop(raw, rows):
        raw = raw[:raw.shape[0] // rows * rows]
        if raw.shape[0] == 0:
            return
        q = torch.from_numpy(raw.reshape(rows, -1))
        c, scale, offset = int8_parts(q, fmt)
        assert c.dtype == torch.int8 and scale.dtype == torch.float32
        assert c.shape == (rows, raw.shape[0] // rows * fmt.block_elems)
        assert scale.shape[1] in (c.shape[1] // 32, c.shape[1] // 16)
        got = codes_weight(c, scale, offset).numpy()
        assert same_bits(got.reshape(-1), fmt.dequantize(raw).reshape(-1))
    prop()


def test_a_format_without_codes_is_refused_by_name():
    with pytest.raises(ValueError, match="IQ2_XXS has no int8-code form"):
        int8_parts(torch.zeros((1, quant.get("IQ2_XXS").block_bytes), dtype=torch.uint8), "IQ2_XXS")


def _random_weight(fmt, n, k, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    raw = fmt.quantize(w).reshape(n, -1)
    return torch.from_numpy(raw), fmt.dequantize(raw).reshape(n, k).astype(np.float64)


def _gamma(k):
    u = 2.0 ** -24
    return k * u / (1 - k * u)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("fmt_name", ["Q8_0", "IQ3_XXS", "Q4_K", "Q6_K"])
def test_a_few_rows_within_the_float32_bound(fmt_name, compiled, monkeypatch):
    import triton_kernels.cpu.compiled as compiled_mod
    monkeypatch.setattr(compiled_mod, "broken", [])
    monkeypatch.setenv("STRATA_CPU_COMPILE", "1" if compiled else "0")
    fmt = quant.get(fmt_name)
    k = 512
    q, w = _random_weight(fmt, 96, k, 1)
    c, scale, offset = int8_parts(q, fmt)
    for m, n in ((1, 96), (GEMV_ROWS, 96), (1, 40)):  # the rows and a second N (dynamic)
        x = torch.randn(m, k)
        got = codes_matmul(x, c[:n], scale[:n], None if offset is None else offset[:n]).double().numpy()
        xd = x.double().numpy()
        bound = _gamma(k) * (np.abs(xd) @ np.abs(w[:n]).T)
        assert np.all(np.abs(got - xd @ w[:n].T) <= bound), fmt_name
    assert compiled_broken() == []


def test_many_rows_take_bfloat16_within_its_bound():
    fmt = quant.get("IQ3_S")
    k = 256
    q, w = _random_weight(fmt, 64, k, 2)
    c, scale, offset = int8_parts(q, fmt)
    x = torch.randn(GEMV_ROWS + 3, k)
    got = codes_matmul(x, c, scale, offset, torch.bfloat16).double().numpy()
    xd = x.double().numpy()
    bound = (2.0 ** -7 + _gamma(k)) * (np.abs(xd) @ np.abs(w).T)
    assert np.all(np.abs(got - xd @ w.T) <= bound)
    # float32 through the eager reference: the float32 bound, sliced into a few row runs
    got32 = codes_matmul_torch(x, c, scale, offset, rows=24).double().numpy()
    assert np.all(np.abs(got32 - xd @ w.T) <= _gamma(k) * (np.abs(xd) @ np.abs(w).T))


def test_a_failing_compile_warns_once_and_multiplies_eagerly(monkeypatch):
    import triton_kernels.cpu.compiled as compiled
    monkeypatch.setenv("STRATA_CPU_COMPILE", "1")
    monkeypatch.setattr(compiled, "broken", [])
    monkeypatch.setattr(codes_mod._MATMUL, "compiled", None)  # compiled anew, by the compile below

    def no_compiler(fn, **kw):
        def call(*a):
            raise RuntimeError("no C++ compiler")
        return call
    monkeypatch.setattr(torch, "compile", no_compiler)
    fmt = quant.get("Q8_0")
    q, w = _random_weight(fmt, 8, 64, 3)
    c, scale, _ = int8_parts(q, fmt)
    x = torch.randn(1, 64)
    with pytest.warns(RuntimeWarning, match="no C.. compiler.*eagerly from now on"):
        first = codes_matmul(x, c, scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the path is remembered
        second = codes_matmul(x, c, scale)
    want = x.double().numpy() @ w.T
    for got in (first, second):
        assert np.all(np.abs(got.double().numpy() - want) <= _gamma(64) * (np.abs(x.double().numpy()) @ np.abs(w).T))


def test_a_row_gives_the_same_bits_alone_or_beside_others():
    """Rows up to GEMV_ROWS run one at a time: batching decodes changes no bit; no rows, no work."""
    fmt = quant.get("IQ3_XXS")
    q, _ = _random_weight(fmt, 48, 256, 4)
    c, scale, offset = int8_parts(q, fmt)
    x = torch.randn(3, 256)
    together = codes_matmul(x, c, scale, offset)
    for i in range(3):
        assert torch.equal(codes_matmul(x[i:i + 1], c, scale, offset), together[i:i + 1])
    assert codes_matmul(x[:0], c, scale, offset).shape == (0, 48)
