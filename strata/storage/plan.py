"""The plan: what sits where, what a prompt will read from the drive, and how fast the
drive reads, measured rather than assumed.

A start prints `plan_lines(...)`; `strata plan MODEL` prints them alone. The numbers:

- each part of the GGUF (embeddings, layer weights, routed experts, PLE table, output) by
  size and tier;
- the page cache the file set may use: MemAvailable less what the tiers copy into RAM;
  the file set is every part read through the page cache (mapped, or mmap reads);
- so the drive reads per prompt of `tokens` tokens: the routed experts' bytes (tokens x
  layers x top-k x expert bytes, at most the experts' size), the PLE rows (tokens x 16
  rows) and the embedding rows, each times the share that misses the cache (none when the
  file set fits; all of it for O_DIRECT tiers, which bypass the cache);
- and per decoded token, from a cold page cache and from a warm one: a row at no particular
  offset touches 1 + (row bytes - 1) / 4096 pages on average (a 90-byte PLE row 1.02, a
  1100-byte embedding row 1.27), an O_DIRECT read of an expert's slice whole pages around
  it. Cold is what a table much larger than RAM costs for as long as the page cache has
  not filled with it (at 64 KiB of PLE pages a token, 17 GiB of cache take 280,000
  tokens): every page a token touches is a first touch. Warm is the steady state above;
- the PLE table where it is: in the model's file or in another shard of its set (the
  releases keep it alone in shard 2);
- the drive's speed: a short O_DIRECT read of the model file itself, random 4 KiB and
  sequential 1 MiB, cached per block device in the Strata cache with its time (an assumed
  1.5 GB/s was 2-8x below what a user's NVMe did: seeds/004).
"""
from __future__ import annotations

import datetime
import errno
import json
import mmap
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from strata.names.qwen4exp import EXPERT_TENSOR, PLE_ROWS_PER_TOKEN, PLE_TABLE, TOKEN_EMBD
from strata.storage import io
from strata.storage.io import PAGE, gib

TOKENS = 32768
RANDOM_BYTES, SEQ_BYTES = 4096, 1 << 20
PLAN_DEPTH_RANDOM, PLAN_DEPTH_SEQ = 16, 4  # the PLE pool's default depth; a few large reads in flight
MAX_AGE_S = 7 * 86400  # a drive measured within a week is not measured again


# --- the drive ---------------------------------------------------------------------------

@dataclass
class DriveSpeed:
    """Bytes/s of reads of one file: random 4 KiB and sequential 1 MiB reads, by depth."""
    device: str  # "major:minor" of the file's block device
    file: str
    direct: bool  # False: the file system refused O_DIRECT, so these are page-cache speeds
    random_4k: dict[int, float] = field(default_factory=dict)  # depth -> bytes/s
    seq_1m: dict[int, float] = field(default_factory=dict)
    measured_at: float = 0.0  # Unix time
    seconds: float = 0.0  # per measurement

    def random(self, depth: int = PLAN_DEPTH_RANDOM) -> float:
        return self.random_4k.get(depth) or max(self.random_4k.values(), default=0.0)

    def seq(self, depth: int = PLAN_DEPTH_SEQ) -> float:
        return self.seq_1m.get(depth) or max(self.seq_1m.values(), default=0.0)

    def when(self) -> str:
        return datetime.datetime.fromtimestamp(self.measured_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    def line(self) -> str:
        how = "O_DIRECT" if self.direct else "buffered (O_DIRECT refused: page-cache speed, not the drive's)"
        rd = max((d for d in self.random_4k if d <= PLAN_DEPTH_RANDOM), default=PLAN_DEPTH_RANDOM)
        sd = max((d for d in self.seq_1m if d <= PLAN_DEPTH_SEQ), default=PLAN_DEPTH_SEQ)
        return (f"drive {self.seq(sd) / 1e9:.2f} GB/s sequential 1 MiB at depth {sd}, "
                f"{self.random(rd) / 1e9:.3f} GB/s random 4 KiB at depth {rd} "
                f"({self.random(rd) / RANDOM_BYTES:,.0f} IOPS) (measured {self.when()}, device "
                f"{self.device}, {how} reads of {Path(self.file).name}; `strata probe` measures again)")


def device_of(path: str | os.PathLike) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def _open(path: Path) -> tuple[int, bool]:
    try:
        return io.open_direct(path), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    fd = os.open(path, os.O_RDONLY)
    return fd, False


def _read_rate(path: Path, size: int, depth: int, chunk: int, sequential: bool, seconds: float,
               seed: int) -> tuple[float, bool]:
    """Bytes/s of `depth` threads reading `chunk`-byte aligned pieces of the file for
    `seconds`: random offsets, or one shared cursor walking the file (wrapping at its end).
    (bytes/s, whether the reads were O_DIRECT)."""
    fd, direct = _open(path)
    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if not sequential else os.POSIX_FADV_SEQUENTIAL)
    chunks = max(1, size // chunk)
    lock = threading.Lock()
    cursor = [np.random.default_rng(seed).integers(0, chunks)]
    done = [0]
    stop = time.perf_counter() + seconds

    def work(i: int) -> None:
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        rng = np.random.default_rng(seed * 1000 + i)
        n = 0
        while time.perf_counter() < stop:
            if sequential:
                with lock:
                    c = cursor[0]
                    cursor[0] = (c + 1) % chunks
            else:
                c = int(rng.integers(0, chunks))
            n += os.preadv(fd, [buf], c * chunk)
        buf.close()
        with lock:
            done[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    os.close(fd)
    return done[0] / elapsed, direct


def measure_drive(path: str | os.PathLike, random_depths=(PLAN_DEPTH_RANDOM,), seq_depths=(PLAN_DEPTH_SEQ,),
                  seconds: float = 0.25) -> DriveSpeed:
    """Read the file itself for `seconds` per depth: random 4 KiB, then sequential 1 MiB."""
    path = Path(path)
    size = path.stat().st_size
    if size < RANDOM_BYTES:
        raise ValueError(f"{path}: {size} bytes is too small to measure a drive on")
    out = DriveSpeed(device_of(path), str(path.resolve()), True, measured_at=time.time(), seconds=seconds)
    for i, d in enumerate(random_depths):
        out.random_4k[d], direct = _read_rate(path, size, d, RANDOM_BYTES, False, seconds, i + 1)
        out.direct &= direct
    for i, d in enumerate(seq_depths):
        out.seq_1m[d], direct = _read_rate(path, size, d, min(SEQ_BYTES, size // PAGE * PAGE), True, seconds, i + 101)
        out.direct &= direct
    return out


def _cache_file() -> Path:
    from strata.cache import cache_dir
    return cache_dir() / "drives.json"


def _load_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def save_drive(d: DriveSpeed) -> None:
    cache = _load_cache()
    cache[d.device] = asdict(d)
    tmp = _cache_file().with_suffix(".partial")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, _cache_file())


def cached_drive(path: str | os.PathLike, max_age_s: float = MAX_AGE_S) -> DriveSpeed | None:
    """The last measurement of the block device holding `path`, when younger than max_age_s."""
    got = _load_cache().get(device_of(path))
    if not got or time.time() - got.get("measured_at", 0) > max_age_s:
        return None
    for k in ("random_4k", "seq_1m"):  # JSON keys are strings
        got[k] = {int(d): float(v) for d, v in got[k].items()}
    try:
        return DriveSpeed(**got)
    except TypeError:  # written by another version
        return None


def drive_speed(path: str | os.PathLike, remeasure: bool = False) -> DriveSpeed:
    """The drive's speed for `path`: cached per device, else measured (about half a second)
    and cached."""
    d = None if remeasure else cached_drive(path)
    if d is None:
        d = measure_drive(path)
        save_drive(d)
    return d


# --- the parts of a model ----------------------------------------------------------------

@dataclass
class Part:
    name: str
    nbytes: int
    tier: str  # words for where it sits
    kind: str  # "resident" (read at start), "cache" (through the page cache), "direct" (O_DIRECT)
    ram_bytes: int = 0  # what the tier copies into anonymous RAM
    drive_per_prompt: float = 0.0  # bytes it reads per prompt before the page cache's share
    drive_per_token: float = 0.0  # bytes a decoded token reads before the page cache's share


def _parts(g) -> dict[str, int]:
    sizes = {"embeddings": 0, "layers": 0, "experts": 0, "PLE table": 0, "output": 0}
    for name, t in g.tensors.items():
        if name == TOKEN_EMBD:
            sizes["embeddings"] += t.nbytes
        elif name == PLE_TABLE:
            sizes["PLE table"] += t.nbytes
        elif EXPERT_TENSOR.match(name):
            sizes["experts"] += t.nbytes
        elif name.startswith("blk."):
            sizes["layers"] += t.nbytes
        else:
            sizes["output"] += t.nbytes
    return sizes


def _arch(g, key: str, default=0):
    return g.get(f"{g.arch}.{key}", default)


def _pages(nbytes: float) -> float:
    """Pages a run of `nbytes` bytes at no particular offset touches, on average."""
    return 1 + (nbytes - 1) / PAGE if nbytes else 0.0


def _ple_in_set(g):
    """The PLE table's PleSource where it sits in another shard of `g`'s set, else None."""
    from strata.gguf.shards import shard_files
    if len(shard_files(g.path)) < 2:
        return None
    from strata.storage.ple_source import find_ple
    try:
        return find_ple(g.path, opened=g)
    except ValueError:  # no table anywhere in the set
        return None


@dataclass
class Plan:
    path: Path
    file_bytes: int
    parts: list[Part]
    mem_available: int | None
    cache_bytes: int | None  # page cache the file set may use
    file_set: int
    fits: bool | None
    miss: float  # share of page-cache reads that go to the drive
    drive_bytes: dict[str, float]  # per part, per prompt
    tokens: int
    drive: DriveSpeed | None
    seconds: float | None  # expected drive time per prompt
    set_bytes: int = 0  # the whole shard set's files
    token_cold: dict[str, float] = field(default_factory=dict)  # per decoded token, cold page cache
    token_warm: dict[str, float] = field(default_factory=dict)  # per decoded token, warm page cache
    token_seconds: float | None = None  # expected drive time per decoded token, cold

    def lines(self) -> list[str]:
        total = sum(self.drive_bytes.values())
        whole = f"; {self.set_bytes / 1e9:.2f} GB with its other shards" if self.set_bytes > self.file_bytes else ""
        out = [f"plan for {self.path.name} ({self.file_bytes / 1e9:.2f} GB{whole}):"]
        for p in self.parts:
            out.append(f"  {p.name:<11} {p.nbytes / 1e9:8.3f} GB  {p.tier}")
        avail = "unknown" if self.mem_available is None else gib(self.mem_available)
        held = sum(p.ram_bytes for p in self.parts)
        out.append(f"  memory: MemAvailable {avail}; the tiers copy {gib(held)} into RAM, leaving "
                   f"{'unknown' if self.cache_bytes is None else gib(self.cache_bytes)} of page cache")
        if self.cache_bytes is None:
            verdict = f"file set {gib(self.file_set)} (page cache unknown: counted as missing it)"
        elif self.fits:
            verdict = f"file set {gib(self.file_set)} fits the page cache {gib(self.cache_bytes)}"
        else:
            verdict = (f"file set {gib(self.file_set)} does not fit the page cache {gib(self.cache_bytes)} "
                       f"({self.miss:.0%} of its reads miss, if spread evenly)")
        parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in self.drive_bytes.items() if v)
        when = f", about {self.seconds:.1f} s of drive time" if self.seconds is not None and total else ""
        out.append(f"  {verdict} -> about {total / 1e9:.1f} GB read from the drive per {self.tokens}-token "
                   f"prompt" + (f" ({parts} GB{when})" if parts else ""))
        cold, warm = sum(self.token_cold.values()), sum(self.token_warm.values())
        if cold:
            each = ", ".join(f"{k} {v / 1e6:.3f}" for k, v in self.token_cold.items() if v)
            secs = f"; about {1e3 * self.token_seconds:.0f} ms of drive time" if self.token_seconds else ""
            out.append(f"  per decoded token: {cold / 1e6:.2f} MB from the drive with a cold page cache ({each} MB), "
                       f"{warm / 1e6:.2f} MB warm{secs}")
        out.append("  " + (self.drive.line() if self.drive else "drive speed not measured"))
        return out

    def as_dict(self) -> dict:
        return {"file": str(self.path), "file_bytes": self.file_bytes,
                "parts": [asdict(p) for p in self.parts], "mem_available": self.mem_available,
                "page_cache_bytes": self.cache_bytes, "file_set_bytes": self.file_set, "fits": self.fits,
                "miss": self.miss, "drive_bytes_per_prompt": self.drive_bytes, "tokens": self.tokens,
                "drive_seconds_per_prompt": self.seconds, "drive": asdict(self.drive) if self.drive else None,
                "set_bytes": self.set_bytes, "drive_bytes_per_token_cold": self.token_cold,
                "drive_bytes_per_token_warm": self.token_warm, "drive_seconds_per_token_cold": self.token_seconds}


def make_plan(g, *, experts: str | None = None, ple_io: str = "auto", device: str = "cpu",
              experts_io: str = "direct", experts_dir: str | os.PathLike | None = None, tokens: int = TOKENS, drive: DriveSpeed | None = None,
              measure: bool = True, mem_available: int | None = None) -> Plan:
    """The plan of GGUF `g` (a GGUFFile or a path) with the given flags."""
    from strata.gguf import GGUFFile, open_gguf
    from strata.storage.expert_tier import parse_tier
    g = g if isinstance(g, GGUFFile) else open_gguf(g)
    sizes = _parts(g)
    on_cpu = device == "cpu"
    layers = int(_arch(g, "block_count", 0))
    n_exp, top_k = int(_arch(g, "expert_count", 0)), int(_arch(g, "expert_used_count", 0))
    parts: list[Part] = []

    emb = g.tensors.get(TOKEN_EMBD)
    emb_reads = emb_token = 0.0
    if emb is not None:  # a token's row: the pages it touches
        emb_token = _pages(emb.data.shape[-1]) * PAGE
        emb_reads = min(min(tokens, emb.shape[0]) * emb_token, sizes["embeddings"])
    parts.append(Part("embeddings", sizes["embeddings"], "page cache (the rows a step needs, mapped)", "cache",
                      drive_per_prompt=emb_reads, drive_per_token=emb_token))
    where = "RAM" if on_cpu else device
    parts.append(Part("layers", sizes["layers"], f"{where}, read at start (attention/DeltaNet, routers, shared "
                      f"experts, norms, hyper-connections)", "resident",
                      ram_bytes=sizes["layers"] if on_cpu else 0))

    if sizes["experts"]:
        spec = parse_tier(experts) if experts else None
        slabs: dict[int, list[int]] = {}  # layer -> an expert's bytes in gate, up, down
        for name, t in g.tensors.items():
            if m := EXPERT_TENSOR.match(name):
                slabs.setdefault(int(m[1]), []).append(t.nbytes // max(t.shape[0], 1))
        # over the layers whose experts this file holds (an MTP block's among them, where it has one)
        per_expert = sizes["experts"] / max(len(slabs) * n_exp, 1)
        reads = min(tokens * layers * top_k * per_expert, sizes["experts"])
        one = next(iter(slabs.values()))
        # what reading one expert touches: the pack's expert starts on a page and is one run,
        # the GGUF's three slices each start anywhere in a page
        packed_run = -(-sum(one) // PAGE) * PAGE
        file_runs = sum(_pages(b) for b in one) * PAGE
        kind, ram, share = "resident", 0, 1.0
        how = "O_DIRECT reads" if experts_io == "direct" else "mmap reads"
        if spec is None or spec.kind in ("device", "dense"):
            if on_cpu:
                tier = ("device: blocks in the page cache, mapped" if spec else
                        "default: dense copies while STRATA_DENSE_MIB lasts, else blocks in the page cache")
                kind = "cache"
            else:
                tier = f"device ({device})"
        elif spec.kind == "host":
            tier, ram = "host: read once into RAM" + ("" if on_cpu else ", pinned"), sizes["experts"]
        else:
            backing = spec.backing if spec.kind == "cache" else spec.kind
            src = {"host": "host RAM", "packed": f"experts.bin ({how})", "file": f"the GGUF in place ({how})"}[backing]
            if backing == "packed":
                from strata.storage.pack import PACK_INDEX, default_pack_dir
                pack_dir = Path(experts_dir) if experts_dir else default_pack_dir(g.path)
                if not (pack_dir / PACK_INDEX).is_file():
                    src += f" - none in {pack_dir} yet: `strata pack {g.path} --out {pack_dir}` writes it"
            if spec.kind == "cache":
                slots = min(spec.slots, n_exp)
                tier = f"cache of {slots} slots a layer on {device}, misses from {src}"
                share = 1 - slots / n_exp if n_exp else 1.0  # routing spread evenly over the experts
                ram = slots * per_expert * layers if on_cpu else 0
            else:
                tier = src
            if backing == "host":
                kind, ram = "resident", ram + sizes["experts"]
            else:
                kind = "direct" if experts_io == "direct" else "cache"
        run = packed_run if spec is not None and "packed" in (spec.kind, spec.backing) else file_runs
        parts.append(Part("experts", sizes["experts"], f"{tier}; {per_expert / 2**20:.2f} MiB an expert, "
                          f"{layers} layers x {n_exp} top-{top_k}", kind, ram_bytes=int(ram),
                          drive_per_prompt=reads * share if kind != "resident" else 0.0,
                          drive_per_token=layers * top_k * run * share if kind != "resident" else 0.0))
    else:
        parts.append(Part("experts", 0, "none (a dense model)", "resident"))

    ple = g.tensors.get(PLE_TABLE)
    ple_where, set_bytes = "", g.size
    if ple is not None:
        row_bytes, ple_bytes = ple.data.shape[-1], ple.nbytes
    elif (src := _ple_in_set(g)) is not None:  # the releases keep it alone in shard 2
        row_bytes, ple_bytes, ple_where = src.row_bytes, src.nbytes, f" (in {src.path.name})"
        from strata.gguf.shards import shard_files
        set_bytes = sum(p.stat().st_size for p in shard_files(g.path) if p.is_file())
    if ple is not None or ple_where:
        row_pages = _pages(row_bytes) * PAGE
        ple_reads = min(tokens * PLE_ROWS_PER_TOKEN * row_pages, -(-ple_bytes // PAGE) * PAGE)
        tier = {"ram": ("--ple-io ram: read whole into RAM, locked", "resident"),
                "mmap": ("--ple-io mmap: page cache, one batched MADV_WILLNEED a step", "cache"),
                "direct": ("--ple-io direct: O_DIRECT pages by a thread pool", "direct"),
                "auto": ("--ple-io auto: measured at start (counted here as mmap)", "cache")}[ple_io]
        parts.append(Part("PLE table", ple_bytes, f"{tier[0]}; {row_bytes} B a row{ple_where}", tier[1],
                          ram_bytes=ple_bytes if ple_io == "ram" else 0,
                          drive_per_prompt=ple_reads if tier[1] != "resident" else 0.0,
                          drive_per_token=PLE_ROWS_PER_TOKEN * row_pages if tier[1] != "resident" else 0.0))
    else:
        parts.append(Part("PLE table", 0, "none", "resident"))
    parts.append(Part("output", sizes["output"], f"{where}, read at start (lm_head, final mixer)", "resident",
                      ram_bytes=sizes["output"] if on_cpu else 0))

    avail = io.mem_available() if mem_available is None else mem_available
    held = sum(p.ram_bytes for p in parts)
    file_set = sum(p.nbytes for p in parts if p.kind == "cache")
    cache = None if avail is None else max(0, avail - held)
    fits = None if cache is None else file_set <= cache
    miss = 1.0 if cache is None else (0.0 if fits else 1 - cache / file_set)
    drive_bytes, cold, warm = {}, {}, {}
    for p in parts:
        share = {"cache": miss, "direct": 1.0}.get(p.kind, 0.0)
        drive_bytes[p.name] = p.drive_per_prompt * share
        warm[p.name] = p.drive_per_token * share
        cold[p.name] = p.drive_per_token * (1.0 if p.kind in ("cache", "direct") else 0.0)
    if drive is None and measure:
        drive = drive_speed(g.path)
    seconds = token_seconds = None
    if drive is not None:
        seq, rnd = drive.seq() or float("inf"), drive.random() or float("inf")

        # experts are runs of hundreds of KiB (sequential); PLE and embedding rows a page each
        def drive_time(b: dict) -> float:
            return b.get("experts", 0) / seq + (b.get("PLE table", 0) + b.get("embeddings", 0)) / rnd
        seconds, token_seconds = drive_time(drive_bytes), drive_time(cold)
    return Plan(g.path, g.size, parts, avail, cache, file_set, fits, miss, drive_bytes, tokens, drive, seconds,
                set_bytes, cold, warm, token_seconds)


def choose_experts(expert_bytes: int, other_bytes: int, per_expert: float, layers: int, n_experts: int,
                   device: str = "cpu", mem_available: int | None = None, device_free: int | None = None,
                   pack_exists: bool = False) -> tuple[str | None, str]:
    """The --experts tier a start would pick, and why: resident while the experts fit beside
    the rest (on the CPU: the page cache holds the mapped file; reading in place where the
    model fits cost 21-57% of prompt speed: seeds/004), else a cache of the slots that fit,
    filled from host RAM when the experts fit there, else from the pack, else the GGUF."""
    if not expert_bytes:
        return None, "no routed experts (a dense model)"
    avail = mem_available
    fit_ram = avail is not None and expert_bytes + other_bytes <= 0.9 * avail
    if device == "cpu":
        if fit_ram:
            return "device", (f"the file set ({gib(expert_bytes + other_bytes)}) fits 90% of MemAvailable "
                              f"({gib(avail)}): the page cache holds the experts")
        room = 0.8 * avail - other_bytes if avail is not None else 0
        where = "the pack" if pack_exists else "the GGUF in place (`strata pack` writes a pack: one read an expert)"
        backing = "packed" if pack_exists else "file"
    else:
        if device_free is not None and expert_bytes + other_bytes <= 0.9 * device_free:
            return "device", f"the experts and the rest fit 90% of free {device} memory ({gib(device_free)})"
        room = 0.8 * device_free - other_bytes if device_free is not None else 0
        if fit_ram:
            where, backing = "host RAM (the experts fit MemAvailable)", "host"
        else:
            where = "the pack" if pack_exists else "the GGUF in place"
            backing = "packed" if pack_exists else "file"
    slots = int(max(0, room) // max(per_expert * layers, 1))
    if slots < 1:
        return f"{'packed' if pack_exists else 'file'}", (f"not one expert slot a layer fits beside the rest "
                                                           f"({gib(other_bytes)}): every expert read per batch")
    slots = min(slots, n_experts)
    return f"cache:{slots}:{backing}", (f"{slots} of {n_experts} expert slots a layer fit 80% of the free "
                                        f"memory beside the rest; misses from {where}")
