"""The PLE table reader: every format in every I/O mode returns the rows as stored, and the
hints, the lock and the O_DIRECT fallback behave as the seeds ask."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers import examples

import quant
from strata.gguf.writer import write_gguf
from strata.storage import PLE_TENSOR, PleTable, choose_mode, find_ple, io
from strata.tensors import QTensor

FORMATS = ("F32", "F16", "BF16", "FP8_E4M3", "Q8_0", "Q4_0", "IQ4_NL")
MODES = ("ram", "mmap", "direct")
ROWS, DIM = 301, 160  # 90-byte IQ4_NL rows: many straddle a page boundary
SCALE = 0.0625  # FP8's global scale: a power of two, exact in bf16
REPO = Path(__file__).resolve().parents[2]


def _fmt(name: str) -> quant.Format:
    try:
        return quant.get(name)
    except ValueError:
        pytest.skip(f"{name} is not in quant/ yet: the FP8 legs run once quant.get({name!r}) works")


def _direct_ok(d: Path) -> bool:
    probe = d / ".odirect-probe"
    probe.write_bytes(b"\0" * io.PAGE)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """A directory where O_DIRECT works: the tmp dir, unless it is a tmpfs that refuses it,
    then one in the project's (ignored) .pytest_cache, on the project's disk."""
    d = tmp_path_factory.mktemp("ple")
    if _direct_ok(d):
        yield d
        return
    d = REPO / ".pytest_cache" / f"ple-direct-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def write_table(d: Path, name: str, rows: int = ROWS, seed: int = 0):
    """A table file of `rows` rows in format `name` and its raw bytes [rows, row_bytes]."""
    fmt = _fmt(name)
    x = np.random.default_rng(seed).standard_normal((rows, DIM)).astype(np.float32)
    q = fmt.quantize(x)
    if fmt.type_id is None:  # FP8: a safetensors file with the global bf16 scale, as the releases ship it
        from safetensors.torch import save_file
        path = d / f"ple-{name}-{rows}.safetensors"
        save_file({PLE_TENSOR: torch.from_numpy(q).view(torch.float8_e4m3fn),
                   PLE_TENSOR + "_scale": torch.tensor(SCALE, dtype=torch.bfloat16)}, str(path))
        return path, q, SCALE
    path = d / f"ple-{name}-{rows}.gguf"
    # another tensor first, so that the table does not start at the data section's start
    write_gguf(path, "qwen4exp", {}, [QTensor("token_embd.weight", quant.F32, (3, 32), np.zeros((3, 128), np.uint8)),
                                      QTensor(PLE_TENSOR, fmt, (rows, DIM), q)])
    return path, q, None


def expected(fmt, q, scale, ids) -> np.ndarray:
    x = fmt.dequantize(q[np.asarray(ids)])
    return x * np.float32(scale) if scale is not None else x


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit, NaN payloads aside (a quantized row can hold NaN codes)."""
    return a.shape == b.shape and bool(((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all())


@pytest.fixture(scope="module")
def table(disk):
    """(table, raw rows, scale) for a format and a mode: one file per format, opened once
    per mode for the whole module (Hypothesis draws ids, not files)."""
    files, tables = {}, {}

    def get(name: str, mode: str):
        if name not in files:
            files[name] = write_table(disk, name)
        if (name, mode) not in tables:
            path, q, scale = files[name]
            tables[name, mode] = (PleTable.open(path, mode, depth=4, say=lambda _m: None), q, scale)
        return tables[name, mode]
    yield get
    for t, _, _ in tables.values():
        t.close()


ids_strategy = st.lists(st.one_of(st.sampled_from([0, ROWS - 1]), st.integers(0, ROWS - 1)), min_size=1, max_size=40)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=examples(25))
@given(ids=ids_strategy)
def test_format_round_trip(table, name, mode, ids):
    """read_row, gather and gather_batch return the stored rows; dequantized, they equal
    the format's numpy codec (times the global scale) for any ids, duplicates included."""
    t, q, scale = table(name, mode)
    fmt = t.fmt
    ids = np.array(ids)
    assert np.array_equal(t.read_row(int(ids[0])), q[ids[0]])
    rows = t.gather(ids)
    assert np.array_equal(rows.rows(), q[ids])
    assert same(rows.dequantize(), expected(fmt, q, scale, ids))
    batch = [ids, ids[::-1].reshape(-1, 1), np.array([0, ROWS - 1, 0])]
    for got, want in zip(t.gather_batch(batch), batch):
        assert got.ids.shape == want.shape
        assert np.array_equal(got.rows(), q[want])
        assert same(got.dequantize(), expected(fmt, q, scale, want))
    if mode == "direct":  # really O_DIRECT: no silent fallback (the last page is short)
        assert t.stats()["direct"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_row_past_the_end_is_an_index_error_naming_the_row_count(table, name, mode):
    t, _, _ = table(name, mode)
    for bad in (ROWS, -1):
        with pytest.raises(IndexError, match=f"{ROWS:,} rows"):
            t.gather(np.array([0, bad]))
    with pytest.raises(IndexError, match=f"row {ROWS} is out of range"):
        t.read_row(ROWS)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_gather_kernel_on_the_rows_handed_over(table, name, mode):
    """The rows as handed to ple_gather (whole table zero-copy, or compact rows and
    remapped ids) give the reference, concatenated head-major."""
    ple = pytest.importorskip("triton_kernels.ple")
    t, q, scale = table(name, mode)
    ids = np.array([[0, ROWS - 1, 5, 5] * 4, [ROWS - 1] * 16, list(range(100, 116))])
    rows = t.gather(ids)
    inputs = rows.kernel_inputs()
    if mode != "direct":  # zero-copy: the kernel reads the table's own memory
        assert inputs["table"].data_ptr() == rows.table.ctypes.data
    out = ple.ple_gather(**inputs, out_dtype=torch.float32).numpy()
    assert same(out, expected(t.fmt, q, scale, ids).reshape(3, 16 * DIM))


def test_hints_are_counted_where_they_are_issued(disk, monkeypatch):
    """0 on a locked table, > 0 on mmap, 0 with --no-ple-prefetch, 0 in direct mode."""
    calls = []
    real = io.advise_willneed
    monkeypatch.setattr(io, "advise_willneed", lambda mm, spans: (calls.append(len(spans)), real(mm, spans)))
    # 54 KiB: it locks even under the old 64 KiB default RLIMIT_MEMLOCK
    path, q, _ = write_table(disk, "IQ4_NL", rows=600)
    steps = np.random.default_rng(3).integers(0, 600, (6, 16))

    def hints(mode, prefetch=True):
        calls.clear()
        with PleTable.open(path, mode, prefetch=prefetch, depth=4, say=lambda _m: None) as t:
            for k, step in enumerate(steps):  # decode: hint the next token, gather this one
                if k + 1 < len(steps):
                    t.prefetch(steps[k + 1:k + 2])
                assert np.array_equal(t.gather(step[None]).rows()[0], q[step])
            assert t.stats()["hints"] == len(calls)
            return len(calls), t.locked

    n, locked = hints("ram")
    assert locked, f"mlock of a 54 KiB table failed (RLIMIT_MEMLOCK {io.memlock_limit()})"
    assert n == 0
    n, _ = hints("mmap")
    assert n >= len(steps) - 1  # at least one call a step
    assert hints("mmap", prefetch=False)[0] == 0
    assert hints("direct")[0] == 0


def test_hint_reads_the_pages(disk):
    """A step's hint is one call (where process_madvise works) and brings its rows' pages
    into the page cache."""
    path, _, _ = write_table(disk, "Q8_0", rows=20000, seed=1)
    src = find_ple(path)
    io.drop_cache(path)
    if io.resident(path, src.offset, src.nbytes)[0]:
        pytest.skip("posix_fadvise(DONTNEED) does not drop this file's pages here")
    ids = np.arange(0, 20000, 1250)
    runs = io.page_runs(src.offset + ids * src.row_bytes, src.row_bytes)
    wanted = np.concatenate([np.arange(a, b) for a, b in zip(*runs)])
    with PleTable(src, "mmap") as t:
        assert t.prefetch(ids) == (1 if io._batched else len(runs[0]))  # process_madvise, else a madvise a run
        for _ in range(200):  # the reads are asynchronous
            if all(io.resident(path, p * io.PAGE, 1)[0] for p in wanted):
                break
            time.sleep(0.01)
        assert all(io.resident(path, p * io.PAGE, 1)[0] for p in wanted)


def test_refused_mlock_leaves_the_table_in_ram_with_one_note(disk, monkeypatch):
    path, q, _ = write_table(disk, "Q4_0", rows=500)
    monkeypatch.setattr(io, "mlock", lambda buf, n: errno.EPERM)
    said = []
    with PleTable.open(path, "ram", say=said.append) as t:
        assert not t.locked
        assert np.array_equal(t.gather(np.array([0, 499])).rows(), q[[0, 499]])
        t.prefetch(np.array([1, 2]))
        assert t.stats()["hints"] == 0
    note = [m for m in said if "mlock" in m]
    assert len(note) == 1
    assert "RLIMIT_MEMLOCK is" in note[0] and "ulimit -l" in note[0] and "LimitMEMLOCK" in note[0] \
        and "CAP_IPC_LOCK" in note[0]


def test_ram_under_memlock_zero(disk):
    """In a process with RLIMIT_MEMLOCK 0 (and, as root, without CAP_IPC_LOCK) the lock is
    refused: the note says so, the table reads right, unlocked."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is not installed")
    cmd = [prlimit, "--memlock=0:0"]
    if os.geteuid() == 0:  # root locks past any limit unless CAP_IPC_LOCK goes
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv to drop CAP_IPC_LOCK")
        cmd = [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"] + cmd
    path, q, _ = write_table(disk, "IQ4_NL", rows=700, seed=2)
    code = textwrap.dedent(f"""
        import numpy as np
        from strata.storage import PleTable
        t = PleTable.open({str(path)!r}, "ram")
        print("locked", t.locked)
        np.save({str(disk / 'rows.npy')!r}, t.gather(np.array([0, 699, 3])).rows())
    """)
    out = subprocess.run(cmd + [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    assert "locked False" in out.stdout
    assert "mlock of the PLE table" in out.stderr and "RLIMIT_MEMLOCK is 0 bytes" in out.stderr
    assert np.array_equal(np.load(disk / "rows.npy"), q[[0, 699, 3]])


def test_direct_falls_back_when_open_refuses_o_direct(disk, monkeypatch):
    path, q, _ = write_table(disk, "Q8_0", rows=400, seed=4)

    def refuse(p):
        raise OSError(errno.EINVAL, "Invalid argument", str(p))
    monkeypatch.setattr(io, "open_direct", refuse)
    said = []
    with PleTable.open(path, "direct", say=said.append) as t:
        assert np.array_equal(t.gather(np.array([399, 0, 0])).rows(), q[[399, 0, 0]])
        assert t.stats()["direct"] is False
    assert any("refuses O_DIRECT (EINVAL at open)" in m and "buffered pread" in m for m in said)


def test_direct_falls_back_when_a_read_refuses_o_direct(disk, monkeypatch):
    path, q, _ = write_table(disk, "Q8_0", rows=400, seed=5)
    real = os.preadv

    def preadv(fd, bufs, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset)
    monkeypatch.setattr(os, "preadv", preadv)
    said = []
    with PleTable.open(path, "direct", depth=3, say=said.append) as t:
        ids = np.arange(0, 400, 7)
        assert np.array_equal(t.gather(ids).rows(), q[ids])
        assert t.stats()["direct"] is False
    assert sum("EINVAL at read" in m for m in said) == 1


def test_direct_reads_each_page_once_and_reads_ahead(disk):
    path, q, _ = write_table(disk, "IQ4_NL", rows=3000, seed=6)
    with PleTable.open(path, "direct", depth=4, say=lambda _m: None) as t:
        ids = np.array([7, 7, 7, 8, 2999])
        r = t.gather(ids)
        assert r.table.shape[0] == 3  # the distinct rows, and ids remapped into them
        assert np.array_equal(r.rows(), q[ids])
        t.prefetch(np.array([[100, 2000]]))  # the next step's rows start reading now
        assert np.array_equal(t.gather(np.array([[2000, 100]])).rows(), q[[[2000, 100]]])
        assert t.stats()["gathers_read_ahead"] == 1


def test_auto_measures_and_says_why(disk):
    path, _, _ = write_table(disk, "IQ4_NL", rows=5000, seed=7)
    said = []
    with PleTable.open(path, "auto", depth=4, say=said.append) as t:
        assert t.mode in MODES
    assert len(said) == 1
    line = said[0]
    assert f"--ple-io auto -> {t.mode}" in line and "rows/s decode|prefill" in line
    for mode in ("mmap", "direct"):
        assert f"{mode} " in line.split("rows/s")[1]
    # ram is a candidate only when the table fits beside the model in MemAvailable
    mode, line = choose_mode(find_ple(path), depth=4, budget_s=0.05, mem_available=100_000)
    assert mode in ("mmap", "direct") and "ram not tried" in line
    # an explicit mode always wins, and says that it was given
    said.clear()
    with PleTable.open(path, "mmap", say=said.append) as t:
        assert t.mode == "mmap"
    assert "--ple-io mmap (given; not measured)" in said[0]


def test_flags_and_the_table_in_another_shard(disk):
    """--ple-* flags parse where a command adds them; the table is found in a sibling
    shard of the model's GGUF; a file without it names the flag to use."""
    import argparse

    from strata.cli.args import add_ple_args, load_options
    fmt = quant.get("Q8_0")
    q = fmt.quantize(np.random.default_rng(8).standard_normal((50, DIM)).astype(np.float32))
    shard1 = disk / "m-00001-of-00002.gguf"
    write_gguf(shard1, "qwen4exp", {}, [QTensor("token_embd.weight", quant.F32, (2, 32), np.zeros((2, 128), np.uint8))])
    write_gguf(disk / "m-00002-of-00002.gguf", "qwen4exp", {}, [QTensor(PLE_TENSOR, fmt, (50, DIM), q)])
    p = argparse.ArgumentParser()
    add_ple_args(p)
    args = p.parse_args(["--ple-io", "direct", "--ple-io-depth", "2", "--no-ple-prefetch"])
    o = load_options(args)
    with PleTable.open(o.ple_file or shard1, o.ple_io, depth=o.ple_io_depth, prefetch=o.ple_prefetch,
                       say=lambda _m: None) as t:
        assert (t.mode, t.depth, t.reading_ahead) == ("direct", 2, False)
        assert t.source.path.name == "m-00002-of-00002.gguf"
        assert np.array_equal(t.read_row(49), q[49])
    lone = disk / "lone.gguf"
    write_gguf(lone, "qwen4exp", {}, [QTensor("token_embd.weight", quant.F32, (2, 32), np.zeros((2, 128), np.uint8))])
    with pytest.raises(ValueError, match="--ple-gguf"):
        find_ple(lone)


@pytest.mark.parametrize("mode", MODES)
def test_rows_across_a_page_boundary(table, mode):
    t, q, _ = table("IQ4_NL", mode)
    starts = t.source.offset + np.arange(ROWS) * t.row_bytes
    across = np.flatnonzero(starts // io.PAGE != (starts + t.row_bytes - 1) // io.PAGE)
    assert across.size >= 5
    assert np.array_equal(t.gather(across).rows(), q[across])
    assert np.array_equal(t.read_row(int(across[-1])), q[across[-1]])


def test_bench_without_fio_skips_only_that_row(tmp_path, monkeypatch, capsys):
    import argparse

    from strata.bench import ple as bench
    monkeypatch.setattr(bench.shutil, "which", lambda _name: None)
    args = argparse.Namespace(format="Q8_0", rows=3000, file=str(tmp_path / "t.gguf"), tokens=8, ubatch=4,
                              depth=2, modes=["mmap", "mmap-nohint", "direct"], json=False,
                              compute_us=100.0)
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "fio row skipped: fio is not installed" in out
    for mode in ("mmap", "mmap-nohint", "direct"):
        assert f" {mode} |" in out  # its rows are there
    assert "mmap+hints / mmap without hints" in out and "auto: --ple-io auto ->" in out


def test_hints_pause_while_they_start_no_reads(disk):
    """mmap: decode hints over cached pages are dropped after IDLE_HINTS in a row (one step
    in PROBE_EVERY + 1 still hints), a prefill step's when a sample of its pages is cached;
    on a cold table every step is hinted."""
    from strata.storage.ple import IDLE_HINTS, PROBE_EVERY
    if io.read_bytes() is None:
        pytest.skip("no /proc/self/io read accounting: every step is hinted here")
    path, _, _ = write_table(disk, "IQ4_NL", rows=100_000, seed=9)
    src = find_ple(path)
    steps = np.random.default_rng(9).integers(0, src.rows, (60, 16))
    io.drop_cache(path)
    if io.resident(path, src.offset, src.nbytes)[0]:
        pytest.skip("posix_fadvise(DONTNEED) does not drop this file's pages here")
    with PleTable(src, "mmap") as t:
        before = io.read_bytes()
        for step in steps[:12]:
            t.prefetch(step)
        if io.read_bytes() == before:
            pytest.skip("the kernel does not account this process's reads (/proc/self/io)")
        assert t.stats()["hints_skipped"] == 0  # cold: each hint started reads
        big = np.random.default_rng(10).integers(0, src.rows, 200)  # a prefill step
        assert t.prefetch(big) >= 1  # its sampled pages are not all cached: hinted
        t.gather(np.arange(src.rows)).rows()  # now every page is cached
        assert t.prefetch(big) == 0 and t.stats()["hints_skipped"] == 1
        t.reset_stats()
        for step in steps[12:12 + IDLE_HINTS + 2 * (PROBE_EVERY + 1)]:
            t.prefetch(step)
        s = t.stats()
        assert s["hints_skipped"] > 0 and s["hints"] >= IDLE_HINTS
        assert s["hints"] + s["hints_skipped"] == IDLE_HINTS + 2 * (PROBE_EVERY + 1)
