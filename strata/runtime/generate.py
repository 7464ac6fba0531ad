"""The generation loop: prefill in chunks, then decode token by token (or a few at a time,
speculatively: strata.runtime.spec), streaming text."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

from triton_kernels import invariant

from .sampling import Sampler, SamplingParams
from .spec import SpecStats, Speculator, can_draft, prefill
from . import timing
from .text import TextOut
from .timing import StepTimer


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str          # "stop" (end of turn or a stop string) or "length"
    prompt_tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    spec: SpecStats | None = None  # speculative decoding's counters, where it ran
    first_step_s: float = 0.0      # the first decode step, which pays one-time costs
    first_step_tokens: int = 0     # the tokens it chose

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s else 0.0

    @property
    def steady_tok_s(self) -> float:
        """The decode's rate past its first step (the first token comes from the prefill,
        and the first step pays one-time costs: batch-invariant probes, first allocations);
        the whole decode's rate where there is no second step."""
        steps_s = self.decode_s - self.first_step_s
        later = len(self.tokens) - 1 - self.first_step_tokens
        return later / steps_s if later > 0 and steps_s > 0 else self.decode_tok_s


def generate(model, tokenizer, prompt_ids: list[int], params: SamplingParams,
             on_text: Callable[[str], None] | None = None, cache=None, ubatch: int = 512,
             spec: int = 0, spec_min_p: float = 0.0, drafter=None, vision=None, images=()) -> GenerationResult:
    """Generate after `prompt_ids`; `on_text` receives the text as it becomes final.
    `spec` > 0: speculative decoding with up to `spec` drafts of the model's MTP head a step
    (strata.runtime.spec; `spec_min_p` stops a draft below that top probability; `drafter`
    replaces the head). Greedy, the tokens are those of `spec` = 0. `images`
    (strata.vision.images.Image, read by `vision`) fill the prompt's runs of image tokens."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    sampler = Sampler(params)
    speculator = Speculator(model, spec, sampler, spec_min_p, drafter, measure=timing.enabled()) if spec else None
    if cache is None:
        capacity = len(prompt_ids) + params.max_tokens
        cache = speculator.new_state(capacity) if speculator else model.new_cache(capacity)
    t0 = time.perf_counter()
    if images:
        if cache.length:
            raise ValueError("images take a sequence from its first token: give generate() a new cache")
        vision.prepare(cache, prompt_ids, list(images))
    for i in range(0, len(prompt_ids), ubatch):
        logits = prefill(model, prompt_ids[i:i + ubatch], cache)
    t1 = time.perf_counter()
    timer = StepTimer(model) if timing.enabled() else None
    out: list[int] = []
    text = TextOut(tokenizer, params.stop)
    reason = "length"

    def emit(tok: int) -> bool:
        """Take one token; False once the answer is over."""
        nonlocal reason
        if tok in tokenizer.eot_ids:
            reason = "stop"
            return False
        out.append(tok)
        if text.feed(tok):
            reason = "stop"
            return False
        if on_text and (piece := text.take()):
            on_text(piece)
        return len(out) < params.max_tokens

    chosen = [sampler(logits[-1])] if params.max_tokens > 0 else []
    first = None  # the first decode step's seconds and tokens
    drafts = can_draft(model)  # its decode steps batch-invariant by default (triton_kernels.invariant)
    # every token chosen is fed but the last, which the next step feeds
    while chosen and all(emit(t) for t in chosen):
        ts = time.perf_counter()
        with invariant.decoding(drafts):  # a verify's rows compute as these steps (triton_kernels.invariant)
            if speculator:
                chosen = speculator.step(cache, out[-1], limit=params.max_tokens - len(out) - 1)
                ms = 1e3 * (time.perf_counter() - ts)
            else:
                logits = model([out[-1]], cache, last_only=True)
                ms = 1e3 * (time.perf_counter() - ts)
                chosen = [sampler(logits[-1])]
        if first is None:
            first = (ms / 1e3, len(chosen))
        if timer:
            line = timer.line(len(chosen), ms)
            print(f"strata: {speculator.line() + '; ' if speculator else ''}{line}", file=sys.stderr)
    if reason == "length":
        text.flush()
    if on_text and (piece := text.take(final=True)):
        on_text(piece)
    t2 = time.perf_counter()
    return GenerationResult(out, text.text, reason, len(prompt_ids), t1 - t0, t2 - t1,
                            speculator.stats if speculator else None, *(first or (0.0, 0)))
