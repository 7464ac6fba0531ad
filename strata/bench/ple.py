"""`strata bench ple`: PLE rows/s per I/O mode, cold and warm, against the drive's roof.

A synthetic table (default 4 GiB of IQ4_NL rows of 160 values; `--rows 320001536` for the
real size) is written once into Strata's cache (or `--file`; a real GGUF holding the table
is read as it is). The pattern is the model's: 16 rows a token, one per head, each head in
its own part of the table; decode gathers a token a step (hinting the next one first), a
prefill `--ubatch` tokens a step (hinted as a whole, then gathered). Each mode gets fresh
rows: cold after posix_fadvise(DONTNEED) on the file (checked with mincore, since a
container can keep pages), then warm on the same rows again. Modes: ram, mmap with hints,
mmap without hints, direct at `--depth`. The roof is fio's random 4 KiB O_DIRECT read rate
at the same depth (psync, one thread a depth, as the reader's pool).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import numpy as np

import quant
from strata.bench.report import emit, machine, markdown
from strata.storage import io
from strata.storage.io import PAGE, gib
from strata.names.qwen4exp import PLE_ROWS_PER_TOKEN as HEADS
from strata.storage.ple import PleTable
from strata.storage.ple_auto import choose_mode, probe_ids
from strata.storage.ple_source import PLE_TENSOR, PleSource, find_ple

ROW_DIM = 160
DEFAULT_BYTES = 4 << 30
CHUNK = 64 << 20
MODES = ("ram", "mmap", "mmap-nohint", "direct")


# --- the synthetic table -----------------------------------------------------------------

def _random_rows(fmt: quant.Format, n_rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with finite scales (random bytes also defeat a compressing file system,
    which would make the drive look faster than it is)."""
    from strata.bench.dequant import random_blocks
    n_blocks = n_rows * (ROW_DIM // fmt.block_elems)
    if fmt.name == "FP8_E4M3":  # any byte but the NaN codes
        b = rng.integers(0, 256, n_blocks, dtype=np.uint8)
        return np.where((b & 0x7F) == 0x7F, b ^ 1, b).reshape(n_rows, -1)
    return random_blocks(fmt, n_blocks, rng).reshape(n_rows, -1)


def _stream_rows(fout, fmt: quant.Format, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    per = max(1, CHUNK // fmt.row_bytes(ROW_DIM))
    for a in range(0, rows, per):
        _random_rows(fmt, min(per, rows - a), rng).tofile(fout)


def write_table(path: Path, fmt: quant.Format, rows: int, seed: int = 0) -> Path:
    """A GGUF holding only `per_layer_token_embd.weight` (a safetensors file for FP8, which
    GGUF has no type for), written chunk by chunk so that its size never sits in memory.
    It appears complete or not at all (written beside, then renamed)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    nbytes = rows * fmt.row_bytes(ROW_DIM)
    io.log(f"strata bench ple: writing a synthetic {fmt.name} table of {rows:,} rows ({gib(nbytes)}) "
           f"to {path} (once; delete it to free the space)")
    try:
        if fmt.type_id is None:  # safetensors: table, then its bf16 global scale
            scale_name = PLE_TENSOR + "_scale"
            header = {PLE_TENSOR: {"dtype": "F8_E4M3", "shape": [rows, ROW_DIM], "data_offsets": [0, nbytes]},
                      scale_name: {"dtype": "BF16", "shape": [], "data_offsets": [nbytes, nbytes + 2]}}
            head = json.dumps(header).encode()
            head += b" " * (-len(head) % 8)
            with open(tmp, "wb") as f:
                f.write(struct.pack("<Q", len(head)) + head)
                _stream_rows(f, fmt, rows, seed)
                f.write(quant.BF16.quantize(np.array([0.0625], np.float32)).tobytes())
        else:
            w = GGUFWriter(tmp, "qwen4exp")
            w.add_string("general.name", "strata bench ple synthetic table")
            w.add_tensor_info(PLE_TENSOR, (rows, fmt.row_bytes(ROW_DIM)), np.dtype(np.uint8), nbytes,
                              raw_dtype=GGMLQuantizationType(fmt.type_id))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            fout = w.fout[0]
            w.write_padding(fout, fout.tell())
            _stream_rows(fout, fmt, rows, seed)
            w.write_padding(fout, nbytes)
            w.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def table_path(args, fmt: quant.Format, rows: int) -> Path:
    if args.file:
        return Path(args.file)
    from strata.cache import cache_dir
    ext = "safetensors" if fmt.type_id is None else "gguf"
    return cache_dir() / "bench" / f"ple-{fmt.name}-{rows}.{ext}"


# --- measuring ---------------------------------------------------------------------------

def run_pattern(table: PleTable, ids: np.ndarray, ubatch: int, compute_s: float = 0.0) -> dict:
    """The model's calls over `ids` [T, 16], `ubatch` tokens a step (1: decode, which hints
    the next token before gathering this one); each gathered row is copied out, as the
    kernel would read it, and `compute_s` a step stands for the model's own work (a sleep:
    the reads announced for the next step go on meanwhile). Returns totals from the
    table's counters; `us_per_token` leaves the compute out."""
    table.reset_stats()
    before = io.read_bytes()
    t = time.perf_counter()
    steps = [ids[i:i + ubatch] for i in range(0, len(ids), ubatch)]
    slept = 0.0
    table.prefetch(steps[0])
    for k, step in enumerate(steps):
        nxt = steps[k + 1] if k + 1 < len(steps) else None
        if ubatch == 1 and nxt is not None:  # decode: the next token announced first
            table.prefetch(nxt)
        table.gather(step).rows()
        if ubatch != 1 and nxt is not None:  # prefill: the next ubatch, once this one is in
            table.prefetch(nxt)
        if compute_s:  # timed: a loaded machine oversleeps, which is no I/O's doing
            c = time.perf_counter()
            time.sleep(compute_s)
            slept += time.perf_counter() - c
    seconds = time.perf_counter() - t - slept
    after = io.read_bytes()
    s = table.stats()
    tokens = len(ids)
    return {"tokens": tokens, "rows": s["rows"], "seconds": seconds,
            "rows_per_s": s["rows"] / seconds, "us_per_token": seconds / tokens * 1e6,
            "pages_per_s": s["distinct_pages"] / seconds if table.mode != "ram" else None,
            "hints_per_token": s["hints"] / tokens,
            "kib_read_per_token": ((after - before) / tokens / 1024) if before is not None else None,
            "direct": s["direct"]}


def _drop(path: Path, source: PleSource) -> float:
    """Drop the file's cached pages; the share of the table's pages still cached after."""
    io.drop_cache(path)
    cached, total = io.resident(path, source.offset, source.nbytes)
    return cached / total if total else 0.0


def fio_roof(path: Path, source: PleSource, depth: int, seconds: float = 3.0) -> dict | None:
    """fio's random 4 KiB O_DIRECT read rate over the table's bytes, `depth` threads of psync
    (what the reader's pool does); None when fio is not installed."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    start = source.offset // PAGE * PAGE
    size = (source.offset + source.nbytes - start) // PAGE * PAGE
    cmd = [exe, "--name=ple-roof", f"--filename={path}", "--readonly", "--rw=randread", "--bs=4k",
           "--direct=1", "--ioengine=psync", f"--numjobs={depth}", "--thread", "--group_reporting",
           f"--offset={start}", f"--size={size}", "--time_based", f"--runtime={seconds:g}",
           "--randrepeat=0", "--norandommap", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["fio failed"]}
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]["read"]
    pct = job["clat_ns"].get("percentile", {})
    return {"iops": job["iops"], "mb_per_s": job["bw_bytes"] / 1e6, "depth": depth,
            "lat_us": job["clat_ns"]["mean"] / 1e3,
            "p50_us": pct.get("50.000000", 0) / 1e3, "p99_us": pct.get("99.000000", 0) / 1e3}


def run(args) -> int:
    fmt = quant.get(args.format)
    row_bytes = fmt.row_bytes(ROW_DIM)
    rows = args.rows or DEFAULT_BYTES // row_bytes
    modes = args.modes or list(MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--modes: unknown {', '.join(bad)}; choose from {', '.join(MODES)}")
    path = table_path(args, fmt, rows)
    if not path.is_file():
        write_table(path, fmt, rows)
    source = find_ple(path)
    avail = io.mem_available()
    results, notes = [], []
    seed = 1
    for mode in modes:
        if mode == "ram" and avail is not None and source.nbytes > avail * 0.8:
            notes.append(f"ram skipped: the table ({gib(source.nbytes)}) does not fit in 80% of "
                         f"MemAvailable ({gib(avail)})")
            continue
        kind = "mmap" if mode.startswith("mmap") else mode
        for pattern, ubatch in (("decode", 1), ("prefill", args.ubatch)):
            ids = probe_ids(source.rows, args.tokens, seed=seed)  # fresh rows for each cold run
            seed += 1
            left = _drop(path, source)
            table = PleTable(source, kind, depth=args.depth, prefetch=mode != "mmap-nohint")
            try:
                for state in ("cold", "warm"):
                    r = run_pattern(table, ids, ubatch, args.compute_us / 1e6)
                    r.update(mode=mode, pattern=pattern, cache=state, cached_before=left if state == "cold" else None)
                    if mode == "ram":
                        r.update(load_s=table.load_s, locked=table.locked)
                    results.append(r)
            finally:
                table.close()
    roof = fio_roof(path, source, args.depth)
    if roof is None:
        notes.append("fio row skipped: fio is not installed (Debian/Ubuntu: apt-get install fio)")
    elif "error" in roof:
        notes.append(f"fio row skipped: fio failed: {roof['error'][0]}")
        roof = None
    _drop(path, source)  # auto measures a cold start, as a server's first one
    _, auto_line = choose_mode(source, depth=args.depth, mem_available=avail)
    # and as on a machine where the table does not fit beside the model: mmap or direct
    _drop(path, source)
    _, auto_tight = choose_mode(source, depth=args.depth, mem_available=0)
    out = {"machine": machine(), "file": str(path), "format": fmt.name, "rows": source.rows,
           "table_bytes": source.nbytes, "depth": args.depth, "tokens": args.tokens,
           "ubatch": args.ubatch, "compute_us": args.compute_us, "results": results, "fio": roof, "auto": auto_line, "auto_without_ram": auto_tight, "notes": notes,
           "ratios": _ratios(results, roof)}
    emit(out, _table(out), args.json)
    return 0


def _find(results, mode, pattern, cache):
    return next((r for r in results if (r["mode"], r["pattern"], r["cache"]) == (mode, pattern, cache)), None)


def _ratios(results, roof) -> dict:
    out = {}
    for pattern in ("decode", "prefill"):
        for cache in ("cold", "warm"):
            d = _find(results, "direct", pattern, cache)
            if d and roof:
                out[f"direct_vs_fio_{pattern}_{cache}"] = d["pages_per_s"] / roof["iops"]
            h, n = _find(results, "mmap", pattern, cache), _find(results, "mmap-nohint", pattern, cache)
            if h and n:
                out[f"mmap_hints_vs_none_{pattern}_{cache}"] = h["rows_per_s"] / n["rows_per_s"]
    return out


def _table(out: dict) -> str:
    cols = [("mode", "mode"), ("pattern", "pattern"), ("cache", "cache"), ("rows_per_s", "rows/s"),
            ("pages_per_s", "pages/s"), ("us_per_token", "µs/token"), ("hints_per_token", "hints/token"),
            ("kib_read_per_token", "KiB read/token"), ("cached", "cached before")]
    rows = []
    for r in out["results"]:
        r = dict(r)
        r["cached"] = f"{r['cached_before']:.1%}" if r.get("cached_before") is not None else None
        if r["mode"] == "direct" and not r["direct"]:
            r["mode"] = "direct (buffered: O_DIRECT refused)"
        rows.append(r)
    roof = out["fio"]
    if roof:
        rows.append({"mode": f"fio 4 KiB randread, {roof['depth']} jobs", "pattern": "-", "cache": "O_DIRECT",
                     "pages_per_s": roof["iops"], "us_per_token": HEADS * 1e6 / roof["iops"]})
    head = (f"PLE table {out['file']}: {out['rows']:,} rows of {ROW_DIM} {out['format']} "
            f"({gib(out['table_bytes'])}); {out['tokens']} tokens a run, 16 rows a token; "
            f"prefill ubatch {out['ubatch']}; direct depth {out['depth']}"
            + (f"; {out['compute_us']:g} µs of compute a step (slept, left out of µs/token)" if out["compute_us"] else ""))
    lines = [head, "", markdown(rows, cols), ""]
    ram = next((r for r in out["results"] if r["mode"] == "ram"), None)
    if ram:
        lines.append(f"ram: loaded in {ram['load_s']:.1f} s ({out['table_bytes'] / ram['load_s'] / 1e9:.2f} GB/s), "
                     f"{'locked' if ram['locked'] else 'NOT locked'}; hints issued: "
                     f"{sum(r['hints_per_token'] for r in out['results'] if r['mode'] == 'ram'):.0f}")
    for k, v in out["ratios"].items():
        what = k.replace("_", " ").replace("vs", "/").replace("mmap hints", "mmap+hints").replace(" none", " mmap without hints")
        lines.append(f"{what}: {v:.2f}x" if "fio" not in k else f"{what} (pages/s / IOPS): {v:.0%}")
    if roof:  # a decode step waits for the slowest of its 16 reads: the tail sets its pace
        lines.append(f"fio latency at depth {roof['depth']}: mean {roof['lat_us']:,.0f} µs, p50 "
                     f"{roof['p50_us']:,.0f} µs, p99 {roof['p99_us']:,.0f} µs (a decode step waits "
                     f"for the slowest of its 16 reads)")
    lines.append(f"auto: {out['auto']}")
    lines.append(f"auto where the table does not fit in RAM: {out['auto_without_ram']}")
    cold = [r["cached_before"] for r in out["results"] if r.get("cached_before") is not None]
    if cold:
        lines.append(f"cold runs: posix_fadvise(DONTNEED) left at most {max(cold):.1%} of the table's pages "
                     f"cached (mincore); a VM's host may still cache the disk image, which only the "
                     f"fio roof and the KiB-read column can hint at")
    lines += out["notes"]
    return "\n".join(lines)
