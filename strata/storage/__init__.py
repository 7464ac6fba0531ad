"""Storage tiers: where the weights a step needs come from (RAM, the page cache, the drive).

`ple`: the PLE table reader (`PleTable`, `--ple-io ram|mmap|direct|auto`); `io`: the shared
I/O machinery (page runs, hints, mlock, direct reads, /proc counters).
"""
from strata.storage.ple import (
    MODES,
    PLE_TENSOR,
    PleRows,
    PleSource,
    PleTable,
    choose_mode,
    find_ple,
)

__all__ = ["MODES", "PLE_TENSOR", "PleRows", "PleSource", "PleTable", "choose_mode", "find_ple"]
