"""Where each token sits for qwen4exp's multimodal RoPE (M-RoPE): a (t, h, w) triple.

Text tokens take (p, p, p), p one more than the largest position before them; the tokens
of an image of (h', w') merged patches, starting at p, take (p, p + row, p + col), and the
text after it continues at p + max(h', w'). So once an image is in, a token's position is
no longer its index (transformers' `get_rope_index`, Qwen4ExpModel). The rotary pairs are
split among the three by `Rope`'s interleaved sections.

While a sequence holds text alone, nothing is stored and every position is its index: the
text path computes exactly what it did before images existed."""
from __future__ import annotations

import torch


class Positions:
    """One sequence's M-RoPE positions: `rows` (3, n) int64 for its first n tokens, fed or
    planned, once an image has been planned (None before: position = index)."""

    def __init__(self):
        self.rows: torch.Tensor | None = None
        self.next = 0  # the next text token's position, where rows is held

    def plan(self, runs: list[tuple[int, tuple[int, int] | None]]) -> None:
        """Positions for a whole sequence, from its first token: `runs` in order, each
        (count, None) for text or (count, (h', w')) for an image's count = h' * w' tokens."""
        parts, p = [], 0
        for count, grid in runs:
            if grid is None:
                parts.append((p + torch.arange(count)).expand(3, -1))
                p += count
                continue
            h, w = grid
            if h * w != count:
                raise ValueError(f"an image of {h} x {w} merged patches has {h * w} tokens, not {count}")
            rr, cc = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            parts.append(torch.stack([torch.full((count,), p), p + rr.flatten(), p + cc.flatten()]))
            p += max(h, w)
        self.rows, self.next = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long), p

    def _cover(self, n: int) -> None:
        """Hold rows for the first n tokens, text positions for any not yet planned."""
        if self.rows is None:
            self.rows, self.next = torch.arange(0).expand(3, -1), 0
        have = self.rows.shape[1]
        if n > have:
            more = (self.next + torch.arange(n - have)).expand(3, -1)
            self.rows, self.next = torch.cat([self.rows, more], dim=1), self.next + n - have

    def of(self, start: int, count: int) -> torch.Tensor | None:
        """(3, count) positions of tokens start.., or None while they are their indices.
        Text alone, (count,): its three positions are one, and RoPE's 1-D rows are its."""
        if self.rows is None:
            return None
        self._cover(start + count)
        rows = self.rows[:, start:start + count]
        return rows[0] if bool((rows == rows[0]).all()) else rows

    def at(self, index: torch.Tensor) -> torch.Tensor:
        """(3, len(index)) positions of tokens already covered (a block's first token), or the
        indices themselves while positions are indices."""
        return index if self.rows is None else self.rows[:, index]

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (a verify's kept rows)."""
        if self.rows is not None:
            self._cover(n)
            self.rows = self.rows[:, :n]
            self.next = int(self.rows.max()) + 1 if n else 0

    def copy(self, n: int) -> "Positions":
        """A copy of the first n tokens' positions."""
        c = Positions()
        c.rows, c.next = self.rows, self.next  # rows are replaced, never written in place
        c.truncate(n)
        return c
