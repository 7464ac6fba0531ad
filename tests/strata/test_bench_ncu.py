"""`strata bench kernels --ncu` (strata.bench.ncu) without a GPU: ncu's CSV read into one row a
kernel, the rows told apart by the child's markers, and the child's launches run through the
Triton interpreter at tiny shapes. ncu itself runs under scripts/gpu_check.sh."""
import csv
import io
import os

import pytest

from strata.bench import ncu

HEAD = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
        "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]


def _csv(kernels: list[tuple[str, dict[str, tuple[str, str]]]]) -> str:
    """ncu's --csv layout: its ==PROF== lines, then one row a kernel and metric."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 4242 (/usr/bin/python3.12)\n")
    w = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(HEAD)
    for i, (name, metrics) in enumerate(kernels):
        for metric, (unit, value) in metrics.items():
            w.writerow([i, 4242, "python3.12", "127.0.0.1", name, 1, 7, "(128, 1, 1)", "(512, 1, 1)", 0, "9.0",
                        "Command line profiler metrics", metric, unit, value])
    out.write("==PROF== Disconnected from process 4242\n")
    return out.getvalue()


def _metrics(us: str, mbytes: str, pct: str, sectors: str, requests: str) -> dict:
    return {"gpu__time_duration.sum": ("usecond", us), "dram__bytes_read.sum": ("Mbyte", mbytes),
            "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", pct),
            "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": ("sector", sectors),
            "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": ("request", requests)}


MARK = ("void at::cuda::(anonymous namespace)::spin_kernel(long)", {"gpu__time_duration.sum": ("nsecond", "1,024")})


def test_rows_are_read_per_kernel_and_split_by_the_markers():
    text = _csv([MARK, ("_quantize_x_kernel", _metrics("2.5", "0.03", "1.2", "1,792", "112")),
                 ("_gemv_dp4a_kernel", _metrics("20", "33.03", "38.5", "2,064,384", "129,024")),
                 MARK, ("_moe_gate_up_kernel", _metrics("10", "9.8", "n/a", "0", "0"))])
    kernels = ncu.parse(text)
    assert [k["kernel"] for k in kernels] == ["spin_kernel", "_quantize_x_kernel", "_gemv_dp4a_kernel",
                                              "spin_kernel", "_moe_gate_up_kernel"]
    rows = ncu.assign(kernels, [("gemv", "Q4_0"), ("moe", "IQ3_XXS/IQ4_NL")])
    assert [(r["op"], r["format"], r["kernel"]) for r in rows] == [
        ("gemv", "Q4_0", "_quantize_x_kernel"), ("gemv", "Q4_0", "_gemv_dp4a_kernel"),
        ("moe", "IQ3_XXS/IQ4_NL", "_moe_gate_up_kernel")]
    gemv = rows[1]
    assert gemv["us"] == pytest.approx(20) and gemv["dram_mb"] == pytest.approx(33.03)
    assert gemv["dram_gb_per_s"] == pytest.approx(33.03e6 / 20e-6 / 1e9)  # the kernel's bytes over its time
    assert gemv["dram_pct_peak"] == pytest.approx(38.5)
    assert gemv["sectors_per_request"] == pytest.approx(16.0)  # thousands separators read
    assert rows[2]["dram_pct_peak"] is None and rows[2]["sectors_per_request"] is None  # n/a, no loads


def test_a_marker_count_that_disagrees_with_the_cases_is_an_error():
    kernels = ncu.parse(_csv([MARK, ("_gemv_dp4a_kernel", _metrics("20", "33", "38", "16", "1"))]))
    with pytest.raises(ValueError, match="1 markers in its output for 2 cases"):
        ncu.assign(kernels, [("gemv", "Q4_0"), ("gemv", "Q8_0")])
    with pytest.raises(ValueError, match="outside the 1 marked cases"):
        ncu.assign(ncu.parse(_csv([("_gemv_dp4a_kernel", _metrics("20", "33", "38", "16", "1"))])),
                   [("gemv", "Q4_0")])
    with pytest.raises(ValueError, match="unknown unit"):
        ncu.parse(_csv([("_gemv_dp4a_kernel", {"dram__bytes_read.sum": ("furlong", "3")})]))


def test_the_command_profiles_only_the_marked_window_with_the_clocks_left_alone():
    cmd = ncu.command("/usr/local/cuda/bin/ncu", "/tmp/x.csv", ["Q4_0", "IQ3_XXS"])
    assert cmd[cmd.index("--clock-control") + 1] == "none"
    assert cmd[cmd.index("--profile-from-start") + 1] == "off"
    assert cmd[cmd.index("--metrics") + 1].split(",") == list(ncu.METRICS)
    assert cmd[cmd.index("--print-units") + 1] == "base"  # bytes and seconds, not ncu's scaled units
    assert cmd[-3:] == ["-m", "strata.bench.ncu", "Q4_0,IQ3_XXS"]


def test_no_ncu_on_the_path_is_said(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="no `ncu` on PATH"):
        ncu.profile(["Q4_0"])


@pytest.mark.parametrize("stop", ["timeout", "interrupt"])
def test_an_ncu_past_its_time_is_stopped_with_what_it_runs(tmp_path, monkeypatch, stop):
    """ncu and the process under it are stopped at the timeout (gpu_check.sh's own limit
    is longer, so the error and the rows before it reach its log), and when the bench is
    interrupted (gpu_check.sh's `timeout -s INT`): ncu runs in a session of its own, which
    the signal does not reach, and would hold the GPU through the next step."""
    import signal
    import time
    stub = tmp_path / "ncu"
    pid = tmp_path / "child.pid"
    stub.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pid}\nwait\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    t = time.monotonic()
    if stop == "timeout":
        with pytest.raises(ValueError, match="ncu ran past 1 s and was stopped"):
            ncu.profile(["Q4_0"], timeout=1)
    else:
        def interrupt(*_):
            raise KeyboardInterrupt
        before = signal.signal(signal.SIGALRM, interrupt)
        signal.alarm(1)
        try:
            with pytest.raises(KeyboardInterrupt):
                ncu.profile(["Q4_0"], timeout=60)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, before)
    assert time.monotonic() - t < 30
    child = int(pid.read_text())
    for _ in range(50):  # the killed child is reaped by init a moment later
        if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"ncu's child {child} still runs")


def test_the_child_launches_every_case_through_the_interpreter():
    # the launch sequence ncu profiles, at tiny shapes on the CPU: GEMV, MoE, GEMM
    from triton_kernels.analysis.launches import record
    with record() as calls:
        ncu.child(["Q4_0"], device="cpu", small=True)
    ops = [c["op"] for c in calls]
    half = len(ops) // 2  # launched twice: once to compile, once behind the markers
    assert ops[:half] == ops[half:] and len(ncu.cases(["Q4_0"])) == 3
    assert ops[:half] == ["qmatmul", "moe", "qmatmul"], ops
