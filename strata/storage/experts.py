"""Where the routed experts' weights live, and the matmuls over them.

A layer's experts are three GGUF tensors: gate and up (E, I, H) and down (E, H, I), each
a run of E equal slabs of quantized rows. The store of one layer answers
`store(x, weights, ids)`: the routed experts' SwiGLU outputs, weighted and summed per
token. Tiers (`--experts`, parsed by `parse_tier`):

- `dense`: dequantized once into the compute dtype (CPU, while the model's DenseBudget
  lasts); a matmul per routed expert.
- `device` (alias `blocks`): the raw blocks resident where the model computes: copied to
  the device on CUDA; on the CPU zero-copy views of the mapped GGUF (the page cache keeps
  them in RAM). The fused MoE kernel (triton_kernels.moe) on CUDA, `moe_torch` on the CPU.
- `host`: the raw blocks read once from the file into host RAM (anonymous memory, so the
  page cache keeps no second copy; pinned on CUDA). On the CPU the matmul runs on them in
  place; on CUDA each call copies the experts the batch routes to onto the device.
- `cache:N[:host|packed|file]`: N expert slots on the device, least recently used out
  first, filled from the tier named last (default `host`). Hits and misses are counted;
  a batch that routes to more than N experts runs in groups of N (see `_grouped`).
- `packed`: `experts.bin` written by `strata pack` (`pack`): per layer, expert after
  expert, each expert's gate, up and down blocks adjacent, so one expert is one read; a
  text index beside it records where each tensor came from in the GGUF.
- `file`: read in place from the GGUF, three reads an expert.

`packed` and `file` read through strata.storage.io as the PLE table does (`--experts-io
direct`: O_DIRECT reads of whole pages by a thread pool; `mmap`: one batched
MADV_WILLNEED over the experts' pages, then a copy). Every tier that fetches hands the
matmul the compact set of experts a batch needs, with ids remapped into it, so its output
equals the resident tier's bit for bit: the same bytes meet the same kernel, in the same
tiles (see `ExpertStore._moe`).
"""
from __future__ import annotations

import argparse
import collections
import mmap
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from strata.nn.linear import DenseBudget
from strata.storage import io
from strata.storage.io import PAGE
from strata.tensors import QTensor
from triton_kernels.backend import choose_kernels
from triton_kernels.moe import choose_path
from triton_kernels.ops import impl

KINDS = ("dense", "device", "host", "cache", "packed", "file")
BACKINGS = ("host", "packed", "file")
IO_MODES = ("direct", "mmap")
PACK_BIN, PACK_INDEX = "experts.bin", "experts.txt"
PACK_ALIGN = PAGE  # each expert starts on a page: a direct read of one expert wastes no page
EXPERT_TENSORS = ("gate", "up", "down")
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


# --- the --experts flag ------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertTier:
    """A parsed `--experts` spec: `kind` one of KINDS; a cache has `slots` and `backing`."""
    kind: str
    slots: int = 0
    backing: str = ""

    def __str__(self) -> str:
        return f"cache:{self.slots}:{self.backing}" if self.kind == "cache" else self.kind


def parse_tier(spec: str, flag: str = "--experts") -> ExpertTier:
    """`device|host|cache:N[:host|packed|file]|packed|file` (and `dense`, `blocks` = device)."""
    text = spec.strip().lower()
    if text == "blocks":
        return ExpertTier("device")
    if text in KINDS and text != "cache":
        return ExpertTier(text)
    parts = text.split(":")
    if parts[0] == "cache" and len(parts) in (2, 3):
        backing = parts[2] if len(parts) == 3 else "host"
        if parts[1].isdigit() and int(parts[1]) > 0 and backing in BACKINGS:
            return ExpertTier("cache", int(parts[1]), backing)
    raise ValueError(f"{flag} {spec!r}: expected device, host, packed, file or cache:N[:host|packed|file] "
                     f"with N the number of expert slots (at least 1), e.g. cache:64:file")


def _tier_arg(text: str) -> str:
    try:
        parse_tier(text)
    except ValueError as e:  # argparse prints an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_expert_args(p: argparse.ArgumentParser) -> None:
    """The expert tier's flags, for every command that loads a MoE model
    (`store_kwargs(args)` turns them into ExpertStore's keyword arguments)."""
    p.add_argument("--experts", type=_tier_arg, default=None, metavar="TIER",
                   help="where routed experts live: device (resident), host (RAM; pinned on CUDA), "
                        "cache:N[:host|packed|file] (N slots on the device, LRU), packed (experts.bin "
                        "of `strata pack`), file (read in place from the GGUF). Default: dense on the "
                        "CPU while memory lasts, else device")
    p.add_argument("--experts-dir", default=None, metavar="DIR",
                   help="the directory `strata pack --out` wrote experts.bin and experts.txt to "
                        "(default: packs/<model> in the Strata cache)")
    p.add_argument("--experts-io", choices=IO_MODES, default="direct",
                   help="how packed and file tiers read: direct (O_DIRECT, thread pool; default) or "
                        "mmap (page cache, one batched MADV_WILLNEED a fetch)")
    p.add_argument("--experts-io-depth", type=int, default=16, metavar="N",
                   help="direct reads in flight (threads) for --experts-io direct (default 16)")


def store_kwargs(args) -> dict:
    """ExpertStore keyword arguments from `add_expert_args`' flags."""
    return {"tier": args.experts, "experts_dir": args.experts_dir, "io_mode": args.experts_io,
            "depth": args.experts_io_depth}


# --- where a tensor's bytes are ----------------------------------------------------------

def tensor_file(t: QTensor) -> tuple[Path, int]:
    """(file, byte offset) of a tensor opened from a GGUF: its data is a view of the
    reader's np.memmap, whose address maps to the file's offset `memmap.offset`."""
    x = t.data
    while isinstance(x.base, np.ndarray):
        x = x.base
    if not isinstance(x, np.memmap) or x.filename is None:
        raise ValueError(f"tensor {t.name!r} is not a view of a file (built in memory?): the host, "
                         f"packed and file expert tiers read it from its GGUF; open the model with "
                         f"strata.gguf.open_gguf, or use --experts device")
    return Path(x.filename), t.data.ctypes.data - x.ctypes.data + x.offset


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

class _Source:
    """Gives the raw blocks of some experts: uint8 CPU tensors (n, rows, row_bytes), one
    for each of gate, up, down."""
    shapes: tuple  # ((rows, row_bytes) of gate, up, down)

    def fetch(self, experts: list[int]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class _HostSource(_Source):
    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.tensors = tensors
        self.shapes = tuple(tuple(t.shape[1:]) for t in tensors)

    def fetch(self, experts):
        idx = torch.as_tensor(experts, dtype=torch.long)
        return tuple(t.index_select(0, idx) for t in self.tensors)

    def describe(self) -> str:
        return "host RAM"


class _FileSource(_Source):
    """Experts read in place from the GGUF: expert e of a tensor at offset + e * bytes."""

    def __init__(self, ts: tuple[QTensor, ...], mode: str, depth: int):
        self.where = [tensor_file(t) for t in ts]
        self.shapes = tuple(_slab_shape(t) for t in ts)
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


class _PackedSource(_Source):
    """Experts from experts.bin: gate, up, down of one expert adjacent, so one read each."""

    def __init__(self, ts: tuple[QTensor, ...], pack: Pack, mode: str, depth: int):
        entries = [pack.entry(t) for t in ts]
        self.shapes = tuple(_slab_shape(t) for t in ts)
        self.bytes = [rows * rb for rows, rb in self.shapes]
        g = entries[0]
        for ent, before in zip(entries[1:], np.cumsum(self.bytes)[:-1].tolist()):
            if ent.packed_offset != g.packed_offset + before or ent.stride != g.stride:
                raise ValueError(f"{pack.index}: {ent.name} is not adjacent to {g.name} in {PACK_BIN}; "
                                 f"the pack is not one this Strata wrote: run `strata pack` again")
        self.base, self.stride, self.span = g.packed_offset, g.stride, sum(self.bytes)
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


def _slab_shape(t: QTensor) -> tuple[int, int]:
    e = t.shape[0]
    return t.data.shape[0] // e, t.data.shape[-1]


def _slabs(t: QTensor) -> torch.Tensor:
    """(E, rows, row_bytes) uint8 view of a stacked expert tensor."""
    import warnings
    with warnings.catch_warnings():  # a read-only mapping: nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(t.data).reshape(t.shape[0], *_slab_shape(t))


def _read_host(ts: tuple[QTensor, ...], pin: bool) -> tuple[torch.Tensor, ...]:
    """The tensors' blocks read once into anonymous memory: O_DIRECT where the file system
    allows (the page cache keeps no second copy), else a copy of the mapping."""
    out = []
    for t in ts:
        try:
            path, offset = tensor_file(t)
        except ValueError:
            host = torch.from_numpy(np.array(t.data))
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
            host = torch.from_numpy(np.frombuffer(buf, np.uint8)[offset - base:offset - base + t.nbytes])
        host = host.reshape(t.shape[0], *_slab_shape(t))
        out.append(host.pin_memory() if pin else host)
    return tuple(out)


# --- the store ---------------------------------------------------------------------------

class ExpertStore(torch.nn.Module):
    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, dtype=torch.float32, device="cpu",
                 budget: DenseBudget | None = None, tier: str | ExpertTier | None = None, *,
                 experts_dir: str | os.PathLike | None = None, io_mode: str = "direct", depth: int = 16,
                 kernels: str | None = None):
        """`tier`: a `--experts` spec (see `parse_tier`), or None: dense on the CPU while
        `budget` lasts, else device. `experts_dir`: where `strata pack` wrote the pack
        (packed tiers; default `default_pack_dir` of the GGUF). `io_mode`, `depth`: how
        packed and file tiers read (`--experts-io`, `--experts-io-depth`). `kernels`: "triton"
        (the MoE kernels) or "torch" (None: the device's default, see
        triton_kernels.backend.choose_kernels)."""
        super().__init__()
        self.kernels = choose_kernels(kernels, device)
        self.names = (gate.name, up.name, down.name)
        self.fmts = (gate.fmt, up.fmt, down.fmt)
        self.n_experts, self.inter, self.hidden = gate.shape
        self.dtype, self.device = dtype, device
        on_cpu = torch.device(device).type == "cpu"
        dense_bytes = 3 * self.n_experts * self.inter * self.hidden * torch.finfo(dtype).bits // 8
        if tier is None:
            dense = on_cpu and self.kernels == "torch"  # the MoE kernels take blocks
            tier = "dense" if dense and (budget or DenseBudget()).take(dense_bytes) else "blocks"
        spec = tier if isinstance(tier, ExpertTier) else parse_tier(tier)
        self.spec = spec
        # `tier` is what the plan line counts: "blocks" (the default's name) stays "blocks"
        self.tier = "blocks" if tier == "blocks" else str(spec)
        self.hits = torch.zeros(self.n_experts, dtype=torch.long)  # tokens routed to each expert
        self._counts = {"calls": 0, "experts": 0, "hits": 0, "misses": 0, "evictions": 0,
                        "bytes": 0, "fetch_s": 0.0}
        self.expert_bytes = gate.nbytes // self.n_experts + up.nbytes // self.n_experts + down.nbytes // self.n_experts
        self.source: _Source | None = None
        self.compact = False  # fetch what a batch needs, then compute on that compact set
        ts = (gate, up, down)
        kind = spec.kind
        if kind == "dense":
            # gate and up stacked: one matmul gives both halves
            self.w13 = torch.cat([gate.dequantize(dtype), up.dequantize(dtype)], dim=1)
            self.w2 = down.dequantize(dtype)
        elif kind == "device":
            self.wg, self.wu, self.wd = (_slabs(t).to(device) for t in ts)
        elif kind == "host":
            host = _read_host(ts, pin=not on_cpu)
            if on_cpu:
                self.wg, self.wu, self.wd = host
            else:
                self.source, self.compact = _HostSource(host), True
        else:
            backing = spec.backing if kind == "cache" else kind
            if backing == "host":
                self.source = _HostSource(_read_host(ts, pin=not on_cpu))
            elif backing == "packed":
                where = experts_dir or default_pack_dir(tensor_file(gate)[0])
                self.source = _PackedSource(ts, Pack.open(where), io_mode, depth)
            else:
                self.source = _FileSource(ts, io_mode, depth)
            if kind == "cache":
                n = min(spec.slots, self.n_experts)
                self.slots = n
                self.wg, self.wu, self.wd = (torch.empty((n, *_slab_shape(t)), dtype=torch.uint8, device=device)
                                             for t in ts)
                self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # expert -> slot
                self._free = list(range(n))
            else:
                self.compact = True

    # what it holds and has done

    def held_bytes(self) -> int:
        if self.spec.kind == "dense":
            ts = (self.w13, self.w2)
        elif hasattr(self, "wg"):
            ts = (self.wg, self.wu, self.wd)
        else:
            ts = self.source.tensors if isinstance(self.source, _HostSource) else ()
        return sum(t.numel() * t.element_size() for t in ts)

    def describe(self) -> str:
        if self.spec.kind == "cache":
            return f"{self.tier} ({self.slots} slots on {self.device}, misses from {self.source.describe()})"
        if self.source is not None:
            return f"{self.tier} ({self.source.describe()})"
        return self.tier

    def cache_order(self) -> list[int]:
        """Cached experts, least recently used first (cache tier; empty otherwise)."""
        return list(self._lru) if self.spec.kind == "cache" else []

    def stats(self) -> dict:
        """Counters since construction (or `reset_stats`): calls, experts asked for, hits,
        misses (fetched), evictions, bytes fetched and seconds fetching."""
        c = dict(self._counts)
        asked = c["hits"] + c["misses"]
        c.update(tier=self.tier, hit_rate=c["hits"] / asked if asked else None,
                 gb_per_s=c["bytes"] / c["fetch_s"] / 1e9 if c["fetch_s"] else None)
        return c

    def reset_stats(self) -> None:
        for k in self._counts:
            self._counts[k] = 0.0 if k == "fetch_s" else 0

    # running

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long().cpu()
        kept = flat[flat >= 0]
        self.hits += torch.bincount(kept, minlength=self.n_experts)
        self._counts["calls"] += 1
        if self.spec.kind == "dense":
            return self._dense(x, weights, ids)
        needed = torch.unique(kept)  # sorted: the compact set keeps the experts' order
        self._counts["experts"] += needed.numel()
        if self.spec.kind == "cache":
            return self._cached(x, weights, ids, flat, needed.tolist())
        if not self.compact:  # resident: every expert a hit
            self._counts["hits"] += needed.numel()
            return self._moe(x, self.wg, self.wu, self.wd, weights, ids)
        ws = self._fetch(needed.tolist())
        self._counts["misses"] += needed.numel()
        lut = torch.full((self.n_experts,), -1, dtype=torch.long)
        lut[needed] = torch.arange(needed.numel())
        return self._moe(x, *ws, weights, self._remap(lut, ids, flat))

    def _remap(self, lut: torch.Tensor, ids: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        # -1 (an expert held elsewhere) stays -1: the MoE drops it
        out = torch.where(flat >= 0, lut[flat.clamp(min=0)], -1)
        return out.reshape(ids.shape).to(device=ids.device, dtype=ids.dtype)

    def _moe(self, x, wg, wu, wd, weights, ids, n_slots: int | None = None,
             tokens: int | None = None) -> torch.Tensor:
        if self.kernels == "torch":
            return impl("moe", "torch")(x, wg, wu, wd, *self.fmts, weights, ids).float()
        # the path and tiles of the resident call (all E experts, the batch's T tokens and
        # T * k slots), so that a compact set or a group runs the kernels' arithmetic and
        # blocks exactly as the resident tier does
        slots = ids.numel() if n_slots is None else n_slots
        path = choose_path(*self.fmts, x.shape[0] if tokens is None else tokens)
        return impl("moe", "triton")(x, wg, wu, wd, *self.fmts, weights, ids, path=path,
                                     tile_slots=slots).float()

    def _fetch(self, experts: list[int]) -> tuple[torch.Tensor, ...]:
        t = time.perf_counter()
        ws = self.source.fetch(experts)
        ws = tuple(w.to(self.device, non_blocking=True) for w in ws)
        self._counts["fetch_s"] += time.perf_counter() - t
        self._counts["bytes"] += len(experts) * self.expert_bytes
        return ws

    def _ensure(self, experts: list[int]) -> None:
        """Make every expert of `experts` (at most `slots`) resident in a slot: hits move to
        the recent end; misses take free slots, then the least recently used ones."""
        lru, want = self._lru, set(experts)
        misses = []
        for e in experts:
            if e in lru:
                lru.move_to_end(e)
                self._counts["hits"] += 1
            else:
                misses.append(e)
        if not misses:
            return
        slots = []
        for _ in misses:
            if self._free:
                slots.append(self._free.pop(0))
                continue
            old = next(e for e in lru if e not in want)  # hits are at the recent end
            slots.append(lru.pop(old))
            self._counts["evictions"] += 1
        g, u, d = self._fetch(misses)
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.wg.device)
        for dst, src in ((self.wg, g), (self.wu, u), (self.wd, d)):
            dst.index_copy_(0, idx, src)
        for e, s in zip(misses, slots):
            lru[e] = s
        self._counts["misses"] += len(misses)

    def _cached(self, x, weights, ids, flat, needed: list[int]) -> torch.Tensor:
        if len(needed) <= self.slots:
            self._ensure(needed)
            return self._moe(x, self.wg, self.wu, self.wd, weights, self._remap(self._lut(), ids, flat))
        return self._grouped(x, weights, ids, flat, needed)

    def _lut(self) -> torch.Tensor:
        lut = torch.full((self.n_experts,), -1, dtype=torch.long)
        if self._lru:
            lut[list(self._lru)] = torch.tensor(list(self._lru.values()))
        return lut

    def _grouped(self, x, weights, ids, flat, needed: list[int]) -> torch.Tensor:
        """More experts than slots: the experts in groups of `slots`, each group's token
        choices run as tokens of their own (k = 1, whose sum over one choice is exact), each
        choice's output written to its place; then the choices are summed per token in the
        resident tier's order, so the result is the same bit for bit."""
        T, k = ids.shape
        per_slot = torch.zeros((T * k, self.hidden), dtype=torch.float32, device=x.device)
        w = weights.reshape(-1)
        for i in range(0, len(needed), self.slots):
            group = needed[i:i + self.slots]
            self._ensure(group)
            sel = torch.isin(flat, torch.tensor(group)).nonzero().squeeze(1)
            ids1 = self._lut()[flat[sel]].reshape(-1, 1).to(device=ids.device, dtype=ids.dtype)
            sel_d = sel.to(x.device)
            per_slot[sel_d] = self._moe(x[sel_d // k], self.wg, self.wu, self.wd, w[sel_d].reshape(-1, 1),
                                        ids1, n_slots=T * k, tokens=T)
        return per_slot.view(T, k, self.hidden).sum(dim=1)

    def _dense(self, x, weights, ids) -> torch.Tensor:
        T, k = ids.shape
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        xd = x.to(self.dtype)
        out = torch.zeros(T, self.hidden, dtype=torch.float32, device=x.device)
        w = weights.reshape(-1)
        at = 0
        # experts in increasing id order, each over its tokens (as transformers' loop)
        for e in np.nonzero(counts)[0].tolist():
            slots = order[at:at + counts[e]]
            at += counts[e]
            rows = slots // k
            g, u = (xd[rows] @ self.w13[e].T).float().chunk(2, dim=-1)
            y = (F.silu(g) * u).to(self.dtype) @ self.w2[e].T
            # a token meets each expert once, so rows are distinct: a plain indexed add
            # (index_add_ spins up threads for a few rows; this is 100x cheaper on a busy CPU)
            out[rows] += y.float() * w[slots, None]
        return out


# --- counters over a model ---------------------------------------------------------------

def summarize(stores) -> dict:
    """The counters of several stores (a model's layers) added up, per tier."""
    total = {"calls": 0, "experts": 0, "hits": 0, "misses": 0, "evictions": 0, "bytes": 0, "fetch_s": 0.0}
    tiers = collections.Counter()
    for s in stores:
        c = s.stats()
        tiers[c["tier"]] += 1
        for k in total:
            total[k] += c[k]
    asked = total["hits"] + total["misses"]
    total.update(tiers=dict(tiers), hit_rate=total["hits"] / asked if asked else None,
                 gb_per_s=total["bytes"] / total["fetch_s"] / 1e9 if total["fetch_s"] else None)
    return total


def stats_line(stores) -> str:
    """One line of expert counters for STRATA_DECODE_TIMING=1."""
    c = summarize(stores)
    tiers = ", ".join(f"{t} x{n}" for t, n in c["tiers"].items())
    rate = "-" if c["hit_rate"] is None else f"{c['hit_rate']:.1%}"
    speed = f" ({c['gb_per_s']:.2f} GB/s)" if c["gb_per_s"] else ""
    return (f"experts [{tiers}]: {c['hits']:,} hits, {c['misses']:,} misses (hit rate {rate}), "
            f"{c['evictions']:,} evictions, {c['bytes'] / 1e9:.3f} GB fetched in {c['fetch_s']:.3f} s{speed}")


# --- the pack ----------------------------------------------------------------------------

def default_pack_dir(gguf: str | os.PathLike) -> Path:
    """Where `strata pack` writes without --out: packs/<file stem> in the Strata cache."""
    from strata.hub import cache_dir
    return cache_dir() / "packs" / Path(gguf).name.removesuffix(".gguf")


@dataclass(frozen=True)
class PackEntry:
    layer: int
    tensor: str  # gate, up or down
    name: str
    fmt: str
    shape: tuple[int, ...]
    gguf_offset: int
    expert_bytes: int
    packed_offset: int
    stride: int  # bytes from one expert to the next in experts.bin
    gguf_size: int
    gguf: str


_INDEX_HEAD = """\
# Strata expert pack, version 1.
# experts.bin holds the routed experts layer by layer, expert after expert; each expert's
# gate, up and down blocks sit back to back (one read an expert), and each expert starts on
# a {align}-byte boundary. Expert e of a tensor is at packed_offset + e * stride in
# experts.bin, and at gguf_offset + e * expert_bytes in its GGUF file. Tab-separated.
"""
_COLUMNS = ("layer", "tensor", "name", "format", "shape", "gguf_offset", "expert_bytes",
            "packed_offset", "stride", "gguf_size", "gguf")


class Pack:
    """An opened pack: `bin` (experts.bin), `index` (experts.txt), entries by tensor name."""

    def __init__(self, index: Path, entries: dict[str, PackEntry]):
        self.index, self.bin, self.entries = index, index.with_name(PACK_BIN), entries

    @classmethod
    def open(cls, where: str | os.PathLike) -> Pack:
        where = Path(where)
        index = where / PACK_INDEX if where.is_dir() or not where.suffix else where
        if not index.is_file() or not index.with_name(PACK_BIN).is_file():
            raise ValueError(f"{where}: no expert pack ({PACK_BIN} and {PACK_INDEX}); write one with "
                             f"`strata pack MODEL.gguf --out {where}`, or pass --experts-dir")
        return _open_pack(str(index.resolve()), index.stat().st_mtime_ns)

    def entry(self, t: QTensor) -> PackEntry:
        ent = self.entries.get(t.name)
        if ent is None:
            raise ValueError(f"{self.index}: no entry for tensor {t.name!r}; this pack is of another "
                             f"model: run `strata pack` on this one")
        path, offset = tensor_file(t)
        size = path.stat().st_size
        if (ent.fmt, ent.shape, ent.expert_bytes) != (t.fmt.name, tuple(t.shape), t.nbytes // t.shape[0]) \
                or ent.gguf_size != size or ent.gguf_offset != offset:
            raise ValueError(f"{self.index}: tensor {t.name!r} was packed from {ent.gguf} ({ent.fmt} "
                             f"{ent.shape}, file of {ent.gguf_size:,} bytes, offset {ent.gguf_offset}) "
                             f"but {path} has {t.fmt.name} {tuple(t.shape)}, {size:,} bytes, offset "
                             f"{offset}: the pack is stale; run `strata pack {path} --out {self.index.parent}`")
        return ent


_packs: dict[tuple, Pack] = {}


def _open_pack(index: str, mtime: int) -> Pack:
    """Parsed once per index file (and version of it), however many layers ask."""
    key = (index, mtime)
    if key not in _packs:
        entries = {}
        with open(index) as f:
            for n, line in enumerate(f, 1):
                if not line.strip() or line.startswith("#"):
                    continue
                cols = line.rstrip("\n").split("\t")
                if cols[0] == "layer":  # the header row
                    continue
                if len(cols) != len(_COLUMNS):
                    raise ValueError(f"{index}:{n}: {len(cols)} columns, expected {len(_COLUMNS)} "
                                     f"({' '.join(_COLUMNS)}); run `strata pack` again")
                try:
                    ent = PackEntry(int(cols[0]), cols[1], cols[2], cols[3], tuple(int(s) for s in cols[4].split("x")),
                                    *(int(c) for c in cols[5:10]), cols[10])
                except ValueError:
                    raise ValueError(f"{index}:{n}: cannot read {line.strip()!r}; run `strata pack` again") from None
                entries[ent.name] = ent
        _packs[key] = Pack(Path(index), entries)
    return _packs[key]


def _expert_tensors(gguf: Path) -> dict[int, dict[str, QTensor]]:
    """Layer -> {gate, up, down} expert tensors of a GGUF and the other shards of its set."""
    from strata.gguf import open_gguf
    from strata.storage.ple import _SHARD
    files = [gguf]
    m = _SHARD.match(gguf.name)
    if m:
        n = int(m["n"])
        files = [gguf.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    layers: dict[int, dict[str, QTensor]] = collections.defaultdict(dict)
    for p in files:
        if not p.is_file():
            raise ValueError(f"{gguf}: shard {p.name} of its set is missing")
        for name, t in open_gguf(p).tensors.items():
            mm = _EXPS.match(name)
            if mm:
                layers[int(mm[1])][mm[2]] = t
    for i, d in layers.items():
        if set(d) != set(EXPERT_TENSORS):
            raise ValueError(f"{gguf}: layer {i} has expert tensors {sorted(d)}, not gate, up and down")
    return dict(sorted(layers.items()))


def pack(gguf: str | os.PathLike, out: str | os.PathLike | None = None, say=io.log) -> Path:
    """Write experts.bin and its index experts.txt for a GGUF's routed experts into `out`
    (default `default_pack_dir`); returns the index's path. Both appear complete or not at
    all: they are written beside and renamed into place."""
    gguf = Path(gguf)
    layers = _expert_tensors(gguf)
    if not layers:
        raise ValueError(f"{gguf}: no routed expert tensors (blk.N.ffn_gate_exps.weight ...): nothing to pack")
    out = Path(out) if out is not None else default_pack_dir(gguf)
    out.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = out / (PACK_BIN + ".partial"), out / (PACK_INDEX + ".partial")
    rows = []
    t0, pos = time.perf_counter(), 0
    try:
        with open(tmp_bin, "wb") as f:
            for i, d in layers.items():
                ts = [d[k] for k in EXPERT_TENSORS]
                E = ts[0].shape[0]
                if any(t.shape[0] != E for t in ts):
                    raise ValueError(f"{gguf}: layer {i}'s expert tensors disagree on the expert count "
                                     f"({', '.join(f'{t.name} {t.shape}' for t in ts)})")
                per = [t.nbytes // E for t in ts]
                stride = -(-sum(per) // PACK_ALIGN) * PACK_ALIGN
                views = [t.data.reshape(E, -1) for t in ts]
                pad = bytes(stride - sum(per))
                for e in range(E):
                    f.writelines(memoryview(v[e]) for v in views)
                    f.write(pad)
                at = pos
                for kind, t, n in zip(EXPERT_TENSORS, ts, per):
                    path, offset = tensor_file(t)
                    rows.append((i, kind, t.name, t.fmt.name, "x".join(map(str, t.shape)), offset, n, at, stride,
                                 path.stat().st_size, str(path.resolve())))
                    at += n
                pos += E * stride
        with open(tmp_idx, "w") as f:
            f.write(_INDEX_HEAD.format(align=PACK_ALIGN))
            f.write("\t".join(_COLUMNS) + "\n")
            f.writelines("\t".join(map(str, r)) + "\n" for r in rows)
        os.replace(tmp_bin, out / PACK_BIN)
        os.replace(tmp_idx, out / PACK_INDEX)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise
    say(f"strata: packed {len(layers)} layers of experts of {gguf.name} ({pos / 2**30:.2f} GiB) into "
        f"{out / PACK_BIN} in {time.perf_counter() - t0:.1f} s; index {out / PACK_INDEX}")
    return out / PACK_INDEX
