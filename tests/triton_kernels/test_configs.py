"""triton_kernels.configs: the one place that picks tiles, with a device's tuned table and its
tiles per weight height N ("by_n", written by `strata bench kernels --tune`)."""
import json
import shutil

import pytest

import quant
from triton_kernels import configs, int8

DEVICE = "Test GPU 9000"


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """configs reading from tmp_path: the real default.json and a tuned table for DEVICE."""
    shutil.copy(configs.HERE / "default.json", tmp_path / "default.json")
    monkeypatch.setattr(configs, "HERE", tmp_path)
    tuned = {"gemv": {"Q8_0": {"block_n": 2, "block_u": 64,
                               "by_n": {"1024": {"block_n": 1, "block_u": 32}, "8192": {"block_n": 2, "block_u": 64},
                                        "1048576": {"block_n": 16, "block_u": 8}}}}}
    path = configs.write(DEVICE, tuned)
    assert path == tmp_path / "Test_GPU_9000.json" and json.loads(path.read_text()) == tuned
    return json.loads((tmp_path / "default.json").read_text())


def test_a_tuned_table_overrides_the_defaults_per_height(tables):
    base = tables["gemv"]
    assert configs.pick("gemv", "Q8_0") == {k: v for k, v in base.items() if not isinstance(v, dict)}
    # with no N: the format's own tiles (--tune's 4096 x 14336), the op's other keys kept
    got = configs.pick("gemv", "Q8_0", DEVICE)
    assert (got["block_n"], got["block_u"], got["num_warps"]) == (2, 64, base["num_warps"])
    assert "by_n" not in got
    for n, tiles in ((1, (1, 32)), (512, (1, 32)), (1024, (1, 32)), (1025, (2, 64)), (8192, (2, 64)),
                     (151936, (16, 8)), (1 << 21, (16, 8))):  # past the last bound: the last bound's
        got = configs.pick("gemv", "Q8_0", DEVICE, n=n)
        assert (got["block_n"], got["block_u"]) == tiles, n
    # a format the table does not name keeps the defaults at any height
    assert configs.pick("gemv", "Q4_0", DEVICE, n=512)["block_n"] == base["block_n"]


def test_the_gemv_launch_takes_the_tiles_of_its_height(tables, monkeypatch):
    monkeypatch.setattr(int8, "device_name", lambda device: DEVICE)
    fmt = quant.get("Q8_0")
    import torch
    cpu = torch.device("cpu")
    assert int8.gemv_launch(fmt, cpu, 512, 2560)[:2] == (1, 32)
    assert int8.gemv_launch(fmt, cpu, 4096, 14336)[:2] == (2, 64)
    assert int8.gemv_launch(fmt, cpu, 65536, 2560)[:2] == (16, 8)
    assert int8.gemv_launch(fmt, cpu, 65536, 2560, tiles=(4, 16))[:2] == (4, 16)  # explicit tiles win


def test_rdnas_entries_lie_over_amds(monkeypatch):
    """The "rdna" family (AMD's 32-lane waves) takes "hip"'s entries and its own over them:
    the unit GEMM's 8 warps for the formats whose 4-warp tile spills on gfx1100. A device's
    family follows its backend and lanes (configs.family_of)."""
    import torch

    from triton_kernels import backend
    cuda, hip, rdna = (configs.pick(op, fmt, family=f) for op, fmt, f in
                       (("gemm", "Q6_K", "cuda"), ("gemm", "Q6_K", "hip"), ("gemm", "Q6_K", "rdna")))
    assert (cuda["unit_num_warps"], hip["unit_num_warps"], rdna["unit_num_warps"]) == (4, 4, 8)
    assert configs.pick("gemm", "Q4_K", family="rdna")["unit_num_warps"] == 4
    assert configs.pick("gemv", "Q4_0", family="rdna")["block_n"] == configs.pick("gemv", "Q4_0", family="hip")["block_n"]
    gpu = torch.device("cuda", 0)
    for target, lanes, family in (("cuda", 32, "cuda"), ("hip", 64, "hip"), ("hip", 32, "rdna")):
        monkeypatch.setattr(backend, "_target", (target, lanes))  # as the compile replay sets it
        assert configs.family(gpu) == family, (target, lanes)
