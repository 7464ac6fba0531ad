"""flash-shape: Qwen3.8-Flash-Next's real widths in random blocks, written straight to GGUF.

The real file set is about 35 GB, so the suite writes one layer, a PLE table of 1,000 rows,
16 experts a layer of which a token takes 2, and a vocabulary of 512 (counts, not widths:
every width stays real) with a byte-level tokenizer of its own, and checks the real counts
on the tensor table without writing it. (The torch path dequantizes a routed IQ3_XXS
expert in about 0.2 s on a busy 2-core machine: top-2 keeps the forward to seconds.)"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from strata.convert.flash_shape import (
    Shape,
    ple_constants,
    tensor_specs,
    write_flash_shape,
)
from strata.gguf import open_gguf
from strata.names import qwen4exp as n

ROWS, EXPERTS, TOP_K, VOCAB = 1000, 16, 2, 512


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory):
    """A byte-level BPE tokenizer of 258 tokens (the 256 byte symbols, one merge, an end of
    turn), so that the test file's vocabulary is small and padded."""
    from gguf import GGUFValueType as T
    from tokenizers.pre_tokenizers import ByteLevel

    from strata.gguf import write_gguf
    tokens = sorted(ByteLevel.alphabet()) + ["Ġt", "<|im_end|>"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": ([1] * 257 + [3], T.INT32),
          "tokenizer.ggml.merges": ["Ġ t"], "tokenizer.ggml.eos_token_id": len(tokens) - 1}
    return write_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf", "gpt2", md, [])


@pytest.fixture(scope="module")
def written(tmp_path_factory, tokenizer_gguf):
    d = tmp_path_factory.mktemp("flash-shape")
    main = write_flash_shape(d, layers=1, rows=ROWS, tokenizer_gguf=tokenizer_gguf, experts=EXPERTS,
                             top_k=TOP_K, vocab=VOCAB, quiet=True)
    return main, Shape(1, ROWS, EXPERTS, VOCAB, TOP_K).paths(d)


def test_real_counts_and_table():
    """At the real counts (not written here): 512 experts of 640 a layer, IQ3_XXS with the
    640-wide down projections in IQ4_NL, the PLE table of 320,001,536 rows x 160 IQ4_NL
    (26.8 GiB), vocabulary 248,320, and the n-gram constants of REFERENCE.md section 3."""
    main, ple, mtp = tensor_specs(Shape(layers=4))
    by = {s.name: s for s in main + mtp}
    assert (ple.shape, ple.fmt, ple.nbytes) == ((320_001_536, 160), "IQ4_NL", 320_001_536 * 90)
    assert (by[n.TOKEN_EMBD].shape, by[n.OUTPUT].shape) == ((248_320, 2560), (248_320, 2560))
    for i in range(5):  # four layers and the MTP block
        assert by[n.blk(i, n.MOE["gate_exps"])].shape == (512, 640, 2560)
        assert by[n.blk(i, n.MOE["gate_exps"])].fmt == "IQ3_XXS"
        assert (by[n.blk(i, n.MOE["down_exps"])].shape, by[n.blk(i, n.MOE["down_exps"])].fmt) == \
            ((512, 2560, 640), "IQ4_NL")
    assert n.blk(3, n.ATTENTION["idx_q"]) in by and n.blk(2, n.DELTANET["qkv"]) in by  # (i+1) % 4 == 0
    assert n.blk(1, n.PLE["key"]) in by and n.blk(0, n.PLE["key"]) not in by
    k = ple_constants(248_320, 320_001_536)
    assert k.multipliers == (23703573157769, 20109073645365, 8052911324071)
    assert (k.head_vocab_sizes[0], k.head_vocab_sizes[-1], sum(k.head_vocab_sizes)) == (20000003, 20000171,
                                                                                          320_001_446)


def test_small_tables_hash_inside():
    """For any --rows the hashed ids stay inside the table: the padded total of the primes
    fits, and is the largest that does (one more step of the base would not)."""
    for rows in (384, 1000, 4097, 100_000):
        k = ple_constants(VOCAB, rows)
        assert sum(k.head_vocab_sizes) <= k.rows <= rows
        assert len(set(k.head_vocab_sizes)) == 16
    with pytest.raises(ValueError, match="--rows 100: the PLE table needs at least 384 rows"):
        Shape(1, 100)


def test_files_have_the_real_widths(written):
    main_path, (first, second, sidecar) = written
    assert main_path == first and second.is_file() and sidecar.is_file()
    g, t, side = open_gguf(first), open_gguf(second), open_gguf(sidecar)
    assert n.PLE_TABLE not in g.tensors and list(t.tensors) == [n.PLE_TABLE]  # alone in shard 2
    table = t.tensors[n.PLE_TABLE]
    assert (table.shape, table.fmt.name) == ((ROWS, 160), "IQ4_NL")
    assert (g.get("split.no"), t.get("split.no"), t.get("split.count")) == (0, 1, 2)
    from strata.models.qwen4exp import Qwen4ExpConfig
    c = Qwen4ExpConfig.from_gguf(g)
    assert (c.dim, c.streams, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim) == (2560, 4, 24, 2, 256, 64)
    assert (c.k_heads, c.v_heads, c.dk, c.dv, c.conv_kernel) == (16, 48, 128, 128, 4)
    assert (c.n_experts, c.top_k, c.expert_dim, c.shared_dim) == (EXPERTS, TOP_K, 640, 640)
    assert (c.idx_heads, c.idx_dim, c.idx_budget, c.ple_layers, c.ple["row_dim"]) == (4, 128, 2048, (0,), 160)
    assert c.vocab_size == VOCAB and c.recurrent == (True,)
    shapes = {**{k: (v.shape, v.fmt.name) for k, v in g.tensors.items()},
              **{k: (v.shape, v.fmt.name) for k, v in side.tensors.items()}}
    assert shapes["blk.0.ffn_gate_exps.weight"] == ((EXPERTS, 640, 2560), "IQ3_XXS")
    assert shapes["blk.0.ffn_down_exps.weight"] == ((EXPERTS, 2560, 640), "IQ4_NL")
    assert shapes["blk.0.attn_qkv.weight"] == ((10240, 2560), "Q4_0")
    assert shapes["blk.0.ple_key.weight"] == ((10240, 2560), "Q4_0")
    assert shapes["blk.1.attn_q.weight"] == ((12288, 2560), "Q4_0")  # the MTP block: full attention
    assert shapes["blk.1.indexer.q_proj.weight"] == ((512, 2560), "F32")  # as llama-quantize leaves it
    assert shapes["blk.0.ffn_gate_inp.weight"] == ((EXPERTS, 2560), "F32")  # the router, likewise
    assert shapes["blk.1.nextn.eh_proj.weight"] == ((2560, 5120), "Q4_0")
    assert shapes[n.TOKEN_EMBD] == ((VOCAB, 2560), "IQ3_S")
    from strata.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(g)
    assert tok.vocab_size == VOCAB and tok.decode([300]) == ""  # padding: [PAD300], unused


def test_the_model_built_in_memory_holds_the_written_files(written):
    """strata.convert.flash_shape_memory reads the same tensor list and draws each tensor
    from the same generator as the writer: the same tensors, bytes and metadata (but the
    tokenizer's, the shards' and the end-of-turn id the tokenizer gives), with no MTP block."""
    from strata.convert.flash_shape_memory import flash_shape_memory
    _, (first, second, _) = written
    g = open_gguf(first)
    m = flash_shape_memory(1, ROWS, experts=EXPERTS, top_k=TOP_K, vocab=VOCAB)
    on_disk = {**g.tensors, **open_gguf(second).tensors}
    assert list(m.tensors) == list(on_disk)
    for name, t in on_disk.items():
        assert (m.tensors[name].shape, m.tensors[name].nbytes) == (t.shape, t.nbytes)
        assert np.array_equal(m.tensor(name).data, t.data), name
    same = (lambda k: not k.startswith(("tokenizer.", "split.")) and k != f"{n.ARCH}.ple.eos_token_id")
    assert {k: v for k, v in m.metadata.items() if same(k)} == {k: v for k, v in g.metadata.items() if same(k)}


def test_blocks_are_valid_and_scaled(written):
    """Every quantized matrix decodes to finite weights of RMS 1/sqrt(fan_in) and mean zero
    (Q4_0's and IQ4_NL's codes average below zero: their scales take either sign, as
    llama.cpp's quantizers write them). Tolerances: the scales are drawn from [0.75, 1.25] x
    the target (1.01 x on average in RMS); over the 65,536 weights drawn a tensor (at least
    256 blocks' scales, 65,536 codes) the RMS's sampling error is under 2%, so 5% covers it
    and fp16 rounding. The mean of N weights of RMS s in B blocks whose scales take a random
    sign has a standard error of s * sqrt(1/N + 0.11^2/B) (0.11: the largest block mean,
    Q4_0's); 4.5 of those is 0.021 s for a large Q4_0 matrix, where one-signed scales would
    put the mean at 0.11 s."""
    _, (first, second, sidecar) = written
    for path in (first, second, sidecar):
        for name, t in open_gguf(path).tensors.items():
            if t.fmt.block_elems == 1:
                assert np.isfinite(t.numpy()).all(), name
                continue
            rows = t.data.reshape(-1, t.data.shape[-1])[:max(1, 65536 // t.shape[-1])]
            w = t.fmt.dequantize(rows)
            rms = 0.02 if name in (n.TOKEN_EMBD, n.PLE_TABLE) else 1 / math.sqrt(t.shape[-1])
            assert np.isfinite(w).all(), name
            assert abs(np.sqrt(np.mean(w ** 2)) / rms - 1) < 0.05, (name, np.sqrt(np.mean(w ** 2)), rms)
            se = rms * math.sqrt(1 / w.size + 0.11 ** 2 / (w.size / t.fmt.block_elems))
            assert abs(w.mean()) < 4.5 * se, (name, w.mean(), rms)


def test_plan_reads_the_table_from_shard_2(written):
    """The plan finds the PLE table in the other shard and counts a decoded token's reads:
    top-k experts a layer (three slices each, whole pages around each when read in place),
    16 PLE rows and an embedding row of 1 + (bytes - 1) / 4096 pages each on average."""
    from strata.storage.io import PAGE
    from strata.storage.plan import DriveSpeed, make_plan
    _, (first, second, _) = written
    drive = DriveSpeed("0:0", str(first), True, {16: 4e8}, {4: 2e9}, measured_at=1.0)
    p = make_plan(open_gguf(first), experts="file", ple_io="direct", drive=drive, mem_available=64 << 30)
    ple = next(x for x in p.parts if x.name == "PLE table")
    assert ple.nbytes == ROWS * 90 and second.name in ple.tier
    assert p.set_bytes == first.stat().st_size + second.stat().st_size
    g = open_gguf(first)
    slices = [g.tensors[n.blk(0, n.MOE[k])].nbytes // EXPERTS for k in ("gate_exps", "up_exps", "down_exps")]
    expert = sum(1 + (b - 1) / PAGE for b in slices) * PAGE
    assert p.token_cold["experts"] == pytest.approx(TOP_K * expert)
    assert p.token_cold["PLE table"] == pytest.approx(16 * (1 + 89 / PAGE) * PAGE)
    assert p.token_cold["embeddings"] == pytest.approx((1 + 1099 / PAGE) * PAGE)
    assert p.token_warm["experts"] == p.token_cold["experts"]  # O_DIRECT: no page cache to warm
    assert p.token_warm["embeddings"] == 0  # the mapped file set fits 64 GiB
    assert p.token_seconds == pytest.approx(p.token_cold["experts"] / 2e9 + (
        p.token_cold["PLE table"] + p.token_cold["embeddings"]) / 4e8)


def test_packed_tiers_look_for_the_models_pack(written):
    """`strata pack` packs the MTP sidecar's experts with the model's: without --experts-dir
    every store, the sidecar's too, is sent to the pack named after the model's file."""
    from strata.load import Options, decide
    from strata.storage.pack import default_pack_dir
    _, (first, _, _) = written
    plan = decide(open_gguf(first), Options(experts="cache:4:packed"))
    assert plan.experts.store_kwargs()["experts_dir"] == str(default_pack_dir(first))


def _vm_flags(view: np.ndarray) -> list[str]:
    """The VmFlags of the mapping that holds `view` (/proc/self/smaps)."""
    addr, inside = view.ctypes.data, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return []


def test_loads_and_generates_without_nan(written):
    """Experts read in place (O_DIRECT), the PLE table read from shard 2: a prompt and a
    decode step give finite logits, and the table served each token its 16 rows. The token
    embedding's pages are mapped MADV_RANDOM ("rr"), so that a row costs its pages and not
    the disk's readahead window."""
    from strata.load import load_model
    _, (first, second, _) = written
    m = load_model(first, experts="file", ple_io="direct")
    assert m.ple.table.table.source.path == second
    cache = m.new_cache(4)
    logits = [m([1, 2], cache, last_only=True), m([3], cache, last_only=True)]
    assert all(torch.isfinite(x).all() for x in logits)
    assert m.io_stats()["ple"]["rows"] == 16 * 3
    assert "rr" in _vm_flags(m.embedding.data)


def test_cli_synth_flash_shape(monkeypatch, capsys, tmp_path):
    from strata import hub
    from strata.cli import main
    got = {}
    monkeypatch.setattr(hub, "synth_flash_shape", lambda *a, **k: got.update(args=a, kw=k) or tmp_path / "x.gguf")
    assert main(["synth", "flash-shape", "--layers", "1", "--rows", "1000", "--out", str(tmp_path)]) == 0
    assert got["args"] == (1, 1000, str(tmp_path)) and capsys.readouterr().out.strip() == str(tmp_path / "x.gguf")
    assert main(["synth", "flash-tiny", "--rows", "5"]) == 2
    assert "--rows: flash-shape's flags" in capsys.readouterr().err
