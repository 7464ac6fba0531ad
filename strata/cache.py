"""Where Strata keeps what it fetches, builds and measures: `$STRATA_CACHE`, else
`$XDG_CACHE_HOME/strata`, else `~/.cache/strata`."""
from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("STRATA_CACHE"):
        root = Path(os.environ["STRATA_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata"
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold `directory`/.lock: parallel processes (the test workers, two commands) that
    would build the same cached thing take turns, and the later one finds it built."""
    import fcntl
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
