"""Storage tiers: where the weights a step needs come from (RAM, the page cache, the drive).

The PLE table: `ple_source` (where it is: `find_ple`), `ple` (`PleTable`, `--ple-io
ram|mmap|direct`), `ple_auto` (`--ple-io auto`: `choose_mode`). The routed experts:
`expert_tier` (the `--experts` spec), `expert_sources`, `experts` (`ExpertStore`), `pack`
(`strata pack`). `io`: the shared I/O machinery (page runs, hints, mlock, direct reads,
/proc counters).
"""
from strata.storage.ple import MODES, PleRows, PleTable
from strata.storage.ple_auto import choose_mode
from strata.storage.ple_source import PLE_TENSOR, PleSource, find_ple

__all__ = ["MODES", "PLE_TENSOR", "PleRows", "PleSource", "PleTable", "choose_mode", "find_ple"]
