"""The PLE table: ~320M quantized rows of 160 values, 16 scattered rows per token.

The table's file and layout are found by strata.storage.ple_source (`find_ple`). A
machine that cannot hold the model often cannot hold this either, so how rows reach the
gather kernel is a choice (`--ple-io`), and each choice is what a field report measured:

- `ram`: the table read whole into anonymous memory, then mlock'ed. `locked` is True only
  when the lock of the whole table worked; a refused lock is said once (with the limit and
  the remedy) and the table stays in RAM unlocked. Rows live in anonymous memory, so no
  hint is ever given (a per-row WILLNEED on a locked table cost 30% of prefill on ZFS:
  seeds/000).
- `mmap`: the page cache. `prefetch(ids)` hints the merged, page-aligned runs of the rows
  a step needs with MADV_WILLNEED, in one process_madvise call where the kernel has it
  (none with `--no-ple-prefetch`; paused while hints start no reads, see `prefetch`);
  `gather` then faults the pages in.
- `direct`: O_DIRECT reads of whole pages by a thread pool of `depth`, each page once;
  `prefetch` starts the reads of the next step's rows. The gather kernel gets the compact
  rows read and ids remapped into them.
- `auto`: measures the real pattern in each candidate mode after a warm-up and keeps the
  faster by a margin (a cold, single-depth probe once picked the slower mode: seeds/003);
  strata.storage.ple_auto (`choose_mode`).

The model calls, per step (prefill: the whole ubatch; decode: the next token's rows are
hinted while this token's step computes):

    table.prefetch(next_ids)          # [T, 16] row ids; a no-op where hints are off
    rows = table.gather(ids)          # PleRows: table + ids, format and scale
    x = ple_gather(**rows.kernel_inputs(device), out_dtype=torch.bfloat16)
"""
from __future__ import annotations

import collections
import mmap
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

import quant
from strata.storage import io
from strata.storage.io import PAGE, gib
from strata.storage.ple_source import PleSource, find_ple
from triton_kernels.cpu import compiled
from triton_kernels.backend import to_device

MODES = ("ram", "mmap", "direct")
# when mmap mode leaves a hint out (see PleTable.prefetch): steps of up to SMALL_STEP rows
# (decode: 16 a token) after IDLE_HINTS hints in a row that started no read, but for one
# step in PROBE_EVERY + 1; larger steps when SAMPLE_PAGES of their pages are all cached
SMALL_STEP = 64
IDLE_HINTS = 8
PROBE_EVERY = 15
SAMPLE_PAGES = 16


# --- what a gather hands on --------------------------------------------------------------

@dataclass
class PleRows:
    """Quantized rows ready for the gather kernel: `ids` index rows of `table`. In ram and
    mmap modes `table` is the whole table (zero-copy over its memory) and `ids` the ids
    asked for; in direct mode `table` holds just the rows read and `ids` point into it."""
    table: np.ndarray  # uint8 [R, row_bytes]
    ids: np.ndarray  # int64, the shape the caller gave
    fmt: quant.Format
    scale: float | None
    row_dim: int

    def rows(self) -> np.ndarray:
        """uint8 [*ids.shape, row_bytes]: a copy of each row asked for."""
        return self.table[self.ids]

    def dequantize(self) -> np.ndarray:
        """float32 [*ids.shape, row_dim] by the format's numpy codec (the reference)."""
        x = self.fmt.dequantize(self.rows())
        return x * np.float32(self.scale) if self.scale is not None else x

    def kernel_inputs(self, device: str | torch.device = "cpu") -> dict:
        """table, ids, fmt, scale for `triton_kernels.ple.ple_gather(**inputs, out_dtype=...)`.
        On the CPU the table is handed over as is, zero-copy; a device gets only the
        distinct rows asked for, and ids remapped into them (the whole table would not fit)."""
        table, ids = self.table, self.ids
        if torch.device(device).type != "cpu":
            uniq, inv = np.unique(ids, return_inverse=True)
            table, ids = table[uniq], inv.reshape(ids.shape)
        with warnings.catch_warnings():
            # a read-only mapping: torch warns that it cannot be written, and nothing writes it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(table)
        return {"table": to_device(t, device),
                "ids": to_device(torch.from_numpy(np.ascontiguousarray(ids, np.int64)), device),
                "fmt": self.fmt, "scale": self.scale}


# --- the table ---------------------------------------------------------------------------

class PleTable:
    """A PLE table opened in one I/O mode; see the module's docstring for the modes and
    for how the model calls `prefetch` and `gather` (from one thread: the model's)."""

    def __init__(self, source: PleSource, mode: str = "mmap", *, depth: int = 16,
                 prefetch: bool = True, say: Callable[[str], None] = io.log):
        if mode not in MODES:
            raise ValueError(f"--ple-io {mode!r}: choose one of {', '.join(MODES)} or auto")
        self.source, self.mode, self.depth = source, mode, depth
        self.fmt, self.scale = source.fmt, source.scale
        self.rows, self.row_dim, self.row_bytes = source.rows, source.row_dim, source.row_bytes
        self.locked = False
        self._say = say
        self._mm: mmap.mmap | None = None
        self._table: np.ndarray | None = None
        self._whole: np.ndarray | None = None  # mmap mode: the whole mapping, bytes
        self._reader: io.PageReader | None = None
        self._delta = 0  # where the table starts in the mapping (mmap) or in the file (direct)
        self.load_s = 0.0
        self._counts = {"gathers": 0, "rows": 0, "distinct_pages": 0, "hints": 0, "hints_skipped": 0,
                        "rows_read_ahead": 0, "gathers_read_ahead": 0, "gather_s": 0.0}
        self._idle_hints = self._skipped = 0  # see prefetch
        if mode == "ram":
            self._open_ram()
        elif mode == "mmap":
            self._open_mmap()
        else:
            self._reader = io.PageReader(source.path, depth, say=say)
            self._delta = source.offset
        # hints only where a file mapping's pages can be missing: never in RAM, never direct
        self.hinting = prefetch and mode == "mmap"
        # direct mode's prefetch starts the reads themselves, in the background: the
        # next token's rows arrive while this step computes. Kept: the last few, newest last
        self.reading_ahead = prefetch and mode == "direct"
        self._ahead: collections.deque = collections.deque(maxlen=4)
        self._read_base = io.read_bytes()  # after opening: ram's load is `load_s`, not a gather

    # opening

    def _open_mmap(self) -> None:
        src = self.source
        base = src.offset // PAGE * PAGE  # mmap's offset must be page-aligned
        self._delta = src.offset - base
        with open(src.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), self._delta + src.nbytes, access=mmap.ACCESS_READ, offset=base)
        self._whole = np.frombuffer(self._mm, np.uint8)
        self._table = self._whole[self._delta:self._delta + src.nbytes].reshape(src.rows, src.row_bytes)

    def _open_ram(self) -> None:
        src = self.source
        t = time.perf_counter()
        base = src.offset // PAGE * PAGE
        span = src.offset - base + src.nbytes
        alloc = -(-span // PAGE) * PAGE
        self._mm = mmap.mmap(-1, alloc)  # anonymous: the rows no longer need the file
        # O_DIRECT in large chunks, a few at a time: 1.0 GB/s here where buffered reads of
        # the same file gave 0.19 GB/s, and the page cache keeps no second copy. Where the
        # file system refuses O_DIRECT the load just reads through the cache, unannounced
        reader = io.PageReader(src.path, depth=4, say=lambda _msg: None)
        try:
            got = reader.read_span(self._mm, base, alloc)
            buffered = not reader.direct
        finally:
            reader.close()
        if got < span:
            raise ValueError(f"{src.path}: the file ends inside the PLE table (byte {base + got} of "
                             f"{src.offset + src.nbytes}); it is truncated")
        if buffered:  # the copy is what the table reads from now: leave the cache to the experts
            io.drop_cache(src.path, base, alloc)
        err = io.mlock(self._mm, alloc)
        self.locked = err == 0
        if not self.locked:
            self._say(f"strata: --ple-io ram: mlock of the PLE table ({gib(src.nbytes)}) refused "
                      f"({os.strerror(err)}); RLIMIT_MEMLOCK is {io.memlock_limit()}. The table "
                      f"stays in RAM unlocked (it can be swapped out). To lock it: `ulimit -l "
                      f"unlimited` in the shell, LimitMEMLOCK=infinity in a systemd unit, or "
                      f"CAP_IPC_LOCK for the process")
        delta = src.offset - base
        self._table = np.frombuffer(self._mm, np.uint8)[delta:delta + src.nbytes].reshape(src.rows, src.row_bytes)
        self.load_s = time.perf_counter() - t

    @classmethod
    def open(cls, path: str | os.PathLike, mode: str = "auto", *, depth: int = 16,
             prefetch: bool = True, tensor: str | None = None, reserve_bytes: int = 0,
             probe_ids: np.ndarray | None = None, say: Callable[[str], None] = io.log) -> PleTable:
        """Open the table in `path` in `mode`; `auto` measures first (see `choose_mode`).
        `reserve_bytes`: memory the rest of the model needs, so that `ram` is tried only
        when the table fits beside it. One line on `say` tells the mode that runs and why."""
        source = find_ple(path, tensor)
        if mode == "auto":
            # here, not at the top: ple_auto measures by opening PleTables of this module
            from strata.storage.ple_auto import choose_mode
            mode, line = choose_mode(source, depth=depth, prefetch=prefetch,
                                     reserve_bytes=reserve_bytes, ids=probe_ids)
        else:
            if mode not in MODES:
                raise ValueError(f"--ple-io {mode!r}: choose one of {', '.join(MODES)} or auto")
            line = f"--ple-io {mode} (given; not measured)"
        table = cls(source, mode, depth=depth, prefetch=prefetch, say=say)
        hints = "hints on" if table.hinting else "no hints"
        lock = ", locked" if table.locked else (", unlocked" if mode == "ram" else "")
        say(f"strata: PLE table {source.describe()}: {line}; {hints}{lock}")
        return table

    # reading

    def _check(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"PLE row ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise IndexError(f"PLE row {bad} is out of range: {self.source.path} tensor "
                             f"{self.source.tensor!r} has {self.rows:,} rows (0..{self.rows - 1:,})")
        return ids

    def read_row(self, i: int) -> np.ndarray:
        """uint8 [row_bytes]: row i as stored."""
        return self.gather(np.array([i])).rows()[0]

    def rows_array(self) -> np.ndarray:
        """The whole table's blocks (rows, row bytes), as held in RAM (ram mode)."""
        if self.mode != "ram":
            raise ValueError(f"the PLE table is opened {self.mode}, not ram: its rows are not all in memory")
        return self._table

    def count_rows(self, n: int) -> None:
        """Rows a kernel gathered from the table in RAM itself (counted as a gather's)."""
        self._count(n, 0, time.perf_counter())

    def gather(self, ids) -> PleRows:
        return self.gather_batch([ids])[0]

    def gather_batch(self, id_arrays: Sequence) -> list[PleRows]:
        """One read for the rows of several id arrays (say, the tokens of a step): direct
        mode reads each page they need once, and every result shares the rows read."""
        arrays = [self._check(a) for a in id_arrays]
        flat = np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0, np.int64)
        t = time.perf_counter()
        if self.mode == "ram":  # resident rows: no pages to find, nothing to read
            out = [PleRows(self._table, a, self.fmt, self.scale, self.row_dim) for a in arrays]
            self._count(flat.size, 0, t)
            return out
        run_first, run_end = io.page_runs(self._delta + flat * self.row_bytes, self.row_bytes)
        if self.mode == "direct":
            table, ids = self._direct_rows(flat, run_first, run_end)
            out, pos = [], 0
            for a in arrays:
                out.append(PleRows(table, ids[pos:pos + a.size].reshape(a.shape), self.fmt, self.scale, self.row_dim))
                pos += a.size
        else:
            if flat.size:
                self._touch(run_first, run_end)
            out = [PleRows(self._table, a, self.fmt, self.scale, self.row_dim) for a in arrays]
        self._count(flat.size, int((run_end - run_first).sum()), t)
        return out

    def _count(self, rows: int, pages: int, t: float) -> None:
        if compiled.warming():  # the background compile's scratch step counts nothing
            return
        c = self._counts
        c["gathers"] += 1
        c["rows"] += int(rows)
        c["distinct_pages"] += pages
        c["gather_s"] += time.perf_counter() - t

    def _touch(self, run_first: np.ndarray, run_end: np.ndarray) -> None:
        """Fault in every page of the runs now, in page order: the I/O happens (and is
        counted) here rather than inside the kernel, which then reads resident rows."""
        sizes = run_end - run_first
        pages = np.repeat(run_first - io.run_positions(run_first, run_end), sizes) + np.arange(sizes.sum())
        int(self._whole[pages * PAGE].sum())  # one byte of each page; the sum keeps the reads

    def _direct_rows(self, flat, run_first, run_end) -> tuple[np.ndarray, np.ndarray]:
        """(rows, ids into them) for `flat`: from reads started by `prefetch` when they
        hold every row, else read now."""
        uniq, inv = np.unique(flat, return_inverse=True)
        for ahead in reversed(self._ahead):
            at = np.searchsorted(ahead.ids, uniq)
            if uniq.size and (at < ahead.ids.size).all() and (ahead.ids[np.minimum(at, ahead.ids.size - 1)] == uniq).all():
                self._counts["gathers_read_ahead"] += 1
                return ahead.rows(), at[inv].astype(np.int64)
        return _RowsRead(self, uniq, run_first, run_end).rows(), inv.astype(np.int64)

    # hints

    def prefetch(self, ids) -> int:
        """Announce the rows a coming step needs: mmap mode hints them (MADV_WILLNEED),
        direct mode starts reading them in the background; ram mode and --no-ple-prefetch
        do nothing. Call it before the step's gather: the whole ubatch for a prefill, the
        next token's rows while the current decode step computes. Returns hints issued."""
        if self.reading_ahead:
            uniq = np.unique(self._check(ids))
            self._ahead.append(_RowsRead(self, uniq))
            self._counts["rows_read_ahead"] += int(uniq.size)
            return 0
        if not self.hinting:
            return 0
        ids = np.asarray(ids)
        # a hint over cached pages starts no read and still costs: 4 µs a range here, and
        # 30% of prefill on ZFS (seeds/000); opt-in prefetch slowed decode where the model
        # fit the page cache (seeds/004). A missed hint costs more: a fault that reads 256
        # KiB around each row, one at a time. So a large step (a prefill's) is hinted unless
        # a sample of its pages is all cached (mincore), and a decode step unless IDLE_HINTS
        # hints in a row started no read (the process read nothing from the drive while
        # giving them): then one step in PROBE_EVERY + 1 is hinted, to see the cache go
        # cold. Without read accounting (no /proc/self/io) every decode step is hinted
        small = ids.size <= SMALL_STEP
        if small and self._idle_hints >= IDLE_HINTS and self._skipped < PROBE_EVERY:
            self._skipped += 1
            self._counts["hints_skipped"] += 1
            return 0
        flat = self._check(ids).ravel()
        run_first, run_end = io.page_runs(self._delta + flat * self.row_bytes, self.row_bytes)
        if not small:
            sample = run_first[np.linspace(0, run_first.size - 1, min(SAMPLE_PAGES, run_first.size)).astype(np.int64)]
            if io.all_cached(self._mm, sample):
                self._counts["hints_skipped"] += 1
                return 0
        self._skipped = 0
        before = io.read_bytes()
        n = io.advise_runs(self._mm, run_first, run_end)
        after = io.read_bytes()
        if small and before is not None and after is not None:
            self._idle_hints = self._idle_hints + 1 if after == before else 0
        self._counts["hints"] += n
        return n

    def stats(self) -> dict:
        """Counters since opening (or the last `reset_stats`), for STRATA_DECODE_TIMING."""
        c = dict(self._counts)
        # /proc/self/io counts the whole process since the last reset: in the engine, expert
        # reads land here too. Read around every call it cost 40 µs a decode step: so here
        now = io.read_bytes()
        c["drive_bytes"] = now - self._read_base if now is not None and self._read_base is not None else None
        c.update(mode=self.mode, locked=self.locked, hinting=self.hinting, reading_ahead=self.reading_ahead,
                 direct=bool(self._reader and self._reader.direct), depth=self.depth,
                 us_per_gather=c["gather_s"] / c["gathers"] * 1e6 if c["gathers"] else 0.0,
                 rows_per_s=c["rows"] / c["gather_s"] if c["gather_s"] else 0.0)
        return c

    def reset_stats(self) -> None:
        for k in self._counts:
            self._counts[k] = 0 if k != "gather_s" else 0.0
        self._read_base = io.read_bytes()

    def close(self) -> None:
        self._table = self._whole = None
        for ahead in self._ahead:  # let no read land in a closed file's buffers
            if ahead.pending is not None:
                ahead.pending.wait()
        self._ahead.clear()
        if self._reader is not None:
            self._reader.close()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # PleRows still point into the table: they keep it alive
                pass
            self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"PleTable({self.source.describe()}, mode={self.mode}, locked={self.locked})"


class _RowsRead:
    """Direct mode: the reads of the sorted distinct rows `ids`, started now; `rows()`
    waits for them and cuts the rows out of the pages read."""

    def __init__(self, table: PleTable, ids: np.ndarray, run_first=None, run_end=None):
        self.ids, self._row_bytes = ids, table.row_bytes
        self._starts = table._delta + ids * table.row_bytes
        if run_first is None:
            run_first, run_end = io.page_runs(self._starts, table.row_bytes)
        self._runs = run_first, run_end
        self.pending = table._reader.start(run_first, run_end) if ids.size else None
        self._rows: np.ndarray | None = None

    def rows(self) -> np.ndarray:
        """uint8 [len(ids), row_bytes]."""
        if self._rows is None:
            if self.pending is None:
                self._rows = np.zeros((0, self._row_bytes), np.uint8)
                return self._rows
            buf = self.pending.result()
            data = np.frombuffer(buf, np.uint8)
            run_first, run_end = self._runs
            # a row's pages are adjacent, so they sit in one run and back to back in the buffer
            page = self._starts // PAGE
            run = np.searchsorted(run_first, page, side="right") - 1
            at = (io.run_positions(run_first, run_end)[run] + page - run_first[run]) * PAGE + self._starts % PAGE
            self._rows = data[at[:, None] + np.arange(self._row_bytes)]  # a copy: the buffer can go
            del data
            buf.close()
        return self._rows
