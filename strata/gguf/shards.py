"""GGUF shard sets: one model split over files named `<stem>-0000i-of-0000n.gguf`."""
from __future__ import annotations

import os
import re
from pathlib import Path

_SHARD = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def shard_files(path: str | os.PathLike) -> list[Path]:
    """Every file of `path`'s shard set, first to last (whether present or not: callers
    decide what a missing shard means); `[path]` when its name is not a shard's."""
    path = Path(path)
    m = _SHARD.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    # the same five-digit spelling as the name matched, so `path` itself is in the list as is
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
