"""Every command no other test runs end to end, run through `strata.cli.main` in this
process: pull and synth (cached: they print the path), perplexity with saved log-probs and
the KL divergence from them, imatrix, quantize with that imatrix (and the result
generating), pack and a generate that reads the pack, and bench model, serve, kernels
(--static) and ple. Each test checks what the command claims, not only its exit status.

Already run elsewhere: generate, chat (test_cli_text), serve (test_server), convert
(test_convert), plan and probe --json (test_plan), bench dequant (test_bench_dequant),
perplexity --make-text (test_perplexity).
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import triton

import quant
from strata.cli import main
from strata.gguf import open_gguf

NUM = r"(\d+(?:\.\d+)?)"
FAST = ["--dtype", "f32", "-t", "2"]  # f32: no bf16 rounding, and faster on these CPUs


@dataclass
class Run:
    rc: int
    out: str
    err: str


def cli(*argv: str) -> Run:
    """`strata ARGV...` in this process, its stdout and stderr captured (usable in fixtures
    of any scope, where capsys is not)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return Run(rc, out.getvalue(), err.getvalue())


def positive(s: str) -> float:
    x = float(s.replace(",", ""))
    assert math.isfinite(x) and x > 0, s
    return x


@pytest.fixture(autouse=True)
def keep_torch_threads():
    # the benches and loads set torch's thread count for the whole process
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """A short text (3000 characters, about 700 SmolLM2 tokens) cut from the one
    `strata perplexity --make-text` writes."""
    d = tmp_path_factory.mktemp("text")
    r = cli("perplexity", "--make-text", d / "full.txt")
    assert r.rc == 0, r.err
    short = d / "short.txt"
    short.write_text((d / "full.txt").read_text(encoding="utf-8")[:3000], encoding="utf-8")
    return short


# --- pull, synth ---------------------------------------------------------------------------

def test_pull_prints_the_checked_cached_file(smollm2_gguf):
    from strata.cache import sha256
    from strata.hub import SMOLLM2
    r = cli("pull", "smollm2")
    assert r.rc == 0, r.err
    path = Path(r.out.strip())
    assert r.out.count("\n") == 1 and path == smollm2_gguf.path and path.is_file()
    assert sha256(path) == SMOLLM2["sha256"]  # the file pull checks, still as checked
    assert smollm2_gguf.arch == "llama"  # the fixture opened this very file


def test_synth_prints_the_cached_flash_tiny(flash_tiny_gguf):
    from strata.names.qwen4exp import mtp_sidecar
    r = cli("synth", "flash-tiny")
    assert r.rc == 0, r.err
    path = Path(r.out.strip())
    assert r.out.count("\n") == 1 and path == flash_tiny_gguf.path
    g = flash_tiny_gguf  # this very file, opened
    assert g.arch == "qwen4exp" and {t.fmt.name for t in g.tensors.values()} == {"F32"}
    assert "blk.0.ffn_gate_exps.weight" in g.tensors and mtp_sidecar(path).is_file()


# --- perplexity: saved log-probs, then the KL divergence from them -----------------------

@pytest.mark.slow
def test_perplexity_saves_log_probs_and_the_kld_from_them_is_zero(text, tmp_path):
    from strata.perplexity import SavedLogits
    saved = tmp_path / "base.npz"
    r = cli("perplexity", "smollm2", "-f", text, "--ctx", 64, "--chunks", 2, *FAST, "--save-all-logits", saved)
    assert r.rc == 0, r.err
    running = [positive(x) for x in re.findall(rf"\[\d+\]{NUM},", r.out)]
    m = re.search(rf"Final estimate: PPL = {NUM} \+/- {NUM}", r.out)
    assert len(running) == 2 and m, r.out
    ppl = positive(m[1])
    positive(m[2])
    assert 1 < ppl < 1000 and running[-1] == ppl  # the running PPL ends at the estimate
    # 2 chunks, each scoring its second half: 64 - 1 - 32 = 31 tokens
    assert f"saved log-probs of 62 tokens to {saved}" in r.err
    s = SavedLogits(saved)
    assert (s.n_ctx, s.n_chunks, s.top_k) == (64, 2, 1024) and len(s.tokens) == 128

    r = cli("perplexity", "smollm2", *FAST, "--kl-divergence-base", saved, "--kl-divergence", "--json")
    assert r.rc == 0, r.err
    assert f"base log-probs from {saved}" in r.err and "2 chunks of 64" in r.err
    rows = [l for l in r.out.splitlines() if re.match(r"\s+\d+\s+\d", l)]
    assert len(rows) == 2  # the per-chunk table
    assert re.search(r"Mean\s+KLD:\s+0\.000000", r.out) and re.search(r"Same top p: 100\.000", r.out)
    res = json.loads(r.out.strip().splitlines()[-1])
    assert abs(res["kld_mean"]) < 1e-6 and abs(res["kld_max"]) < 1e-6 and res["same_top_p"] == 1.0
    assert res["count"] == 62 and (res["n_ctx"], res["n_chunks"]) == (64, 2)
    assert res["ppl"] == pytest.approx(res["ppl_base"], rel=1e-6)
    assert res["ppl"] == pytest.approx(ppl, abs=1e-4)  # the model scored the file's tokens again


# --- imatrix, then quantize with it, then the result generates ---------------------------

@pytest.fixture(scope="module")
def imatrix_run(text, tmp_path_factory):
    out = tmp_path_factory.mktemp("imatrix") / "smollm2.imatrix.gguf"
    return out, cli("imatrix", "smollm2", "-f", text, "--ctx", 64, "--chunks", 2, *FAST, "-o", out)


def test_imatrix_writes_the_importance_of_every_weight(imatrix_run, smollm2_gguf):
    from strata.imatrix import load_imatrix
    path, r = imatrix_run
    assert r.rc == 0, r.err
    assert len(re.findall(rf"\[\d+\]{NUM},", r.out)) == 2
    ppl = positive(re.search(rf"Final estimate: PPL = {NUM}", r.out)[1])
    assert 1 < ppl < 1000
    m = re.search(rf"stored (\d+) weights' importance after 2 chunks of 64 tokens in {re.escape(str(path))}", r.err)
    assert m, r.err
    assert open_gguf(path).tensors  # a GGUF file, as llama-imatrix writes
    im = load_imatrix(path)
    # every 2-D weight of the blocks (7 a layer, 30 layers), one value per input column
    assert len(im) == int(m[1]) == 210
    for name, v in im.items():
        assert v.shape == (smollm2_gguf.tensors[name].shape[-1],), name
        assert np.isfinite(v).all() and (v >= 0).all() and v.sum() > 0, name


@pytest.fixture(scope="module")
def quantized(imatrix_run, smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized") / "smollm2-q4_0.gguf"
    return out, cli("quantize", smollm2_gguf.path, out, "Q4_0", "--imatrix", imatrix_run[0], "-t", 2)


def test_quantize_with_the_imatrix_writes_llama_cpp_s_mix(quantized, smollm2_gguf):
    path, r = quantized
    assert r.rc == 0, r.err
    lines = [l for l in r.out.splitlines() if l.startswith("[")]
    assert len(lines) == len(smollm2_gguf.tensors) == 272
    assert any("blk.5.ffn_gate.weight" in l and "type =   q4_1, converting to q4_0" in l for l in lines)
    assert "falling back to    q8_0" in r.out  # token_embd: q6_K's 256-blocks do not fit 576
    size_in = positive(re.search(rf"model size  = \s*{NUM} MiB", r.out)[1])
    size_out = positive(re.search(rf"quant size  = \s*{NUM} MiB", r.out)[1])
    assert size_out < size_in
    positive(re.search(rf"quantize time = \s*{NUM} s", r.out)[1])

    g = open_gguf(path)
    types = {n: t.fmt.name for n, t in g.tensors.items()}
    assert types.keys() == smollm2_gguf.tensors.keys()
    # with an imatrix, llama.cpp's Q4_0 mix keeps ffn_down of the first eighth (30 // 8 = 3) Q4_1
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(5)] == ["Q4_1"] * 3 + ["Q4_0"] * 2
    assert types["blk.7.attn_q.weight"] == types["blk.29.ffn_up.weight"] == "Q4_0"
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert g.get("general.file_type") == 2  # LLAMA_FTYPE_MOSTLY_Q4_0
    # the blocks are Q4_0's quantization of the source's weights
    src, got = smollm2_gguf.tensors["blk.5.ffn_gate.weight"], g.tensors["blk.5.ffn_gate.weight"]
    want = quant.get("Q4_0").quantize(src.numpy().astype(np.float32))
    assert np.array_equal(np.asarray(got.data).reshape(want.shape), want)


@pytest.mark.slow
def test_the_quantized_model_generates(quantized):
    path, _ = quantized
    r = cli("generate", "-m", path, "What is the capital of France?", "-n", 8, "--temperature", 0, *FAST)
    assert r.rc == 0, r.err
    assert "Paris" in r.out
    assert "Q4_0 x207" in r.err and "Q4_1 x3" in r.err  # the plan line: this file was loaded
    m = re.search(rf"(\d+) prompt tokens at {NUM} tok/s, 8 generated at {NUM} tok/s \(length\)", r.err)
    assert m and positive(m[2]) and positive(m[3])


# --- pack, then a generate that reads the pack -------------------------------------------

@pytest.fixture(scope="module")
def packed(flash_tiny_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("pack") / "flash-tiny"
    return d, cli("pack", "flash-tiny", "--out", d)


def test_pack_writes_every_expert_page_aligned(packed, flash_tiny_gguf):
    from strata.names.qwen4exp import mtp_sidecar
    from strata.storage.pack import Pack
    d, r = packed
    assert r.rc == 0, r.err
    # 8 layers and the MTP sidecar's block
    assert "packed 9 layers of experts of flash-tiny.f32.gguf" in r.err and str(d / "experts.bin") in r.err
    p = Pack.open(d)
    assert len(p.entries) == 27 and {e.layer for e in p.entries.values()} == set(range(9))
    gate = sorted((e for e in p.entries.values() if e.tensor == "gate"), key=lambda e: e.layer)
    assert all(e.packed_offset % 4096 == 0 and e.stride % 4096 == 0 for e in gate)
    last = gate[-1]
    assert p.bin.stat().st_size == last.packed_offset + 64 * last.stride
    assert Path(last.gguf) == mtp_sidecar(flash_tiny_gguf.path).resolve()
    # one expert's bytes in experts.bin are its bytes in the GGUF
    for name, e in (("blk.3.ffn_up_exps.weight", 5), ("blk.8.ffn_down_exps.weight", 63)):
        ent = p.entries[name]
        with open(p.bin, "rb") as f:
            f.seek(ent.packed_offset + e * ent.stride)
            got = f.read(ent.expert_bytes)
        with open(ent.gguf, "rb") as f:
            f.seek(ent.gguf_offset + e * ent.expert_bytes)
            assert got == f.read(ent.expert_bytes) and len(got) == 256 * 256 * 4


def test_generate_reads_the_experts_from_the_pack(packed, flash_tiny_gguf):
    from strata.load import load_model
    from strata.runtime import SamplingParams, generate
    from strata.tokenizer import Tokenizer
    d, _ = packed
    r = cli("generate", "-m", "flash-tiny", "Hello", "--raw", "-n", 2, "--temperature", 0, *FAST,
            "--experts", "packed", "--experts-dir", d, "--ple-io", "ram")
    assert r.rc == 0, r.err
    assert f"experts: packed ({d / 'experts.bin'}" in r.err and "2 generated" in r.err
    # the same tokens as the experts held in memory
    tok = Tokenizer.from_gguf(flash_tiny_gguf)
    model = load_model(flash_tiny_gguf, dtype=torch.float32, experts="host")
    ref = generate(model, tok, tok.encode("Hello"), SamplingParams(temperature=0, max_tokens=2))
    assert len(ref.tokens) == 2 and r.out == ref.text + "\n"


# --- bench model, serve, kernels, ple ------------------------------------------------------

@pytest.mark.slow
def test_bench_model_table(smollm2_gguf):
    r = cli("bench", "model", "-m", "smollm2", "-p", 8, "-n", 4, "-r", 1, *FAST)
    assert r.rc == 0, r.err
    cells = lambda line: [c.strip() for c in line.split("|")[1:-1]]  # noqa: E731
    lines = r.out.splitlines()
    assert cells(lines[0]) == ["engine", "model", "threads", "test", "t/s"]
    rows = [cells(l) for l in lines[2:4]]
    assert [row[:4] for row in rows] == [["strata", smollm2_gguf.path.name, "2", t] for t in ("pp8", "tg4")]
    for row in rows:
        m = re.fullmatch(rf"{NUM} ± {NUM}", row[4])
        assert m and positive(m[1]) and float(m[2]) == 0.0  # one run: no spread
    m = re.search(rf"Strata: float32 on cpu \(torch kernels\), load {NUM} s, peak RSS {NUM} MiB; a decode step "
                  rf"reads {NUM} MiB of weights: {NUM} GB/s, {NUM}% of the {NUM} GB/s a copy moves on cpu", r.out)
    assert m, r.out
    load_s, rss, step_mib, gbs, pct, copy = (positive(x) for x in m.groups())
    # f32: weights under 2^20 dense float32, larger ones int8 codes where the CPU takes them
    # (AVX-512, with compiles on: gate_up, the Q8_0 head): 296 MiB; elsewhere, and with
    # STRATA_CPU_COMPILE=0 (the suite's default), all dense float32: 134.5M weights, 513 MiB
    from triton_kernels.backend import cpu_compile_mode, cpu_int8_vectors
    lo, hi = (280, 320) if cpu_int8_vectors() and cpu_compile_mode() == "on" else (500, 530)
    assert lo < step_mib < hi
    assert rss > step_mib


@pytest.mark.slow  # two engines' runs; the quick tier benches through bench serve's row
def test_bench_model_batch_invariant_rows(smollm2_gguf):
    r = cli("bench", "model", "-m", "smollm2", "-p", 8, "-n", 2, "-r", 1, *FAST, "--batch-invariant", "--json")
    assert r.rc == 0, r.err
    rows = json.loads(r.out)["rows"]
    assert [(x["engine"], x["test"]) for x in rows] == [("strata", "pp8"), ("strata", "tg2"),
                                                        ("strata --batch-invariant", "pp8"),
                                                        ("strata --batch-invariant", "tg2")]
    for plain, inv in zip(rows[:2], rows[2:]):
        assert plain["vs_plain"] is None and inv["vs_plain"] == pytest.approx(inv["tok_s"] / plain["tok_s"])


def test_bench_serve_one_slot_one_request():
    """The quick tier's `bench serve`: one slot, one request of one token, its row."""
    r = cli("bench", "serve", "-m", "smollm2", "--slots", "1", "--requests", 1, "-n", 1, *FAST, "--json")
    assert r.rc == 0, r.err
    rows = json.loads(r.out)["rows"]
    assert [(x["slots"], x["numerics"], x["requests"], x["generated"]) for x in rows] == [(1, "plain", 1, 1)]
    assert rows[0]["tok_s"] == pytest.approx(rows[0]["generated"] / rows[0]["wall_s"])


@pytest.mark.slow
def test_bench_serve_json():
    r = cli("bench", "serve", "-m", "smollm2", "--slots", "1,2", "--requests", 2, "-n", 2, *FAST, "--json",
            "--batch-invariant")
    assert r.rc == 0, r.err
    out = json.loads(r.out)
    assert out["bench"] == "serve" and out["machine"]["threads"] == 2
    rows = out["rows"]
    assert [(x["slots"], x["numerics"], x["requests"], x["generated"]) for x in rows] == [
        (1, "plain", 2, 4), (1, "batch-invariant", 2, 4), (2, "plain", 2, 4), (2, "batch-invariant", 2, 4)]
    for x in rows:
        assert positive(str(x["wall_s"])) and x["tok_s"] == pytest.approx(x["generated"] / x["wall_s"])
    assert rows[0]["vs_first"] == 1.0 and rows[2]["vs_first"] == pytest.approx(rows[2]["tok_s"] / rows[0]["tok_s"])
    assert rows[3]["vs_plain"] == pytest.approx(rows[3]["tok_s"] / rows[2]["tok_s"]) and rows[2]["vs_plain"] is None


def test_bench_kernels_static_table():
    r = cli("bench", "kernels", "--static", "--ops", "gemv", "--formats", "Q8_0,Q4_0", "--target", "sm_90")
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert lines[0] == "## sm_90"
    # the compiler that made the rows: another Triton's ptxas gives other registers and counts
    assert re.fullmatch(rf"Triton {re.escape(triton.__version__)}, ptxas \d+\.\d+", lines[2]), lines[2]
    cells = lambda line: [c.strip() for c in line.split("|")[1:-1]]  # noqa: E731
    head = cells(lines[4])
    assert head[:8] == ["op", "format", "layout", "kernel", "regs", "spill B", "instr/w loop", "instr/w 4096x14336"]
    assert head[8:12] == ["B/load", ">=8B share", "in flight", "mma"]
    assert "H200 bw" in head and head[-1] == "loop mix"
    rows = [dict(zip(head, cells(l))) for l in lines[6:] if l.startswith("|")]
    assert [(x["op"], x["format"]) for x in rows] == [("gemv", "Q8_0"), ("gemv", "Q4_0")]
    for x in rows:
        assert x["kernel"].startswith("_") and int(x["regs"]) > 0 and int(x["spill B"]) >= 0
        assert x["layout"] == "split" and x["mma"] == "none"  # the layout a GPU holds them in
        assert positive(x["B/load"]) >= 4 and 0.5 <= float(x[">=8B share"]) <= 1
        assert positive(x["instr/w loop"]) <= positive(x["instr/w 4096x14336"])
        assert 0 < positive(x["H200 bw"]) <= 1
        assert re.fullmatch(r"(\w+:\d+ ?)+", x["loop mix"])


def test_bench_ple_json(tmp_path):
    table = tmp_path / "ple.gguf"
    r = cli("bench", "ple", "--rows", 3000, "--format", "Q8_0", "--file", table, "--tokens", 8, "--ubatch", 4,
            "--depth", 2, "--json")
    assert r.rc == 0, r.err
    out = json.loads(r.out)
    assert table.is_file() and out["file"] == str(table)  # written where --file says, not the cache
    assert (out["format"], out["rows"]) == ("Q8_0", 3000)
    assert out["table_bytes"] == 3000 * quant.get("Q8_0").row_bytes(160)
    got = {(x["mode"], x["pattern"], x["cache"]): x for x in out["results"]}
    assert set(got) == {(m, p, c) for m in ("ram", "mmap", "mmap-nohint", "direct")
                        for p in ("decode", "prefill") for c in ("cold", "warm")}
    for x in got.values():
        assert x["tokens"] == 8 and x["rows"] == 8 * 16  # 16 rows a token
        assert positive(str(x["rows_per_s"])) and positive(str(x["us_per_token"]))
    assert set(out["ratios"]) >= {f"mmap_hints_vs_none_{p}_{c}" for p in ("decode", "prefill")
                                  for c in ("cold", "warm")}
    assert all(positive(str(v)) for v in out["ratios"].values())
    assert out["auto"].startswith("--ple-io auto -> ") and out["auto_without_ram"].startswith("--ple-io auto -> ")
    assert "ram not tried" in out["auto_without_ram"]
    if out["fio"] is None:
        assert any("fio row skipped" in n for n in out["notes"])
    else:
        assert out["fio"]["iops"] > 0
