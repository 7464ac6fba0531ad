"""The CPU path's compiled decode against its eager one: the llama step
(strata.runtime.cpu_step), and Flash-Next's DeltaNet step and dense experts.

Tolerance: 1e-5 of the largest |logit|, as the decode graph's test: the same weights and
ops in float32; Inductor may fuse an element-wise chain (a different rounding of a few ops)
and sums the int8-code head in its own order (triton_kernels.codes: gamma_K sum |w x|,
about 3e-5 relative at K = 576 in the worst case, far less on real logits; measured
below 1e-6)."""
from __future__ import annotations

import pytest
import torch

import strata.runtime.cpu_step as cpu_step
import triton_kernels.compiled as compiled
from strata.load import load_model


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    return load_model(smollm2_gguf, dtype=torch.bfloat16)


def _decode(model, prompt, steps, compiled, monkeypatch):
    monkeypatch.setenv("STRATA_CPU_COMPILE", "1" if compiled else "0")
    cache = model.new_cache(8)  # grows past its capacity on the way: a new capacity, no recompile needed
    model(prompt, cache, last_only=True)
    out, tok = [], 42
    for _ in range(steps):
        logits = model([tok], cache, last_only=True)
        out.append(logits)
        tok = int(logits.argmax())
    return out, cache


def test_compiled_step_equals_eager_decode(model, monkeypatch):
    monkeypatch.setattr(compiled, "broken", [])
    prompt = [1, 504, 3458, 314, 2113]
    want, a = _decode(model, prompt, 6, False, monkeypatch)
    assert getattr(model, "_cpu_step", None) is None  # off: never built
    got, b = _decode(model, prompt, 6, True, monkeypatch)
    assert model._cpu_step is not None and compiled.broken == []
    assert b.length == a.length == len(prompt) + 6
    for g, w in zip(got, want):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-5
    n = a.length
    scale = a.k[:, :, :n].abs().max()
    assert float((b.k[:, :, :n] - a.k[:, :, :n]).abs().max() / scale) < 1e-5  # keys written alike


def test_the_step_is_skipped_where_it_does_not_apply(model, monkeypatch):
    from triton_kernels import invariant
    monkeypatch.setenv("STRATA_CPU_COMPILE", "1")
    monkeypatch.setattr(compiled, "broken", [])
    cache = model.new_cache(8)
    assert cpu_step.CpuStep.usable(model, cache)
    int8 = model.new_cache(8)
    int8.kind = "int8"
    assert not cpu_step.CpuStep.usable(model, int8)   # codes and scales: the eager path's
    with invariant.batch_invariant(True):
        assert not cpu_step.CpuStep.usable(model, cache)  # fixed-shape matmuls: eager
    monkeypatch.setenv("STRATA_CPU_COMPILE", "0")
    assert not cpu_step.CpuStep.usable(model, cache)


def test_a_failing_compile_warns_and_decodes_eagerly(model, monkeypatch):
    monkeypatch.setenv("STRATA_CPU_COMPILE", "1")
    monkeypatch.setattr(compiled, "broken", [])

    step, calls = cpu_step.CpuStep(model), []

    def no_compiler(*args):  # two layers run, the third fails: a step that fails half way
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("no C++ compiler")
        return cpu_step._layer(*args)
    step.layer_fn.compiled = no_compiler
    monkeypatch.setattr(model, "_cpu_step", step, raising=False)
    cache = model.new_cache(8)
    model([1, 504, 3458], cache, last_only=True)
    ref = model.new_cache(8)
    model([1, 504, 3458], ref, last_only=True)
    with pytest.warns(RuntimeWarning, match="no C.. compiler.*eagerly from now on"):
        got = model([42], cache, last_only=True)
    assert cache.length == 4 and not compiled.available()
    want = model([42], ref, last_only=True)  # eagerly too, now that the step is off
    assert torch.equal(got, want)


def test_flash_next_decode_compiled_equals_eager(flash_tiny_gguf, monkeypatch):
    """Flash-Next's decode takes the compiled DeltaNet step and the dense experts' one pass;
    logits and the DeltaNet states stay within 1e-5 of the eager path's (float32 both ways,
    Inductor's element-wise rounding and summation order: measured about 1e-7)."""
    import strata.nn.deltanet as deltanet
    import strata.storage.experts as experts
    monkeypatch.setattr(compiled, "broken", [])
    model = load_model(flash_tiny_gguf, dtype=torch.float32)
    prompt = list(range(1000, 1012))
    runs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("STRATA_CPU_COMPILE", on)
        state = model.new_cache()
        model(prompt, state)
        logits = [model([t], state) for t in (5000, 6000, 7000)]
        runs[on] = logits, [x.rec.clone() for x in state.layers if hasattr(x, "rec")]
    assert deltanet._STEP.compiled is not None and experts._FEW_TOKENS.compiled is not None
    assert compiled.broken == []
    (want, want_rec), (got, got_rec) = runs["0"], runs["1"]
    assert want_rec
    for g, w in zip(got + got_rec, want + want_rec):
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())
