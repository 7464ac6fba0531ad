"""`strata bench kernels --tune` without a GPU: tune_table with timers given here, so the
table's shape (tiles per format and per weight height, the MoE decode's tiles) is checked
against what configs.pick reads back. The timings themselves come from a device run."""
import pytest

from strata.bench import kernels
from triton_kernels import configs


def _gemv_timer(log):
    def time(fmt, shape, tiles):  # each shape has its own fastest tiles; (16, 4) never launches
        log.append((fmt, shape, tiles))
        if tiles is None:
            return 1.0
        if tiles == (16, 4):
            raise RuntimeError("out of resources")
        want = {kernels.SMALL_SHAPE: (1, 32), kernels.GEMV_SHAPE: (4, 16)}.get(shape, (16, 8))
        return 0.1 + abs(tiles[0] - want[0]) + abs(tiles[1] - want[1])
    return time


def test_tune_writes_tiles_per_height_that_pick_reads_back(tmp_path, monkeypatch):
    log = []
    table, rows = kernels.tune_table(["Q8_0", "F16", "IQ3_XXS"], _gemv_timer(log),
                                     lambda tiles: 0.5 if tiles is None else 0.2 + tiles[0] / 64 + tiles[1] / 1024)
    assert set(table["gemv"]) == {"Q8_0", "IQ3_XXS"}  # F16 has no int8 units: no dp4a GEMV to tune
    q8 = table["gemv"]["Q8_0"]
    assert (q8["block_n"], q8["block_u"]) == (4, 16)  # GEMV_SHAPE's, for a pick with no N
    assert q8[configs.BY_N] == {"1024": {"block_n": 1, "block_u": 32}, "8192": {"block_n": 4, "block_u": 16},
                                str(1 << 20): {"block_n": 16, "block_u": 8}}
    assert table["moe_gate_up"] == {"IQ3_XXS": {"block_n": 16, "block_k": 256}}
    assert table["moe_down"] == {"IQ4_NL": {"block_n": 16, "block_k": 256}}
    # every candidate timed at every height, and the engine's current tiles once a height
    assert len(log) == 2 * len(kernels.TUNE_SHAPES) * (len(kernels.TUNE_TILES) + 1)
    gemv_rows = [r for r in rows if r["op"] == "gemv"]
    assert len(gemv_rows) == 6 and all(r["failed"] == 1 and r["now_us"] == 1000 for r in gemv_rows)
    assert rows[-1]["op"].startswith("moe") and rows[-1]["now_us"] == 500

    (tmp_path / "default.json").write_text((configs.HERE / "default.json").read_text())
    monkeypatch.setattr(configs, "HERE", tmp_path)
    configs.write("Tuned GPU", table)
    for n, want in ((512, (1, 32)), (4096, (4, 16)), (151936, (16, 8))):
        got = configs.pick("gemv", "IQ3_XXS", "Tuned GPU", n=n)
        assert (got["block_n"], got["block_u"]) == want
    assert configs.pick("moe_down", "IQ4_NL", "Tuned GPU")["block_n"] == 16


def test_tune_says_when_no_tiles_launch():
    def fail(fmt, shape, tiles):
        raise RuntimeError("no device")
    with pytest.raises(ValueError, match="no candidate tiles launched: .*RuntimeError"):
        kernels.tune_table(["Q8_0"], fail)


def test_a_moe_whose_tiles_all_fail_leaves_the_gemv_table(capsys):
    def fail(tiles):
        raise RuntimeError("out of resources")
    table, rows = kernels.tune_table(["Q4_0"], _gemv_timer([]), fail)
    assert set(table) == {"gemv"} and "Q4_0" in table["gemv"]
    assert rows[-1]["tiles"] == "none launched" and rows[-1]["failed"] == len(kernels.MOE_TUNE_TILES)
    assert "no candidate tiles launched" in capsys.readouterr().err
