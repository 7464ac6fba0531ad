"""strata.perplexity: llama-perplexity's PPL and KL divergence, on SmolLM2 over 2 chunks of
128 tokens of the standard-library text (tests/data/llama_tools_text.txt; 63 scored a
chunk), against what llama-perplexity
itself printed and wrote for the same text (tests/data/llama_tools_golden.json, from
scripts/golden_llama_tools.py); the top-k file's KL divergence over 2 chunks of 64."""
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

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
GOLDEN = json.loads((Path(__file__).resolve().parents[2] / "tests" / "data" / "llama_tools_golden.json").read_text())
LLAMA = GOLDEN["perplexity"]

# Strata (bf16) against llama-perplexity (Q4_1 weights, activations rounded to Q8_1) on the
# same file and text; measured on this text: |ln PPL ratio| 0.0030 (0.0054 at chunk 1), error
# bar -0.93%, per-token NLL max 0.33 and mean 0.067, the same argmax at 96.0% of positions.
TOL_LN_PPL, TOL_REL_ERR = 0.01, 0.02
TOL_NLL, TOL_NLL_MEAN, MIN_SAME_TOP = 0.5, 0.1, 0.93
# the KL divergence run (ffn_down in Q4_0): PPL(Q) ln ratio -0.020 (the Q model's rounding
# in both engines adds up), KLD mean -7.5%, median -1.1%, 90th percentile -12.4%, RMS Δp
# +2.6%, same top 84.9% against 81.7% (4 tokens of 126)
TOL_LN_PPL_Q, TOL_KLD_REL, TOL_DP_RMS_REL, SAME_TOP_TOKENS = 0.04, 0.2, 0.1, 6


@pytest.fixture(scope="module")
def text():
    return stdlib_text()


@pytest.fixture(scope="module")
def tokens(llama_tools_text, smollm2_tokenizer):
    assert (GOLDEN["n_ctx"], GOLDEN["n_chunks"]) == (N_CTX, N_CHUNKS)
    return smollm2_tokenizer.encode(llama_tools_text, parse_special=False)


@pytest.fixture(scope="module")
def smollm2_f32(smollm2_gguf):
    from strata.load import load_model
    return load_model(smollm2_gguf, dtype=torch.float32)


class Cached:
    """A model's logits for each chunk, computed once and handed out again (a base for
    kl_divergence, the model for perplexity)."""

    def __init__(self, model):
        self.model, self.logits = model, {}

    def new_cache(self, capacity):
        return None

    def forward(self, tokens, cache, last_only=False):
        key = tuple(tokens)
        if key not in self.logits:
            self.logits[key] = self.model.forward(list(tokens), self.model.new_cache(len(tokens)))
        return self.logits[key]


@pytest.fixture(scope="module")
def smollm2_chunks(smollm2_bf16):
    return Cached(smollm2_bf16)


def test_stdlib_text_is_the_same_in_every_process(text):
    # another process, another hash seed: no set or dict order may leak into the text
    code = "import hashlib, strata.perplexity as p; print(hashlib.sha256(p.stdlib_text().encode()).hexdigest())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out == hashlib.sha256(text.encode()).hexdigest()
    assert text.startswith("abc\n===\n") and len(text) > 300_000


class Replay:
    """llama.cpp's log-prob of each scored next token, as logits: the row of a position
    llama-perplexity scored holds that log-prob (float32, as decoded) at the next token and
    the rest of the mass at one other id, so that its log-softmax gives the log-prob back
    (to 1 ulp); every other row is uniform (-ln 49152 for any target), so a perplexity that
    scores other positions, or other targets, comes out far off."""

    def __init__(self, token_logp, n_vocab: int):
        self.token_logp, self.n_vocab, self.calls = np.asarray(token_logp, np.float64), n_vocab, 0

    def new_cache(self, capacity):
        return None

    def forward(self, tokens, cache, last_only=False):
        n, first = len(tokens), len(tokens) // 2
        per_chunk = n - 1 - first
        lp = self.token_logp[self.calls * per_chunk:(self.calls + 1) * per_chunk]
        self.calls += 1
        logits = torch.zeros(n, self.n_vocab)
        for j, v in enumerate(lp):
            i, target = first + j, tokens[first + j + 1]
            logits[i] = -math.inf
            logits[i, target] = v
            logits[i, (target + 1) % self.n_vocab] = math.log(-math.expm1(v)) if v < 0 else -math.inf
        return logits


def test_tokens_are_the_ones_llama_perplexity_evaluated(tokens):
    f = LLAMA["logits_file"]
    assert (f["n_ctx"], f["n_chunks"]) == (N_CTX, N_CHUNKS)
    assert tokens[:N_CTX * N_CHUNKS] == f["tokens"]  # SmolLM2 adds no BOS: the text's own tokens


def test_scoring_reproduces_llama_perplexity_from_its_own_log_probs(tokens):
    """Strata's chunking, scored positions, targets, mean and error, fed the log-probs
    llama-perplexity wrote (its --kl-divergence-base file, 16 bits a log-prob).

    Exact where llama.cpp used those same decoded values: its "Mean PPL(base)" (the base
    side of a KL divergence run of the model against its own file), to the 6 decimals
    printed and the float32 ulp Strata's log-probs may move each value by (2^-23 of the
    mean NLL). Bounded where it used the unrounded logits: each decoded log-prob is within
    scale/2 of llama.cpp's (scale = range/65535, about 2.4e-4), so every running PPL of the
    plain run ("[i]x", 4 decimals) is within a factor exp(max scale/2), plus the rounding."""
    f = LLAMA["logits_file"]
    res = perplexity(Replay(f["token_logp"], f["n_vocab"]), tokens, N_CTX, N_CHUNKS)
    ppl_base, ppl_base_err = LLAMA["kld_self"]["Mean PPL(base)"]
    ulps = 2**-23 * -np.mean(f["token_logp"])
    assert abs(res.ppl - ppl_base) <= 5e-7 + ppl_base * ulps
    assert abs(res.ppl_err - ppl_base_err) <= 5e-7 + ppl_base_err * 4 * ulps
    assert res.n_scored == len(f["token_logp"]) == N_CHUNKS * (N_CTX - 1 - N_CTX // 2)
    bound = math.expm1(max(f["scale"]) / 2)
    plain = LLAMA["plain"]
    assert len(res.chunk_ppl) == len(plain["chunk_ppl"])
    for ours, theirs in zip(res.chunk_ppl, plain["chunk_ppl"]):
        assert abs(ours - theirs) <= theirs * bound + 5e-5
    assert abs(res.ppl_err - plain["ppl_err"]) <= plain["ppl_err"] * 2 * bound + 5e-6


def test_ppl_of_smollm2_is_llama_perplexitys(smollm2_chunks, tokens):
    """Strata's SmolLM2 (bf16) against llama-perplexity's run of the same Q4_1 file.

    The engines differ in rounding only: llama.cpp's CPU matmuls round the activations to
    8 bits (Q8_1, relative error up to 2^-8 per element) and Strata's bf16 model rounds
    weights and activations to 8-bit mantissas (2^-9). On these 126 tokens that moves the
    mean NLL by TOL_LN_PPL at most (measured: see the number beside it), and the NLL of a
    single token by TOL_NLL; a change to the scoring of the size of the model's own
    top-1 probability margin, or a wrong chunk, is far outside both."""
    res = perplexity(smollm2_chunks, tokens, N_CTX, N_CHUNKS)
    plain = LLAMA["plain"]
    assert abs(math.log(res.ppl / plain["ppl"])) < TOL_LN_PPL
    for ours, theirs in zip(res.chunk_ppl, plain["chunk_ppl"]):
        assert abs(math.log(ours / theirs)) < TOL_LN_PPL
    assert res.ppl_err == pytest.approx(plain["ppl_err"], rel=TOL_REL_ERR)
    # per token, against the log-probs llama-perplexity wrote
    f = LLAMA["logits_file"]
    nll, top = [], []
    for c in range(N_CHUNKS):
        chunk = tokens[c * N_CTX:(c + 1) * N_CTX]
        logits = smollm2_chunks.forward(chunk, None)[N_CTX // 2:N_CTX - 1].double()
        logp = torch.log_softmax(logits, -1)
        nll += [-float(logp[i, chunk[N_CTX // 2 + 1 + i]]) for i in range(logits.shape[0])]
        top += logits.argmax(-1).tolist()
    d = np.abs(np.array(nll) + np.array(f["token_logp"]))
    assert d.max() < TOL_NLL and d.mean() < TOL_NLL_MEAN
    assert np.mean(np.array(top) == np.array(f["top"])) >= MIN_SAME_TOP


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


@pytest.fixture(scope="module")
def q_model(smollm2_gguf, tmp_path_factory):
    """SmolLM2 with ffn_down requantized to Q4_0 by `strata quantize`, as llama-quantize made
    the Q model of the golden KL divergence run."""
    from strata.quantize import quantize_model
    q = LLAMA["q_model"]
    out = tmp_path_factory.mktemp("q") / "smollm2-ffn_down-q4_0.gguf"
    quantize_model(smollm2_gguf.path, out, q["ftype"], tensor_types=q["tensor_types"], threads=2,
                   log=lambda _line: None)
    return out


def test_kld_of_a_requantized_ffn_down_is_llama_perplexitys(q_model, smollm2_chunks, tokens):
    """KL divergence of SmolLM2 with ffn_down in Q4_0 from SmolLM2, Strata's against the
    statistics llama-perplexity --kl-divergence printed for the same two weight sets (the
    Q4_0 bytes are checked equal to llama-quantize's first).

    Both engines' own rounding (see test_ppl_of_smollm2_is_llama_perplexitys) is a small
    part of the divergence the requantization causes: the KLD mean and its percentiles
    agree within TOL_KLD_REL, the PPLs within TOL_LN_PPL_Q, the same-top fraction within
    SAME_TOP_TOKENS tokens of 126, RMS Δp within TOL_DP_RMS_REL."""
    from strata.gguf import open_gguf
    from strata.load import load_model
    g = open_gguf(q_model)
    got = {n: hashlib.sha256(t.data.tobytes()).hexdigest() for n, t in g.tensors.items() if "ffn_down" in n}
    assert got == LLAMA["q_model"]["ffn_down_sha256"]
    r = kl_divergence(load_model(g), tokens, smollm2_chunks, N_CTX, N_CHUNKS)
    k = LLAMA["kld_q"]
    assert r.count == len(LLAMA["logits_file"]["token_logp"])
    assert abs(math.log(r.ppl / k["Mean PPL(Q)"][0])) < TOL_LN_PPL_Q
    assert abs(math.log(r.ppl_base / k["Mean PPL(base)"][0])) < TOL_LN_PPL
    assert r.kld_mean == pytest.approx(k["Mean KLD"][0], rel=TOL_KLD_REL)
    assert r.kld_median == pytest.approx(k["Median KLD"][0], rel=TOL_KLD_REL)
    assert r.kld_p90 == pytest.approx(k["90.0% KLD"][0], rel=TOL_KLD_REL)
    assert r.dp_rms * 100 == pytest.approx(k["RMS Δp"][0], rel=TOL_DP_RMS_REL)
    assert abs(r.same_top_p * 100 - k["Same top p"][0]) <= SAME_TOP_TOKENS / r.count * 100 + 1e-3


@pytest.mark.slow
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
