"""`strata bench dequant` measures every path on the same blocks and reports the ratio."""
import json

import numpy as np
import pytest

import quant
from strata.bench.dequant import random_blocks
from strata.cli import main


def test_bench_dequant_json(capsys):
    assert main(["bench", "dequant", "--formats", "IQ3_XXS,q4_0", "--mib", "0.25",
                 "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["format"], r["path"]): r for r in result["rows"]}
    assert set(rows) == {(f, p) for f in ("IQ3_XXS", "Q4_0") for p in ("torch (cpu)", "gguf-py (numpy)")}
    for (fmt, path), r in rows.items():
        assert r["mvalues_per_s"] > 0 and r["gb_per_s"] > 0
        # the ratio is the peer's time over ours on the same blocks
        peer = rows[(fmt, "gguf-py (numpy)")]
        assert abs(r["vs_peer"] - peer["ms"] / r["ms"]) < 1e-9 * max(1.0, r["vs_peer"])
    # gguf-py's floats are the reference's: ours equal them bit for bit
    assert all(rows[(f, "torch (cpu)")]["same_bits"] == "yes" for f in ("IQ3_XXS", "Q4_0"))


def test_bench_dequant_table(capsys):
    assert main(["bench", "dequant", "--formats", "F16", "--mib", "0.1", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cells = lambda line: [c.strip() for c in line.split("|")[1:-1]]  # noqa: E731
    assert cells(lines[0]) == ["format", "path", "MiB", "ms", "Mvalues/s", "GB/s in", "x gguf-py", "same bits"]
    assert [cells(l)[:2] for l in lines[2:]] == [["F16", "gguf-py (numpy)"], ["F16", "torch (cpu)"]]


def test_unknown_format_flag_is_refused(capsys):
    try:
        main(["bench", "dequant", "--formats", "IQ9"])
    except SystemExit as e:
        assert e.code == 2
    assert "unknown quantization format 'IQ9'" in capsys.readouterr().err


def test_bench_blocks_have_finite_scales():
    rng = np.random.default_rng(0)
    for fmt in quant.FORMATS.values():
        raw = random_blocks(fmt, 64, rng)
        assert raw.shape == (64, fmt.block_bytes)
        assert np.isfinite(fmt.dequantize(raw)).all()


def test_ggml_peer_rows_say_whether_the_bits_match(capsys):
    # CI checks the torch path against the numpy reference bit for bit (test_dequant*.py, whose
    # reference equals gguf-py's), and the peer's missing-library message below
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (its libggml) is not installed: "
                        "scripts/build_llama_cpp.sh; the torch path's bits are checked in test_dequant*.py")
    import torch
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "dequant", "--formats", "Q8_0,IQ3_S", "--mib", "0.1", "--repeats", "1",
                     "--threads", "1", "--peer", "ggml", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)  # the bench sets it for the process
    result = json.loads(capsys.readouterr().out)
    assert result["peer"].startswith("ggml ")
    rows = {(r["format"], r["path"]): r for r in result["rows"]}
    assert set(rows) == {(f, p) for f in ("Q8_0", "IQ3_S") for p in ("torch (cpu)", "ggml to_float (C)")}
    # ggml's C loops compute what the numpy reference computes: the same bits
    assert rows[("Q8_0", "torch (cpu)")]["same_bits"] == rows[("IQ3_S", "torch (cpu)")]["same_bits"] == "yes"


def test_ggml_peer_without_llama_cpp_names_the_fix(capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert main(["bench", "dequant", "--formats", "Q8_0", "--mib", "0.1", "--peer", "ggml"]) != 0
    assert "--peer ggml: llama-cpp-python is not importable here" in capsys.readouterr().err
