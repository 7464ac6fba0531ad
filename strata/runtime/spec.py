"""Speculative decoding with the model's MTP head: draft, verify in one forward, keep.

One step, with `tok` the token just chosen and not yet fed:

  draft   d_1..d_k with the MTP head (strata.models.qwen4exp.MTPHead): from tok and the
          trunk's streams at the last position, then from each draft and the head's own
          output streams; k <= n, fewer where the draft's top probability (the softmax of
          its logits) falls below `min_p`, or where the answer may hold fewer tokens
  verify  one forward of [tok, d_1..d_k]: row j gives p_j, the sampler's distribution of
          the token after d_j (after tok for j = 0)
  accept  d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j)), q_j the sampler's
          distribution of the draft's logits (d_j was drawn from it); at the first refusal a
          token from norm(max(p_{j-1} - q_j, 0)) and stop; all accepted, a token from p_k.
          The output then has p's distribution (Leviathan et al., 2023; Chen et al., 2023).
          Greedy, p and q are one-hot: d_j is kept while it is the argmax of p_{j-1}, and
          the token after is the argmax of the first row not matched: the tokens --spec 0
          picks, one by one
  keep    the rows of tok and the accepted drafts; the state rolls back past them
          (Qwen4ExpState.keep: attention truncated, DeltaNet states cut back, PLE redone)

`step` returns the accepted drafts and the token after them, that one not yet fed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from triton_kernels import invariant

from .sampling import Sampler


def can_draft(model) -> bool:
    """Whether `model` has a draft head (an MTP head) to speculate with."""
    return getattr(model, "mtp", None) is not None


def prefill(model, ids: list[int], state) -> torch.Tensor:
    """model(ids, state, last_only=True) for a chunk of a prompt. A one-token chunk of a
    model that drafts runs as its decode steps do (batch-invariant: invariant.decoding), so
    that on a GPU it captures the CUDA graph those steps replay, where a capture in the
    other mode would be made again at the first step."""
    with invariant.decoding(len(ids) == 1 and can_draft(model)):
        return model(ids, state, last_only=True)


def check(model, n: int) -> None:
    """Speculative decoding of up to `n` drafts needs a model with an MTP head."""
    if n < 0:
        raise ValueError(f"--spec {n}: the number of drafts must be >= 0")
    if n and not can_draft(model):
        arch = getattr(getattr(model, "gguf", None), "arch", type(model).__name__)
        where = getattr(getattr(model, "gguf", None), "path", "this model")
        raise ValueError(f"--spec {n}: {where} ({arch}) has no MTP head to draft with; drop --spec "
                         f"(qwen4exp models take one from the file or its mtp-<name> sidecar)")


def acceptance(p: torch.Tensor, q: torch.Tensor, d: int) -> float:
    """The probability of keeping draft d drawn from q when the target is p."""
    return min(1.0, float(p[d]) / float(q[d]))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a refused draft's token is drawn from: norm(max(p - q, 0)) (p where p == q,
    where no draft is ever refused)."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


@dataclass
class SpecStats:
    """Counters over the steps: drafts made and kept, seconds drafting and verifying, and
    the last one-token step's seconds (the verify's yardstick)."""
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    one_s: float | None = None

    def summary(self) -> str:
        if not self.steps:
            return "spec: no steps"
        verifies = self.verify_tokens / self.steps
        rate = self.accepted / self.drafted if self.drafted else 0.0
        one = f", a one-token step {1e3 * self.one_s:.1f} ms" if self.one_s else ""
        return (f"spec: {self.steps} steps, {self.drafted} drafted, {self.accepted} accepted ({rate:.1%}), "
                f"{(self.accepted + self.steps) / self.steps:.2f} tokens a step; draft "
                f"{1e3 * self.draft_s / self.steps:.1f} ms, verify of {verifies:.1f} tokens "
                f"{1e3 * self.verify_s / self.steps:.1f} ms a step{one}")


class Speculator:
    """Speculative decoding of one sequence at a time (a server slot, a generation).

    `drafter(state, tok, k)` -> (drafts, their distributions q) replaces the MTP head (the
    tests propose known tokens). `measure`: make the first step a plain one-token step, the
    yardstick `line` holds the verifies against."""

    def __init__(self, model, n: int, sampler: Sampler, min_p: float = 0.0, drafter=None,
                 measure: bool = False):
        check(model, n)
        if not 0 <= min_p <= 1:
            raise ValueError(f"--spec-min-p {min_p}: a probability, 0 to 1")
        self.model, self.n, self.sampler, self.min_p = model, n, sampler, min_p
        self.drafter = drafter or self._mtp_drafts
        self.greedy = sampler.p.temperature == 0
        self.measure = measure
        self.stats = SpecStats()
        self.last: tuple[int, int, float, float] | None = None  # drafted, accepted, draft s, verify s

    def new_state(self, capacity: int):
        return self.model.new_cache(capacity, mtp=True)

    # -- distributions ---------------------------------------------------------------------

    def _dist(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampler's distribution of `logits`, over the whole vocabulary."""
        ids, probs = self.sampler.distribution(logits)
        p = torch.zeros(logits.numel())
        p[ids] = probs
        return p

    def _draw(self, p: torch.Tensor) -> int:
        if self.greedy:  # one-hot
            return int(torch.argmax(p))
        return int(torch.multinomial(p, 1, generator=self.sampler.gen))

    # -- one step ----------------------------------------------------------------------------

    def _mtp_drafts(self, state, tok: int, k: int) -> tuple[list[int], list[torch.Tensor]]:
        drafts, qs, hidden = [], [], None
        for j in range(k):
            logits, hidden = self.model.draft(drafts[-1] if drafts else tok, state, hidden, step=j)
            if self.min_p and float(torch.softmax(logits.float(), dim=-1).max()) < self.min_p:
                break
            q = self._dist(logits)
            drafts.append(self._draw(q))
            qs.append(q)
        state.mtp.truncate(state.length)  # the drafts' own keys: the verify writes the trunk's
        return drafts, qs

    def step(self, state, tok: int, limit: int | None = None) -> list[int]:
        """Feed `tok` and up to `n` drafts (at most `limit`); the accepted drafts and the
        token after them, which is not fed yet."""
        k = self.n if limit is None else max(0, min(self.n, limit))
        if self.measure and self.stats.one_s is None:
            k = 0
        t0 = time.perf_counter()
        drafts, qs = self.drafter(state, tok, k) if k else ([], [])
        t1 = time.perf_counter()
        if drafts:
            rows = self.model.verify([tok] + drafts, state)
        else:
            rows = self.model([tok], state)
        out: list[int] = []
        for j, d in enumerate(drafts):
            p = self._dist(rows[j])
            a = acceptance(p, qs[j], d)
            if a >= 1 or (a > 0 and float(torch.rand(1, generator=self.sampler.gen)) < a):
                out.append(d)
                continue
            out.append(self._draw(residual(p, qs[j])))
            break
        else:
            out.append(self._draw(self._dist(rows[len(drafts)])))
        if drafts:
            state.keep(len(out))
        t2 = time.perf_counter()
        s = self.stats
        s.steps += 1
        s.drafted += len(drafts)
        s.accepted += len(out) - 1
        s.verify_tokens += len(drafts) + 1
        s.draft_s += t1 - t0
        s.verify_s += t2 - t1
        if not drafts:
            s.one_s = t2 - t1
        self.last = (len(drafts), len(out) - 1, t1 - t0, t2 - t1)
        return out

    def line(self) -> str:
        """The last step: drafted, accepted, the draft's and the verify's time, the verify
        against a one-token step."""
        k, a, draft_s, verify_s = self.last
        one = self.stats.one_s
        ratio = f" = {verify_s / one:.2f}x a one-token step ({1e3 * one:.1f} ms)" if one and k else ""
        return (f"spec: drafted {k}, accepted {a}; draft {1e3 * draft_s:.1f} ms, verify of {k + 1} "
                f"token{'s' if k else ''} {1e3 * verify_s:.1f} ms{ratio}")
