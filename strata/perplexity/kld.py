"""KL divergence of a model from a base, as llama-perplexity --kl-divergence computes it:
`kld_rows` (per position, exact or over a top-k base), `kl_divergence`, which runs the
model over the base's chunks and returns a `KLDResult` (PPL of both, their ratio, KLD and
Δp statistics, same top token), and `print_kld`, the three blocks llama.cpp prints at the
end. The base is a model run side by side (full log-probs) or a `SavedLogits` file.
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from strata.perplexity.saved import BaseChunk, SavedLogits, base_from_logits
from strata.perplexity.scoring import (
    LogitsModel,
    chunk_logits,
    iter_chunks,
    log_probs,
    mean_err,
    n_chunks_of,
    scored_targets,
)

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
        (lp, lp_err), (lb, lb_err) = mean_err(nll), mean_err(nll_base)
        cov = self._cov(nll, nll_base)
        ratio_err = math.sqrt(max(lp_err ** 2 + lb_err ** 2 - 2 * cov, 0.0))
        k, k_err = mean_err(kld)
        mse, mse_err = mean_err(dp * dp)
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
        (lp, lp_err), (lb, lb_err) = mean_err(nll), mean_err(nll_base)
        ppl, ppl_base = math.exp(lp), math.exp(lb)
        cov = self._cov(nll, nll_base)
        cor = cov / (lp_err * lb_err) if lp_err * lb_err > 0 else 1.0
        ppl_err, base_err = ppl * lp_err, ppl_base * lb_err
        ratio = math.exp(r["ln_ratio"])
        dp_mean, dp_err = mean_err(dp)
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
        targets = scored_targets(chunk)
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

def print_kld(r: KLDResult, out=None) -> None:
    """The three blocks llama-perplexity --kl-divergence prints at the end."""
    p = lambda s="": print(s, file=out or sys.stdout)  # sys.stdout at the call, not at import
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
