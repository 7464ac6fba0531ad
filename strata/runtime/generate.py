"""The generation loop: prefill in chunks, then decode token by token, streaming text."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .sampling import Sampler, SamplingParams


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str          # "stop" (end of turn or a stop string) or "length"
    prompt_tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    timings: dict = field(default_factory=dict)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s else 0.0


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters might start a stop string (so are not streamed yet)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    return n


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
    stream = tokenizer.stream()
    out: list[int] = []
    text, sent, reason = "", 0, "length"
    stop_ids = set(tokenizer.eot_ids)
    for _ in range(params.max_tokens):
        tok = sampler(logits[-1])
        if tok in stop_ids:
            reason = "stop"
            break
        out.append(tok)
        text += stream.feed(tok)
        hit = min((text.find(s) for s in params.stop if s in text), default=-1)
        if hit >= 0:
            text, reason = text[:hit], "stop"
            break
        if on_text:
            ready = len(text) - _held_back(text, params.stop)
            if ready > sent:
                on_text(text[sent:ready])
                sent = ready
        if len(out) == params.max_tokens:
            break
        logits = model([tok], cache, last_only=True)
    if reason == "length":
        text += stream.flush()
    if on_text and len(text) > sent:
        on_text(text[sent:])
    t2 = time.perf_counter()
    return GenerationResult(out, text, reason, len(prompt_ids), t1 - t0, t2 - t1)
