"""The generation loop: prefill in chunks, then decode token by token, streaming text."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

from .sampling import Sampler, SamplingParams
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

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s else 0.0


def generate(model, tokenizer, prompt_ids: list[int], params: SamplingParams,
             on_text: Callable[[str], None] | None = None, cache=None, ubatch: int = 512) -> GenerationResult:
    """Generate after `prompt_ids`; `on_text` receives the text as it becomes final."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    sampler = Sampler(params)
    cache = cache if cache is not None else model.new_cache(len(prompt_ids) + params.max_tokens)
    t0 = time.perf_counter()
    for i in range(0, len(prompt_ids), ubatch):
        logits = model(prompt_ids[i:i + ubatch], cache, last_only=True)
    t1 = time.perf_counter()
    out: list[int] = []
    text = TextOut(tokenizer, params.stop)
    reason = "length"
    timer = StepTimer(model) if timing.enabled() else None
    for _ in range(params.max_tokens):
        tok = sampler(logits[-1])
        if tok in tokenizer.eot_ids:
            reason = "stop"
            break
        out.append(tok)
        if text.feed(tok):
            reason = "stop"
            break
        if on_text and (piece := text.take()):
            on_text(piece)
        if len(out) == params.max_tokens:
            break
        ts = time.perf_counter()
        logits = model([tok], cache, last_only=True)
        if timer:
            print(f"strata: {timer.line(1, 1e3 * (time.perf_counter() - ts))}", file=sys.stderr)
    if reason == "length":
        text.flush()
    if on_text and (piece := text.take(final=True)):
        on_text(piece)
    t2 = time.perf_counter()
    return GenerationResult(out, text.text, reason, len(prompt_ids), t1 - t0, t2 - t1)
