"""Where Strata keeps what it fetches, builds and measures: `$STRATA_CACHE`, else
`$XDG_CACHE_HOME/strata`, else `~/.cache/strata`."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("STRATA_CACHE"):
        root = Path(os.environ["STRATA_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata"
    root.mkdir(parents=True, exist_ok=True)
    return root
