"""flash-shape built in memory (strata.convert.flash_shape_memory): `strata bench model -m
flash-shape[:LAYERS]` loads it through the loader a GGUF file goes through, reports pp,
tg, the launches of its decode step traced on fake CUDA and what its tiers moved; on
fake CUDA held to a small card's budget the placement takes an expert cache over pinned
host memory and leaves the PLE table in host memory, and the step still asks the host
nothing.

At the real counts (512 experts, top-10, vocabulary 248,320) one layer's bench takes
about two minutes on a busy 2-core machine (the torch path dequantizes each routed
IQ3_XXS expert a call), so the command runs here with 16 experts a layer of which a
token takes 2 and a vocabulary of 512, as tests/strata/test_flash_shape.py writes them:
counts, not widths; every width is real."""
from __future__ import annotations

import contextlib
import functools
import io
import math
import re

import numpy as np
import pytest
import torch

from strata.convert import flash_shape_memory as fsm
from strata.names import qwen4exp as n

SMALL = dict(experts=16, top_k=2, vocab=512)
NUM = r"(\d[\d,]*(?:\.\d+)?)"


def test_tensors_are_made_on_demand_and_equal_each_time():
    """The tensor table says every tensor's format, shape and size with no memory behind it;
    the blocks are made at each read, from the tensor's own generator: the same bytes each
    time, whatever was read before."""
    g = fsm.flash_shape_memory(1, 1000, **SMALL)
    stand_in = g.tensors[n.blk(0, n.MOE["gate_exps"])]
    assert stand_in.data.strides == (0, 0) and stand_in.nbytes == 16 * 640 * 2560 * 98 // 256
    a = g.tensor(n.PLE_TABLE).data
    g.tensor(n.OUTPUT)
    b = g.tensor(n.PLE_TABLE).data
    assert a.shape == (1000, 90) and a is not b and np.array_equal(a, b)
    assert g.arch == n.ARCH and g.get(f"{n.ARCH}.expert_count") == 16


def _cli(*argv) -> tuple[int, str, str]:
    from strata.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def test_bench_model_says_what_to_shrink_when_the_blocks_would_not_fit_in_ram(monkeypatch):
    """On the CPU every block is made in RAM: past 90% of what is available the command
    stops before making any, with the PLE table's share, and names fewer layers only
    where there are more than one."""
    from strata.storage import io as sio
    monkeypatch.setattr(sio, "mem_available", lambda: 2**30)
    rc, _, err = _cli("bench", "model", "-m", "flash-shape:1", "--device", "cpu")
    m = re.search(rf"flash-shape:1: {NUM} GiB of blocks \({NUM} GiB the PLE table's\), more than 90% of the 1.0 "
                  rf"GiB of RAM available; give a smaller PLE table \(--rows 65536\)\n", err)
    assert rc == 2 and m and 26 < float(m[2]) < float(m[1]), err
    rc, _, err = _cli("bench", "model", "-m", "flash-shape:2", "--rows", 65536, "--device", "cpu")
    assert rc == 2 and "(--rows 65536) or fewer layers (flash-shape:1)" in err, err


@pytest.mark.slow  # 14 s alone on 2 cores, 30-36 s beside other jobs
def test_bench_model_flash_shape_on_the_cpu(monkeypatch):
    """`strata bench model -m flash-shape:1 --rows 65536 --device cpu`: the plan lines, a row
    each for pp and tg with finite rates, the model's plan line (built in memory, one layer),
    the launches of its decode step on a GPU traced on fake CUDA, and what a token moved."""
    monkeypatch.setattr(fsm, "flash_shape_memory", functools.partial(fsm.flash_shape_memory, **SMALL))
    n_threads = torch.get_num_threads()
    try:
        rc, out, err = _cli("bench", "model", "-m", "flash-shape:1", "--rows", 65536, "--device", "cpu",
                            "-p", 4, "-n", 2, "-r", 1, "-t", 1)
    finally:
        torch.set_num_threads(n_threads)
    assert rc == 0, err
    assert "strata: plan: qwen4exp on cpu" in err and "PLE table: its blocks made in memory (6 MiB IQ4_NL, no file)" in err
    for test in ("pp4", "tg2"):
        m = re.search(rf"\| strata \| flash-shape-1l-65536rows-16x2-512v \(in memory\) \|\s+1 \|\s+{test} \|"
                      rf"\s+{NUM} ± {NUM} \|", out)
        assert m and math.isfinite(float(m[1])) and float(m[1]) > 0, out
    m = re.search(rf"load {NUM} s, peak RSS {NUM} MiB; a decode step reads {NUM} MiB of weights", out)
    assert m and all(float(x.replace(",", "")) > 0 for x in m.groups()), out
    assert "Flash-Shape 1L (qwen4exp, 1 layers: 1 DeltaNet + 0 attention, dim 2560 x 4 streams, 16 experts " \
           "top-2" in out
    m = re.search(rf"a decode step on a GPU \(bfloat16, Triton kernels, experts device, PLE in memory, its CUDA graph's "
                  rf"step, traced on fake CUDA\): {NUM} kernel launches \({NUM} a layer\): {NUM} Triton, {NUM} torch", out)
    assert m, out
    launches, triton, torch_ops = int(m[1]), int(m[3]), int(m[4])
    assert launches == triton + torch_ops and triton > 0 and 20 < launches < 400
    # the tg run's 2 timed steps and its untimed first (a graph's capture on CUDA)
    assert re.search(rf"a tg run's first step, untimed there \(on CUDA it captures the decode graph\), took {NUM} ms",
                     out), out
    assert re.search(r"a decoded token \(over the tg runs' 3 steps\): no PCIe \(the model computes on the CPU\); experts "
                     rf"\w+: expert hit rate n/a .*, {NUM} hits and 0.0 misses a token", out), out


def test_a_small_cards_placement_keeps_the_table_and_expert_misses_on_the_host(monkeypatch):
    """flash-shape:1 on fake CUDA held to a card of 1 GiB: the placement takes a cache of
    the experts over pinned host memory and leaves the PLE table in host memory, read by the
    GPU over PCIe; a decode step reads nothing on the host. The tiers copy the experts'
    blocks where they hold them, so the store keeps only their formats and shapes, not the
    blocks made for it (at flash-shape, 50 GiB of host RAM twice over); and a trace, on zeros
    that stand in for the blocks, repacks none of them into the device layout."""
    from strata.imatrix import _gate_up
    from strata.load import Options, build, decide
    from strata.runtime.trace import fake_cuda, trace
    from strata.storage import expert_sources
    real_pack = expert_sources.layout.pack

    def pack(q, fmt):  # host memory's bytes, not a fake device's shapes
        assert q.device.type != "cpu", "a trace repacked blocks in host memory"
        return real_pack(q, fmt)
    monkeypatch.setattr(expert_sources.layout, "pack", pack)
    g = fsm.flash_shape_memory(1, 65536)
    with fake_cuda():
        plan = decide(g, Options(device="cuda", kernels="triton", gpu_mem_gib=1.0, ram_gib=64, vram_reserve_mib=0))
        assert plan.experts.tier.startswith("cache:") and plan.experts.tier.endswith(":host"), plan.lines(False)
        assert plan.ple.host and plan.placement.ple_where == "ram"
        model = build(plan)
        assert "in host memory, read by the GPU over PCIe" in model.plan_line(), model.plan_line()
        state = model.new_cache(8)
        trace(lambda: model(torch.tensor([1]), state))
        t = trace(lambda: model(torch.tensor([4]), state))
    assert t.launches > 0 and model.ple.table.stats()["pcie_bytes"] == 2 * 16 * 90
    store = model.layers[0].moe.experts
    assert any(f.layout != "gguf" for f in store.fmts), store.fmts  # the layout a trace would have packed
    assert not store.blocks_kept and all(t.data.strides == (0, 0) for t in store.tensors)
    assert [t.shape for t in store.tensors] == [g.tensors[name].shape for name in store.names]
    with pytest.raises(ValueError, match=r"ffn_gate_exps.*keep no host copy.*from a GGUF file"):
        _gate_up(store, 0, "cpu")


def test_a_placement_with_no_room_for_a_model_made_in_memory_stops_there(flash_tiny_gguf):
    """Where the placement finds no room in VRAM or RAM for a part, a file's is read from
    the drive (tests/strata/test_load_plan.py); flash-shape's is made in memory, with no
    file to read it from, so the placement stops, naming the part, not the first read."""
    import dataclasses

    from strata.convert.flash_shape import REAL
    from strata.load import Options, decide
    from strata.runtime.trace import fake_cuda
    from strata.storage import placement as pl
    g = fsm.flash_shape_memory(1, 65536)
    shape = pl.shape_of(g)
    assert not shape.on_drive
    with fake_cuda(), pytest.raises(ValueError, match=r"Flash-Shape 1L is made in memory, with no file to read "
                                                      r"from: its experts \(1\.0 GiB\) need the VRAM or 90% of the "
                                                      r"host RAM left \(0\.0 GiB\); give more --ram"):
        decide(g, Options(device="cuda", kernels="triton", gpu_mem_gib=1.0, ram_gib=0.001, vram_reserve_mib=0))
    real_table = dataclasses.replace(shape, ple_rows=REAL["ple_rows"])  # 26.8 GiB: neither 8 GiB of VRAM nor 1 of RAM
    with pytest.raises(ValueError, match=r"its PLE table \(26\.8 GiB\)"):
        pl.place(real_table, pl.Machine(1, 8 * 2**30, 2**30, 0))
    assert pl.place(real_table, pl.Machine(1, 8 * 2**30, 64 * 2**30, 0)).ple_where == "ram"
    assert pl.shape_of(flash_tiny_gguf).on_drive  # a file's model


def test_plan_takes_flash_shape_as_bench_model_builds_it():
    """`strata plan flash-shape[:LAYERS]`: the placement `bench model -m flash-shape`
    would make on that card, or on the CPU the load plan without a drive's reads."""
    rc, out, err = _cli("plan", "flash-shape", "--gpu-mem", 24, "--ram", 100)
    assert rc == 0, err
    assert "placement of Flash-Shape 48L on 1 x 24.0 GiB GPU" in out and re.search(r"--experts cache:\d+:host", out), out
    rc, out, err = _cli("plan", "flash-shape:1", "--device", "cpu")
    assert rc == 0 and "PLE table: its blocks made in memory (27466 MiB IQ4_NL, no file)" in out, (out, err)
    assert "--experts default: dense copies while STRATA_DENSE_MIB lasts, else the blocks made in memory" in out
    rc, _, err = _cli("plan", "flash-shape:1", "--device", "cpu", "--json")
    assert rc == 2 and "flash-shape:1 is made in memory and reads none" in err, err


def test_the_decode_timing_line_says_the_launches_a_step():
    from strata.load.launches import StepLaunches
    from strata.runtime.timing import StepTimer
    from strata.runtime.trace import Trace

    class Model:
        step_launches = StepLaunches(8, "bf16", Trace(torch_ops={"mul": 700}, triton={"_gemv": 90}))

    line = StepTimer(Model()).line(1, 2.0)
    assert "790 launches a step on a GPU (98.8 a layer, traced)" in line, line
