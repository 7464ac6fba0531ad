"""Generated tokens -> text, cut at the first stop string, streamed only once final."""
from __future__ import annotations


class TextOut:
    """Feed sampled token ids; `text` is the output so far, `take()` the part not yet handed
    out that can no longer turn into a stop string (nor a broken UTF-8 character)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.stream = tokenizer.stream()
        self.stop = [s for s in stop if s]
        self.text = ""
        self.sent = 0

    def feed(self, token: int) -> bool:
        """Append a token's text; True when a stop string ended the output (cut before it)."""
        self.text += self.stream.feed(token)
        hits = [self.text.find(s) for s in self.stop if s in self.text]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def flush(self) -> None:
        """The output ends without a stop: keep what the decoder still holds."""
        self.text += self.stream.flush()

    def take(self, final: bool = False) -> str:
        ready = len(self.text) if final else len(self.text) - self._held_back()
        piece = self.text[self.sent:ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return piece

    def _held_back(self) -> int:
        """Trailing characters that might start a stop string."""
        n = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    n = max(n, k)
                    break
        return n
