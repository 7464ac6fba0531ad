"""The CPU path's compiled decode against its eager one: the llama step
(strata.runtime.cpu_step), and Flash-Next's DeltaNet step and dense experts.

Tolerance, float32: 1e-5 of the largest |logit|, as the decode graph's test: the same
weights and ops in float32; Inductor may fuse an element-wise chain (a different rounding
of a few ops) and sums the int8-code head in its own order (triton_kernels.cpu.codes: gamma_K
sum |w x|, about 3e-5 relative at K = 576 in the worst case, far less on real logits;
measured below 2e-6). bfloat16 (the int4 kernel's activations): where a fused norm rounds
an activation to the other neighbouring bfloat16 (2^-8 relative), 30 layers carry it, and
a bfloat16 head rounds logits to 2^-8 of their size: 2^-5 of the largest |logit| and the
same greedy tokens (measured up to 1.7% on an AVX2 CPU; a wrong RoPE or cache row moves
logits by whole units)."""
from __future__ import annotations

import pytest
import torch

import strata.runtime.cpu_step as cpu_step
import triton_kernels.cpu.compiled as compiled
from strata.load import load_model


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    return load_model(smollm2_gguf, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def model_f32(smollm2_gguf):
    return load_model(smollm2_gguf, dtype=torch.float32)


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


@pytest.mark.slow  # 28 s of Inductor compiles; the quick tier compiles the step in the background test below
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_compiled_step_equals_eager_decode(dtype, request, monkeypatch):
    model = request.getfixturevalue("model_f32" if dtype == "f32" else "model")
    bound = 1e-5 if dtype == "f32" else 2.0 ** -5
    monkeypatch.setattr(compiled, "broken", [])
    prompt = [1, 504, 3458, 314, 2113]
    want, a = _decode(model, prompt, 6, False, monkeypatch)
    assert getattr(model, "_cpu_step", None) is None  # off: never built
    got, b = _decode(model, prompt, 6, True, monkeypatch)
    assert model._cpu_step is not None and compiled.broken == []
    assert b.length == a.length == len(prompt) + 6
    for g, w in zip(got, want):
        assert float((g - w).abs().max() / w.abs().max()) < bound
        assert int(g.argmax()) == int(w.argmax())
    n = a.length
    scale = a.k[:, :, :n].abs().max()
    assert float((b.k[:, :, :n] - a.k[:, :, :n]).abs().max() / scale) < bound  # keys written alike


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
    import strata.nn.linear as linear
    monkeypatch.setenv("STRATA_CPU_COMPILE", "1")
    monkeypatch.setattr(compiled, "broken", [])
    # the head's one-row product eager: its compile (6 s here) is the background test's and test_linear.py's
    monkeypatch.setattr(linear, "_GEMV", lambda *a: None)

    step, calls = cpu_step.CpuStep(model), []

    def no_compiler(*args):  # two layers run, the third fails: a step that fails half way
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("no C++ compiler")
        return cpu_step._layer(*args)
    monkeypatch.setattr(step.layer_fn, "compiled", no_compiler)
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


@pytest.mark.slow  # 27 s of Inductor compiles; the quick tier compiles llama's step above
@pytest.mark.parametrize("halves", [True, False])
def test_flash_next_decode_compiled_equals_eager(halves, flash_tiny_gguf, monkeypatch):
    """Flash-Next's decode takes each layer's compiled halves (strata.models.qwen4exp_step);
    without them (`halves` off: a layer whose matmuls have no pure form), the compiled DeltaNet
    step and the dense experts' one pass. Logits, the DeltaNet states and the experts'
    counters stay within 1e-5 of the eager path's (float32 both ways, Inductor's element-wise
    rounding and summation order: measured up to 5e-7)."""
    import strata.models.qwen4exp_step as step
    import strata.nn.deltanet as deltanet
    import strata.storage.experts as experts
    monkeypatch.setattr(compiled, "broken", [])
    if not halves:
        monkeypatch.setattr(step, "_step", lambda layer, x: None)
    calls = {}
    for mod, name in ((step, "_MIXER"), (step, "_FFN"), (step, "_ATTN_IN"), (step, "_ATTN_OUT"), (step, "_PLE"),
                      (deltanet, "_STEP"), (experts, "_FEW_TOKENS")):
        def counted(*args, f=getattr(mod, name), name=name):
            calls[name] = calls.get(name, 0) + 1
            return f(*args)
        monkeypatch.setattr(mod, name, counted)
    model = load_model(flash_tiny_gguf, dtype=torch.float32)
    prompt = list(range(1000, 1070))  # past the QSA budget (64): the sparse path decodes
    runs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("STRATA_CPU_COMPILE", on)
        state = model.new_cache()
        model(prompt, state)
        calls.clear()  # the compiled run's calls are what is left
        before = [l.moe.experts.hits.clone() for l in model.layers]
        logits = [model([t], state) for t in (5000, 6000, 7000)]
        hits = [l.moe.experts.hits - b for l, b in zip(model.layers, before)]
        runs[on] = logits, [x.rec.clone() for x in state.layers if hasattr(x, "rec")], hits
    # three steps: 6 DeltaNet layers (a mixer half, an MoE half), 2 attention layers (an
    # input half; the output half runs their MoE) and the PLE block each
    n_rec, n_attn = sum(model.cfg.recurrent), len(model.layers) - sum(model.cfg.recurrent)
    want_calls = ({"_MIXER": 3 * n_rec, "_FFN": 3 * n_rec, "_ATTN_IN": 3 * n_attn, "_ATTN_OUT": 3 * n_attn,
                   "_PLE": 3}
                  if halves else {"_STEP": 3 * n_rec, "_FEW_TOKENS": 3 * len(model.layers)})
    assert calls == want_calls and compiled.broken == []
    (want, want_rec, want_hits), (got, got_rec, got_hits) = runs["0"], runs["1"]
    assert want_rec
    for g, w in zip(got + got_rec, want + want_rec):
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max())
    # three steps, top-k experts each, in every layer: counted alike
    assert all(torch.equal(g, w) and int(w.sum()) == 3 * model.cfg.top_k for g, w in zip(got_hits, want_hits))


@pytest.fixture
def auto(monkeypatch):
    """The default compile mode (STRATA_CPU_COMPILE unset), no background compile started
    yet, and plain decode steps (STRATA_BATCH_INVARIANT=0: the invariant ones are never
    compiled)."""
    from triton_kernels import invariant
    monkeypatch.delenv("STRATA_CPU_COMPILE", raising=False)
    monkeypatch.setattr(compiled, "broken", [])
    compiled.reset()
    with invariant.batch_invariant(False):
        yield
    compiled.reset()


def test_invariant_decode_steps_start_no_background_compile(model, monkeypatch):
    """Batch-invariant decode steps never run compiled, so nothing is built for them: a
    model with a draft head by default (its steps are invariant so that greedy --spec keeps
    --spec 0's tokens), any model with --batch-invariant."""
    from strata.runtime.background import compile_in_background
    from triton_kernels import invariant
    monkeypatch.delenv("STRATA_CPU_COMPILE", raising=False)
    compiled.reset()
    with invariant.batch_invariant(True):
        assert compile_in_background(model) is None
    monkeypatch.setattr(model, "mtp", "a draft head", raising=False)
    with invariant.batch_invariant(None):
        assert compile_in_background(model) is None and compiled.ready_line() is None


def test_by_default_a_short_run_compiles_nothing(model, auto, monkeypatch):
    """auto: no compile in the caller's thread, and a budget under LONG_RUN starts none."""
    from strata.runtime.background import LONG_RUN, compile_in_background
    monkeypatch.setattr(model, "_cpu_step", None, raising=False)
    assert compile_in_background(model, LONG_RUN - 1) is None
    cache = model.new_cache(8)
    model([1, 504, 3458], cache, last_only=True)
    model([42], cache, last_only=True)
    assert not compiled.available() and model._cpu_step is None and compiled.ready_line() is None


def test_a_background_compile_takes_over_the_decode_when_ready(model_f32, auto, monkeypatch):
    """The compile runs on its thread beside eager steps; once it is done the steps run
    compiled, within the float32 bound of the eager ones (the module's docstring)."""
    from strata.runtime.background import compile_in_background
    monkeypatch.setattr(model_f32, "_cpu_step", None, raising=False)
    torch._dynamo.reset()  # as a new process: no compile of the tests before (they count too)
    prompt = [1, 504, 3458, 314, 2113]
    monkeypatch.setenv("STRATA_CPU_COMPILE", "0")
    want, _ = _decode(model_f32, prompt, 4, False, monkeypatch)
    monkeypatch.delenv("STRATA_CPU_COMPILE")
    cache = model_f32.new_cache(64)  # as generate makes it: room for the answer
    model_f32(prompt, cache, last_only=True)
    thread = compile_in_background(model_f32)  # open-ended: a chat's, a server's
    assert thread is not None and compile_in_background(model_f32) is None  # one a process
    got, tok = [model_f32([42], cache, last_only=True)], None  # beside the compile: eager or compiled
    thread.join()
    assert compiled.available() and compiled.broken == [] and "ready" in compiled.ready_line()
    calls = []
    fn = model_f32._cpu_step.layer_fn
    monkeypatch.setattr(fn, "compiled", lambda *a, f=fn.compiled: calls.append(1) or f(*a))
    for _ in range(3):
        tok = int(got[-1].argmax())
        got.append(model_f32([tok], cache, last_only=True))
    assert len(calls) == 3 * model_f32.cfg.n_layers  # the steps after it: compiled, a call a layer
    for g, w in zip(got, want):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-5
        assert int(g.argmax()) == int(w.argmax())


@pytest.mark.slow
def test_flash_next_background_compile_counts_nothing(flash_tiny_gguf, auto, monkeypatch):
    """Flash-Next's halves built on a scratch state: the experts' and the PLE table's
    counters see none of its steps, and the decode after it runs the halves."""
    import strata.models.qwen4exp_step as step
    from strata.runtime.background import compile_in_background
    model = load_model(flash_tiny_gguf, dtype=torch.float32, ple_io="ram")
    table = next(l.ple.table for l in model.layers if l.ple is not None)
    assert "rows" in table.stats()  # a stored table, which counts its reads
    before = ([l.moe.experts.hits.clone() for l in model.layers], dict(table.stats()))
    thread = compile_in_background(model)
    assert thread is not None
    thread.join()
    assert compiled.available() and compiled.broken == []
    assert all(torch.equal(l.moe.experts.hits, h) for l, h in zip(model.layers, before[0]))
    counts = ("gathers", "rows", "distinct_pages")  # (drive_bytes is the process's, compiles included)
    assert {k: table.stats()[k] for k in counts} == {k: before[1][k] for k in counts}
    calls = []
    f = step._MIXER.compiled
    monkeypatch.setattr(step._MIXER, "compiled", lambda *a: calls.append(1) or f(*a))
    state = model.new_cache()
    model([5, 6, 7], state)
    model([8], state)
    assert len(calls) == sum(model.cfg.recurrent)
    assert table.stats()["rows"] > before[1]["rows"]  # the caller's steps count
