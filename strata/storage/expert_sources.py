"""Where a stacked expert tensor's bytes are, and the sources that fetch some experts' raw
blocks: host RAM (`HostSource`), the GGUF in place (`FileSource`) or a pack
(`PackedSource`), the latter two through a shared `SpanReader` (`--experts-io direct`:
O_DIRECT reads of whole pages by a thread pool; `mmap`: one batched MADV_WILLNEED over the
experts' pages, then a copy), as the PLE table reads (strata.storage.io). `read_host`
reads tensors once into anonymous memory for the host tier.
"""
from __future__ import annotations

import mmap
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from strata.storage import io
from strata.storage.expert_tier import IO_MODES
from strata.storage.io import PAGE
from strata.tensors import QTensor
from triton_kernels import layout
from triton_kernels.backend import faking
from triton_kernels.host_memory import lock, owner, pinned

if TYPE_CHECKING:  # only annotations name Pack; strata.storage.pack imports tensor_file from here
    from strata.storage.pack import Pack


# --- where a tensor's bytes are ----------------------------------------------------------

def tensor_file(t: QTensor) -> tuple[Path, int]:
    """(file, byte offset) of a tensor opened from a GGUF: its data is a view of the
    reader's np.memmap, whose address maps to the file's offset `memmap.offset`."""
    x = owner(t.data)
    if not isinstance(x, np.memmap) or x.filename is None:
        raise ValueError(f"tensor {t.name!r} is not a view of a file (built in memory?): the host, "
                         f"packed and file expert tiers read it from its GGUF; open the model with "
                         f"strata.gguf.open_gguf, or use --experts device")
    return Path(x.filename), t.data.ctypes.data - x.ctypes.data + x.offset


def in_file(t: QTensor) -> bool:
    """Whether `t`'s blocks are a view of a GGUF file's mapping (not made in memory)."""
    try:
        tensor_file(t)
    except ValueError:
        return False
    return True


class SpanReader:
    """Equal-length byte spans of one file, read in one batch: `direct` by a PageReader
    (O_DIRECT pages at `depth`, each page once), `mmap` by one batched MADV_WILLNEED over
    the spans' pages and a copy. Shared by every store reading the same file (`reader`):
    48 layers with a pool each would be 768 threads."""

    def __init__(self, path: Path, mode: str, depth: int):
        if mode not in IO_MODES:
            raise ValueError(f"--experts-io {mode!r}: choose {' or '.join(IO_MODES)}")
        self.path, self.mode = path, mode
        self._pr: io.PageReader | None = None
        self._mm: mmap.mmap | None = None
        if mode == "direct":
            self._pr = io.PageReader(path, depth, say=lambda _msg: io.log(
                f"strata: {path}: the file system refuses O_DIRECT; --experts-io direct reads through the "
                f"page cache instead (buffered pread). Put the model on a disk file system (ext4, xfs) for "
                f"direct reads, or use --experts-io mmap"))
        else:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._whole = np.frombuffer(self._mm, np.uint8)

    @property
    def direct(self) -> bool:
        return bool(self._pr and self._pr.direct)

    def start(self, starts: np.ndarray, length: int):
        """Start reading [s, s + length) for each s; returns a function that waits and gives
        uint8 [len(starts), length] (a copy: the read buffers go)."""
        starts = np.asarray(starts, np.int64)
        if starts.size == 0:
            return lambda: np.zeros((0, length), np.uint8)
        run_first, run_end = io.page_runs(starts, length)
        if self._pr is None:
            io.advise_runs(self._mm, run_first, run_end)
            return lambda: np.stack([self._whole[s:s + length] for s in starts.tolist()])
        pending = self._pr.start(run_first, run_end)

        def done() -> np.ndarray:
            buf = pending.result()
            data = np.frombuffer(buf, np.uint8)
            # a span's pages are adjacent, so they sit in one run and back to back in the buffer
            page = starts // PAGE
            run = np.searchsorted(run_first, page, side="right") - 1
            at = (io.run_positions(run_first, run_end)[run] + page - run_first[run]) * PAGE + starts % PAGE
            out = np.empty((starts.size, length), np.uint8)
            for i, a in enumerate(at.tolist()):
                out[i] = data[a:a + length]
            del data
            buf.close()
            return out
        return done


_readers: dict[tuple, SpanReader] = {}
_readers_lock = threading.Lock()


def reader(path: Path, mode: str, depth: int) -> SpanReader:
    key = (str(Path(path).resolve()), mode, depth)
    with _readers_lock:
        if key not in _readers:
            _readers[key] = SpanReader(Path(path), mode, depth)
        return _readers[key]


# --- sources: where fetched experts come from --------------------------------------------

class Source:
    """Gives the raw blocks of some experts: uint8 CPU tensors (n, rows, row_bytes), one
    for each of gate, up, down."""
    shapes: tuple  # ((rows, row_bytes) of gate, up, down)

    def fetch(self, experts: list[int]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class HostSource(Source):
    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.tensors = tensors
        self.shapes = tuple(tuple(t.shape[1:]) for t in tensors)

    def fetch(self, experts):
        idx = torch.as_tensor(experts, dtype=torch.long)
        return tuple(t.index_select(0, idx) for t in self.tensors)

    def fetch_to(self, experts: list[int], device) -> tuple[torch.Tensor, ...]:
        """fetch's blocks made on `device` straight from the host tensors, a run of
        consecutive experts one asynchronous copy: `fetch` gathers into a new pageable
        tensor, whose copy to a GPU waits for it and moves through the driver's staging
        buffers, where the (pinned) host tensors copy at the PCIe rate, the host free."""
        out = tuple(torch.empty((len(experts), *t.shape[1:]), dtype=t.dtype, device=device) for t in self.tensors)
        i = 0
        while i < len(experts):
            j = i + 1
            while j < len(experts) and experts[j] == experts[j - 1] + 1:
                j += 1
            for o, t in zip(out, self.tensors):
                o[i:j].copy_(t[experts[i]:experts[i] + j - i], non_blocking=True)
            i = j
        return out

    def describe(self) -> str:
        return "host RAM"


class FileSource(Source):
    """Experts read in place from the GGUF: expert e of a tensor at offset + e * bytes."""

    def __init__(self, ts: tuple[QTensor, ...], mode: str, depth: int):
        self.where = [tensor_file(t) for t in ts]
        self.shapes = tuple(slab_shape(t) for t in ts)
        self.bytes = [rows * rb for rows, rb in self.shapes]
        self.readers = [reader(p, mode, depth) for p, _ in self.where]

    def fetch(self, experts):
        e = np.asarray(experts, np.int64)
        # the three tensors' reads start together, so they share the pool's queue depth
        waits = [r.start(off + e * n, n) for r, (_, off), n in zip(self.readers, self.where, self.bytes)]
        return tuple(torch.from_numpy(w().reshape(len(e), *shape)) for w, shape in zip(waits, self.shapes))

    def describe(self) -> str:
        r = self.readers[0]
        how = f"O_DIRECT at depth {r._pr.depth}" if r.direct else (
            "buffered pread (O_DIRECT refused)" if r.mode == "direct" else "mmap + MADV_WILLNEED")
        return f"{self.where[0][0].name} in place ({how})"


class PackedSource(Source):
    """Experts from experts.bin: gate, up, down of one expert adjacent, so one read each."""

    def __init__(self, ts: tuple[QTensor, ...], pack: Pack, mode: str, depth: int, first: int = 0):
        """`first`: the pack's expert that this source's expert 0 is (a rank's share)."""
        entries = [pack.entry(t) for t in ts]
        self.shapes = tuple(slab_shape(t) for t in ts)
        self.bytes = [rows * rb for rows, rb in self.shapes]
        g = entries[0]
        for ent, before in zip(entries[1:], np.cumsum(self.bytes)[:-1].tolist()):
            if ent.packed_offset != g.packed_offset + before or ent.stride != g.stride:
                raise ValueError(f"{pack.index}: {ent.name} is not adjacent to {g.name} in {pack.bin.name}; "
                                 f"the pack is not one this Strata wrote: run `strata pack` again")
        self.base, self.stride, self.span = g.packed_offset + first * g.stride, g.stride, sum(self.bytes)
        self.reader = reader(pack.bin, mode, depth)
        self.pack = pack

    def fetch(self, experts):
        e = np.asarray(experts, np.int64)
        raw = self.reader.start(self.base + e * self.stride, self.span)()
        out, at = [], 0
        for n, shape in zip(self.bytes, self.shapes):
            out.append(torch.from_numpy(np.ascontiguousarray(raw[:, at:at + n]).reshape(len(e), *shape)))
            at += n
        return tuple(out)

    def describe(self) -> str:
        how = f"O_DIRECT at depth {self.reader._pr.depth}" if self.reader.direct else (
            "buffered pread (O_DIRECT refused)" if self.reader.mode == "direct" else "mmap + MADV_WILLNEED")
        return f"{self.pack.bin} ({how})"


def slab_shape(t: QTensor) -> tuple[int, int]:
    e = t.shape[0]
    return t.data.shape[0] // e, t.data.shape[-1]


def slabs(t: QTensor) -> torch.Tensor:
    """(E, rows, row_bytes) uint8 view of a stacked expert tensor."""
    import warnings
    with warnings.catch_warnings():  # a read-only mapping: nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(t.data).reshape(t.shape[0], *slab_shape(t))


def read_host(ts: tuple[QTensor, ...], pin: bool, fmts=None) -> tuple[torch.Tensor, ...]:
    """The tensors' blocks read once into anonymous memory: O_DIRECT where the file system
    allows (the page cache keeps no second copy), else a copy of the mapping; blocks made
    in memory (strata.gguf.MemoryGGUF) are taken as they are. `fmts`: the formats the
    blocks are held in; a device layout's (triton_kernels.layout) are repacked into a copy,
    so that a GPU's kernels read them in place. `pin`: page-locked for a GPU to read
    (triton_kernels.host_memory): blocks read from the file locked where they were read,
    the others copied into pages of their own."""
    out = []
    for t, held in zip(ts, fmts or [t.fmt for t in ts]):
        own = False  # the blocks lie in pages of their own, which `lock` takes as they are
        try:
            path, offset = tensor_file(t)
        except ValueError:
            writable = t.data.flags.writeable and t.data.flags.c_contiguous
            host = torch.from_numpy(t.data if writable else np.array(t.data))
        else:
            base = offset // PAGE * PAGE
            span = offset - base + t.nbytes
            buf = mmap.mmap(-1, -(-span // PAGE) * PAGE)
            r = io.PageReader(path, depth=4, say=lambda _msg: None)
            try:
                got = r.read_span(buf, base, len(buf))
            finally:
                r.close()
            if got < span:
                raise ValueError(f"{path}: the file ends inside tensor {t.name!r}; it is truncated")
            blocks = np.frombuffer(buf, np.uint8)[offset - base:offset - base + t.nbytes]
            own = held.layout == t.fmt.layout and pin and lock(blocks)
            host = torch.from_numpy(blocks)
        host = host.reshape(t.shape[0], *slab_shape(t))
        if held.layout != t.fmt.layout and not faking():  # (a trace's blocks are zeros: nothing to move)
            host = layout.pack(host, t.fmt)
        out.append(pinned(host) if pin and not own else host)
    return tuple(out)
