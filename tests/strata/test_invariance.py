"""Batch-invariant mode (--batch-invariant, triton_kernels.invariant): flash-tiny in
bfloat16 gives the same logits, bit for bit, and so the same greedy tokens, whatever the
chunks its prompt is prefilled in (1, 7, 64 and 512 tokens), on a prompt past the QSA
budget (64 tokens), so that the indexer's choice, the sparse attention, the DeltaNet
recurrence and the routed experts all run."""
import pytest
import torch

from strata.runtime import SamplingParams, generate
from triton_kernels import invariant

PROMPT, NEW = 100, 6
CHUNKS = (512, 64, 7, 1)


@pytest.fixture(scope="module")
def tiny_bf16(flash_tiny_gguf):
    from strata.load import load_model
    from strata.tokenizer import Tokenizer
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two cores shared with the rest of the suite
    yield load_model(flash_tiny_gguf, dtype=torch.bfloat16, kernels="torch"), Tokenizer.from_gguf(flash_tiny_gguf)
    torch.set_num_threads(before)


def _prompt():
    return torch.randint(1000, 49152, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()


def _prefill(model, ids, chunk):
    cache = model.new_cache(len(ids) + NEW)
    for i in range(0, len(ids), chunk):
        logits = model(ids[i:i + chunk], cache, last_only=True)
    return logits[-1], cache


@pytest.mark.slow
def test_any_prefill_chunking_gives_the_same_logits_and_tokens(tiny_bf16):
    model, tok = tiny_bf16
    ids = _prompt()
    with invariant.batch_invariant():
        logits = {c: _prefill(model, ids, c)[0] for c in CHUNKS}
        tokens = {c: generate(model, tok, ids, SamplingParams(temperature=0, max_tokens=NEW), ubatch=c).tokens
                  for c in CHUNKS}
    for c in CHUNKS[1:]:
        assert torch.equal(logits[c], logits[CHUNKS[0]]), f"chunks of {c}: the prompt's last logits differ"
        assert tokens[c] == tokens[CHUNKS[0]], f"chunks of {c}: {tokens[c]} != {tokens[CHUNKS[0]]}"
    assert len(tokens[1]) == NEW


def test_a_decoded_token_equals_the_same_token_prefilled(tiny_bf16):
    """Decode (one row) and prefill (many) share the arithmetic: the logits after
    prompt + [t] fed as one chunk equal those of the prompt, then t as a decode step."""
    model, _ = tiny_bf16
    ids = _prompt()
    with invariant.batch_invariant():
        _, cache = _prefill(model, ids, 64)
        stepped = model([ids[0]], cache, last_only=True)[-1]
        whole = _prefill(model, ids + [ids[0]], 512)[0]
    assert torch.equal(stepped, whole)


def test_serve_is_batch_invariant_by_default_and_the_plan_says_so(flash_tiny_gguf):
    from strata.cli.args import load_options
    from strata.cli.parser import build_parser
    from strata.load import decide
    p = build_parser()
    assert p.parse_args(["serve"]).batch_invariant is True
    assert p.parse_args(["serve", "--no-batch-invariant"]).batch_invariant is False
    assert p.parse_args(["generate", "hi"]).batch_invariant is None  # the process's: decode steps alone
    on = decide(flash_tiny_gguf, load_options(p.parse_args(["serve"])))
    off = decide(flash_tiny_gguf, load_options(p.parse_args(["serve", "--no-batch-invariant"])))
    assert any(line.startswith("numerics: batch-invariant") for line in on.lines())
    assert not any(line.startswith("numerics:") for line in off.lines())
