"""`strata bench model --spec N`: what a speculative step costs against a one-token step.

From a context of `-p` tokens, `-n` times: N greedy MTP drafts; the verify, one forward of
the step's token and the drafts (N+1 tokens) with its checkpoints; the roll-back to one
kept token (every draft refused: the dearest keep); and, from a copy of the same state,
a one-token step. Each MoE layer of the trunk counts the distinct experts it reads in the
verify and in the one-token step: N+1 tokens route to more experts than one does, and on a
device where decode is bound by the bytes it reads, that is what a verify costs.

What acceptance pays: if each draft is accepted with probability a (given the ones before
it), a step yields E(a) = (1 - a^(N+1)) / (1 - a) tokens for (draft + verify) time, against
E = 1 for a one-token step, so speculation pays once E(a) > (draft + verify) / one-token.
The break-even a is given for the measured times and for the bytes model: the drafts'
weights (the head's block, the output mixer, lm_head) plus the verify's dense weights and
distinct experts, against a one-token step's dense weights and top-k experts. flash-tiny's
weights are random, so its own acceptance says nothing; a trained MTP head sets a.
"""
from __future__ import annotations

import statistics
import time

import torch


def tokens_a_step(a: float, n: int) -> float:
    """Expected tokens a step yields with n drafts, each accepted with probability a."""
    return float(n + 1) if a >= 1 else (1 - a ** (n + 1)) / (1 - a)


def break_even(cost: float, n: int) -> float | None:
    """The per-draft acceptance at which a step of `cost` one-token steps pays for itself
    (None: not even with every draft accepted)."""
    if cost <= 1:
        return 0.0
    if cost >= n + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_a_step(mid, n) < cost else (lo, mid)
    return hi


def _experts_counter(model):
    """Per call of every trunk layer's expert store: the distinct experts its tokens route to."""
    calls: list[int] = []
    hooks = [layer.moe.experts.register_forward_pre_hook(
        lambda _m, inputs: calls.append(int(torch.unique(inputs[2][inputs[2] >= 0]).numel())))
        for layer in model.layers]
    return calls, hooks


def measure(model, n: int, context: list[int], steps: list[int], sync=lambda: None) -> dict:
    """The costs of speculative steps of `n` drafts after `context`, one per token of `steps`."""
    from strata.runtime.spec import check
    check(model, n)
    state = model.new_cache(len(context) + len(steps) + n + 1, mtp=True)
    model(context, state, last_only=True)
    calls, hooks = _experts_counter(model)
    draft_ms, verify_ms, keep_ms, one_ms, experts_v, experts_1 = [], [], [], [], [], []
    try:
        for tok in steps:
            one = state.copy()
            sync()
            t0 = time.perf_counter()
            drafts, hidden = [], None
            for j in range(n):
                logits, hidden = model.draft(drafts[-1] if drafts else tok, state, hidden, step=j)
                drafts.append(int(torch.argmax(logits)))
            state.mtp.truncate(state.length)
            sync()
            t1 = time.perf_counter()
            del calls[:]
            model.verify([tok] + drafts, state)
            sync()
            t2 = time.perf_counter()
            experts_v.append(sum(calls))
            state.keep(1)
            sync()
            t3 = time.perf_counter()
            del calls[:]
            model([tok], one, last_only=True)
            sync()
            t4 = time.perf_counter()
            experts_1.append(sum(calls))
            draft_ms.append(1e3 * (t1 - t0))
            verify_ms.append(1e3 * (t2 - t1))
            keep_ms.append(1e3 * (t3 - t2))
            one_ms.append(1e3 * (t4 - t3))
    finally:
        for h in hooks:
            h.remove()
    med = statistics.median
    stores = [layer.moe.experts for layer in model.layers]
    expert_bytes = sum(s.expert_bytes for s in stores) / len(stores)
    from strata.bench.decode_cost import step_bytes
    dense = step_bytes(model) - sum(layer.moe.top_k * s.expert_bytes for layer, s in zip(model.layers, stores))
    dense -= step_bytes(model.mtp)  # the head's weights are no part of a trunk step
    # a draft reads the head (its block's dense weights and top-k experts), the output mixer and lm_head
    draft_bytes = step_bytes(model.mtp) + step_bytes(model.out_hc) + step_bytes(model.output)
    r = {"n": n, "context": len(context), "steps": len(steps), "layers": len(stores),
         "draft_ms": med(draft_ms), "verify_ms": med(verify_ms), "keep_ms": med(keep_ms), "one_ms": med(one_ms),
         "experts_verify": statistics.fmean(experts_v) / len(stores),
         "experts_one": statistics.fmean(experts_1) / len(stores),
         "expert_bytes": expert_bytes, "dense_bytes": dense, "draft_bytes": draft_bytes}
    r["cost_time"] = (r["draft_ms"] + r["verify_ms"] + r["keep_ms"]) / r["one_ms"]
    one_bytes = dense + r["experts_one"] * len(stores) * expert_bytes
    verify_bytes = dense + r["experts_verify"] * len(stores) * expert_bytes
    r["cost_bytes"] = (n * draft_bytes + verify_bytes) / one_bytes
    r["break_even_time"] = break_even(r["cost_time"], n)
    r["break_even_bytes"] = break_even(r["cost_bytes"], n)
    return r


def text(r: dict) -> str:
    """The measurement in words, for the bench's report."""
    def be(x):
        return "never (not even all accepted)" if x is None else f"{x:.0%}"
    n = r["n"]
    return (f"Speculative step (--spec {n}) after {r['context']} tokens, median of {r['steps']}: "
            f"{n} MTP drafts {r['draft_ms']:.1f} ms, verify of {n + 1} tokens {r['verify_ms']:.1f} ms, "
            f"roll-back to 1 kept {r['keep_ms']:.1f} ms, against a one-token step of {r['one_ms']:.1f} ms: "
            f"a step costs {r['cost_time']:.2f} one-token steps. Distinct experts read per MoE layer: "
            f"{r['experts_verify']:.1f} by the verify, {r['experts_one']:.1f} by a one-token step "
            f"({r['expert_bytes'] / 2**10:.0f} KiB each; dense weights {r['dense_bytes'] / 2**20:.1f} MiB a step, "
            f"{r['draft_bytes'] / 2**20:.1f} MiB a draft), so where decode is bound by the bytes it reads, the "
            f"drafts and the verify cost {r['cost_bytes']:.2f} one-token steps. "
            f"Break-even acceptance per draft: {be(r['break_even_time'])} at the measured times, "
            f"{be(r['break_even_bytes'])} by the bytes; at 70% a step yields "
            f"{tokens_a_step(0.7, n):.2f} tokens, at 85% {tokens_a_step(0.85, n):.2f}")
