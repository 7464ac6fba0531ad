"""The I/O machinery of the storage tiers: page arithmetic, hints, mlock, direct reads, and
what the kernel says about a process's reads and a machine's memory.

Linux first: the hints and the O_DIRECT path are what the PLE table's modes are made of,
and the numbers (/proc/self/io, /proc/meminfo, mincore) are what the seeds measured with.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import resource
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from triton_kernels.host_memory import owner

PAGE = mmap.PAGESIZE
# one direct read covers at most this many adjacent pages, so that a long run of pages
# (a prefill's neighbouring rows) still spreads over the pool's threads
MAX_RUN_PAGES = 32
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


# --- pages -------------------------------------------------------------------------------

def page_runs(starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges [start, start + length) -> the pages they touch as sorted, merged runs
    [first, end) of page numbers; adjacent and overlapping runs are joined, so each page
    appears once (a duplicate row costs nothing, a row across a page boundary two pages)."""
    starts = np.asarray(starts, dtype=np.int64).ravel()
    if starts.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty
    if starts.size <= 64:  # a decode step's 16 rows: plain Python beats numpy's call overheads
        firsts, ends = [], []
        for s in sorted(set(starts.tolist())):
            a, b = s // PAGE, (s + length - 1) // PAGE + 1
            if ends and a <= ends[-1]:
                ends[-1] = max(ends[-1], b)
            else:
                firsts.append(a)
                ends.append(b)
        return np.array(firsts, np.int64), np.array(ends, np.int64)
    starts = np.unique(starts)  # sorted, and a row asked for twice counts once
    first = starts // PAGE
    end = (starts + length - 1) // PAGE + 1
    reach = np.maximum.accumulate(end)
    new = np.ones(first.size, bool)
    new[1:] = first[1:] > reach[:-1]  # a gap before this one: a new run starts
    idx = np.flatnonzero(new)
    run_first = first[idx]
    run_end = reach[np.r_[idx[1:] - 1, first.size - 1]]
    return run_first, run_end


def run_positions(run_first: np.ndarray, run_end: np.ndarray) -> np.ndarray:
    """Where each run starts in a buffer holding the runs' pages back to back (in pages)."""
    sizes = run_end - run_first
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)


# --- hints -------------------------------------------------------------------------------

MADV_WILLNEED = 3
MAX_IOV = 1024  # UIO_MAXIOV: ranges one process_madvise call takes
_SYS = {"x86_64": (434, 440), "aarch64": (434, 440)}.get(os.uname().machine)  # pidfd_open, process_madvise
_libc.syscall.restype = ctypes.c_long
_pidfd: tuple[int, int] | None = None  # (pid, pidfd): a forked child must open its own
_batched = _SYS is not None


def _self_pidfd() -> int:
    global _pidfd
    if _pidfd is None or _pidfd[0] != os.getpid():
        fd = _libc.syscall(_SYS[0], os.getpid(), 0)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "pidfd_open")
        _pidfd = (os.getpid(), fd)
    return _pidfd[1]


class _Unbatched(Exception):
    pass


def advise_willneed(mm: mmap.mmap, spans: np.ndarray) -> None:
    """One hint system call: MADV_WILLNEED over `spans` ((k, 2) page-aligned start, length
    in the mapping); the kernel starts reading the pages and returns. Linux 5.10+ takes up
    to 1024 ranges in one process_madvise (for the caller itself without CAP_SYS_NICE since
    6.13); one range is one madvise. Every hint Strata gives goes through here, so that a
    test can count them (the first seed counted madvise calls with a linker wrap, after a
    per-row hint on a locked table cost 30% of prefill on ZFS)."""
    if len(spans) == 1:
        mm.madvise(mmap.MADV_WILLNEED, int(spans[0, 0]), int(spans[0, 1]))
        return
    iov = np.empty((len(spans), 2), np.uint64)
    iov[:, 0] = address(mm) + spans[:, 0]
    iov[:, 1] = spans[:, 1]
    try:
        done = _libc.syscall(_SYS[1], ctypes.c_int(_self_pidfd()), ctypes.c_void_p(iov.ctypes.data),
                             ctypes.c_size_t(len(spans)), ctypes.c_int(MADV_WILLNEED), ctypes.c_uint(0))
    except OSError:  # no pidfd_open
        done = -1
    if done < 0:
        raise _Unbatched


def advise_runs(mm: mmap.mmap, run_first: np.ndarray, run_end: np.ndarray) -> int:
    """Hint merged runs of pages in as few calls as the kernel allows; the starts are page-
    aligned (EINVAL otherwise: a PR measured nothing for a whole run that way, REFERENCE
    §4). Returns the hint calls issued."""
    global _batched
    spans = np.stack([run_first * PAGE, (run_end - run_first) * PAGE], axis=1)
    calls = i = 0
    while i < len(spans):
        per = MAX_IOV if _batched else 1
        try:
            advise_willneed(mm, spans[i:i + per])
        except _Unbatched:  # an older kernel, or a sandbox that refuses it: a range a call
            _batched = False
            continue
        calls += 1
        i += per
    return calls


# --- memory ------------------------------------------------------------------------------

def address(buf: mmap.mmap) -> int:
    return np.frombuffer(buf, np.uint8).ctypes.data


def advise_random(view: np.ndarray) -> bool:
    """MADV_RANDOM over the pages of `view`, a slice of a file's np.memmap: a fault there
    reads its own page, not the readahead window around it (read_ahead_kb: 128 KiB by
    default, 8 MiB on some virtual disks). For a table whose rows are read one at a time
    from the mapping (the token embedding). False where `view` maps no file."""
    base = owner(view)
    mm = getattr(base, "_mmap", None)
    if not isinstance(base, np.memmap) or not isinstance(mm, mmap.mmap) or view.nbytes == 0:
        return False
    start = view.ctypes.data - address(mm)
    first = start // PAGE * PAGE
    mm.madvise(mmap.MADV_RANDOM, first, start + view.nbytes - first)
    return True


def mlock(buf: mmap.mmap, length: int) -> int:
    """Lock a mapping's first `length` bytes in RAM; 0 when it worked, else the errno."""
    if _libc.mlock(address(buf), length) == 0:
        return 0
    return ctypes.get_errno()


def memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,} bytes ({soft / 2**20:.0f} MiB)"


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_io_fd: tuple[int, int] | None = None


def read_bytes() -> int | None:
    """Bytes this process has caused to be fetched from storage (/proc/self/io read_bytes:
    every thread, page-cache hits excluded; None where the kernel does not account I/O).
    Read through a descriptor kept open: opening the file each time costs 20 µs, a
    decode step's whole budget for the counters."""
    global _io_fd
    try:
        if _io_fd is None or _io_fd[0] != os.getpid():
            _io_fd = (os.getpid(), os.open("/proc/self/io", os.O_RDONLY))
        text = os.pread(_io_fd[1], 1024, 0).decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return None


# --- the page cache ----------------------------------------------------------------------

def drop_cache(path: str | os.PathLike, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to drop a file's cached pages (no root needed). Only clean, unmapped
    pages go, and in a container the host may still cache the disk: check with `resident`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages (a file just written) cannot be dropped
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: str | os.PathLike, offset: int = 0, length: int | None = None) -> tuple[int, int]:
    """(pages of the range in the page cache, pages in the range), by mincore."""
    size = os.path.getsize(path)
    length = size - offset if length is None else length
    base = offset // PAGE * PAGE
    span = offset - base + length
    if span <= 0:
        return 0, 0
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), span, access=mmap.ACCESS_READ, offset=base)
    try:
        n = (span + PAGE - 1) // PAGE
        vec = np.zeros(n, np.uint8)
        view = np.frombuffer(mm, np.uint8)
        if _libc.mincore(view.ctypes.data, span, vec.ctypes.data) != 0:
            raise OSError(ctypes.get_errno(), f"mincore on {path}")
        del view
        return int((vec & 1).sum()), n
    finally:
        mm.close()


def all_cached(mm: mmap.mmap, pages: np.ndarray) -> bool:
    """Whether every page of `pages` (page numbers in the mapping) is in memory: one
    mincore a page, so pass a sample."""
    base = address(mm)
    vec = ctypes.c_ubyte()
    for p in pages.tolist():
        if _libc.mincore(base + p * PAGE, PAGE, ctypes.byref(vec)) != 0 or not vec.value & 1:
            return False
    return True


# --- direct reads ------------------------------------------------------------------------

def open_direct(path: str | os.PathLike) -> int:
    """os.open with O_DIRECT; the one place that asks for it, so a test can refuse it."""
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


class PageReader:
    """Reads whole pages of one file into page-aligned buffers, `depth` reads at a time.

    O_DIRECT skips the page cache, so reads cost the drive's random-read time and leave
    the cache to the experts; it needs aligned offsets, lengths and buffers, hence whole
    pages into anonymous mappings (page-aligned; os.pread's bytes objects are not). Where
    the file system refuses O_DIRECT (EINVAL at open or at the first read: tmpfs on older
    kernels, some overlayfs) it says so once and reads through the page cache instead.
    os.preadv releases the GIL, so the pool's threads give a real queue depth."""

    def __init__(self, path: str | os.PathLike, depth: int, *, direct: bool = True, say=log):
        if depth < 1:
            raise ValueError(f"--ple-io-depth must be at least 1, got {depth}")
        self.path, self.depth, self._say = Path(path), depth, say
        self.direct = False
        self.fd = -1
        if direct:
            try:
                self.fd = open_direct(self.path)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._refused("open")
        if self.fd < 0:
            self._open_buffered()
        self.size = os.fstat(self.fd).st_size
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="strata-ple-io")
        self._lock = threading.Lock()

    def _open_buffered(self) -> None:
        self.fd = os.open(self.path, os.O_RDONLY)
        # the reads are random: readahead would fetch neighbours nobody asked for
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def _refused(self, where: str) -> None:
        self._say(f"strata: {self.path}: the file system refuses O_DIRECT (EINVAL at {where}); "
                  f"--ple-io direct reads through the page cache instead (buffered pread). "
                  f"Put the table on a disk file system (ext4, xfs) for direct reads, or use "
                  f"--ple-io mmap")

    def _fallback(self, fd: int) -> None:
        with self._lock:
            if self.fd == fd and self.direct:  # the first thread to hit EINVAL switches
                self.direct = False
                os.close(fd)
                self._open_buffered()
                self._refused("read")

    def _read(self, view: memoryview, offset: int) -> int:
        done = 0
        while done < len(view):
            fd = self.fd
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._fallback(fd)
                continue
            done += n
            if n == 0 or offset + done >= self.size:  # the file's last page is short
                break
        return done

    def _read_all(self, jobs) -> int:
        return sum(self._read(view, off) for view, off in jobs)

    def start(self, run_first: np.ndarray, run_end: np.ndarray) -> PendingRead:
        """Start reading runs of pages into one buffer, back to back in run order; returns
        at once (`PendingRead.result()` waits for the buffer)."""
        n_pages = int((run_end - run_first).sum())
        buf = mmap.mmap(-1, max(n_pages, 1) * PAGE)
        mv = memoryview(buf)
        jobs = []
        pos = 0
        for a, b in zip(run_first.tolist(), run_end.tolist()):
            for c in range(a, b, MAX_RUN_PAGES):
                d = min(b, c + MAX_RUN_PAGES)
                jobs.append((mv[pos * PAGE:(pos + d - c) * PAGE], c * PAGE))
                pos += d - c
        return PendingRead(buf, mv, jobs, self._submit(jobs))

    def read_runs(self, run_first: np.ndarray, run_end: np.ndarray) -> mmap.mmap:
        return self.start(run_first, run_end).result()

    def read_span(self, buf: mmap.mmap, offset: int, length: int, chunk: int = 8 << 20) -> int:
        """Read [offset, offset + length) of the file (page-aligned offset) into the start of
        `buf` (page-aligned) in `chunk`-byte reads, `depth` at a time; returns bytes read
        (less than `length` only at the end of the file)."""
        mv = memoryview(buf)
        jobs = [(mv[i:min(i + chunk, length)], offset + i) for i in range(0, length, chunk)]
        return PendingRead(buf, mv, jobs, self._submit(jobs)).wait()

    def _submit(self, jobs) -> list:
        # one task per thread over an interleaved share of the reads, not one per read:
        # a future costs tens of µs of Python, a 4 KiB read about a hundred
        w = max(1, min(self.depth, len(jobs)))
        return [self._pool.submit(self._read_all, jobs[i::w]) for i in range(w)]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PendingRead:
    """Reads in flight on a PageReader's threads, into one page-aligned buffer."""

    def __init__(self, buf: mmap.mmap, mv: memoryview, jobs: list, futures: list):
        self.buf, self._mv, self._jobs, self._futures = buf, mv, jobs, futures
        self._done: int | None = None

    def wait(self) -> int:
        """Bytes read, once every read has finished."""
        if self._done is None:
            try:
                self._done = sum(f.result() for f in self._futures)
            finally:
                for view, _ in self._jobs:
                    view.release()
                self._mv.release()
                self._jobs = []
        return self._done

    def result(self) -> mmap.mmap:
        self.wait()
        return self.buf
