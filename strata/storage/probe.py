"""`strata probe [MODEL]`: what this machine offers the storage tiers, measured.

The drive (random 4 KiB reads at depths 1, 4, 16 and 32, sequential 1 MiB reads, all
O_DIRECT on the model file itself), the file system and whether the disk is rotational,
the page cache (MemAvailable, the cgroup's limit, how much of the model file is cached
already), the mlock limit (`--ple-io ram` locks the table), and which `--ple-io` and
`--experts` the engine would pick, with the reason.

Lessons from the seeds: random reads need queue depth (one depth tells little: a probe
of the table at depth 1 mispredicted both prefill and decode, seeds/003), so the table
shows every depth and `--ple-io` is picked by measuring the real pattern in each mode
(strata.storage.ple.choose_mode); on ZFS a MADV_WILLNEED becomes an ARC prefetch of a
whole record (seeds/000); and the drive is measured, not assumed (seeds/004).
"""
from __future__ import annotations

import os
import resource
from pathlib import Path

from strata.storage import io, plan
from strata.storage.io import gib

DEPTHS = (1, 4, 16, 32)
SCRATCH_BYTES = 256 << 20


def _size(n: float) -> str:
    return gib(n) if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _mount(path: Path) -> tuple[str, str]:
    """(file system type, mount point) of the mount holding `path`."""
    best, kind = "", "unknown"
    real = str(path.resolve())
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4]
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except OSError:
        pass
    return kind, best


def _rotational(dev: str) -> bool | None:
    """Whether the block device spins (/sys/dev/block/M:m/queue/rotational; a partition's
    answer is its disk's)."""
    base = Path("/sys/dev/block") / dev
    for q in (base / "queue" / "rotational", base / ".." / "queue" / "rotational"):
        try:
            return q.read_text().strip() == "1"
        except OSError:
            continue
    return None


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _cgroup_limit() -> int | None:
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(p).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def _scratch() -> Path:
    """A file to measure the drive on when no model is given: the largest GGUF in the
    Strata cache, else a scratch file written there once."""
    from strata.cache import cache_dir
    ggufs = sorted(cache_dir().rglob("*.gguf"), key=lambda p: p.stat().st_size, reverse=True)
    if ggufs:
        return ggufs[0]
    p = cache_dir() / "probe.bin"
    if not p.is_file() or p.stat().st_size < SCRATCH_BYTES:
        with open(p, "wb") as f:
            f.writelines(os.urandom(1 << 20) for _ in range(SCRATCH_BYTES >> 20))
        io.drop_cache(p)
    return p


def probe(model: str | os.PathLike | None = None, *, device: str = "cpu", seconds: float = 0.2,
          ple_budget_s: float = 0.3) -> dict:
    """Everything `strata probe` prints, as a dict (the --json output)."""
    from strata.gguf import open_gguf
    path = Path(model) if model else _scratch()
    g = None
    if path.suffix == ".gguf" or model:
        try:
            g = open_gguf(path)
        except ValueError:
            g = None
    drive = plan.measure_drive(path, random_depths=DEPTHS, seq_depths=DEPTHS, seconds=seconds)
    plan.save_drive(drive)  # the plan line of every start uses the newest measurement
    fs, mount = _mount(path)
    mem = _meminfo()
    avail = io.mem_available()
    cached, pages = io.resident(path)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unl = resource.RLIM_INFINITY
    out = {
        "file": str(path.resolve()), "file_bytes": path.stat().st_size, "model": g.get("general.name") if g else None,
        "drive": {"device": drive.device, "direct": drive.direct, "filesystem": fs, "mount": mount,
                  "rotational": _rotational(drive.device), "seconds_each": seconds,
                  "random_4k": {str(d): {"bytes_s": r, "iops": r / plan.RANDOM_BYTES} for d, r in drive.random_4k.items()},
                  "seq_1m": {str(d): {"bytes_s": r} for d, r in drive.seq_1m.items()}},
        "page_cache": {"mem_total": mem.get("MemTotal"), "mem_available": avail, "cached": mem.get("Cached"),
                       "cgroup_limit": _cgroup_limit(), "file_cached_fraction": cached / pages if pages else 0.0,
                       "file_fits": None if avail is None else path.stat().st_size <= avail},
        "mlock": {"soft": None if soft == unl else soft, "hard": None if hard == unl else hard,
                  "limit": io.memlock_limit()},
        "ple_io": {"mode": None, "why": "no PLE table in this file"},
        "experts": {"tier": None, "why": "no model given" if g is None else "no routed experts (a dense model)"},
    }
    if g is not None:
        _choices(out, g, device, avail, ple_budget_s)
    out["notes"] = _notes(out)
    return out


def _choices(out: dict, g, device: str, avail: int | None, ple_budget_s: float) -> None:
    from strata.storage import pack as ex
    from strata.storage.ple_auto import choose_mode
    from strata.storage.ple_source import PLE_TENSOR, find_ple
    sizes = plan._parts(g)
    other = sum(v for k, v in sizes.items() if k not in ("experts", "PLE table"))
    if PLE_TENSOR in g.tensors:
        src = find_ple(g.path)
        mode, line = choose_mode(src, depth=16, budget_s=ple_budget_s, reserve_bytes=other + sizes["experts"])
        lock = out["mlock"]["soft"]
        out["mlock"]["ple_table_bytes"] = src.nbytes
        out["mlock"]["ple_table_lockable"] = lock is None or src.nbytes <= lock
        out["ple_io"] = {"mode": mode, "why": line}
    layers = int(plan._arch(g, "block_count", 0))
    n_exp = int(plan._arch(g, "expert_count", 0))
    per = sizes["experts"] / max(layers * n_exp, 1)
    free = None
    if device != "cpu":
        import torch
        free = torch.cuda.mem_get_info(torch.device(device))[0]
    pack_ok = (ex.default_pack_dir(g.path) / ex.PACK_INDEX).is_file()
    tier, why = plan.choose_experts(sizes["experts"], other + sizes["PLE table"], per, layers, n_exp, device,
                                    avail, free, pack_ok)
    out["experts"] = {"tier": tier, "why": why, "expert_bytes": per, "experts_bytes": sizes["experts"]}


def _notes(out: dict) -> list[str]:
    notes = []
    d = out["drive"]
    if not d["direct"]:
        notes.append("the file system refuses O_DIRECT: the speeds are the page cache's, and --ple-io direct "
                     "reads buffered")
    if d["filesystem"] == "zfs":
        notes.append("ZFS: a MADV_WILLNEED becomes an ARC prefetch of a whole record; --ple-io ram (locked) "
                     "gives no hints, and --no-ple-prefetch turns them off in mmap mode")
    r = d["random_4k"]
    if "1" in r and "16" in r and r["16"]["bytes_s"] > 2 * r["1"]["bytes_s"]:
        notes.append(f"random reads scale with depth ({r['16']['bytes_s'] / r['1']['bytes_s']:.1f}x from 1 to 16): "
                     f"direct reads need a pool (--ple-io-depth, --experts-io-depth)")
    m = out["mlock"]
    if m.get("ple_table_lockable") is False:
        notes.append(f"the PLE table ({_size(m['ple_table_bytes'])}) exceeds RLIMIT_MEMLOCK ({m['limit']}): --ple-io "
                     f"ram would run unlocked; `ulimit -l unlimited` or LimitMEMLOCK=infinity locks it")
    return notes


def table(out: dict) -> str:
    d = out["drive"]
    spin = {True: "rotational", False: "not rotational", None: "rotational: unknown"}[d["rotational"]]
    rows = [f"probe of {out['file']} ({out['file_bytes'] / 1e9:.2f} GB{', ' + out['model'] if out['model'] else ''})",
            (f"drive: device {d['device']}, {d['filesystem']} at {d['mount']}, {spin}, "
             f"{'O_DIRECT' if d['direct'] else 'buffered (O_DIRECT refused)'}, {d['seconds_each']} s a reading"),
            f"  {'depth':>5}  {'random 4 KiB':>14}  {'IOPS':>9}  {'sequential 1 MiB':>16}"]
    for dep in DEPTHS:
        r, s = d["random_4k"].get(str(dep)), d["seq_1m"].get(str(dep))
        rows.append(f"  {dep:>5}  {r['bytes_s'] / 1e9:>10.3f} GB/s  {r['iops']:>9,.0f}  {s['bytes_s'] / 1e9:>11.2f} GB/s")
    pc = out["page_cache"]
    lim = f", cgroup limit {gib(pc['cgroup_limit'])}" if pc["cgroup_limit"] else ""
    avail = "unknown" if pc["mem_available"] is None else gib(pc["mem_available"])
    rows.append(f"page cache: MemAvailable {avail} of {gib(pc['mem_total'] or 0)}{lim}; Cached {gib(pc['cached'] or 0)}; "
                f"this file {pc['file_cached_fraction']:.0%} cached, {'fits' if pc['file_fits'] else 'does not fit'} "
                f"MemAvailable")
    m = out["mlock"]
    ple = (f"; the PLE table ({_size(m['ple_table_bytes'])}) {'can' if m['ple_table_lockable'] else 'cannot'} be locked"
           if "ple_table_bytes" in m else "")
    rows.append(f"mlock: RLIMIT_MEMLOCK {m['limit']}{ple}")
    rows.append(f"--ple-io: {out['ple_io']['mode'] or '-'}: {out['ple_io']['why']}")
    rows.append(f"--experts: {out['experts']['tier'] or '-'}: {out['experts']['why']}")
    rows += [f"note: {n}" for n in out["notes"]]
    return "\n".join(rows)
