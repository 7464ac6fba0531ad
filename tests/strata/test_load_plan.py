"""The plan is the decision: for each expert tier and PLE mode, the model built from a
LoadPlan holds exactly what the plan says, and the plan's lines say it."""
import pytest
import torch

from strata.load import Options, build, decide

# (--experts, --ple-io): every tier and every PLE mode, paired to keep the loads few
CASES = [(None, None), ("device", "ram"), ("host", "mmap"), ("cache:8:host", "direct"),
         ("cache:4:file", "auto"), ("file", "mmap"), ("packed", "direct"), ("blocks", None)]


@pytest.mark.parametrize("experts,ple_io", CASES)
def test_the_model_holds_what_its_plan_says(flash_tiny_gguf, flash_tiny_pack, experts, ple_io):
    tiny, pack_dir = flash_tiny_gguf, flash_tiny_pack
    opts = Options(dtype=torch.float32, device="cpu", kernels="torch", experts=experts,
                   experts_dir=str(pack_dir), experts_io_depth=4, ple_io=ple_io, ple_io_depth=4)
    plan = decide(tiny, opts)
    model = build(plan)  # build raises when the model differs from the plan
    assert plan.check(model) == []
    stores = {l.moe.experts.tier for l in model.layers}
    table = getattr(model.ple.table, "table", None)
    if experts is None:
        assert stores <= {"dense", "blocks"}
    else:
        assert stores == {experts if experts == "blocks" else experts}
        assert all(l.moe.experts.kernels == "torch" for l in model.layers)
    assert (table.mode if table is not None else None) == plan.ple.mode
    if ple_io not in (None, "auto"):
        assert plan.ple.mode == ple_io
    lines = "\n".join(plan.lines(drive=False))
    assert f"--experts {experts or 'default'}: " in lines and "PLE table: " in lines
    assert "on cpu, torch kernels, float32" in lines
    if table is not None:
        table.close()


def test_a_model_that_differs_from_its_plan_is_named(flash_tiny_gguf):
    tiny = flash_tiny_gguf
    plan = decide(tiny, Options(dtype=torch.float32, device="cpu", kernels="torch", experts="host"))
    model = build(plan)
    other = decide(tiny, Options(dtype=torch.float32, device="cpu", kernels="torch", experts="file",
                                 ple_io="mmap"))
    bad = other.check(model)
    assert any("layer 0's experts: host" in b and "planned file" in b for b in bad), bad
    assert any("PLE table in the mapping, planned mmap" in b for b in bad), bad
    assert decide(tiny, Options(dtype=torch.bfloat16, device="cpu", kernels="torch", experts="host")).check(model)


def test_the_command_line_prints_the_plan_it_builds_from(flash_tiny_gguf, capsys):
    tiny = flash_tiny_gguf
    from strata.cli import main
    assert main(["generate", "-m", str(tiny.path), "--raw", "-n", "1", "--temperature", "0", "--dtype", "f32",
                 "--experts", "cache:4:host", "--ple-io", "mmap", "--device", "cpu", "Hi"]) == 0
    err = capsys.readouterr().err
    assert "strata: plan: qwen4exp on cpu, torch kernels, float32" in err
    assert "strata: --experts cache:4:host: given" in err
    assert "--ple-io mmap (given; not measured)" in err and "PLE table opened: mmap" in err
    assert "experts: cache:4:host (4 slots" in err and "PLE table mmap from" in err


def test_a_table_in_another_shard_is_found(tmp_path):
    """The releases keep the PLE table alone in shard 2 of 2: the plan of shard 1 finds it
    there, read through the page cache unless --ple-io says otherwise."""
    import numpy as np
    from gguf import GGUFValueType

    import quant
    from strata.gguf import open_gguf, write_gguf
    from strata.tensors import QTensor
    fmt = quant.get("Q8_0")
    q = fmt.quantize(np.random.default_rng(0).standard_normal((40, 32)).astype(np.float32))
    shard1, shard2 = tmp_path / "m-00001-of-00002.gguf", tmp_path / "m-00002-of-00002.gguf"
    write_gguf(shard1, "qwen4exp", {"qwen4exp.ple.layers": ([1], GGUFValueType.INT32)},
               [QTensor("token_embd.weight", quant.F32, (2, 32), np.zeros((2, 128), np.uint8))])
    write_gguf(shard2, "qwen4exp", {}, [QTensor("per_layer_token_embd.weight", fmt, (40, 32), q)])
    g = open_gguf(shard1)
    plan = decide(g, Options(device="cpu", kernels="torch"))
    assert plan.ple.mode == "mmap" and plan.ple.source.path == shard2 and "--ple-io mmap" in plan.ple.why
    direct = decide(g, Options(device="cpu", kernels="torch", ple_io="direct", ple_io_depth=2))
    assert (direct.ple.mode, direct.ple.depth, direct.ple.source.rows) == ("direct", 2, 40)


@pytest.mark.parametrize("where, mode, host", [("vram", None, False), ("ram", None, True), ("drive", "direct", False)])
def test_the_ple_table_goes_where_the_gpus_placement_puts_it(flash_tiny_gguf, where, mode, host):
    """No --ple-io on a GPU: the table's blocks in VRAM, in host memory read over PCIe, or,
    where the placement found no room in RAM, read from the drive with direct I/O (never
    held in host memory, nor copied to the GPU)."""
    from types import SimpleNamespace

    from strata.load.plan import _ple
    got = _ple(flash_tiny_gguf, Options(device="cuda", kernels="triton"), SimpleNamespace(ple_where=where))
    assert (got.mode, got.host) == (mode, host), got
    assert ("keeps it on the drive" in got.why) == (where == "drive") and ("host memory" in got.why) == host


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_cpu_plan_says_what_the_cpus_vector_units_decided(flash_tiny_gguf, native, monkeypatch):
    """One `cpu:` line: the ISA, whether matmuls of many rows run in float32 (no bfloat16 dot
    products) and whether the int8-code matmuls are on (AVX-512)."""
    from triton_kernels import backend
    monkeypatch.setenv("STRATA_CPU_BF16", native)
    lines = decide(flash_tiny_gguf, Options(dtype=torch.bfloat16, device="cpu", kernels="torch")).lines(drive=False)
    cpu = [line for line in lines if line.startswith("cpu: ")]
    assert len(cpu) == 1 and torch.backends.cpu.get_cpu_capability() in cpu[0]
    rows = f"matmuls of {backend.UPCAST_ROWS} rows or more in float32"
    assert (rows in cpu[0]) == (native == "0")
    assert ("int8-code matmuls on" in cpu[0]) == backend.cpu_int8_vectors()
