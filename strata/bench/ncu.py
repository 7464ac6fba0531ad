"""`strata bench kernels --ncu`: the hardware's own counters for the kernels the bench times.

Nsight Compute (`ncu`) runs a child process that launches, once each after a warm-up, the
decode GEMV of every format, the MoE decode and the prefill GEMM, at `bench kernels`'
shapes and in the engine's layout. Per kernel it reads the DRAM bytes read and the time
(so GB/s from DRAM itself, not from the weight bytes the bench assumes), the DRAM
throughput as a share of its peak, and the sectors per request of the global loads: 32-byte
sectors a warp-wide load instruction touches, 16 for lanes that read 16 contiguous bytes
each, 4 for contiguous 4-byte words, more where lanes read far apart.

ncu replays each kernel several times (once a group of counters) with the caches flushed
between passes; `--clock-control none` leaves the clocks as the bench ran them. Only the
launches between cudaProfilerStart and Stop are profiled, and before each case the child
launches torch's `spin_kernel` (torch.cuda._sleep) as a marker, so that the rows of ncu's
CSV, in launch order, are told apart by case whatever kernels each case launches.
"""
from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile

METRICS = {
    "gpu__time_duration.sum": "time",
    "dram__bytes_read.sum": "dram_read",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_peak",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "ld_sectors",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "ld_requests",
}
MARKER = "spin_kernel"
# ncu scales its units to the value (usecond, Mbyte, Ksector: decimal prefixes)
_SCALE = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "n": 1e-9, "u": 1e-6, "m": 1e-3}
_BASE = {"byte", "second", "sector", "request", "%"}


def _value(unit: str, text: str) -> float | None:
    """ncu's (unit, value) -> the value in bytes, seconds, counts or percent; None for n/a."""
    try:
        v = float(text.replace(",", ""))
    except ValueError:
        return None
    unit = unit.strip()
    if unit in _BASE or unit == "":
        return v
    for prefix, scale in _SCALE.items():
        if unit.startswith(prefix) and unit[len(prefix):] in _BASE:
            return v * scale
    raise ValueError(f"ncu: unknown unit {unit!r}")


def parse(text: str) -> list[dict]:
    """ncu's --csv output (one row a kernel and metric) -> one dict a kernel, in launch
    order: {"kernel": name, metric key of METRICS: value in base units}."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]  # not its ==PROF== lines
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        k = kernels.setdefault(row["ID"], {"kernel": base_name(row["Kernel Name"])})
        key = METRICS.get(row["Metric Name"])
        v = _value(row["Metric Unit"], row["Metric Value"]) if key else None
        if v is not None:
            k[key] = v
    return [kernels[i] for i in sorted(kernels, key=int)]


def base_name(name: str) -> str:
    """A kernel's function name from ncu's demangled one: `void at::(anonymous
    namespace)::spin_kernel(long)` -> spin_kernel; Triton's names stay as they are."""
    name = name.strip().removeprefix("void ")
    cut = len(name)
    for i, ch in enumerate(name):  # the first ( or < that does not follow a `::`
        if ch in "(<" and not name[:i].endswith("::"):
            cut = i
            break
    return name[:cut].rsplit("::", 1)[-1]


def assign(kernels: list[dict], cases: list[tuple[str, str]]) -> list[dict]:
    """Each kernel after the i-th marker belongs to cases[i]: rows for the table, with the
    derived columns."""
    rows, case = [], -1
    for k in kernels:
        if k["kernel"] == MARKER:
            case += 1
            continue
        if case < 0 or case >= len(cases):
            raise ValueError(f"ncu: kernel {k['kernel']} outside the {len(cases)} marked cases")
        t = k.get("time")
        req = k.get("ld_requests")
        rows.append({"op": cases[case][0], "format": cases[case][1], "kernel": k["kernel"],
                     "us": t * 1e6 if t else None,
                     "dram_mb": k["dram_read"] / 1e6 if "dram_read" in k else None,
                     "dram_gb_per_s": k["dram_read"] / t / 1e9 if t and "dram_read" in k else None,
                     "dram_pct_peak": k.get("dram_pct_peak"),
                     "sectors_per_request": k["ld_sectors"] / req if req else None})
    if case != len(cases) - 1:
        raise ValueError(f"ncu: {case + 1} markers in its output for {len(cases)} cases")
    return rows


def cases(formats: list[str]) -> list[tuple[str, str]]:
    from strata.bench.kernels import MOE_SHAPE
    return ([("gemv", f) for f in formats] + [("moe", f"{MOE_SHAPE[4]}/{MOE_SHAPE[5]}")]
            + [("gemm", f) for f in formats])


def child(formats: list[str], device: str = "cuda", small: bool = False) -> None:
    """What ncu runs: every case built, launched once to compile, then once each between
    cudaProfilerStart and Stop behind a marker. small: tiny shapes (the CPU test's)."""
    from strata.bench.kernels import GEMM_M, GEMV_SHAPE, MOE_SHAPE
    from triton_kernels import configs
    if small:  # the interpreter's larger tiles: the same bytes, fewer programs
        with configs.interpreter_tiles():
            return _launch(formats, device, (128, 512), (16, 2, 256, 256) + MOE_SHAPE[4:], 4)
    _launch(formats, device, GEMV_SHAPE, MOE_SHAPE, GEMM_M)


def _launch(formats, device, shape, moe_shape, m) -> None:
    import numpy as np
    import torch

    import quant
    from strata.bench.kernels import gemv_case, moe_case
    from triton_kernels import ops
    qmatmul, moe = ops.impl("qmatmul", "triton"), ops.impl("moe", "triton")  # as the engine calls them
    rng = np.random.default_rng(0)
    weights = [gemv_case(quant.get(f), rng, device, shape) for f in formats]  # the GEMV's and the GEMM's
    calls = [lambda q=q, x=x, fmt=fmt: qmatmul(x, q, fmt) for q, x, fmt in weights]
    args, _ = moe_case(rng, moe_shape, device)
    calls.append(lambda: moe(*args, path="dp4a"))
    xm = torch.from_numpy(rng.uniform(-1, 1, (m, shape[1])).astype(np.float32)).to(device, torch.bfloat16)
    calls += [lambda q=q, fmt=fmt: qmatmul(xm, q, fmt, path="gemm") for q, _, fmt in weights]
    assert len(calls) == len(cases(formats))
    for c in calls:
        c()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for c in calls:
        if cuda:
            torch.cuda._sleep(1)
        c()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def command(ncu: str, log: str, formats: list[str]) -> list[str]:
    # base units (byte, nsecond, ...): no scaled unit for _value to miss
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--print-units", "base",
            "--metrics", ",".join(METRICS), "--log-file", log,
            sys.executable, "-m", "strata.bench.ncu", ",".join(formats)]


def profile(formats: list[str], timeout: float = 200) -> list[dict]:
    """Run the child under ncu; one row a profiled kernel (see assign). Past `timeout`
    seconds ncu and the process it profiles are stopped (a session of their own: the
    child would otherwise hold the GPU on), and the error says so."""
    ncu = shutil.which("ncu")
    if ncu is None:
        raise ValueError("bench kernels --ncu: no `ncu` on PATH (Nsight Compute, part of the CUDA toolkit)")
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "ncu.csv")
        proc = subprocess.Popen(command(ncu, log, formats), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            text = open(log).read() if os.path.exists(log) else ""
            raise ValueError(f"bench kernels --ncu: ncu ran past {timeout:.0f} s and was stopped with the process "
                             f"it profiled: {(text + err).strip()[-800:]}") from None
        except BaseException:  # stopped from outside (Ctrl-C, timeout -s INT): ncu's session too
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        text = open(log).read() if os.path.exists(log) else ""
    kernels = parse(text)
    if proc.returncode != 0 or not kernels:  # ncu's own errors (==ERROR== ...) are in its log
        raise ValueError(f"bench kernels --ncu: ncu exited {proc.returncode} with no kernel read: "
                         f"{(text + err).strip()[-800:]}")
    return assign(kernels, cases(formats))


if __name__ == "__main__":  # the child ncu runs
    child(sys.argv[1].split(","))
