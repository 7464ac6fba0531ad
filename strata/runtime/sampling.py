"""Sampling the next token: greedy, or temperature with top-k, top-p and min-p."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40          # 0: off
    top_p: float = 0.95      # 1.0: off
    min_p: float = 0.05      # 0.0: off
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")


class Sampler:
    """Filters in llama.cpp's order: top-k, top-p, min-p, then temperature, then a draw."""

    def __init__(self, params: SamplingParams):
        self.p = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        idx, probs = self.distribution(logits)
        if self.p.temperature == 0:
            return int(idx[0])
        return int(idx[torch.multinomial(probs, 1, generator=self.gen)])

    def distribution(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a draw picks from: token ids and their probabilities after the filters and
        the temperature (greedy: the argmax, with probability 1)."""
        p = self.p
        logits = logits.reshape(-1).float()
        # the argmax, the top-k's cut or the sort where the logits are (on a GPU, with a
        # top-k, only the top-k and the logits tied at its cut cross to the host); the rest
        # on the CPU, whose generator draws. Of equal logits the lower id comes first on
        # every device, so a seed's draws rest on no device's order.
        if p.temperature == 0:  # (argmax: the first of equal ones)
            return torch.argmax(logits).reshape(1).cpu(), torch.ones(1)
        if 0 < p.top_k < logits.numel():
            # every logit at least the top_k-th largest (those tied with it too), not a sort
            # of the vocabulary: 1 ms for Flash-Next's 248,320 logits on 2 cores, where the
            # sort took 39
            idx = torch.nonzero(logits >= torch.topk(logits, p.top_k).values[-1]).reshape(-1)
            vals, idx = logits[idx].cpu(), idx.cpu()
            order = torch.sort(vals, descending=True, stable=True).indices[:p.top_k]
            vals, idx = vals[order], idx[order]
        else:  # a stable sort's order is one order, whichever device sorts
            vals, idx = (t.cpu() for t in torch.sort(logits, descending=True, stable=True))
        probs = torch.softmax(vals, dim=-1)
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            keep = int(torch.searchsorted(torch.cumsum(probs, 0), torch.tensor(p.top_p))) + 1
            vals, idx, probs = vals[:keep], idx[:keep], probs[:keep]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            vals, idx = vals[keep], idx[keep]
        return idx, torch.softmax(vals / p.temperature, dim=-1)
