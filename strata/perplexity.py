"""`strata perplexity`: llama-perplexity's perplexity and KL divergence.

Any model with `new_cache(capacity)` and `forward(tokens, cache, last_only=False)` returning
logits (S, vocab) can be scored (`chunk_logits` is the one place that calls it).

How llama.cpp scores (tools/perplexity/perplexity.cpp, perplexity() and kl_divergence()):
- the whole text is tokenized once (BOS first when the vocabulary adds one; special-token
  text is not parsed) and cut into len // n_ctx chunks of n_ctx tokens, the tail dropped;
- each chunk is evaluated from an empty context; when the vocabulary adds BOS, the chunk's
  first token is replaced by BOS;
- only the logits at positions n_ctx/2 .. n_ctx-2 are scored, each against the next token:
  n_ctx - 1 - n_ctx/2 tokens a chunk (255 for 512), each seen after at least n_ctx/2
  tokens of context;
- PPL = exp(mean NLL) +/- PPL * sqrt((E[nll^2] - E[nll]^2) / (count - 1)).

KL divergence: llama.cpp first saves the base model's log-probs (all of them, 16 bits each:
100 KB a token for a 49k vocabulary), then evaluates the other model over the same tokens.
Here the base is either a model run side by side (exact: full log-probs) or a file from
`--save-all-logits`: an .npz holding, per scored token, the base's top-k log-probs and ids
(k = `--save-top-k`, 1024 by default; 0 keeps all log-probs) and the log-prob of the actual
next token. With top-k, the mass outside the k ids is one bucket; the KL divergence of the
distributions so coarsened is a lower bound of the full one (and 0 when the models agree).

The text: `stdlib_text()`, the docstrings of a fixed list of standard-library modules, so that
every machine has it without a download. Docstrings move a little between Python versions,
so each result carries the text's token count and sha256.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

# Pure-Python or C modules whose docstrings do not depend on the platform (no os, sys,
# socket, subprocess: their members differ between Linux, macOS and Windows).
STDLIB_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fnmatch", "fractions", "functools", "getopt", "gettext",
    "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client",
    "inspect", "ipaddress", "itertools", "json", "logging", "numbers", "operator", "optparse",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "shlex",
    "shutil", "statistics", "string", "struct", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse", "uuid",
    "warnings", "weakref", "zipfile",
)

LOGITS_FORMAT = "strata-logits/1"
# Top-k KLD against the exact one, SmolLM2 bf16 from f32 (KLD 7e-4, the hardest case: a
# small KLD spread over the whole vocabulary): k=128 91%, 512 96%, 2048 99%, 8192 99.9%.
# 1024 costs 8 KB a token: 42 MB for 20 chunks of 512.
DEFAULT_TOP_K = 1024


# -- the text --------------------------------------------------------------------------------

def _own_doc(obj) -> str | None:
    """The object's own docstring, dedented (inspect.getdoc would inherit a base class's)."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def _module_docs(name: str) -> str:
    mod = importlib.import_module(name)
    out = [f"{name}\n{'=' * len(name)}\n\n{_own_doc(mod) or ''}"]
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != name:  # re-exported from elsewhere
            continue
        if doc := _own_doc(obj):
            out.append(f"{name}.{attr}\n\n{doc}")
        if inspect.isclass(obj):
            for member, v in sorted(vars(obj).items()):
                f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                if member.startswith("_") or not (inspect.isroutine(f) or isinstance(f, property)):
                    continue
                # a method some other package patched in (transformers adds logging.Logger
                # .warning_once on import) would make the text depend on what was imported
                if getattr(f.fget if isinstance(f, property) else f, "__module__", name) not in (name, None):
                    continue
                if doc := _own_doc(f):
                    out.append(f"{name}.{attr}.{member}\n\n{doc}")
    return "\n\n".join(out)


def stdlib_text(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """Docstrings of `modules` (module, then its public classes and functions by name, then
    each class's methods by name): about 436k characters, 116k SmolLM2 tokens on 3.11."""
    with warnings.catch_warnings():  # typing.io and typing.re warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        return "\n\n\n".join(_module_docs(m) for m in modules) + "\n"


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- evaluation ------------------------------------------------------------------------------

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


def _targets(chunk) -> torch.Tensor:
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


def _mean_err(x: np.ndarray) -> tuple[float, float]:
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
        nlls.append(token_nll(chunk_logits(model, chunk, bos_id), _targets(chunk)))
        running.append(math.exp(np.concatenate(nlls).mean()))
        if on_chunk:
            on_chunk(i, running[-1])
    nll = np.concatenate(nlls)
    mean, err = _mean_err(nll)
    ppl = math.exp(mean)
    return PerplexityResult(ppl, ppl * err, n_ctx, n, nll.size, tuple(running), len(tokens),
                            text_sha, time.perf_counter() - t0)


# -- the base model's log-probs --------------------------------------------------------------

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
        base = base_from_logits(chunk_logits(model, chunk, bos_id), _targets(chunk))
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
    mean, err = _mean_err(nll)
    return PerplexityResult(math.exp(mean), math.exp(mean) * err, n_ctx, n, nll.size, tuple(running),
                            len(tokens), text_sha, time.perf_counter() - t0)


# -- KL divergence ---------------------------------------------------------------------------

def kld_rows(lq: torch.Tensor, base: BaseChunk) -> np.ndarray:
    """KL(base || model) per scored position from the model's `log_probs`, summed in float64."""
    lq = lq.double()
    lp = base.logp.double()
    if base.ids is None:
        # llama.cpp skips terms with log p_base <= -16 (its 16-bit file cannot hold them);
        # all are kept here: they move a mean KLD by less than 1e-6
        return (lp.exp() * (lp - lq)).sum(-1).numpy()
    lq_k = lq.gather(1, base.ids)
    kl = (lp.exp() * (lp - lq_k)).sum(-1)
    p_tail = (1 - lp.exp().sum(-1)).clamp_min(0)
    q_tail = (1 - lq_k.exp().sum(-1)).clamp_min(1e-300)
    tail = torch.where(p_tail > 0, p_tail * (p_tail.clamp_min(1e-300).log() - q_tail.log()), 0.0)
    return (kl + tail).numpy()


def _percentile(sorted_x: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile: linear between the two nearest of the sorted values."""
    if fraction <= 0:
        return float(sorted_x[0])
    if fraction >= 1:
        return float(sorted_x[-1])
    p = fraction * (sorted_x.size - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * sorted_x[ip] + p * sorted_x[min(ip + 1, sorted_x.size - 1)])


KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)


@dataclass(frozen=True)
class KLDResult:
    """llama-perplexity --kl-divergence's statistics (its names in the comments)."""
    ppl: float  # Mean PPL(Q)
    ppl_err: float
    ppl_base: float  # Mean PPL(base)
    ppl_base_err: float
    ln_ppl_cor: float  # Cor(ln(PPL(Q)), ln(PPL(base)))
    ln_ppl_ratio: float  # Mean ln(PPL(Q)/PPL(base))
    ln_ppl_ratio_err: float
    ppl_ratio: float  # Mean PPL(Q)/PPL(base)
    ppl_ratio_err: float
    ppl_diff: float  # Mean PPL(Q)-PPL(base)
    ppl_diff_err: float
    kld_mean: float  # Mean KLD
    kld_err: float
    kld_max: float
    kld_p99: float
    kld_p90: float
    kld_median: float
    kld_min: float
    dp_mean: float  # Mean Δp: p(token) - p_base(token), as a fraction (llama.cpp prints %)
    dp_err: float
    dp_max: float
    dp_median: float
    dp_min: float
    dp_rms: float  # RMS Δp
    dp_rms_err: float
    same_top_p: float  # Same top p: fraction of positions whose argmax agrees
    same_top_p_err: float
    count: int  # positions scored
    n_ctx: int
    n_chunks: int
    base: str = ""  # the base model or log-probs file
    base_top_k: int = 0  # 0: exact; k: the base's top-k log-probs, the rest one bucket
    n_tokens: int = 0
    text_sha256: str | None = None
    kld_percentiles: dict = field(default_factory=dict)  # "99.9" -> value, as printed
    dp_percentiles: dict = field(default_factory=dict)
    seconds: float = 0.0


class _KLDAccumulator:
    def __init__(self):
        self.nll, self.nll_base, self.kld, self.dp, self.same = [], [], [], [], []

    def add(self, logits: torch.Tensor, targets: torch.Tensor, base: BaseChunk) -> None:
        if base.logp.shape[0] != logits.shape[0]:
            raise ValueError(f"base log-probs cover {base.logp.shape[0]} positions of a chunk, the "
                             f"model {logits.shape[0]}: were they saved with another --ctx?")
        lq = log_probs(logits)
        nll = -lq.gather(1, targets[:, None])[:, 0].double().numpy()
        nll_base = -base.token_logp.double().numpy()
        self.nll.append(nll)
        self.nll_base.append(nll_base)
        self.kld.append(kld_rows(lq, base))
        self.dp.append(np.exp(-nll) - np.exp(-nll_base))
        self.same.append((lq.argmax(-1) == base.top).numpy())

    def arrays(self):
        return [np.concatenate(x) for x in (self.nll, self.nll_base, self.kld, self.dp, self.same)]

    def row(self) -> dict[str, float]:
        """The running numbers llama.cpp prints after each chunk."""
        nll, nll_base, kld, dp, same = self.arrays()
        n = nll.size
        (lp, lp_err), (lb, lb_err) = _mean_err(nll), _mean_err(nll_base)
        cov = self._cov(nll, nll_base)
        ratio_err = math.sqrt(max(lp_err ** 2 + lb_err ** 2 - 2 * cov, 0.0))
        k, k_err = _mean_err(kld)
        mse, mse_err = _mean_err(dp * dp)
        rms = math.sqrt(mse)
        top = float(same.mean())
        return {"ppl": math.exp(lp), "ppl_err": math.exp(lp) * lp_err, "ln_ratio": lp - lb,
                "ln_ratio_err": ratio_err, "kld": k, "kld_err": k_err, "rms": rms,
                "rms_err": 0.5 / rms * mse_err if rms > 0 else 0.0, "top": top,
                "top_err": math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0}

    @staticmethod
    def _cov(a: np.ndarray, b: np.ndarray) -> float:
        n = a.size
        if n < 10:
            return 0.0
        return (float((a * b).sum()) / n - (float(a.sum()) / n) * (float(b.sum()) / n)) / (n - 1)

    def result(self, **info) -> KLDResult:
        nll, nll_base, kld, dp, _ = self.arrays()
        r = self.row()
        (lp, lp_err), (lb, lb_err) = _mean_err(nll), _mean_err(nll_base)
        ppl, ppl_base = math.exp(lp), math.exp(lb)
        cov = self._cov(nll, nll_base)
        cor = cov / (lp_err * lb_err) if lp_err * lb_err > 0 else 1.0
        ppl_err, base_err = ppl * lp_err, ppl_base * lb_err
        ratio = math.exp(r["ln_ratio"])
        dp_mean, dp_err = _mean_err(dp)
        ks, ds = np.sort(kld), np.sort(dp)
        return KLDResult(
            ppl=ppl, ppl_err=ppl_err, ppl_base=ppl_base, ppl_base_err=base_err, ln_ppl_cor=cor,
            ln_ppl_ratio=r["ln_ratio"], ln_ppl_ratio_err=r["ln_ratio_err"], ppl_ratio=ratio,
            ppl_ratio_err=ratio * r["ln_ratio_err"], ppl_diff=ppl - ppl_base,
            ppl_diff_err=math.sqrt(max(ppl_err ** 2 + base_err ** 2 - 2 * ppl * ppl_base * cov, 0.0)),
            kld_mean=r["kld"], kld_err=r["kld_err"], kld_max=float(ks[-1]),
            kld_p99=_percentile(ks, 0.99), kld_p90=_percentile(ks, 0.90),
            kld_median=float(np.median(ks)), kld_min=float(ks[0]), dp_mean=dp_mean, dp_err=dp_err,
            dp_max=float(ds[-1]), dp_median=float(np.median(ds)), dp_min=float(ds[0]),
            dp_rms=r["rms"], dp_rms_err=r["rms_err"], same_top_p=r["top"], same_top_p_err=r["top_err"],
            count=int(kld.size),
            kld_percentiles={f"{q:g}": _percentile(ks, q / 100) for q in KLD_PERCENTILES},
            dp_percentiles={f"{q:g}": _percentile(ds, q / 100) for q in DP_PERCENTILES}, **info)


def kl_divergence(model: LogitsModel, tokens, base: LogitsModel | SavedLogits, n_ctx: int = 512,
                  n_chunks: int | None = None, bos_id: int | None = None,
                  on_chunk: Callable[[int, dict], None] | None = None, base_name: str = "",
                  text_sha: str | None = None) -> KLDResult:
    """KL divergence of `model` from `base` (a model run side by side, or a saved file whose
    tokens, n_ctx and BOS are then used, as llama.cpp does) over `tokens`' chunks.
    `on_chunk(i, row)` gets the running numbers of llama.cpp's per-chunk table."""
    t0 = time.perf_counter()
    if isinstance(base, SavedLogits):
        tokens, n_ctx, bos_id = base.tokens, base.n_ctx, base.bos_id
        n = base.n_chunks if n_chunks is None or n_chunks < 0 else min(n_chunks, base.n_chunks)
        info = {"base": base_name or str(base.path), "base_top_k": base.top_k,
                "n_tokens": base.n_tokens, "text_sha256": base.text_sha256}
    else:
        tokens = np.asarray(tokens, dtype=np.int64)
        n = n_chunks_of(len(tokens), n_ctx, n_chunks)
        info = {"base": base_name, "base_top_k": 0, "n_tokens": len(tokens), "text_sha256": text_sha}
    acc = _KLDAccumulator()
    for i, chunk in enumerate(iter_chunks(tokens, n_ctx, n)):
        targets = _targets(chunk)
        if isinstance(base, SavedLogits):
            b = base.chunk(i)
        else:
            b = base_from_logits(chunk_logits(base, chunk, bos_id), targets)
        logits = chunk_logits(model, chunk, bos_id)
        vocab = base.n_vocab if isinstance(base, SavedLogits) else b.logp.shape[1]
        if vocab != logits.shape[1]:
            raise ValueError(f"{info['base']} has a vocabulary of {vocab} tokens, the model "
                             f"{logits.shape[1]}: KL divergence needs the same vocabulary")
        acc.add(logits, targets, b)
        if on_chunk:
            on_chunk(i, acc.row())
    return acc.result(n_ctx=n_ctx, n_chunks=n, seconds=time.perf_counter() - t0, **info)


# -- reports ---------------------------------------------------------------------------------

def print_kld(r: KLDResult, out=sys.stdout) -> None:
    """The three blocks llama-perplexity --kl-divergence prints at the end."""
    p = lambda s="": print(s, file=out)
    p("====== Perplexity statistics ======")
    p(f"Mean PPL(Q)                   : {r.ppl:10.6f} ± {r.ppl_err:10.6f}")
    p(f"Mean PPL(base)                : {r.ppl_base:10.6f} ± {r.ppl_base_err:10.6f}")
    p(f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * r.ln_ppl_cor:6.2f}%")
    p(f"Mean ln(PPL(Q)/PPL(base))     : {r.ln_ppl_ratio:10.6f} ± {r.ln_ppl_ratio_err:10.6f}")
    p(f"Mean PPL(Q)/PPL(base)         : {r.ppl_ratio:10.6f} ± {r.ppl_ratio_err:10.6f}")
    p(f"Mean PPL(Q)-PPL(base)         : {r.ppl_diff:10.6f} ± {r.ppl_diff_err:10.6f}")
    p()
    p("====== KL divergence statistics ======")
    p(f"Mean    KLD: {r.kld_mean:10.6f} ± {r.kld_err:10.6f}")
    p(f"Maximum KLD: {r.kld_max:10.6f}")
    for q in KLD_PERCENTILES[:4]:
        p(f"{q:4.1f}%   KLD: {r.kld_percentiles[f'{q:g}']:10.6f}")
    p(f"Median  KLD: {r.kld_median:10.6f}")
    for q in KLD_PERCENTILES[4:]:
        p(f"{q:4.1f}%   KLD: {r.kld_percentiles[f'{q:g}']:10.6f}")
    p(f"Minimum KLD: {r.kld_min:10.6f}")
    p()
    p("====== Token probability statistics ======")
    p(f"Mean    Δp: {100 * r.dp_mean:6.3f} ± {100 * r.dp_err:5.3f} %")
    p(f"Maximum Δp: {100 * r.dp_max:6.3f}%")
    for q in DP_PERCENTILES[:5]:
        p(f"{q:4.1f}%   Δp: {100 * r.dp_percentiles[f'{q:g}']:6.3f}%")
    p(f"Median  Δp: {100 * r.dp_median:6.3f}%")
    for q in DP_PERCENTILES[5:]:
        p(f"{q:4.1f}%   Δp: {100 * r.dp_percentiles[f'{q:g}']:6.3f}%")
    p(f"Minimum Δp: {100 * r.dp_min:6.3f}%")
    p(f"RMS Δp    : {100 * r.dp_rms:6.3f} ± {100 * r.dp_rms_err:5.3f} %")
    p(f"Same top p: {100 * r.same_top_p:6.3f} ± {100 * r.same_top_p_err:5.3f} %")


def _kld_row(i: int, r: dict) -> None:
    if i == 0:
        print("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
              "              Δp RMS            Same top p")
    print(f"{i + 1:4d}    {r['ppl']:9.4f} ± {r['ppl_err']:9.4f}    {r['ln_ratio']:10.5f} ± "
          f"{r['ln_ratio_err']:10.5f}    {r['kld']:10.5f} ± {r['kld_err']:10.5f}    "
          f"{100 * r['rms']:6.3f} ± {100 * r['rms_err']:6.3f} %    {100 * r['top']:6.3f} ± "
          f"{100 * r['top_err']:6.3f} %", flush=True)


def _ppl_progress(i: int, ppl: float) -> None:
    sys.stdout.write(f"[{i + 1}]{ppl:.4f},")
    sys.stdout.flush()


# -- the command -----------------------------------------------------------------------------

def _is_model(name: str) -> bool:
    from strata.hub import MODELS
    p = Path(name).expanduser()
    if name in MODELS:
        return True
    if p.is_file():
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    return False


def _load(args, name: str, dtype):
    """A model and tokenizer as the other commands load them (their flags passed along)."""
    from strata.commands import load
    dt = {"bf16": torch.bfloat16, "f32": torch.float32}.get(dtype, dtype)
    return load(argparse.Namespace(**{**vars(args), "model": name, "dtype": dt}))


def _read_text(path: str | None) -> tuple[str, str]:
    if path is None:
        raise ValueError("--text FILE is needed (make one with `strata perplexity --make-text OUT`)")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--text {path}: no such file")
    text = p.read_text(encoding="utf-8")
    return text, text_sha256(text)


def run(args) -> int:
    if args.make_text:
        text = stdlib_text()
        Path(args.make_text).write_text(text, encoding="utf-8")
        print(f"strata: wrote {args.make_text}: {len(text)} characters, sha256 {text_sha256(text)}, "
              f"Python {sys.version.split()[0]}, docstrings of {len(STDLIB_MODULES)} modules: "
              f"{' '.join(STDLIB_MODULES)}", file=sys.stderr)
        return 0
    base_arg = args.kl_divergence_base
    compare = bool(base_arg) and (args.kl_divergence or _is_model(base_arg))
    save_to = args.save_all_logits or (base_arg if base_arg and not compare else None)
    if args.kl_divergence and not base_arg:
        raise ValueError("--kl-divergence needs --kl-divergence-base (a model, or a file from --save-all-logits)")
    if compare and args.save_all_logits:
        raise ValueError("--save-all-logits with a --kl-divergence-base to compare against: run them "
                         "one after the other (save the base's log-probs first)")
    saved = SavedLogits(base_arg) if compare and not _is_model(base_arg) else None
    if saved and args.ctx not in (None, saved.n_ctx):
        raise ValueError(f"--ctx {args.ctx}: {base_arg} was saved with --ctx {saved.n_ctx}; "
                         "leave --ctx out (the file's is used)")
    text, sha = _read_text(args.text) if saved is None or args.text else (None, None)
    model, tok = _load(args, args.model, args.dtype)
    n_ctx = args.ctx or 512
    bos = tok.bos_id if tok.add_bos else None
    if text is not None:
        # llama.cpp's common_tokenize(ctx, text, add_special=true, parse_special=false)
        tokens = tok.encode(text, parse_special=False)
        print(f"strata: {args.text}: {len(tokens)} tokens, sha256 {sha}", file=sys.stderr)
        n_chunks_of(len(tokens), saved.n_ctx if saved else n_ctx, args.chunks, where=f"--text {args.text}")
        if saved is not None:
            n = saved.n_chunks * saved.n_ctx
            if saved.text_sha256 not in (None, sha) or list(saved.tokens[:n]) != tokens[:n]:
                raise ValueError(f"--text {args.text} is not the text {base_arg} was saved from "
                                 f"(sha256 {saved.text_sha256}); leave --text out to use the file's tokens")
    else:
        tokens, sha = saved.tokens, saved.text_sha256
    if compare:
        if saved is not None:
            base, name = saved, base_arg
            print(f"strata: base log-probs from {base_arg} ({saved.source}; "
                  f"{'top ' + str(saved.top_k) if saved.top_k else 'all'} per token, "
                  f"{saved.n_chunks} chunks of {saved.n_ctx})", file=sys.stderr)
        else:
            base, _ = _load(args, base_arg, args.base_dtype)
            name = f"{base_arg} ({args.base_dtype})"
        res = kl_divergence(model, tokens, base, n_ctx, args.chunks, bos, on_chunk=_kld_row,
                            base_name=name, text_sha=sha)
        print()
        print_kld(res)
    elif save_to:
        top_k = DEFAULT_TOP_K if args.save_top_k is None else args.save_top_k
        res = save_logits(save_to, model, tokens, n_ctx, args.chunks, bos, top_k=top_k,
                          source=f"{args.model} ({str(args.dtype).replace('torch.', '')})", text_sha=sha,
                          on_chunk=_ppl_progress)
        print(f"\nFinal estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}")
        print(f"strata: saved log-probs of {res.n_scored} tokens to {save_to}", file=sys.stderr)
    else:
        res = perplexity(model, tokens, n_ctx, args.chunks, bos, on_chunk=_ppl_progress, text_sha=sha)
        print(f"\nFinal estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}")
    print(f"strata: {res.n_chunks} chunks of {res.n_ctx} tokens ({res.n_tokens} in the text, sha256 "
          f"{res.text_sha256}) in {res.seconds:.1f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(asdict(res)))
    return 0

