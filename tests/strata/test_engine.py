"""The serving engine in-process: queue bound, cancellation, step timing, the prefix cache."""
import logging
import threading
import time

import pytest
import torch

from strata.runtime.prefix_cache import PrefixCache, common_prefix
from strata.runtime.sampling import SamplingParams
from strata.server.engine import Engine, QueueFull, Request


def collect():
    events, done = [], threading.Event()

    def emit(ev):
        events.append(ev)
        if ev["type"] == "done":
            done.set()
    return events, done, emit


def test_queue_bound_cancel_and_timing_log(smollm2_bf16, smollm2_tokenizer, caplog, monkeypatch):
    monkeypatch.setenv("STRATA_DECODE_TIMING", "1")
    caplog.set_level(logging.INFO, logger="strata.server")
    engine = Engine(smollm2_bf16, smollm2_tokenizer, slots=1, queue_size=1, cache_mib=0)
    try:
        prompt = smollm2_tokenizer.encode("Once upon a time")
        long_ev, long_done, long_emit = collect()
        first = engine.submit(Request(prompt, SamplingParams(temperature=0, max_tokens=10_000), long_emit))
        while engine.busy_slots() == 0:  # it holds the only slot
            pass
        engine.submit(Request(prompt, SamplingParams(temperature=0, max_tokens=4), collect()[2]))
        with pytest.raises(QueueFull):
            engine.submit(Request(prompt, SamplingParams(max_tokens=4), collect()[2]))
        while len(long_ev) < 3:  # decoding: some steps are done (and logged)
            time.sleep(0.01)
        first.cancelled = True  # as when a client hangs up
        assert long_done.wait(30) and long_ev[-1] == {"type": "done", "finish_reason": "cancelled"}
    finally:
        engine.close()
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    assert steps and "tokens" in steps[0] and "ms" in steps[0] and "compute" in steps[0]


def test_prefix_cache_keeps_the_longest_prefix_within_budget(smollm2_bf16):
    m = smollm2_bf16
    a, b = list(range(1000, 1040)), list(range(2000, 2040))
    ca, cb = m.new_cache(64), m.new_cache(64)
    m(a, ca)
    m(b, cb)
    pc = PrefixCache(budget_bytes=ca.nbytes() + cb.nbytes())
    pc.put(a, ca)
    pc.put(b, cb)
    got, n = pc.take(a[:30] + [7, 8])
    assert n == 30 and got.length == 30 and pc.hits == 1
    got, n = pc.take(a)  # a whole cached prompt still leaves one token to evaluate
    assert n == len(a) - 1
    assert pc.take([5, 6])[0] is None and pc.misses == 1
    cc = m.new_cache(64)
    m(list(range(3000, 3040)), cc)
    pc.put(list(range(3000, 3040)), cc)  # over budget: the least recently used (b) goes
    assert pc.take(b)[0] is None and pc.take(a)[1] == len(a) - 1
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_batched_forward_equals_one_sequence_at_a_time(smollm2_bf16, monkeypatch):
    """Every output row of a matmul is its own dot products, attention runs per sequence:
    batching sequences changes no bit, prefill or decode. (The eager path: a one-token
    call of the model otherwise runs the compiled CPU step, within 1e-5 of it,
    tests/strata/test_cpu_compile.py.)"""
    monkeypatch.setenv("STRATA_CPU_COMPILE", "0")
    m = smollm2_bf16
    seqs = [list(range(1000, 1030)), list(range(2000, 2017)), [7]]
    alone = [m.new_cache() for _ in seqs]
    together = [m.new_cache() for _ in seqs]
    want = [m(s, c, last_only=True) for s, c in zip(seqs, alone)]
    got = m.forward_batch(list(zip(seqs, together)))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    for step in range(3):
        want = [m([5 + step + i], c, last_only=True) for i, c in enumerate(alone)]
        got = m.forward_batch([([5 + step + i], c) for i, c in enumerate(together)])
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_recurrent_state_is_reused_whole_or_not_at_all():
    class State:  # as a qwen4exp state: cannot be cut back to fewer tokens
        rewindable = False

        def nbytes(self):
            return 1

        def copy(self, n):
            return ("copy", n)

    cache = PrefixCache(1 << 20)
    cache.put([1, 2, 3, 4], State())
    assert cache.take([1, 2, 3, 9, 9]) == (None, 0)          # shares 3 of 4: not usable
    assert cache.take([1, 2, 3, 4, 5, 6]) == (("copy", 4), 4)  # extends it: reused whole


@pytest.mark.slow  # 10 s end to end; the quick tier keeps the two tests above (the prefix cache, a recurrent state whole)
def test_a_recurrent_model_reuses_whole_prompt_chunks_with_the_same_answer(flash_tiny_gguf):
    """flash-tiny (DeltaNet states: no rewinding) through the engine with chunks of 8: a
    second prompt that extends the first reuses the first's whole chunks (16 of its 21
    tokens, kept as the prefill passed them) and answers as an engine without a cache does."""
    from strata.load import load_model
    from strata.tokenizer import Tokenizer
    model = load_model(flash_tiny_gguf, dtype=torch.float32, kernels="torch")
    tok = Tokenizer.from_gguf(flash_tiny_gguf)
    first = list(range(100, 121))
    second = first + list(range(300, 310))

    def run(engine, prompt):
        req = engine.submit(Request(prompt, SamplingParams(temperature=0, max_tokens=3), collect()[2]))
        engine.run(until_idle=True)
        return req
    cached = Engine(model, tok, slots=1, align=8, start_thread=False)
    cold = Engine(model, tok, slots=1, align=8, cache_mib=0, start_thread=False)
    run(cached, first)
    again = run(cached, second)
    assert again.cached_tokens == 16 and cached.prefix.hits == 1
    assert again.tokens == run(cold, second).tokens and len(again.tokens) == 3


def test_the_engine_thread_makes_the_models_gpu_current(monkeypatch):
    """A thread starts with cuda:0 current, and Triton launches on the current device: the
    engine's thread makes its model's GPU current before its first step (serve --device
    cuda:1 would launch on the other card). Checked with set_device recorded, no GPU."""
    import threading
    import types

    import torch

    from triton_kernels import backend
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((torch.device(d), threading.current_thread().name)))
    monkeypatch.setattr(backend, "_fake", None)
    model = types.SimpleNamespace(device=torch.device("cuda", 1), cfg=types.SimpleNamespace(context_length=64))
    engine = Engine(model, None, slots=1, start_thread=False)
    t = threading.Thread(target=engine.run, kwargs={"until_idle": True}, name="engine-under-test")
    t.start()
    t.join(10)
    assert seen == [(torch.device("cuda", 1), "engine-under-test")]
