"""Sampling filters and the generation loop."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from tests.tiers import examples

from strata.runtime import SamplingParams, Sampler, generate

logits_st = st.lists(st.floats(-10, 10), min_size=2, max_size=50).map(lambda v: torch.tensor(v))


@given(logits_st)
def test_temperature_zero_is_argmax(logits):
    assert Sampler(SamplingParams(temperature=0))(logits) == int(logits.argmax())


@given(logits_st, st.floats(0.1, 2.0))
def test_top_k_one_is_argmax(logits, temp):
    s = Sampler(SamplingParams(temperature=temp, top_k=1, top_p=1.0, min_p=0.0, seed=0))
    assert logits[s(logits)] == logits.max()


@settings(max_examples=examples(50))
@given(logits_st, st.floats(0.05, 0.9), st.integers(0, 2**31))
def test_min_p_never_draws_below_its_floor(logits, min_p, seed):
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=min_p, seed=seed))
    probs = torch.softmax(logits, 0)
    for _ in range(20):
        assert probs[s(logits)] >= min_p * probs.max() * (1 - 1e-6)


@settings(max_examples=examples(50))
@given(logits_st, st.floats(0.05, 0.99), st.integers(0, 2**31))
def test_top_p_draws_from_the_smallest_prefix_reaching_p(logits, top_p, seed):
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=top_p, min_p=0.0, seed=seed))
    probs = torch.softmax(logits, 0)
    for _ in range(20):
        tok = s(logits)
        # the mass strictly above the drawn token is still short of top_p
        assert probs[probs > probs[tok]].sum() < top_p + 1e-6


@given(logits_st, st.integers(0, 2**31))
def test_same_seed_same_draws(logits, seed):
    p = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    a, b = Sampler(p), Sampler(p)
    assert [a(logits) for _ in range(10)] == [b(logits) for _ in range(10)]


def sorted_distribution(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The filters over a stable sort of the whole vocabulary (of equal logits the lower id
    first): what the sampler's top-k stands for."""
    vals, idx = torch.sort(logits.float(), descending=True, stable=True)
    if p.top_k:
        vals, idx = vals[:p.top_k], idx[:p.top_k]
    probs = torch.softmax(vals, dim=-1)
    if p.top_p < 1.0:
        keep = int(torch.searchsorted(torch.cumsum(probs, 0), torch.tensor(p.top_p))) + 1
        vals, idx, probs = vals[:keep], idx[:keep], probs[:keep]
    keep = probs >= p.min_p * probs[0]
    return idx[keep], torch.softmax(vals[keep] / p.temperature, dim=-1)


@settings(max_examples=examples(50))
@given(st.integers(2, 3000), st.integers(0, 60), st.floats(0.05, 1.0), st.floats(0.0, 0.5), st.floats(0.1, 2.0),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(1, 64), st.integers(0, 2**31))
def test_the_filters_keep_a_stable_sorts_tokens(vocab, top_k, top_p, min_p, temp, dtype, levels, seed):
    """The sampler's ids and probabilities are those of the filters over a stable sort of the
    vocabulary, bit for bit, ties among the logits (as bf16's are common) included: its
    top-k cut (torch.topk where the logits lie, then the ties at the cut) and its order
    keep the lower of equal ids first, so a seed's draws rest on no device's order (here
    on the CPU; the same code runs on a GPU's logits)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, levels, (vocab,), generator=g).float() / 8).to(dtype)
    p = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    ids, probs = Sampler(p).distribution(logits)
    want_ids, want_probs = sorted_distribution(logits, p)
    assert torch.equal(ids, want_ids) and torch.equal(probs, want_probs)


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_k": -1}, {"top_p": 0}, {"top_p": 1.5},
                                {"min_p": 2}, {"max_tokens": -1}])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_generation_streams_stops_and_counts(smollm2_bf16, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, separated by commas."}]))
    pieces = []
    full = generate(smollm2_bf16, tok, ids, SamplingParams(temperature=0, max_tokens=40), on_text=pieces.append)
    assert "".join(pieces) == full.text
    assert "4" in full.text  # the stop string below occurs
    cut = generate(smollm2_bf16, tok, ids, SamplingParams(temperature=0, max_tokens=40, stop=["4"]),
                   on_text=(streamed := []).append)
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index("4")]
    assert "".join(streamed) == cut.text
    short = generate(smollm2_bf16, tok, ids, SamplingParams(temperature=0, max_tokens=3))
    assert short.finish_reason == "length" and len(short.tokens) == 3
    assert full.tokens[:3] == short.tokens


def test_empty_prompt_is_refused(smollm2_bf16, smollm2_tokenizer):
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(smollm2_bf16, smollm2_tokenizer, [], SamplingParams())
