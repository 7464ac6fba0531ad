"""Speculative decoding (strata.runtime.spec) on flash-tiny, float32.

Greedy, --spec N must give --spec 0's tokens exactly: the verify's rows are the logits of
the same prefixes, computed N+1 rows at a time instead of one, and a row's float32 logits
move by ~2e-7 with the batch (measured), against gaps of 1e-2 and more between flash-tiny's
two best logits; an error in the roll-back or in the acceptance gives another token
within a step or two. flash-tiny's MTP head is random, so its drafts are refused: a
drafter that proposes known tokens, wrong at chosen places, makes every number of
accepted drafts happen.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.runtime import SamplingParams, generate
from strata.runtime.sampling import Sampler
from strata.runtime.spec import Speculator, acceptance, check, residual
from strata.server.engine import Engine, Request

N_PROMPTS, NEW = 20, 6


@pytest.fixture(scope="module")
def one_thread():
    # two cores shared with other work: one thread is the fastest for flash-tiny's small ops
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(flash_tiny_gguf, one_thread):
    from strata.load import load_model
    from strata.tokenizer import Tokenizer
    return load_model(flash_tiny_gguf, dtype=torch.float32, kernels="torch"), Tokenizer.from_gguf(flash_tiny_gguf)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(14)
    return [torch.randint(1000, 49152, (int(n),), generator=g).tolist()
            for n in torch.randint(2, 5, (N_PROMPTS,), generator=g)]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW)


@pytest.fixture(scope="module")
def plain(tiny, prompts):
    """--spec 0's answers."""
    model, tok = tiny
    return [generate(model, tok, p, GREEDY).tokens for p in prompts]


def test_greedy_spec_4_is_spec_0_in_generate(tiny, prompts, plain):
    model, tok = tiny
    runs = [generate(model, tok, p, GREEDY, spec=4) for p in prompts]
    assert [r.tokens for r in runs] == plain
    # NEW tokens: the steps draft 4, 3, 2, 1, 0 (room left), each refused by random weights
    assert all(r.spec.drafted > 0 for r in runs if len(r.tokens) == NEW)


def test_greedy_spec_4_is_spec_0_in_the_server(tiny, prompts, plain):
    model, tok = tiny
    engine = Engine(model, tok, slots=4, cache_mib=0, start_thread=False, spec=4)
    reqs = [engine.submit(Request(p, GREEDY, lambda ev: None)) for p in prompts]
    engine.run(until_idle=True)
    assert [r.tokens for r in reqs] == plain


def _oracle(want: list[int], prompt_len: int, vocab: int):
    """A drafter proposing `want`'s next tokens, the one at (position mod (k + 1)) wrong
    (none wrong when that is k): every number of accepted drafts from 0 to k occurs."""
    def drafter(state, tok, k):
        i = state.length - prompt_len  # tok is want[i]
        drafts = want[i + 1:i + 1 + k]
        bad = i % (k + 1)
        if bad < len(drafts):
            drafts[bad] = (drafts[bad] + 1) % vocab
        qs = [torch.nn.functional.one_hot(torch.tensor(d), vocab).float() for d in drafts]
        return drafts, qs
    return drafter


def test_any_accepted_prefix_keeps_the_greedy_answer(tiny, prompts, plain):
    """Drafts accepted 0 to 4 at a time: the state rolled back to each kept prefix (DeltaNet
    states, conv windows, attention, PLE, the MTP keys) continues as --spec 0 does."""
    model, tok = tiny
    p = prompts[0]
    want = generate(model, tok, p, SamplingParams(temperature=0, max_tokens=16)).tokens
    got = generate(model, tok, p, SamplingParams(temperature=0, max_tokens=16), spec=4,
                   drafter=_oracle(want, len(p), model.cfg.vocab_size))
    assert got.tokens == want and len(want) == 16
    assert 0 < got.spec.accepted < got.spec.drafted


def test_keep_leaves_the_state_a_decode_of_the_kept_tokens(tiny, prompts):
    """Verify 5 tokens, keep n (1..5): every part of the state is the one n single steps
    leave. Tolerance 1e-5 of the largest value: float32, the two differ only in the
    projections' batch (5 rows against 1), measured at most 1e-6 relative."""
    model, _ = tiny
    g = torch.Generator().manual_seed(5)
    extra = torch.randint(1000, 49152, (5,), generator=g).tolist()
    base = model.new_cache(mtp=True)
    model(prompts[0], base)
    steps, s = [], base.copy()
    for t in extra:
        model([t], s)
        steps.append(s.copy())

    def parts(state):
        out = [state.hidden, state.ple.conv, state.ple.history.float(), state.mtp.k, state.mtp.v]
        for x in state.layers:
            out += [x.k, x.v] if hasattr(x, "k") else [x.conv, x.rec]
        return out
    for n in range(1, 6):
        v = base.copy()
        model.verify(extra, v)
        v.keep(n)
        assert v.length == steps[n - 1].length
        for a, b in zip(parts(v), parts(steps[n - 1])):
            assert a.shape == b.shape
            assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1e-30)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=2, max_size=8), st.lists(st.floats(0.01, 1), min_size=2, max_size=8))
def test_accepting_or_drawing_the_residual_gives_the_target(pw, qw):
    """For any target p and draft distribution q: a draft d ~ q kept with acceptance(p, q, d),
    else a token from residual(p, q), is distributed as p (exactly; float32 sums of <= 8
    terms of [0, 1]: 1e-6)."""
    v = min(len(pw), len(qw))
    p, q = torch.tensor(pw[:v]), torch.tensor(qw[:v])
    if p.sum() == 0:
        p[0] = 1.0
    p, q = p / p.sum(), q / q.sum()
    r = residual(p, q)
    out = sum(q[d] * (acceptance(p, q, d) * torch.nn.functional.one_hot(torch.tensor(d), v)
                      + (1 - acceptance(p, q, d)) * r) for d in range(v))
    assert torch.allclose(out, p, atol=1e-6)


class _Fixed:
    """A model whose verify rows have fixed logits, and a state that takes the keep."""
    mtp = "a head"

    def __init__(self, logits):
        self.logits = logits

    def verify(self, tokens, state):
        return self.logits[:len(tokens)]

    def keep(self, n):
        pass


def test_sampled_step_draws_the_first_token_from_the_target():
    """Through Speculator.step with temperature 1: the first token after a step's input is
    distributed as the target's first row whatever the drafts' q. 4000 steps: each
    frequency within 5 binomial standard deviations (<= 0.04) of p; drawing from q instead,
    or dropping the residual, misses by >= 0.2."""
    p = torch.tensor([[0.6, 0.3, 0.05, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([0.05, 0.15, 0.4, 0.4])
    model, state = _Fixed(p.log()), _Fixed(None)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    g = torch.Generator().manual_seed(4)

    def drafter(_state, _tok, k):
        drafts = [int(torch.multinomial(q, 1, generator=g)) for _ in range(k)]
        return drafts, [q] * k
    spec = Speculator(model, 2, Sampler(params), drafter=drafter)
    firsts = torch.tensor([spec.step(state, 0)[0] for _ in range(4000)])
    freq = torch.bincount(firsts, minlength=4).float() / 4000
    assert float((freq - p[0]).abs().max()) < 5 * (0.25 / 4000) ** 0.5


def test_spec_without_an_mtp_head_names_the_flag(smollm2_bf16):
    with pytest.raises(ValueError, match=r"--spec 4: .*llama.*no MTP head"):
        check(smollm2_bf16, 4)
    with pytest.raises(ValueError, match=r"--spec-min-p 1.5"):
        Speculator(smollm2_bf16, 0, Sampler(GREEDY), min_p=1.5)
