"""strata.perplexity: llama-perplexity's PPL and KL divergence, on SmolLM2 over 2 chunks of
128 tokens of the standard-library text (63 scored a chunk); KL divergence over 2 chunks of 64."""
import hashlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from strata.perplexity import (
    SavedLogits,
    chunk_logits,
    kl_divergence,
    perplexity,
    save_logits,
    stdlib_text,
)

N_CTX, N_CHUNKS = 128, 2
KLD_CTX = 64  # each KLD test runs 8 chunk evaluations: shorter ones keep the file quick


@pytest.fixture(scope="module")
def text():
    return stdlib_text()


@pytest.fixture(scope="module")
def tokens(text, smollm2_tokenizer):
    return smollm2_tokenizer.encode(text[:20000], parse_special=False)


@pytest.fixture(scope="module")
def smollm2_f32(smollm2_gguf):
    from strata.load import load_model
    return load_model(smollm2_gguf, dtype=torch.float32)


def test_stdlib_text_is_the_same_in_every_process(text):
    # another process, another hash seed: no set or dict order may leak into the text
    code = "import hashlib, strata.perplexity as p; print(hashlib.sha256(p.stdlib_text().encode()).hexdigest())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out == hashlib.sha256(text.encode()).hexdigest()
    assert text.startswith("abc\n===\n") and len(text) > 300_000


class Recording:
    """The model, keeping what each forward call was given and returned."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def new_cache(self, capacity):
        return self.model.new_cache(capacity)

    def forward(self, tokens, cache, last_only=False):
        out = self.model.forward(tokens, cache, last_only)
        self.calls.append((list(tokens), out))
        return out


def test_ppl_is_exp_mean_nll_of_the_second_half_of_each_chunk(smollm2_bf16, tokens):
    model = Recording(smollm2_bf16)
    res = perplexity(model, tokens, N_CTX, N_CHUNKS)
    nll = []
    for c, (seen, logits) in enumerate(model.calls):
        chunk = tokens[c * N_CTX:(c + 1) * N_CTX]
        assert seen == chunk  # SmolLM2 adds no BOS: the chunk as it is
        logp = torch.log_softmax(logits.double(), -1)
        nll += [-float(logp[i, chunk[i + 1]]) for i in range(N_CTX // 2, N_CTX - 1)]
    nll = np.array(nll)
    assert len(model.calls) == N_CHUNKS
    assert res.n_scored == nll.size == N_CHUNKS * (N_CTX - 1 - N_CTX // 2)
    assert math.isfinite(res.ppl) and res.ppl == pytest.approx(math.exp(nll.mean()), rel=1e-6)
    # llama.cpp's error: PPL * sqrt((E[nll^2] - E[nll]^2) / (count - 1))
    assert res.ppl_err == pytest.approx(res.ppl * nll.std() / math.sqrt(nll.size - 1), rel=1e-5)
    assert res.chunk_ppl[-1] == res.ppl


def test_each_chunk_starts_afresh_and_with_bos_when_the_vocabulary_adds_it():
    seen = []

    class Recorder:
        def new_cache(self, capacity):
            return {"length": 0}

        def forward(self, tokens, cache, last_only=False):
            assert cache["length"] == 0
            seen.append(list(tokens))
            return torch.zeros(len(tokens), 10)

    res = perplexity(Recorder(), list(range(1, 10)) * 3, n_ctx=8, bos_id=0)
    assert seen == [[0, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7], [0, 9, 1, 2, 3, 4, 5, 6]]
    assert res.n_chunks == 3 and res.ppl == pytest.approx(10.0)  # uniform over 10 ids
    assert chunk_logits(Recorder(), [5] * 8).shape == (3, 10)  # positions 4..6 scored


def test_kld_of_a_model_from_itself_is_zero(smollm2_bf16, tokens, tmp_path):
    direct = kl_divergence(smollm2_bf16, tokens, smollm2_bf16, KLD_CTX, N_CHUNKS)
    save_logits(tmp_path / "self.npz", smollm2_bf16, tokens, KLD_CTX, N_CHUNKS, top_k=32)
    saved = kl_divergence(smollm2_bf16, None, SavedLogits(tmp_path / "self.npz"))
    for r in (direct, saved):
        assert r.count == N_CHUNKS * (KLD_CTX - 1 - KLD_CTX // 2)
        assert abs(r.kld_mean) < 1e-9 and abs(r.kld_max) < 1e-9
        assert r.same_top_p == 1.0 and r.ppl == pytest.approx(r.ppl_base, rel=1e-6)


def test_kld_of_bf16_from_f32_is_positive_and_top_k_bounds_it_from_below(smollm2_bf16, smollm2_f32, tokens,
                                                                          tmp_path):
    exact = kl_divergence(smollm2_bf16, tokens, smollm2_f32, KLD_CTX, N_CHUNKS)
    save_logits(tmp_path / "f32.npz", smollm2_f32, tokens, KLD_CTX, N_CHUNKS, top_k=2048)
    top_k = kl_divergence(smollm2_bf16, tokens, SavedLogits(tmp_path / "f32.npz"), KLD_CTX, N_CHUNKS)
    assert exact.kld_mean > 0 and 0.5 < exact.same_top_p <= 1.0
    assert exact.kld_median <= exact.kld_p90 <= exact.kld_p99 <= exact.kld_max
    # the top-k file's KLD is that of coarsened distributions: a lower bound, and close
    # (99% with k=2048 when measured on 512 positions)
    assert 0.95 * exact.kld_mean < top_k.kld_mean <= exact.kld_mean * (1 + 1e-6)
    assert top_k.same_top_p == exact.same_top_p and top_k.ppl_base == pytest.approx(exact.ppl_base, rel=1e-6)
    assert exact.ln_ppl_ratio == pytest.approx(math.log(exact.ppl / exact.ppl_base), abs=1e-9)


def test_make_text_writes_the_stdlib_text(text, tmp_path):
    from strata.cli import main
    assert main(["perplexity", "--make-text", str(tmp_path / "t.txt")]) == 0
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == text
