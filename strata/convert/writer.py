"""Writing a converted checkpoint: strata.gguf's streaming writer, and its progress line.

A checkpoint of hundreds of GB cannot be held, so `write_streamed` writes the header,
metadata and tensor infos (names, shapes, types, sizes, planned beforehand) first and the
data follows one tensor at a time, a large tensor (the PLE table) even one piece at a time.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from strata.gguf.writer import write_streamed

__all__ = ["Progress", "write_streamed"]


class Progress:
    """One line on stderr: tensors done, MB written, the current tensor. Rewritten in place
    on a terminal; elsewhere (logs, CI) one line per tensor."""

    def __init__(self, label: str, n_tensors: int, total_bytes: int, stream=None, enabled: bool = True):
        self.label, self.n, self.total = label, n_tensors, total_bytes
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = self.written = 0
        self.t0 = time.perf_counter()

    def tensor(self, name: str, fmt: str, nbytes: int) -> None:
        self.done += 1
        self.written += nbytes
        if not self.enabled:
            return
        mb, total = self.written / 1e6, self.total / 1e6
        line = (f"{self.label}: [{self.done:{len(str(self.n))}d}/{self.n}] {mb:9.1f}/{total:.1f} MB  "
                f"{fmt:5s} {name}")
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if self.done == self.n:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, path: Path) -> None:
        if self.enabled:
            dt = time.perf_counter() - self.t0
            self.stream.write(f"{self.label}: wrote {path} ({self.written / 1e6:.1f} MB of tensors, "
                              f"{self.n} tensors) in {dt:.1f} s\n")
            self.stream.flush()
