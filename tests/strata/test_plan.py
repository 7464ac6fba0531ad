"""The plan and the probe: the plan lines carry measured numbers, the drive reads per
prompt follow from the tiers and the page cache, and `strata probe --json` reports what
the seeds ask for (drive speed by depth, page cache, mlock limit, the modes picked)."""
from __future__ import annotations

import json
import re

import pytest

from strata import cli
from strata.hub import synth_flash_tiny
from strata.storage import plan

NUM = r"(\d+(?:\.\d+)?)"


@pytest.fixture(autouse=True)
def drive_cache(tmp_path, monkeypatch):
    # measurements go to a file of this test, not to the user's cache
    monkeypatch.setattr(plan, "_cache_file", lambda: tmp_path / "drives.json")


@pytest.fixture(scope="module")
def tiny():
    return synth_flash_tiny(quiet=True)


def test_plan_lines_carry_measured_numbers(tiny, capsys):
    assert cli.main(["plan", str(tiny), "--remeasure", "--experts", "cache:16:file"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"plan for {tiny.name} ({tiny.stat().st_size / 1e9:.2f} GB):"
    parts = {m[1]: float(m[2]) for m in (re.match(rf"  (\S+(?: table)?) +{NUM} GB  ", l) for l in lines) if m}
    assert set(parts) == {"embeddings", "layers", "experts", "PLE table", "output"}
    assert all(v > 0 for v in parts.values())
    verdict = next(l for l in lines if "read from the drive per 32768-token prompt" in l)
    m = re.match(rf"  file set {NUM} GiB (fits|does not fit) the page cache {NUM} GiB .*-> about {NUM} GB read", verdict)
    assert m and float(m[3]) > 0
    # cache:16 of 64 experts reads O_DIRECT: 3/4 of the experts' reads reach the drive
    # whatever the page cache holds, bounded by the experts' size
    assert float(m[4]) > 0 and "experts" in verdict
    drive = next(l for l in lines if l.startswith("  drive "))
    m = re.match(rf"  drive {NUM} GB/s sequential 1 MiB at depth 4, {NUM} GB/s random 4 KiB at depth 16 "
                 rf"\(([\d,]+) IOPS\) \(measured \d{{4}}-\d\d-\d\d \d\d:\d\d UTC, device \d+:\d+, ", drive)
    assert m and float(m[1]) > 0 and float(m[2]) > 0 and int(m[3].replace(",", "")) > 0


def test_drive_reads_follow_the_tiers_and_the_page_cache(tiny):
    from strata.gguf import open_gguf
    g = open_gguf(tiny)
    d = plan.DriveSpeed("0:0", str(tiny), True, {16: 1e8}, {4: 1e9}, measured_at=1.0)
    roomy = plan.make_plan(g, experts="device", ple_io="mmap", drive=d, mem_available=64 << 30)
    assert roomy.fits and sum(roomy.drive_bytes.values()) == 0  # all of it cached after the first prompt
    tight = plan.make_plan(g, experts="file", ple_io="direct", drive=d, mem_available=1 << 20)
    experts = next(p for p in tight.parts if p.name == "experts")
    # O_DIRECT tiers bypass the cache: every expert a token routes to, at most the experts' size
    assert tight.drive_bytes["experts"] == experts.nbytes
    assert tight.drive_bytes["PLE table"] > 0 and tight.seconds > 0
    cached = plan.make_plan(g, experts="cache:64:host", ple_io="ram", drive=d, mem_available=64 << 30)
    assert cached.drive_bytes["experts"] == cached.drive_bytes["PLE table"] == 0


def test_drive_speed_is_cached_per_device(tiny):
    first = plan.drive_speed(tiny)
    again = plan.drive_speed(tiny)
    assert again == first and first.device == plan.device_of(tiny) and first.measured_at > 0
    assert plan.cached_drive(tiny, max_age_s=0) is None  # too old: measured again


def test_choose_experts():
    gib = 1 << 30
    assert plan.choose_experts(0, gib, 1, 1, 1)[0] is None
    assert plan.choose_experts(8 * gib, gib, 2**20, 48, 512, "cpu", 32 * gib)[0] == "device"
    spec, why = plan.choose_experts(40 * gib, gib, 40 * gib / (48 * 512), 48, 512, "cpu", 16 * gib)
    assert re.fullmatch(r"cache:\d+:file", spec) and "strata pack" in why
    spec, _ = plan.choose_experts(40 * gib, gib, 40 * gib / (48 * 512), 48, 512, "cuda", 64 * gib, 12 * gib)
    assert re.fullmatch(r"cache:\d+:host", spec)


def test_probe_json_has_the_keys(tiny, capsys):
    assert cli.main(["probe", str(tiny), "--json", "--seconds", "0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = out["drive"]
    for depth in ("1", "4", "16", "32"):
        assert d["random_4k"][depth]["bytes_s"] > 0 and d["random_4k"][depth]["iops"] > 0
        assert d["seq_1m"][depth]["bytes_s"] > 0
    assert {"device", "direct", "filesystem", "rotational"} <= set(d)
    assert out["page_cache"]["mem_available"] > 0 and 0 <= out["page_cache"]["file_cached_fraction"] <= 1
    assert "limit" in out["mlock"] and out["mlock"]["ple_table_bytes"] > 0
    assert out["ple_io"]["mode"] in ("ram", "mmap", "direct") and "--ple-io auto ->" in out["ple_io"]["why"]
    assert out["experts"]["tier"] and out["experts"]["why"]
    assert plan.cached_drive(tiny).random_4k.keys() == {1, 4, 16, 32}  # the plan uses the newest reading


# --- placement on machines with GPUs, from shapes alone ------------------------------------

def test_flash_next_shape_is_the_real_one():
    from strata.storage.placement import flash_next
    s = flash_next()
    assert (s.n_layers, s.n_experts, s.top_k) == (48, 512, 10)
    assert (s.ple_rows, s.ple_row_bytes, s.ple_layer) == (320_001_536, 90, 1)  # 160 IQ4_NL weights a row
    assert s.ple_bytes / 2**30 == pytest.approx(26.8, abs=0.05)  # REFERENCE: 26.8 GiB
    # gate and up (2 x 640 rows of 2560) in IQ3_XXS, down (640 wide: no 256-block) in IQ4_NL
    assert s.expert_bytes == 1280 * 10 * 98 + 2560 * 20 * 18


def test_placement_for_the_rtx_4090_box():
    from strata.storage.placement import GiB, Machine, flash_next, place
    m = Machine(1, 24 * GiB, 46 * GiB, 1536 * 2**20)  # seeds/004's box
    p = place(flash_next(), m)
    assert p.expert_tier.startswith("cache:") and 0 < p.slots < 512
    # as many slots as fit beside the dense weights and one layer's experts that a prompt
    # fetches (its 512 tokens route to all 512 experts: 1.04 GiB)
    assert p.fetch_bytes == 512 * p.shape.expert_bytes
    held = p.gpu_dense[0] + p.slots * p.shape.expert_bytes * 48 + p.fetch_bytes
    assert held <= m.gpu_bytes - m.reserve_bytes < held + 48 * p.shape.expert_bytes
    assert p.expert_backing == "drive" and p.ple_where == "ram"  # 50 GiB of experts > 90% of 46 GiB
    pcie, drive = p.per_token()
    assert pcie == pytest.approx((1 - p.slots / 512) * 48 * 10 * p.shape.expert_bytes
                                 + 16 * 90 + p.shape.embedding_row_bytes)
    assert drive > 0
    assert any("VRAM" in line and "cache:" in line for line in p.lines())
    assert "a prompt fetching experts 1.0 GiB = " in p.lines()[1], p.lines()[1]


def test_placement_for_eight_h200s_holds_everything_in_vram():
    from strata.storage.placement import GiB, Machine, flash_next, place
    p = place(flash_next(), Machine(8, 141 * GiB, 1000 * GiB, 2**30))
    assert p.expert_tier == "device" and p.ple_where == "vram"
    assert [len(r) for r in p.gpu_layers] == [6] * 8 and 1 in p.gpu_layers[0]
    assert p.per_token() == (p.shape.embedding_row_bytes, 0.0)


def test_placement_says_what_does_not_fit():
    from strata.storage.placement import GiB, Machine, flash_next, place
    with pytest.raises(ValueError, match="does not fit .* use more GPUs"):
        place(flash_next(), Machine(1, 4 * GiB, 46 * GiB, 2**30))


def test_plan_command_prints_the_placement_for_another_machine(capsys):
    from strata.cli import main
    assert main(["plan", "flash-next", "--device", "cuda", "--gpu-mem", "24", "--ram", "46"]) == 0
    out = capsys.readouterr().out
    assert "placement of Qwen3.8-Flash-Next" in out and "1 x 24.0 GiB GPU" in out and "46.0 GiB host RAM" in out
    assert "--experts cache:" in out and "PLE table 26.8 GiB" in out and "over PCIe" in out


def test_shape_of_a_file_counts_its_bytes():
    from strata.gguf import open_gguf
    from strata.hub import synth_flash_tiny
    from strata.storage.placement import shape_of
    g = open_gguf(synth_flash_tiny(quiet=True))
    s = shape_of(g)
    total = (sum(s.layer_bytes) + s.experts_total + s.embedding_bytes + s.output_bytes + s.ple_bytes)
    assert total == sum(t.nbytes for t in g.tensors.values())
    assert (s.n_layers, s.n_experts, s.top_k, s.ple_layer) == (8, 64, 8, 1)
