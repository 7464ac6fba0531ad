"""The serving engine: N slots decoding together (continuous batching) on one thread.

Run the loop on the main thread where it matters (`start_thread=False`, then `run()`):
torch's parallel CPU kernels start their OpenMP team much more slowly from another
thread (measured: a 1536x576 int4 GEMV 24 us on the main thread, 57 us elsewhere; a
SmolLM2 decode step 9.6 ms against 19.3 ms).

Requests wait in a bounded queue. Between steps, waiting requests take free slots: each
prefills (reusing the longest cached prefix of its prompt from the conversation cache, in
whole chunks of `align` tokens), then every busy slot decodes one token in a single
batched forward. A finished or cancelled request leaves at once, and its prompt's KV
state, in whole chunks, goes to the conversation cache (see strata.runtime.prefix_cache
on why chunks).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from strata.dist import RankLost
from strata.runtime import timing
from strata.runtime.prefix_cache import PrefixCache
from strata.runtime.sampling import Sampler, SamplingParams
from strata.runtime.spec import Speculator, can_draft, check as check_spec, prefill
from strata.runtime.text import TextOut
from triton_kernels import invariant
from triton_kernels.backend import use_device

log = logging.getLogger("strata.server")

# Prompts prefill in chunks of this many tokens, aligned from position 0, and the
# conversation cache reuses whole chunks: small enough that a conversation's earlier
# turns are reused, large enough that a chunk keeps the matmuls busy.
PREFILL_CHUNK = 64


class QueueFull(Exception):
    pass


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[dict], None]          # called from the engine thread with events
    id: int = 0
    cancelled: bool = False
    images: list = field(default_factory=list)  # strata.vision.images.Image, in the prompt's order
    key: list[int] | None = None  # the prompt as the conversation cache knows it (images by content)
    # filled in by the engine
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    text: str = ""                        # the whole output, once finished
    finish_reason: str | None = None


@dataclass
class Slot:
    index: int
    req: Request | None = None
    cache: object = None
    sampler: Sampler | None = None
    out: TextOut | None = None
    logits: torch.Tensor | None = None
    keep: tuple | None = None  # (prompt tokens, state) in whole chunks, for the conversation cache
    spec: Speculator | None = None
    chosen: list[int] | None = None  # a speculative step's tokens; the last is fed by the next step


class Engine:
    def __init__(self, model, tokenizer, slots: int = 4, queue_size: int = 64,
                 cache_mib: float = 512, ctx_size: int | None = None, start_thread: bool = True,
                 align: int = PREFILL_CHUNK, spec: int = 0, spec_min_p: float = 0.0, vision=None):
        """`align`: the prefill's chunk, and the conversation cache's unit of reuse. `spec`:
        speculative decoding per slot, up to that many MTP drafts a step (strata.runtime.spec).
        `vision`: the model's tower (strata.vision.images.Vision), for requests with images."""
        self.vision = vision
        check_spec(model, spec)
        self.spec, self.spec_min_p = spec, spec_min_p
        self.model, self.tok, self.align = model, tokenizer, align
        self.ctx_size = ctx_size or getattr(model, "max_context", model.cfg.context_length)
        self.slots = [Slot(i) for i in range(slots)]
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=queue_size)
        self.prefix = PrefixCache(int(cache_mib * 2**20), align)
        self.stats = {"prompt_tokens": 0, "generated_tokens": 0, "requests": 0, "cached_tokens": 0,
                      "decode_seconds": 0.0}
        self._ids = 0
        self._wake = threading.Event()
        self._stop = False
        self.timing = timing.enabled()
        self.timer = timing.StepTimer(model) if self.timing else None
        if start_thread:
            threading.Thread(target=self.run, name="strata-engine", daemon=True).start()

    # --- called from the server -----------------------------------------------------
    def submit(self, req: Request) -> Request:
        self._ids += 1
        req.id = self._ids
        try:
            self.waiting.put_nowait(req)
        except queue.Full:
            raise QueueFull(f"{self.waiting.maxsize} requests are already waiting") from None
        self._wake.set()
        return req

    def busy_slots(self) -> int:
        return sum(s.req is not None for s in self.slots)

    def fail_all(self, message: str) -> None:
        """End every request in a slot or waiting with an error (the engine stops)."""
        reqs = [s.req for s in self.slots if s.req is not None]
        while not self.waiting.empty():
            reqs.append(self.waiting.get_nowait())
        for req in reqs:
            req.emit({"type": "error", "message": message})
        for s in self.slots:
            s.req = s.cache = None

    def close(self) -> None:
        self._stop = True
        self._wake.set()

    # --- the engine thread ----------------------------------------------------------
    def run(self, until_idle: bool = False) -> None:
        """The engine loop; returns on close(), or with `until_idle` once nothing is left."""
        # the model's GPU current in this thread too: a thread starts on cuda:0, and Triton
        # launches on the current device (triton_kernels.backend.use_device)
        device = getattr(self.model, "device", None)
        if isinstance(device, torch.device):
            use_device(str(device))
        while not self._stop:
            self._admit()
            active = [s for s in self.slots if s.req is not None]
            if not active:
                if until_idle and self.waiting.empty():
                    return
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self._step(active)

    def _admit(self) -> None:
        for slot in self.slots:
            if slot.req is not None:
                continue
            try:
                req = self.waiting.get_nowait()
            except queue.Empty:
                return
            if req.cancelled:
                continue
            try:
                self._prefill(slot, req)
            except RankLost:  # --ep/--pp: the engine cannot go on (strata.server.ranks)
                slot.req = req
                raise
            except Exception as e:  # a failed request must not take the engine down
                log.exception("request %d failed in prefill", req.id)
                req.emit({"type": "error", "message": str(e)})
                slot.req = None

    def _prefill(self, slot: Slot, req: Request) -> None:
        t0 = time.perf_counter()
        key = req.key or req.prompt
        cache, reused = self.prefix.take(key)
        if cache is None:
            tracks = {"mtp": True} if self.spec else {}  # what the MTP head drafts from, too
            cache = self.model.new_cache(len(req.prompt) + req.params.max_tokens, **tracks)
        if req.images:
            self.vision.prepare(cache, req.prompt, req.images)
        req.cached_tokens = reused
        slot.req, slot.cache = req, cache
        slot.sampler = Sampler(req.params)
        slot.chosen = None
        slot.spec = (Speculator(self.model, self.spec, slot.sampler, self.spec_min_p, measure=self.timing)
                     if self.spec else None)
        slot.out = TextOut(self.tok, req.params.stop)
        P, a = len(req.prompt), self.align
        whole = P // a * a  # the prompt's whole chunks: what the conversation cache may keep
        slot.keep = None
        for s in range(reused, P, a):
            slot.logits = prefill(self.model, req.prompt[s:s + a], cache)[-1]
            if s + a == whole and whole > reused and not getattr(cache, "rewindable", True):
                slot.keep = (key[:whole], cache.copy())  # a recurrent state cannot be cut back later
        self.stats["prompt_tokens"] += len(req.prompt)
        self.stats["cached_tokens"] += reused
        self.stats["requests"] += 1
        log.info("slot %d: request %d, %d prompt tokens, reused %d from the conversation cache, "
                 "evaluated %d in %.0f ms", slot.index, req.id, len(req.prompt), reused,
                 len(req.prompt) - reused, 1e3 * (time.perf_counter() - t0))

    def _step(self, active: list[Slot]) -> None:
        t0 = time.perf_counter()
        going: list[Slot] = []
        for slot in active:
            req = slot.req
            if req.cancelled:
                self._finish(slot, "cancelled")
                continue
            if req.params.max_tokens == 0:
                self._finish(slot, "length")
                continue
            chosen = slot.chosen if slot.chosen is not None else [slot.sampler(slot.logits)]
            if all(self._take(slot, tok) for tok in chosen):
                going.append(slot)
        t1 = time.perf_counter()
        with invariant.decoding(can_draft(self.model)):  # as generate's steps
            self._decode(going)
        t2 = time.perf_counter()
        self.stats["generated_tokens"] += sum(len(s.chosen) for s in going) if self.spec else len(going)
        self.stats["decode_seconds"] += t2 - t0
        if self.timing:
            log.info("%s", self.timer.line(len(going), 1e3 * (t2 - t0), sampling=1e3 * (t1 - t0),
                                           compute=1e3 * (t2 - t1)))

    def _decode(self, going: list[Slot]) -> None:
        """A step of the slots still going: each verifies its own drafts, one slot at a
        time, or one batched forward of their next tokens."""
        if going and self.spec:
            for s in going:
                r = s.req
                room = min(r.params.max_tokens - len(r.tokens), self.ctx_size - len(r.prompt) - len(r.tokens))
                s.chosen = s.spec.step(s.cache, r.tokens[-1], limit=room - 1)
                if self.timing:
                    log.info("slot %d: %s", s.index, s.spec.line())
        elif going:
            logits = self.model.forward_batch([([s.req.tokens[-1]], s.cache) for s in going])
            for s, lg in zip(going, logits):
                s.logits = lg[-1]

    def _take(self, slot: Slot, tok: int) -> bool:
        """The next token of a slot's answer; False once the answer is finished."""
        req = slot.req
        if tok in self.tok.eot_ids:
            self._finish(slot, "stop")
            return False
        req.tokens.append(tok)
        if slot.out.feed(tok):
            self._finish(slot, "stop")
            return False
        if piece := slot.out.take():
            req.emit({"type": "text", "text": piece})
        if len(req.tokens) >= req.params.max_tokens or len(req.prompt) + len(req.tokens) >= self.ctx_size:
            slot.out.flush()
            self._finish(slot, "length")
            return False
        return True

    def _finish(self, slot: Slot, reason: str) -> None:
        req = slot.req
        req.finish_reason = reason
        if piece := slot.out.take(final=True):
            req.emit({"type": "text", "text": piece})
        req.text = slot.out.text
        req.emit({"type": "done", "finish_reason": reason})
        # the prompt's whole chunks, as a fresh prefill computes them
        whole = len(req.prompt) // self.align * self.align
        if getattr(slot.cache, "rewindable", True) and whole > req.cached_tokens:
            self.prefix.put((req.key or req.prompt)[:whole], slot.cache.copy(whole))
        elif slot.keep is not None:
            self.prefix.put(*slot.keep)
        slot.req = slot.cache = slot.sampler = slot.out = slot.logits = slot.keep = slot.spec = slot.chosen = None
