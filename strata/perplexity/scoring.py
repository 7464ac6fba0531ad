"""llama-perplexity's PPL: the text cut into chunks (`n_chunks_of`, `iter_chunks`), one
chunk's logits at its scored positions (`chunk_logits`, the one place that calls the model),
log-probs and per-token NLL as llama.cpp sums them (`log_probs`, `token_nll`), and
`perplexity`, which returns a `PerplexityResult`. Any model with `new_cache(capacity)` and
`forward(tokens, cache, last_only=False)` returning logits (S, vocab) can be scored.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

# How llama.cpp scores (tools/perplexity/perplexity.cpp, perplexity() and kl_divergence()):
# - the whole text is tokenized once (BOS first when the vocabulary adds one; special-token
#   text is not parsed) and cut into len // n_ctx chunks of n_ctx tokens, the tail dropped;
# - each chunk is evaluated from an empty context; when the vocabulary adds BOS, the chunk's
#   first token is replaced by BOS;
# - only the logits at positions n_ctx/2 .. n_ctx-2 are scored, each against the next token:
#   n_ctx - 1 - n_ctx/2 tokens a chunk (255 for 512), each seen after at least n_ctx/2
#   tokens of context;
# - PPL = exp(mean NLL) +/- PPL * sqrt((E[nll^2] - E[nll]^2) / (count - 1)).


class LogitsModel(Protocol):
    def new_cache(self, capacity: int): ...
    def forward(self, tokens, cache, last_only: bool = False) -> torch.Tensor: ...


def n_chunks_of(n_tokens: int, n_ctx: int, n_chunks: int | None, where: str = "the text") -> int:
    """llama.cpp's chunk count; like it, refuse a text shorter than two chunks."""
    if n_ctx < 4:
        raise ValueError(f"--ctx {n_ctx}: a chunk needs at least 4 tokens")
    if n_tokens < 2 * n_ctx:
        raise ValueError(f"{where} tokenizes to {n_tokens} tokens; --ctx {n_ctx} needs at least "
                         f"{2 * n_ctx}: give a longer --text or a smaller --ctx")
    if n_chunks == 0:
        raise ValueError("--chunks 0: score at least one chunk (or leave --chunks out: all)")
    most = n_tokens // n_ctx
    return most if n_chunks is None or n_chunks < 0 else min(n_chunks, most)


def iter_chunks(tokens, n_ctx: int, n: int) -> Iterator[np.ndarray]:
    tokens = np.asarray(tokens, dtype=np.int64)
    for i in range(n):
        yield tokens[i * n_ctx:(i + 1) * n_ctx]


def chunk_logits(model: LogitsModel, chunk, bos_id: int | None = None) -> torch.Tensor:
    """Logits (n_ctx - 1 - n_ctx//2, vocab), float32, at the scored positions of one chunk,
    evaluated from an empty cache, its first token replaced by `bos_id` when given."""
    toks = [int(t) for t in chunk]
    if bos_id is not None:
        toks[0] = int(bos_id)
    n = len(toks)
    logits = model.forward(toks, model.new_cache(n), last_only=False)
    logits = torch.as_tensor(logits)
    if logits.ndim != 2 or logits.shape[0] != n:
        raise ValueError(f"{type(model).__name__}.forward returned logits of shape "
                         f"{tuple(logits.shape)} for {n} tokens; expected ({n}, vocab)")
    return logits[n // 2:n - 1].float().cpu()  # scored on the CPU, whatever the device


def scored_targets(chunk) -> torch.Tensor:
    """The next token of each position `chunk_logits` returns: chunk[n//2 + 1:], int64."""
    n = len(chunk)
    return torch.as_tensor(np.asarray(chunk[n // 2 + 1:n], dtype=np.int64))


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log softmax, float32, its sum of exponentials in float64 as llama.cpp's (torch's
    float32 log_softmax sums 49k terms in float32: a PPL 1e-5 off). Both sides of a KL
    divergence and the saved files take theirs from here: equal logits, equal log-probs."""
    x = logits.double()
    x = x - x.amax(dim=-1, keepdim=True)
    return (x - x.exp().sum(dim=-1, keepdim=True).log()).float()


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    """-log softmax(logits)[target] per row, float64."""
    return -log_probs(logits).gather(1, targets[:, None])[:, 0].double().numpy()


def mean_err(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error as llama.cpp's mean_and_uncertainty (0 for 10 or fewer)."""
    n = x.size
    if n < 1:
        return 0.0, 0.0
    f = float(x.sum()) / n
    var = float((x * x).sum()) / n - f * f
    return f, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    ppl_err: float  # llama.cpp's "+/-": PPL times the standard error of the mean NLL
    n_ctx: int
    n_chunks: int
    n_scored: int  # tokens scored: n_chunks * (n_ctx - 1 - n_ctx // 2)
    chunk_ppl: tuple[float, ...]  # running PPL after each chunk, llama.cpp's "[i]x" line
    n_tokens: int = 0  # tokens in the whole text
    text_sha256: str | None = None
    seconds: float = 0.0


def perplexity(model: LogitsModel, tokens, n_ctx: int = 512, n_chunks: int | None = None,
               bos_id: int | None = None, on_chunk: Callable[[int, float], None] | None = None,
               text_sha: str | None = None) -> PerplexityResult:
    """llama-perplexity's PPL over `tokens` (the whole text, tokenized); `bos_id` when the
    vocabulary adds BOS (each chunk then starts with it). `on_chunk(i, running_ppl)`."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = n_chunks_of(len(tokens), n_ctx, n_chunks)
    t0 = time.perf_counter()
    nlls, running = [], []
    for i, chunk in enumerate(iter_chunks(tokens, n_ctx, n)):
        nlls.append(token_nll(chunk_logits(model, chunk, bos_id), scored_targets(chunk)))
        running.append(math.exp(np.concatenate(nlls).mean()))
        if on_chunk:
            on_chunk(i, running[-1])
    nll = np.concatenate(nlls)
    mean, err = mean_err(nll)
    ppl = math.exp(mean)
    return PerplexityResult(ppl, ppl * err, n_ctx, n, nll.size, tuple(running), len(tokens),
                            text_sha, time.perf_counter() - t0)
