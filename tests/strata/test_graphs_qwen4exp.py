"""Flash-Next's decode step as a CUDA graph captures it (strata.runtime.graphs_qwen4exp.step),
run as is on the CPU, gives the model's own decode logits; on fake CUDA it reads nothing
on the host, and its launches and their shapes are the same at any position.

Tolerance: 1e-5 of the largest |logit|. Both run the same weights in float32; they differ
in attention's summation (the graph attends over the whole capacity, masked, or over the
gathered blocks' slots; the eager step over the tokens held) and, on the CPU, in the
compiled halves' element-wise rounding (strata.models.qwen4exp_step)."""
from __future__ import annotations

import pytest
import torch

from strata.load import load_model
from strata.runtime import graphs_qwen4exp
from strata.runtime.graphs_qwen4exp import Qwen4ExpGraph


def _rel(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def model(flash_tiny_gguf):
    return load_model(flash_tiny_gguf, dtype=torch.float32, kernels="torch")


def _check(model, prompt, steps, capacity=None, tol=1e-5):
    a = model.new_cache()
    model(prompt, a, last_only=True)
    b = a.copy()
    g = Qwen4ExpGraph(model, b, capacity=capacity)
    tok, worst = 7, 0.0
    for _ in range(steps):
        want = model([tok], a, last_only=True)
        got = g(tok)
        assert b.length == a.length
        worst = max(worst, _rel(got, want))
        assert worst < tol
        tok = int(want.argmax())
    for sa, sb in zip(a.layers, b.layers):  # the states written alike
        if hasattr(sa, "rec"):
            assert _rel(sb.rec, sa.rec) < 1e-5 and _rel(sb.conv, sa.conv) < 1e-5
        else:  # int8 keys: a code may round the other way (half a step of its row's scale)
            assert _rel(sb.k, sa.k) < (1e-5 if sa.kind != "int8" else 1 / 127) and sb.n_blocks == sb.n // 4
            if sa.n_blocks:  # the eager step pools blocks once past the budget; the graph's always
                assert _rel(sb.blocks(4)[:sa.n_blocks], sa.blocks(4)) < 1e-5
    assert torch.equal(a.ple.history, b.ple.history) and _rel(b.ple.conv, a.ple.conv) < 1e-5
    print(f"\nflash-tiny graph step against the eager decode, prompt {len(prompt)}, {steps} steps: "
          f"max |graph - eager| / max |logit| = {worst:.2e}")
    return a, b


def test_graph_step_equals_the_models_decode(model):
    """Within the QSA budget (every visible block kept: dense attention)."""
    _check(model, [1, 504, 3458, 314, 2113], 4)


def test_graph_step_equals_the_models_decode_past_the_qsa_budget(model):
    """flash-tiny keeps 64 tokens (16 blocks of 4): from position 67 on a query chooses;
    the steps cross from dense attention into the chosen blocks'."""
    prompt = [(37 * i + 11) % 500 + 3 for i in range(66)]
    a, b = _check(model, prompt, 4, capacity=72)
    assert a.length == 70 and a.layers[3].n_blocks == 17  # the eager step chose among 17 blocks


# the quick tier takes the cache; --qsa off and int8 keys are the full suite's
@pytest.mark.parametrize("options", [dict(experts="cache:16:host")] + [
    pytest.param(o, marks=pytest.mark.slow) for o in (dict(qsa=False), dict(kv="int8"))], ids=["cache", "dense", "int8"])
def test_graph_step_equals_the_models_decode_with_experts_in_a_cache_without_qsa_or_int8_keys(
        flash_tiny_gguf, options):
    """Experts in a cache of 16 slots a layer over host RAM; `--qsa off` (the attention
    over the whole capacity, masked); keys and values stored as int8 with their scales
    (where the two steps' keys differ by an ulp a code can round the other way: the
    logits then part by about 1e-5, measured 1.3e-5)."""
    other = load_model(flash_tiny_gguf, dtype=torch.float32, kernels="torch", **options)
    _check(other, [1, 504, 3458, 314, 2113], 3, tol=1e-4 if "kv" in options else 1e-5)


def test_a_graph_of_a_window_of_tokens_equals_the_models_forward(model):
    """T = 3 (a verify's N + 1 rows, here as a plain forward): every row's logits."""
    a = model.new_cache()
    model([1, 504, 3458], a, last_only=True)
    b = a.copy()
    g = Qwen4ExpGraph(model, b, T=3)
    for toks in ([5, 6, 7], [8, 9, 10]):
        want, got = model(toks, a), g(toks)
        assert got.shape == want.shape == (3, model.cfg.vocab_size) and b.length == a.length
        assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("bad", [-1, 49152])
def test_a_token_out_of_range_is_refused_before_the_graph_runs(model, bad):
    """The step holds no check of its ids (the runner checks them on the host it fills
    them from): an id past the vocabulary is refused there, and the state is untouched."""
    a = model.new_cache()
    model([1, 504, 3458], a, last_only=True)
    g = Qwen4ExpGraph(model, a)
    conv = a.ple.conv.clone()
    n = model.embedding.shape[0]
    assert n == 49152
    with pytest.raises(ValueError, match=rf"token ids must lie in 0\.\.{n - 1}"):
        g([bad])
    assert a.length == 3 and torch.equal(a.ple.conv, conv)
    b = model.new_cache()
    model([1, 504, 3458], b, last_only=True)
    assert _rel(g([5]), model([5], b)) < 1e-5  # and the next good token goes on as if none came


def test_a_graph_continues_after_eager_steps_and_eager_after_it(model):
    a = model.new_cache()
    model([1, 2, 3], a, last_only=True)
    b = a.copy()
    g = Qwen4ExpGraph(model, b)
    for t in (5, 6):
        want, got = model([t], a, last_only=True), g(t)
        assert _rel(got, want) < 1e-5
    want, got = model([8, 9], a), model([8, 9], b)  # eager after the graph, in its buffers
    assert _rel(got, want) < 1e-5 and b.length == a.length == 7
    assert not g.fits(b, 1)  # the eager forward replaced the DeltaNet windows: capture again


def test_the_graph_is_taken_on_cuda_only(model, monkeypatch):
    state = model.new_cache()
    model([1, 2], state, last_only=True)
    model([4], state, last_only=True)
    assert state.graphs is None and not graphs_qwen4exp.usable(model, state, 1)
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")
    assert not graphs_qwen4exp.usable(model, state, 1)


# flash-tiny's graph step at bf16 with Triton kernels when these bounds were set (its 8
# layers): 98 launches with the experts resident, 106 in a cache over host RAM (the
# router GEMV's last program routes and looks the cache up; the staging one launch; the
# QSA layers' scores and attention the QSA kernels'; an attention layer's q and k norms,
# its rows' stores, the block keys' pooling and the indexer queries' norm one launch, RoPE's
# rows read at the device position: attention_rows; a DeltaNet layer's mixing one launch:
# deltanet_decode; the n-gram history and the PLE conv's
# window moved on in place by the launches that compute them; the embedding one launch
# into every stream, its ids checked on the host that fills them), and 2 fills of the
# token and position before the replay. Each about a microsecond in a graph. They only
# come down (212 and 220 before the QSA kernels, 160 and 168 before these, 149 and 157
# before the routing joined the router's GEMV, 141 and 149 before the shared expert's
# gated down GEMV joined the routed experts' down launch: moe(pair=), 133 and 141 before
# each hyper-connection read's down GEMV joined the launch that writes the streams:
# hc_down, 116 and 124 before attention_rows, 110 and 118 before deltanet_decode).
LAUNCHES_A_LAYER = {"device": 98 / 8, "cache:16:host": 106 / 8}


@pytest.mark.parametrize("experts, ple_io", [("device", None), ("cache:16:host", "ram")])
def test_on_fake_cuda_the_graph_step_reads_nothing_on_the_host_and_is_the_same_at_any_position(
        flash_tiny_gguf, experts, ple_io, monkeypatch):
    """The step the model takes on CUDA (its graph's), traced on fake tensors
    (strata.runtime.trace) at two positions: no host read, and the same launches with the
    same shapes, grids and number arguments. The eager step's differ (its attention reads
    the tokens held), which shows the comparison can fail."""
    from strata.runtime.trace import fake_cuda, trace
    with fake_cuda():
        model = load_model(flash_tiny_gguf, dtype=torch.bfloat16, device="cuda", kernels="triton",
                           experts=experts, ple_io=ple_io)
        state = model.new_cache()
        trace(lambda: model(torch.tensor([1]), state))  # makes the graph (on fake CUDA, not captured)
        g = state.graphs[1]
        first = trace(lambda: model(torch.tensor([2]), state))
        second = trace(lambda: model(torch.tensor([3]), state))
        assert state.graphs == {1: g} and state.length == 3
        monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")
        eager = [trace(lambda: model(torch.tensor([t]), state)) for t in (4, 5)]
    print(f"\nflash-tiny graph step on fake CUDA (bf16, Triton, experts {experts}): "
          f"{second.line(model.cfg.n_layers)}")
    assert first.ops == second.ops and len(first.ops) == first.launches
    assert second.host_to_device == 0 and second.launches <= LAUNCHES_A_LAYER[experts] * model.cfg.n_layers
    assert eager[0].ops != eager[1].ops


@pytest.fixture
def graphs_on_the_cpu(monkeypatch):
    """The model's forward takes its graphs on the CPU as on CUDA (run as is, not captured)."""
    monkeypatch.setattr(graphs_qwen4exp, "usable", graphs_qwen4exp.holds)


def test_a_verify_through_the_graph_keeps_what_single_steps_leave(model, graphs_on_the_cpu):
    """A state with the MTP head's keys: verify 4 tokens through the graph of 4, keep n;
    every part of the state is what n one-token steps through the graph of 1 leave, and
    their logits the eager steps' (the MTP keys and `hidden` written by the graph too)."""
    extra = [1234, 2345, 3456, 4567]
    base = model.new_cache(mtp=True)
    model([1, 504, 3458], base)  # the prompt: eager
    eager, steps = base.copy(), []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs_qwen4exp, "usable", lambda *a: False)
        for t in extra:
            steps.append((model([t], eager), eager.copy()))

    def parts(state):
        out = [state.hidden, state.ple.conv, state.ple.history.float(), state.mtp.k, state.mtp.v]
        for x in state.layers:
            out += [x.k, x.v] if hasattr(x, "k") else [x.conv, x.rec]
        return out
    one = base.copy()
    for t, (want, _) in zip(extra, steps):
        assert _rel(model([t], one), want) < 1e-5
    assert list(one.graphs) == [1]
    for a, b in zip(parts(one), parts(steps[-1][1])):
        assert _rel(a, b) < 1e-5
    for n in (2, 4):
        v = base.copy()
        rows = model.verify(extra, v)
        assert list(v.graphs) == [4] and _rel(rows, torch.cat([w for w, _ in steps])) < 1e-5
        v.keep(n)
        assert v.length == steps[n - 1][1].length
        for a, b in zip(parts(v), parts(steps[n - 1][1])):
            assert a.shape == b.shape and _rel(a, b) < 1e-5


@pytest.mark.slow
def test_greedy_spec_through_the_graphs_gives_the_plain_answer(model, flash_tiny_gguf, graphs_on_the_cpu):
    """Drafts accepted 0 to 3 at a time (a drafter that knows the answer, wrong at one place):
    decode and verifies through their graphs give --spec 0's eager tokens."""
    from strata.runtime import SamplingParams, generate
    from strata.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(flash_tiny_gguf)
    prompt, params = [1, 504, 3458], SamplingParams(temperature=0, max_tokens=10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs_qwen4exp, "usable", lambda *a: False)
        want = generate(model, tok, prompt, params).tokens

    from tests.strata.test_spec import _oracle
    got = generate(model, tok, prompt, params, spec=3, drafter=_oracle(want, len(prompt), model.cfg.vocab_size))
    assert got.tokens == want and 0 < got.spec.accepted < got.spec.drafted


def test_batch_invariant_a_verify_row_through_the_graph_is_its_one_token_step_bit_for_bit(
        flash_tiny_gguf, graphs_on_the_cpu):
    """The promise batch-invariant mode makes (triton_kernels.invariant), kept inside the
    graphs: the verify's rows and the one-token steps at their positions, exactly, in
    bfloat16 (as tests/strata/test_spec.py holds the eager steps to; in float32 on the
    CPU the eager steps too part by ~3e-7)."""
    from triton_kernels import invariant
    model = load_model(flash_tiny_gguf, dtype=torch.bfloat16, kernels="torch")
    extra = [1234, 2345, 3456, 4567]
    base = model.new_cache(mtp=True)
    model([1, 504, 3458], base)
    one, v = base.copy(), base.copy()
    with invariant.batch_invariant(True):
        steps = torch.cat([model([t], one) for t in extra])
        verify = model.verify(extra, v)
    assert list(one.graphs) == [1] and list(v.graphs) == [4]
    assert torch.equal(steps, verify)


def test_on_fake_cuda_a_verify_window_reads_nothing_on_the_host_and_is_the_same_at_any_position(
        flash_tiny_gguf):
    """A state tracking the MTP head's keys: its one-token graph and its verify graph of 4
    rows traced at two positions (a verify kept in part between): no host read, the same
    launches with the same shapes, and one copy from the host, the window's tokens (from
    pinned memory, queued: a pageable copy_ would make the host wait, and raises here)."""
    from strata.runtime.trace import fake_cuda, trace
    with fake_cuda():
        model = load_model(flash_tiny_gguf, dtype=torch.bfloat16, device="cuda", kernels="triton", experts="device")
        state = model.new_cache(mtp=True)
        trace(lambda: model(torch.tensor([1]), state))
        one = trace(lambda: model(torch.tensor([2]), state))
        verifies = []
        for toks in ([3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]):  # the first makes the graph
            verifies.append(trace(lambda: model.verify(torch.tensor(toks), state)))
            trace(lambda: state.keep(2))
        assert sorted(state.graphs) == [1, 4] and state.length == 8
        assert trace(lambda: model(torch.tensor([15]), state)).ops == one.ops
    assert verifies[1].ops == verifies[2].ops and verifies[1].host_to_device == 1
    print(f"\nflash-tiny verify of 4 through its graph on fake CUDA: {verifies[1].line(model.cfg.n_layers)}")


@pytest.mark.slow
def test_the_servers_slots_replay_their_own_graphs_and_answer_as_eagerly(model, flash_tiny_gguf):
    """Three requests in four slots, decoded together: each slot's state takes its graph
    (on the CPU here as on CUDA), and the answers are the eager engine's."""
    from strata.runtime import SamplingParams
    from strata.server.engine import Engine, Request
    from strata.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(flash_tiny_gguf)
    prompts, params = [[1, 504, 3458], [7, 8], [42, 43, 44, 45]], SamplingParams(temperature=0, max_tokens=3)

    def answers():
        engine = Engine(model, tok, slots=4, cache_mib=0, start_thread=False)
        reqs = [engine.submit(Request(p, params, lambda ev: None)) for p in prompts]
        engine.run(until_idle=True)
        return [r.tokens for r in reqs]
    want = answers()
    made = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs_qwen4exp, "usable", graphs_qwen4exp.holds)
        init = Qwen4ExpGraph.__init__

        def counted(self, *a, **k):
            init(self, *a, **k)
            made.append((id(self.state), self.T))
        mp.setattr(Qwen4ExpGraph, "__init__", counted)
        assert answers() == want
    assert len({state for state, _ in made}) == len(prompts) and all(T == 1 for _, T in made)


class _Captured:
    """A stand-in for torch.cuda.CUDAGraph on the CPU: capturing records the step's
    arguments and leaves the state as it was (a capture runs nothing); `replay` runs the
    step on them and writes its results into the tensors the capture returned."""
    now = None

    def __init__(self):
        self.args = self.out = None

    def replay(self):
        counters = self.runner._counters()
        counted = [dict(c) for c in counters]
        fresh = _Captured.real(*self.args)
        for c, was in zip(counters, counted):  # (a replay runs no Python)
            c.update(was)
        for a, b in zip(_flat(self.out), _flat(fresh)):
            a.copy_(b)


def _flat(out):
    logits, x, kept = out
    return [logits, x, *([kept["ple_input"]] if "ple_input" in kept else []),
            *(t for rows in kept.get("rows", []) for t in rows)]


def test_the_capture_and_its_replays_on_a_stand_in_for_cuda(model, graphs_on_the_cpu, monkeypatch):
    """The capture's bookkeeping run on the CPU: warm-up steps undone, the step recorded,
    each replay's outputs handed over (the logits copied, a verify's rows), the host's
    counters (the experts', the PLE table's rows) advanced as eager steps advance them.
    Decode and verify logits as eager."""
    import contextlib
    real = _Captured.real = graphs_qwen4exp.step
    state_of = {}

    def step(model_, tok, pos, state, prev=None):
        g = _Captured.now
        if g is None:
            return real(model_, tok, pos, state, prev)
        held = [t.clone() for t in state_of["runner"]._changed()]
        g.args, g.out = (model_, tok, pos, state, prev), real(model_, tok, pos, state, prev)
        g.runner = state_of["runner"]
        for t, h in zip(state_of["runner"]._changed(), held):
            t.copy_(h)
        return g.out

    @contextlib.contextmanager
    def graph(g, stream=None):
        assert isinstance(stream, Stream)  # captured on the warm-up's stream, as the warm-up made its counts
        _Captured.now = g
        yield
        _Captured.now = None

    class Stream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass
    init = Qwen4ExpGraph.__init__

    def remember(self, *a, **k):
        state_of["runner"] = self
        init(self, *a, **k)
    monkeypatch.setattr(Qwen4ExpGraph, "__init__", remember)
    monkeypatch.setattr(graphs_qwen4exp, "step", step)
    monkeypatch.setattr(graphs_qwen4exp, "captures", lambda dev: True)
    for name, f in (("Stream", Stream), ("current_stream", lambda *a: Stream()), ("CUDAGraph", _Captured),
                    ("graph", graph), ("stream", lambda s: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, f)

    extra = [1234, 2345, 3456, 4567]
    base = model.new_cache(mtp=True)
    model([1, 504, 3458], base)
    eager, want = base.copy(), []

    def calls():
        stats = model.io_stats()
        return stats["experts"]["calls"], stats["ple"]["rows"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs_qwen4exp, "usable", lambda *a: False)
        before = calls()
        for t in extra:
            want.append(model([t], eager))
        eager_calls = [b - a for a, b in zip(before, calls())]
    one = base.copy()
    model([extra[0]], one)  # captures
    before = calls()
    got = [model([t], one) for t in extra[1:]]
    assert isinstance(one.graphs[1].graph, _Captured)
    assert _rel(torch.cat(got), torch.cat(want[1:])) < 1e-5  # copies: each step's own logits
    replayed = [b - a for a, b in zip(before, calls())]
    assert replayed == [n * 3 // 4 for n in eager_calls] and min(replayed) > 0  # a replay counts as an eager step
    v = base.copy()
    rows = model.verify(extra, v)
    assert isinstance(v.graphs[4].graph, _Captured) and _rel(rows, torch.cat(want)) < 1e-5
    v.keep(2)
    assert _rel(model([extra[2]], v), want[2]) < 1e-5


def test_a_replay_advances_the_ple_tables_rows(model):
    """A replay runs no Python: the host counters a captured step added are added again
    for it, from _counters(). A PLE table in memory (flash-tiny's here, a GPU's where it
    fits) counts its rows in a dict that list holds. (The stand-in above restores what
    _counters() lists and runs the step's Python again, so only this reads the list.)"""
    from strata.storage.ple_gather import InMemoryTable
    state = model.new_cache()
    model([1, 2], state)
    table = model.ple.table
    assert isinstance(table, InMemoryTable) and table.stats()["rows"] > 0
    assert any(c is table._counts for c in Qwen4ExpGraph(model, state)._counters())


def test_a_dropped_state_takes_its_graphs_with_it(model):
    import gc
    import weakref
    state = model.new_cache()
    model([1, 2], state)
    state.graphs = {1: Qwen4ExpGraph(model, state)}
    gone = weakref.ref(state.graphs[1])
    gc.disable()
    try:
        del state
        assert gone() is None  # no cycle left for the collector
    finally:
        gc.enable()


def test_a_verify_through_its_graph_leaves_the_graphs_outputs_and_keep_checks_they_are_there(
        model, graphs_on_the_cpu):
    """What a verify through its graph leaves for `keep` are the graph's own outputs (no
    copies: at the real shape hundreds of launches a verify), valid until the graph runs
    again: keep right after the verify cuts the state as the eager one does; keep after
    another verify of the same graph is refused, naming why."""
    base = model.new_cache(mtp=True)
    model([1, 504, 3458], base)
    a, b = base.copy(), base.copy()
    got = model.verify([5, 6, 7], a)
    assert a._verify.graph is not None and a.graphs[3].replays == a._verify.graph[1]
    a.keep(2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs_qwen4exp, "usable", lambda *args: False)
        want = model.verify([5, 6, 7], b)
        b.keep(2)
    assert _rel(got, want) < 1e-5 and a.length == b.length == 5
    assert _rel(model([9], a), model([9], b)) < 1e-5
    model.verify([1, 2, 3], a)
    v = a._verify
    model.verify([4, 5, 6], a)  # the same graph again, over what v refers to
    a._verify = v
    with pytest.raises(RuntimeError, match=r"the verify's graph ran again since, over what keep reads"):
        a.keep(1)
