"""Conversation (prefix) cache: finished prompts' KV states, reused by later prompts that
extend them, under a memory budget with least-recently-used eviction.

The same answer whatever the cache: a token's logits must not depend on whether its
prefix came from the cache. The engine prefills in chunks aligned to multiples of
`align` tokens from position 0, and the cache keeps and hands out whole chunks only, so a
reused prefix holds exactly the values a fresh prefill computes, and the rest runs in the
same chunks, at the same shapes, through the same kernels. (Reusing a prefix of any
length made the next tokens run at another shape and through another attention path, and
in bf16 one greedy answer in 8 changed.) A decoded answer's own KV is not kept: decode
computes it one token at a time, not as a prefill would."""
from __future__ import annotations

from collections import OrderedDict

from strata.nn.attention import KVCache


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, budget_bytes: int, align: int = 1):
        self.budget, self.align = budget_bytes, align
        self.entries: OrderedDict[int, tuple[list[int], KVCache]] = OrderedDict()
        self._next = 0
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes() for _, c in self.entries.values())

    def put(self, tokens: list[int], cache: KVCache) -> None:
        """Keep `cache`, whose first len(tokens) positions hold `tokens`."""
        if cache.nbytes() > self.budget or not tokens:
            return
        # an entry that this one extends is now redundant
        for key, (toks, _) in list(self.entries.items()):
            if common_prefix(toks, tokens) == len(toks):
                del self.entries[key]
        self.entries[self._next] = (list(tokens), cache)
        self._next += 1
        while self.nbytes > self.budget:
            self.entries.popitem(last=False)

    def take(self, prompt: list[int]) -> tuple[KVCache | None, int]:
        """A cache holding the longest cached prefix of `prompt` in whole chunks of `align`
        (a copy: the entry stays) and its length; at least one prompt token is left to
        evaluate, for its logits."""
        best, best_n = None, 0
        for key, (toks, cache) in self.entries.items():
            n = min(common_prefix(toks, prompt), len(prompt) - 1) // self.align * self.align
            if n < len(toks) and not getattr(cache, "rewindable", True):
                continue  # a recurrent state summarises all its tokens: usable whole or not at all
            if n > best_n:
                best, best_n = key, n
        if best is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        self.entries.move_to_end(best)
        return self.entries[best][1].copy(best_n), best_n
