"""`strata serve` under --ep/--pp: rank 0 serves HTTP and runs the engine; every other rank
follows it, running the same model calls on its own part of the model.

The engine on rank 0 sees the model through a `Leader`: before each call that computes or
makes a sequence state (a forward, a batch of forwards, a new state, a copy), the Leader
broadcasts what is about to run, with ids for the states; the followers (`follow`) keep
their own halves of those states under the same ids and make the same call, so the
collectives inside the model meet in the same order on every rank. States the engine
drops (the conversation cache evicts, a request ends) are freed on the followers with
the next call.

A rank that is gone ends the engine: the requests in flight get an error, /health and
every route answer 503 naming the rank, and the process exits so that torchrun
(`--max-restarts N`) can start the world again.
"""
from __future__ import annotations

import collections
import itertools
import logging
import weakref

from strata.dist import Comm

log = logging.getLogger("strata.server")


class Handle:
    """A sequence state on rank 0, and the id its followers' halves go by."""

    def __init__(self, leader: "Leader", sid: int, state):
        self.leader, self.id, self.state = leader, sid, state

    @property
    def rewindable(self) -> bool:
        return getattr(self.state, "rewindable", True)

    def copy(self, n: int | None = None) -> "Handle":
        return self.leader.copy(self, n)

    def __getattr__(self, name):  # length, nbytes, ...: the state's own
        return getattr(self.state, name)


class Leader:
    """The model as rank 0's engine calls it: each call announced to every rank first."""

    def __init__(self, model, comm: Comm):
        self._model, self._comm = model, comm
        self._ids = itertools.count(1)
        self._freed: collections.deque[int] = collections.deque()  # appended by finalizers, any thread

    def __getattr__(self, name):  # cfg, max_context, kernels, ...: the model's own
        return getattr(self._model, name)

    def _announce(self, *cmd) -> None:
        freed = [self._freed.popleft() for _ in range(len(self._freed))]
        self._comm.broadcast_object((freed, *cmd), "the broadcast of the engine's next call")

    def _handle(self, state) -> Handle:
        h = Handle(self, next(self._ids), state)
        weakref.finalize(h, self._freed.append, h.id)
        return h

    def new_cache(self, capacity: int = 256, **kw) -> Handle:
        h = self._handle(None)
        self._announce("new", h.id, capacity, kw)
        h.state = self._model.new_cache(capacity, **kw)
        return h

    def copy(self, src: Handle, n: int | None) -> Handle:
        h = self._handle(None)
        self._announce("copy", src.id, h.id, n)
        h.state = src.state.copy(n)
        return h

    def __call__(self, tokens, cache: Handle, last_only: bool = False):
        return self.forward_batch([(tokens, cache)], last_only)[0]

    def forward_batch(self, items, last_only: bool = True) -> list:
        items = [([int(t) for t in tokens], cache) for tokens, cache in items]
        self._announce("forward", [(t, c.id) for t, c in items], last_only)
        return self._model.forward_batch([(t, c.state) for t, c in items], last_only)

    def stop(self) -> None:
        self._announce("stop")


def follow(model, comm: Comm) -> None:
    """A rank other than 0: make the calls rank 0 announces, until it says stop."""
    states: dict[int, object] = {}
    while True:
        freed, op, *rest = comm.broadcast_object(None, "the wait for the engine's next call")
        for sid in freed:
            states.pop(sid, None)
        if op == "stop":
            return
        try:
            if op == "new":
                sid, capacity, kw = rest
                states[sid] = model.new_cache(capacity, **kw)
            elif op == "copy":
                src, sid, n = rest
                states[sid] = states[src].copy(n)
            elif op == "forward":
                items, last_only = rest
                model.forward_batch([(tokens, states[sid]) for tokens, sid in items], last_only)
        except ValueError as e:  # refused alike on rank 0, before any collective: its request's error
            log.info("rank %d: %s", comm.layout.rank, e)
