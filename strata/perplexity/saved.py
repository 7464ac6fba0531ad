"""The base model's log-probs for a KL divergence: `BaseChunk` (one chunk's, from a model
run side by side through `base_from_logits`, or from a file), `save_logits`, which writes
them as the `--save-all-logits` .npz (format LOGITS_FORMAT, the top DEFAULT_TOP_K per token
unless told otherwise), and `SavedLogits`, which reads that file back chunk by chunk.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from strata.perplexity.scoring import (
    LogitsModel,
    PerplexityResult,
    chunk_logits,
    iter_chunks,
    log_probs,
    mean_err,
    n_chunks_of,
    scored_targets,
)

# llama.cpp saves all of the base's log-probs, 16 bits each: 100 KB a token for a 49k
# vocabulary. The file here keeps, per scored token, the top-k log-probs and their ids, and
# the log-prob of the actual next token; the mass outside the k ids is one bucket, so the KL
# divergence of the distributions so coarsened is a lower bound of the full one (and 0 when
# the models agree).
LOGITS_FORMAT = "strata-logits/1"
# Top-k KLD against the exact one, SmolLM2 bf16 from f32 (KLD 7e-4, the hardest case: a
# small KLD spread over the whole vocabulary): k=128 91%, 512 96%, 2048 99%, 8192 99.9%.
# 1024 costs 8 KB a token: 42 MB for 20 chunks of 512.
DEFAULT_TOP_K = 1024


@dataclass
class BaseChunk:
    """The base model's log-probs at one chunk's scored positions: `logp` (P, k) with `ids`
    (P, k) for a top-k file, or `logp` (P, vocab) with ids None (all of them)."""
    logp: torch.Tensor
    ids: torch.Tensor | None
    token_logp: torch.Tensor  # (P,) log-prob of the actual next token
    top: torch.Tensor  # (P,) argmax, the first of equal maxima (bf16 logits tie often)


def base_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> BaseChunk:
    lp = log_probs(logits)
    return BaseChunk(lp, None, lp.gather(1, targets[:, None])[:, 0], lp.argmax(-1))


class SavedLogits:
    """A `--save-all-logits` file: an uncompressed .npz (format "strata-logits/1") of
    scalars n_ctx, n_vocab, n_chunks, bos_id (-1: none), top_k (0: all log-probs), n_tokens
    (of the whole text), text_sha256, source (the model), and arrays over the P = n_chunks *
    (n_ctx - 1 - n_ctx // 2) scored positions, chunk by chunk: tokens int32 (n_chunks *
    n_ctx, as evaluated, before any BOS), logp float32 (P, top_k or n_vocab), ids int32
    (P, top_k; empty when top_k is 0), token_logp float32 (P,), top int32 (P,): the argmax."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"--kl-divergence-base {self.path}: no such file (save one first: "
                             f"strata perplexity BASE --text FILE --save-all-logits {self.path})")
        with open(self.path, "rb") as f:
            if f.read(2) != b"PK":  # an .npz is a zip archive
                raise ValueError(f"--kl-divergence-base {self.path}: neither a GGUF model nor an .npz "
                                 f"of log-probs from `strata perplexity --save-all-logits`")
        try:
            z = np.load(self.path, allow_pickle=False)
            fmt = str(z["format"])
        except (OSError, ValueError, KeyError) as e:  # not a zip, not an npz, or not ours
            raise ValueError(f"--kl-divergence-base {self.path}: not a log-probs file from "
                             f"`strata perplexity --save-all-logits` ({type(e).__name__}: {e})") from None
        if fmt != LOGITS_FORMAT:
            raise ValueError(f"--kl-divergence-base {self.path}: format {fmt!r}, expected {LOGITS_FORMAT!r}")
        self.n_ctx, self.n_vocab = int(z["n_ctx"]), int(z["n_vocab"])
        self.n_chunks = int(z["n_chunks"])
        self.tokens = z["tokens"].astype(np.int64)
        self.bos_id = int(z["bos_id"]) if int(z["bos_id"]) >= 0 else None
        self.top_k = int(z["top_k"])
        self.text_sha256 = str(z["text_sha256"]) or None
        self.n_tokens = int(z["n_tokens"])
        self.source = str(z["source"])
        self.token_logp = z["token_logp"]
        self.logp = z["logp"]
        self.ids = z["ids"] if self.top_k else None
        self.top = z["top"]
        self.per_chunk = self.n_ctx - 1 - self.n_ctx // 2

    def chunk(self, i: int) -> BaseChunk:
        s = slice(i * self.per_chunk, (i + 1) * self.per_chunk)
        ids = torch.from_numpy(self.ids[s].astype(np.int64)) if self.ids is not None else None
        return BaseChunk(torch.from_numpy(self.logp[s].astype(np.float32)), ids,
                         torch.from_numpy(self.token_logp[s].astype(np.float32)),
                         torch.from_numpy(self.top[s].astype(np.int64)))


def save_logits(path: str | Path, model: LogitsModel, tokens, n_ctx: int = 512,
                n_chunks: int | None = None, bos_id: int | None = None, top_k: int = DEFAULT_TOP_K,
                source: str = "", text_sha: str | None = None,
                on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """Evaluate `model` as `perplexity` does and save its log-probs for a later KL divergence
    run (`top_k` 0: all of them, float32: about 200 KB a token for a 49k vocabulary)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = n_chunks_of(len(tokens), n_ctx, n_chunks)
    t0 = time.perf_counter()
    logps, idss, tok_lps, tops, nlls, running = [], [], [], [], [], []
    for i, chunk in enumerate(iter_chunks(tokens, n_ctx, n)):
        base = base_from_logits(chunk_logits(model, chunk, bos_id), scored_targets(chunk))
        if top_k:
            v, ids = base.logp.topk(min(top_k, base.logp.shape[1]), dim=-1)  # largest first
            logps.append(v.numpy())
            idss.append(ids.to(torch.int32).numpy())
        else:
            logps.append(base.logp.numpy())
        tok_lps.append(base.token_logp.numpy())
        tops.append(base.top.to(torch.int32).numpy())
        nlls.append(-base.token_logp.double().numpy())
        running.append(math.exp(np.concatenate(nlls).mean()))
        if on_chunk:
            on_chunk(i, running[-1])
    path = Path(path)
    with open(path, "wb") as f:  # np.savez on a name would append ".npz"
        np.savez(f, format=LOGITS_FORMAT, n_ctx=n_ctx, n_vocab=base.logp.shape[1], n_chunks=n,
                 tokens=tokens[:n * n_ctx].astype(np.int32), bos_id=-1 if bos_id is None else bos_id, top_k=top_k,
                 text_sha256=text_sha or "", n_tokens=len(tokens), source=source,
                 token_logp=np.concatenate(tok_lps), top=np.concatenate(tops), logp=np.concatenate(logps),
                 ids=np.concatenate(idss) if top_k else np.zeros(0, np.int32))
    nll = np.concatenate(nlls)
    mean, err = mean_err(nll)
    return PerplexityResult(math.exp(mean), math.exp(mean) * err, n_ctx, n, nll.size, tuple(running),
                            len(tokens), text_sha, time.perf_counter() - t0)
