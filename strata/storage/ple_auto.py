"""`--ple-io auto`: which I/O mode reads the PLE table fastest here (`choose_mode`),
measured on the model's own decode and prefill patterns (`measure`) over stand-in row ids
(`probe_ids`) after a warm-up.
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from strata.storage import io
from strata.storage.io import gib
from strata.names.qwen4exp import PLE_ROWS_PER_TOKEN as HEADS
from strata.storage.ple import PleTable
from strata.storage.ple_source import PleSource


def probe_ids(rows: int, tokens: int, seed: int = 0) -> np.ndarray:
    """int64 [tokens, 16]: a fixed-seed stand-in for the hashed n-gram rows of a fixed text,
    head h drawing from its own sixteenth of the table as the real heads do (each head has
    its own range). Where the hash kernel exists, pass its ids for a fixed text instead
    (`PleTable.open(..., probe_ids=...)`)."""
    rng = np.random.default_rng(seed)
    width = max(rows // HEADS, 1)
    heads = np.minimum(np.arange(HEADS) * width, rows - 1)
    return np.minimum(heads + rng.integers(0, width, (tokens, HEADS)), rows - 1).astype(np.int64)


def measure(table: PleTable, ids: np.ndarray, budget_s: float, ubatch: int = 256) -> dict:
    """rows/s of the model's two patterns on `ids` [T, 16], after a warm-up: decode (hint
    the next token, gather this one) and prefill (hint and gather `ubatch` tokens a step),
    half the budget each. The warm-up (the pool's threads, the first cold reads) keeps one
    slow first read from deciding (seeds/003). Walks on through `ids` so that no pattern
    rereads another's rows."""
    pos = 0

    def take(n):
        nonlocal pos
        if pos + n > len(ids):
            pos = 0
        out = ids[pos:pos + n]
        pos += n
        return out

    for step in (take(1) for _ in range(8)):  # warm-up
        table.prefetch(step)
        table.gather(step).rows()
    out = {}
    for name, per_step in (("decode", 1), ("prefill", ubatch)):
        rows, t0 = 0, time.perf_counter()
        cur = take(per_step)
        table.prefetch(cur)
        while True:
            if per_step == 1:  # decode: the next token is hinted while this one is gathered
                nxt = take(1)
                table.prefetch(nxt)
            table.gather(cur).rows()
            rows += cur.size
            if time.perf_counter() - t0 >= budget_s / 2:
                break
            if per_step == 1:
                cur = nxt
            else:  # prefill: the whole ubatch hinted, then gathered
                cur = take(per_step)
                table.prefetch(cur)
        out[name] = rows / (time.perf_counter() - t0)
    return out


def _ram_sample(source: PleSource, ids: np.ndarray, budget_s: float) -> dict:
    """ram's rates without loading the whole table: the same calls on a ram table of its
    first 64 MiB of rows (ids folded into them); a resident row costs the same anywhere."""
    n = max(1, min(source.rows, (64 << 20) // source.row_bytes))
    table = PleTable(dataclasses.replace(source, rows=n), "ram", say=lambda _msg: None)
    try:
        return measure(table, ids % n, budget_s)
    finally:
        table.close()


def _rate(r: dict) -> float:
    return math.sqrt(r["decode"] * r["prefill"])


def _k(x: float) -> str:
    return f"{x / 1e3:,.0f}k" if x >= 1e4 else f"{x:,.0f}"


def choose_mode(source: PleSource, *, depth: int = 16, prefetch: bool = True, reserve_bytes: int = 0,
                ids: np.ndarray | None = None, budget_s: float = 0.3, margin: float = 0.10,
                mem_available: int | None = None) -> tuple[str, str]:
    """Measure each candidate mode on the real pattern for `budget_s` and return (mode,
    the line that says why). Candidates from the cheapest to run: mmap (nothing held),
    direct (a thread pool), ram (the table's size in RAM and its load time; only when it
    fits beside `reserve_bytes` in MemAvailable). A costlier mode wins only when faster by
    `margin` (rates: the geometric mean of decode and prefill rows/s)."""
    ids = probe_ids(source.rows, 4096) if ids is None else np.asarray(ids, np.int64).reshape(-1, HEADS)
    avail = io.mem_available() if mem_available is None else mem_available
    quiet = lambda _msg: None
    results: dict[str, dict] = {}
    notes = []
    for mode in ("mmap", "direct"):
        t = PleTable(source, mode, depth=depth, prefetch=prefetch, say=quiet)  # the table opened says it
        try:
            results[mode] = measure(t, ids, budget_s)
            if mode == "direct" and not t._reader.direct:
                notes.append("direct measured buffered reads: the file system refuses O_DIRECT")
        finally:
            t.close()
    if avail is not None and source.nbytes + reserve_bytes < avail:
        results["ram"] = _ram_sample(source, ids, budget_s)
    else:
        have = "unknown" if avail is None else gib(avail)
        notes.append(f"ram not tried (table {gib(source.nbytes)} + model {gib(reserve_bytes)} "
                     f"> MemAvailable {have})")
    best = "mmap"
    for mode in ("direct", "ram"):
        if mode in results and _rate(results[mode]) > _rate(results[best]) * (1 + margin):
            best = mode
    nums = ", ".join(f"{m} {_k(r['decode'])}|{_k(r['prefill'])}" for m, r in results.items())
    # rates: the geometric mean of decode and prefill rows/s, so that neither pattern alone
    # decides (a probe of one pattern mispredicted the other: seeds/003)
    why = (f"the cheapest; no other faster by {margin:.0%}" if best == "mmap" else
           f"{_rate(results[best]) / _rate(results['mmap']):.2f}x mmap in the geometric mean of "
           f"decode and prefill, more than the {margin:.0%} margin")
    line = (f"--ple-io auto -> {best} ({why}); rows/s decode|prefill at depth {depth}: {nums}"
            + ("; " + "; ".join(notes) if notes else "")
            + "; --ple-io ram|mmap|direct forces a mode")
    return best, line
