"""KV cache types (`--kv f32|bf16|f16|int8`): the int8 codec's bound, the bytes a token
takes, and a model run with a smaller cache staying near the exact one.

Tolerances: the int8 codec is checked against its own bound, |x - x'| <= amax / 254 per
row (round to nearest on a 255-step grid) times 1 + 2^-8 (the bfloat16 scale's rounding). On SmolLM2 (float32 compute, the prompt below) an int8 cache moves the logits by 2.6e-2
of the largest logit, bf16 by 1.3e-2 (8 bits of mantissa), f16 by 5.5e-4 (11 bits); the
bounds are 3x those, still far below what a wrong scale or a row written to the wrong
position gives (0.3 and more).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tests.tiers import examples

from strata.load import load_model
from strata.nn import kv
from strata.nn.attention import KVCache


@settings(max_examples=examples(60), deadline=None)
@given(rows=st.integers(1, 9), dim=st.sampled_from([1, 8, 64, 256]), log_scale=st.floats(-20, 20),
       zero_row=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_int8_rows_come_back_within_half_a_step(rows, dim, log_scale, zero_row, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, dim, generator=g) * 2.0 ** log_scale
    if zero_row:
        x[0, 0] = 0
    data, scale = kv.encode(x, "int8")
    assert data.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (2, rows, 1)
    y = kv.decode(data, scale)
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert bool(((x - y).abs() <= amax / 254 * (1 + 2.0 ** -8)).all())
    if zero_row:
        assert bool((y[0, 0] == 0).all())


def test_bytes_per_token():
    assert kv.row_bytes("int8", 64) == 66 and kv.row_bytes("bf16", 64) == 128 and kv.row_bytes("f32", 64) == 256
    assert kv.row_bytes("int8", 256) / kv.row_bytes("bf16", 256) < 0.51
    with pytest.raises(ValueError, match="--kv 'q4'"):
        kv.row_bytes("q4", 64)


def test_a_cache_keeps_its_rows_through_growth_and_copies():
    c = KVCache(2, 3, 8, capacity=4, kind="int8")
    k, v = torch.randn(3, 6, 8), torch.randn(3, 6, 8)
    c.reserve(6)
    c.write(1, 0, k, v)
    c.length = 6
    d = c.copy(5)
    keys, vals = d.read(1, 5)
    ref_k, ref_v = c.read(1, 5)
    assert torch.equal(keys, ref_k) and torch.equal(vals, ref_v)
    assert (keys - k[:, :5]).abs().max() <= k.abs().max() / 127
    assert d.nbytes() == 2 * 2 * 3 * d.k.shape[2] * (8 + 2)


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer):
    return smollm2_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)


@pytest.fixture(scope="module")
def exact(smollm2_gguf, prompt):
    m = load_model(smollm2_gguf, dtype=torch.float32)
    return m(prompt, m.new_cache())


@pytest.mark.parametrize("kind, bound", [("int8", 8e-2), ("bf16", 4e-2), ("f16", 2e-3)])
def test_smaller_caches_stay_near_the_exact_one(smollm2_gguf, prompt, exact, kind, bound):
    m = load_model(smollm2_gguf, dtype=torch.float32, kv=kind)
    assert f"KV {kind}" in m.plan_line()
    c = m.new_cache()
    assert isinstance(c, KVCache) and c.kind == kind
    # the prompt in two chunks: the second reads the first's rows back from the cache
    out = torch.cat([m(prompt[:40], c), m(prompt[40:], c)])
    rel = float((out - exact).abs().max() / exact.abs().max())
    assert 0 < rel < bound
    assert m.kv_bytes_per_token() / m.kv_bytes_per_token("bf16") == {"int8": 66 / 128, "bf16": 1.0, "f16": 1.0}[kind]


# --- flash-tiny: attention layers with the QSA indexer ---------------------------------------

@pytest.fixture(scope="module")
def tiny_prompt():
    return torch.randint(3, 49152, (160,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def tiny_int8(flash_tiny_gguf):
    return load_model(flash_tiny_gguf, dtype=torch.float32, kv="int8")


def _dense(model, on: bool):
    for layer in model.layers:
        if not layer.recurrent:
            layer.mixer.dense_only = on  # what --qsa off sets


def test_an_int8_cache_gives_one_answer_whatever_the_chunks(tiny_int8, tiny_prompt):
    # past the QSA budget, so the sparse path reads int8 rows and their scales in place.
    # Chunks compute K and V in another summation order (1e-7 apart, test_qwen4exp.py), and
    # a value that close to a rounding boundary takes the next int8 code: one step of its
    # row (amax / 127) moves the logits by up to 4.4e-4 of the largest here (6.3e-7 when no
    # code flips); a row read without its scale, or a scale lost as the buffers grow, moves
    # them by 0.1 and more
    m = tiny_int8
    assert "KV int8" in m.plan_line() and m.cfg.idx_budget < 100
    whole = m(tiny_prompt, m.new_cache())
    st = m.new_cache()
    parts = [m(tiny_prompt[:100], st)] + [m(tiny_prompt[i:i + 1], st) for i in range(100, 110)]
    assert float((torch.cat(parts) - whole[:110]).abs().max() / whole.abs().max()) < 5e-3
    assert m.kv_bytes_per_token() / m.kv_bytes_per_token("bf16") < 0.54  # 2,580 / 4,864 B
    a = next(s for s in st.layers if hasattr(s, "kv_scales"))
    assert a._k.dtype == torch.int8 and a._idx.dtype == torch.int8 and a.kv_scales() is not None


def test_dense_attention_with_an_int8_cache_stays_near_the_exact_one(flash_tiny_gguf, tiny_int8, tiny_prompt):
    # QSA off: what the rows' rounding alone costs (measured 2.5e-2 of the largest logit;
    # with QSA on, flash-tiny's random indexer picks other blocks once any input moves: 0.19)
    exact = load_model(flash_tiny_gguf, dtype=torch.float32, qsa=False)
    want = exact(tiny_prompt, exact.new_cache())
    _dense(tiny_int8, True)
    try:
        got = tiny_int8(tiny_prompt, tiny_int8.new_cache())
    finally:
        _dense(tiny_int8, False)
    rel = float((got - want).abs().max() / want.abs().max())
    assert 0 < rel < 8e-2
