"""strata.imatrix: llama-imatrix's importance matrix, on SmolLM2 over 2 chunks of 128 tokens,
in llama.cpp's GGUF imatrix layout (tools/imatrix/imatrix.cpp, save_imatrix)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from strata.imatrix import (
    collect,
    compute_imatrix,
    load_imatrix,
    read_imatrix,
    write_imatrix,
)
from strata.perplexity import stdlib_text

N_CTX, N_CHUNKS = 128, 2
WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def tokens(smollm2_tokenizer):
    return smollm2_tokenizer.encode(stdlib_text()[:20000], parse_special=False)


@pytest.fixture(scope="module")
def imatrix(smollm2_bf16, tokens):
    return compute_imatrix(smollm2_bf16, tokens, N_CTX, N_CHUNKS, datasets=["stdlib.txt"])


def test_every_blk_weight_has_its_input_columns_and_counts_every_token(imatrix, smollm2_gguf):
    expected = {f"blk.{i}.{w}.weight" for i in range(30) for w in WEIGHTS}
    assert set(imatrix.sums) == expected  # no output.weight, no token_embd.weight: as llama-imatrix
    for name in expected:
        assert imatrix.sums[name].shape == (1, smollm2_gguf.tensors[name].shape[1])
        assert imatrix.counts[name].tolist() == [N_CHUNKS * N_CTX]
    assert np.isfinite(imatrix.ppl) and imatrix.chunk_count == N_CHUNKS and imatrix.chunk_size == N_CTX


def test_sums_are_the_squared_inputs_of_the_weight(imatrix, smollm2_bf16, tokens):
    # blk.0's Q, K and V read attn_norm(embedding): recompute it without any hook
    m = smollm2_bf16
    x = torch.cat([m.blocks[0].attn_norm(m.embed(torch.tensor(tokens[c * N_CTX:(c + 1) * N_CTX])))
                   for c in range(N_CHUNKS)]).double()
    for w in ("attn_q", "attn_k", "attn_v"):
        np.testing.assert_allclose(imatrix.sums[f"blk.0.{w}.weight"][0], (x * x).sum(0).numpy(), rtol=1e-5)


def test_hooks_go_with_the_block_and_short_batches_are_skipped(smollm2_bf16):
    m = smollm2_bf16
    with collect(m) as stats:
        m.forward([1, 2, 3], m.new_cache(3))  # 3 rows: under llama-imatrix's 16
    assert all(s.count == 0 for s in stats.values())
    assert not any(mod._forward_pre_hooks for mod in m.modules())


def test_file_round_trips_and_reads_as_llama_cpp_reads_it(imatrix, tmp_path):
    path = write_imatrix(tmp_path / "imatrix.gguf", imatrix)
    r = GGUFReader(path)
    assert r.fields["general.type"].contents() == "imatrix"
    assert "general.architecture" not in r.fields  # imatrix.cpp writes none
    assert r.fields["imatrix.datasets"].contents() == ["stdlib.txt"]
    assert r.fields["imatrix.chunk_count"].contents() == N_CHUNKS
    assert r.fields["imatrix.chunk_size"].contents() == N_CTX
    names = [t.name for t in r.tensors]
    assert names == [f"{n}.{s}" for n in sorted(imatrix.sums) for s in ("in_sum2", "counts")]
    t = {t.name: t for t in r.tensors}
    # ne [in, n_mat] and [1, n_mat], less the trailing 1s ggml drops for a dense weight
    assert t["blk.0.ffn_down.weight.in_sum2"].shape.tolist() == [1536]
    assert t["blk.0.ffn_down.weight.counts"].shape.tolist() == [1]
    assert all(x.tensor_type == GGMLQuantizationType.F32 for x in r.tensors)

    back = read_imatrix(path)
    assert back.datasets == ["stdlib.txt"] and back.chunk_count == N_CHUNKS
    mean = load_imatrix(path)
    for name, s in imatrix.sums.items():
        np.testing.assert_array_equal(back.sums[name], s)
        np.testing.assert_array_equal(mean[name], (s[0] / (N_CHUNKS * N_CTX)).astype(np.float32))


def test_reads_a_file_laid_out_as_imatrix_cpp_saves_it(tmp_path):
    # imatrix.cpp's save_imatrix: metadata, then per name in sorted order `.in_sum2` F32
    # ne [n_in, n_mat] and `.counts` F32 ne [1, n_mat] (ne [n_in] and [1] for a dense
    # weight); here also a 2-expert entry whose second expert saw no tokens, which
    # llama-quantize reads as all ones
    w = GGUFWriter(tmp_path / "ref.gguf", arch="")  # empty: no general.architecture key
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["a.txt"])
    w.add_uint32("imatrix.chunk_count", 3)
    w.add_uint32("imatrix.chunk_size", 512)
    dense = np.arange(8, dtype=np.float32) * 6
    experts = np.stack([np.full(4, 10.0, np.float32), np.zeros(4, np.float32)])
    w.add_tensor("blk.0.ffn_down.weight.in_sum2", dense)
    w.add_tensor("blk.0.ffn_down.weight.counts", np.array([6.0], np.float32))
    w.add_tensor("blk.0.ffn_down_exps.weight.in_sum2", experts)
    w.add_tensor("blk.0.ffn_down_exps.weight.counts", np.array([[5.0], [0.0]], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = load_imatrix(tmp_path / "ref.gguf")
    np.testing.assert_array_equal(got["blk.0.ffn_down.weight"], np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(got["blk.0.ffn_down_exps.weight"], [[2.0] * 4, [1.0] * 4])
    im = read_imatrix(tmp_path / "ref.gguf")
    assert im.chunk_count == 3 and im.chunk_size == 512 and im.counts["blk.0.ffn_down_exps.weight"].tolist() == [5, 0]
    # and written back, byte for byte (as a file from llama-imatrix was when measured)
    write_imatrix(tmp_path / "again.gguf", im)
    assert (tmp_path / "again.gguf").read_bytes() == (tmp_path / "ref.gguf").read_bytes()
