"""strata.imatrix: llama-imatrix's importance matrix, on SmolLM2 over 2 chunks of 128 tokens,
in llama.cpp's GGUF imatrix layout (tools/imatrix/imatrix.cpp, save_imatrix), against the
file llama-imatrix itself wrote for the same text (tests/data/llama_tools_golden.json and
llama_imatrix.npz, from scripts/golden_llama_tools.py)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from strata.imatrix import (
    collect,
    compute_imatrix,
    load_imatrix,
    read_imatrix,
    write_imatrix,
)

N_CTX, N_CHUNKS = 128, 2
WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
# measured here: block 0's Q, K, V 1.2e-6 at most; deeper inputs 0.19 at most (blk.29
# ffn_down) with the floor, their median 0.2-1.9% per tensor
TOL_FIRST, TOL_DEEP, TOL_DEEP_MEDIAN, TOL_FLOOR = 1e-5, 0.3, 0.03, 0.01
LLAMA = json.loads((DATA / "llama_tools_golden.json").read_text())["imatrix"]


@pytest.fixture(scope="module")
def llama_arrays():
    with np.load(DATA / "llama_imatrix.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def tokens(smollm2_tokenizer, llama_tools_text):
    return smollm2_tokenizer.encode(llama_tools_text, parse_special=False)


@pytest.fixture(scope="module")
def imatrix(smollm2_bf16, tokens):
    return compute_imatrix(smollm2_bf16, tokens, N_CTX, N_CHUNKS, datasets=[LLAMA["metadata"]["imatrix.datasets"]["value"][0]])


def test_weights_and_counts_are_llama_imatrixs(imatrix, llama_arrays):
    # no output.weight, no token_embd.weight; every token of every chunk counted, as llama-imatrix
    names = [t["name"][:-len(".in_sum2")] for t in LLAMA["tensors"] if t["name"].endswith(".in_sum2")]
    assert sorted(imatrix.sums) == sorted(names) and len(names) == 30 * len(WEIGHTS)
    for name in names:
        assert imatrix.counts[name].tolist() == llama_arrays[f"{name}.counts"].reshape(-1).tolist()
    meta = LLAMA["metadata"]
    assert imatrix.chunk_count == meta["imatrix.chunk_count"]["value"] == N_CHUNKS
    assert imatrix.chunk_size == meta["imatrix.chunk_size"]["value"] == N_CTX
    assert np.isfinite(imatrix.ppl)


def test_sums_are_llama_imatrixs(imatrix, llama_arrays):
    """Σ x_j² per input column, against llama-imatrix's for blocks 0, 15 and 29.

    Block 0's Q, K and V read attn_norm(embedding), computed alike by both (bf16 rounding
    here: relative 2^-8 per squared element, averaging out over 256 tokens): TOL_FIRST.
    Deeper inputs went through matmuls whose activations llama.cpp rounds to 8 bits and
    Strata to bf16: TOL_DEEP per column, relative to the column's sum plus TOL_FLOOR of the
    tensor's mean column (columns that see almost nothing are noise in both)."""
    for layer in LLAMA["layers"]:
        for w in WEIGHTS:
            name = f"blk.{layer}.{w}.weight"
            theirs = llama_arrays[f"{name}.in_sum2"].reshape(-1).astype(np.float64)
            ours = imatrix.sums[name][0].astype(np.float64)
            tol = TOL_FIRST if (layer, w) in ((0, "attn_q"), (0, "attn_k"), (0, "attn_v")) else TOL_DEEP
            err = np.abs(ours - theirs) / (theirs + TOL_FLOOR * theirs.mean())
            assert err.max() < tol, (name, err.max(), int(err.argmax()))
            assert np.median(err) < min(tol, TOL_DEEP_MEDIAN), (name, np.median(err))


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


def test_file_is_laid_out_as_llama_imatrixs_and_round_trips(imatrix, llama_arrays, tmp_path):
    # the header (metadata, tensor names, shapes, types, offsets) does not depend on the
    # values: llama-imatrix's, byte for byte; gguf-py then reads the same fields from both
    path = write_imatrix(tmp_path / "imatrix.gguf", imatrix)
    raw = path.read_bytes()
    header = llama_arrays["header"].tobytes()
    assert raw[:len(header)] == header and len(raw) == LLAMA["bytes"]
    r = GGUFReader(path)
    assert {k: {"type": f.types[0].name, "value": f.contents()} for k, f in r.fields.items()
            if not k.startswith("GGUF.")} == LLAMA["metadata"]
    assert [{"name": t.name, "shape": [int(n) for n in t.shape], "type": t.tensor_type.name}
            for t in r.tensors] == LLAMA["tensors"]

    back = read_imatrix(path)
    assert back.datasets == imatrix.datasets and back.chunk_count == N_CHUNKS
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


# -- routed experts: flash-tiny (qwen4exp, 64 experts a layer, 8 a token) ----------------------

MOE = json.loads((DATA / "llama_tools_golden.json").read_text())["imatrix_moe"]
EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(scope="module")
def flash_tiny_f32(flash_tiny_gguf):
    from strata.load import load_model
    return load_model(flash_tiny_gguf, dtype=torch.float32)


@pytest.fixture(scope="module")
def moe_imatrix(flash_tiny_f32, flash_tiny_gguf, llama_tools_text):
    from strata.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(flash_tiny_gguf)
    tokens = tok.encode(llama_tools_text, parse_special=False)
    return compute_imatrix(flash_tiny_f32, tokens, N_CTX, N_CHUNKS, tok.bos_id if tok.add_bos else None,
                           datasets=MOE["metadata"]["imatrix.datasets"]["value"])


@pytest.fixture(scope="module")
def moe_arrays():
    with np.load(DATA / "llama_imatrix_moe.npz") as z:
        return {k: z[k] for k in z.files}


def test_expert_sums_are_a_loop_over_tokens_and_their_experts(flash_tiny_f32, flash_tiny_gguf):
    """Each (token, routed expert) pair adds the token's input to the expert's gate and up
    rows and silu(gate_e x) * up_e x to its down row: against a plain loop over the pairs,
    in float64, with the weights read from the file."""
    from strata.storage.experts import ExpertStore
    m, g = flash_tiny_f32, flash_tiny_gguf
    seen, handles = {}, []

    def keep(mod, args):  # returns None: the store's arguments unchanged
        seen[mod.names] = (args[0].detach().double(), args[2].clone())

    for s in m.modules():
        if isinstance(s, ExpertStore) and s.names[0].startswith(("blk.0.", "blk.5.")):
            handles.append(s.register_forward_pre_hook(keep))
    tokens = list(range(1000, 1024))  # 24 tokens
    try:
        with collect(m) as stats:
            m.forward(tokens, m.new_cache(len(tokens)), last_only=False)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == 2
    for names, (x, ids) in seen.items():
        wg, wu = (torch.from_numpy(g.tensors[n].numpy()).double() for n in names[:2])
        E, H = wg.shape[0], wg.shape[-1]
        ref = {n: torch.zeros(E, wg.shape[-1 if n != names[2] else 1], dtype=torch.float64) for n in names}
        counts = torch.zeros(E, dtype=torch.long)
        for t in range(x.shape[0]):
            for e in ids[t].tolist():
                ref[names[0]][e] += x[t] ** 2
                ref[names[1]][e] += x[t] ** 2
                h = torch.nn.functional.silu(wg[e] @ x[t]) * (wu[e] @ x[t])
                ref[names[2]][e] += h ** 2
                counts[e] += 1
        assert counts.sum() == x.shape[0] * ids.shape[1] and (counts == 0).any()  # some expert unused
        for n in names:
            got = stats[n]
            np.testing.assert_array_equal(got.counts(), counts.numpy())
            np.testing.assert_allclose(got.matrix(), ref[n].numpy(), rtol=1e-5, atol=1e-6 * float(ref[n].max()))
            assert got.matrix().shape == (E, H if n != names[2] else wg.shape[1])


def test_expert_counts_and_sums_are_llama_imatrixs(moe_imatrix, moe_arrays):
    """Against llama-imatrix on the same file, text and chunks. Blocks 0-2 (Gated DeltaNet
    mixers) route every token as llama.cpp does: every expert's count equal, block 0's sums
    within 1e-5 (measured 1.5e-6). From block 3, the first attention block, the two engines'
    hidden states part by float rounding and a random model's near-tied router flips some
    choices: measured 16-26 of the 2048 a layer; the totals stay equal."""
    im = moe_imatrix
    total = N_CHUNKS * N_CTX * 8
    for layer in range(8):
        for w in EXPS:
            name = f"blk.{layer}.{w}.weight"
            theirs = moe_arrays[f"{name}.counts"].reshape(-1).astype(np.int64)
            ours = im.counts[name]
            assert ours.shape == (64,) and ours.sum() == theirs.sum() == total
            if layer < 3:
                assert ours.tolist() == theirs.tolist(), name
            else:
                assert np.abs(ours - theirs).sum() <= 0.05 * total, (name, np.abs(ours - theirs).sum())
    for layer in MOE["layers"]:
        for w in EXPS:
            name = f"blk.{layer}.{w}.weight"
            theirs = moe_arrays[f"{name}.in_sum2"].reshape(64, -1)
            np.testing.assert_allclose(im.sums[name], theirs, rtol=1e-5, atol=1e-5 * theirs.mean())


def test_moe_file_is_laid_out_as_llama_imatrixs(moe_imatrix, moe_arrays, tmp_path):
    """The same weights collected (the MTP head's are not: llama-imatrix never runs it), the
    merged experts as in_sum2 ne [256, 64] and counts ne [1, 64]: the header byte for byte,
    gguf-py reading the same fields from both, and the per-expert rows read back."""
    path = write_imatrix(tmp_path / "imatrix.gguf", moe_imatrix)
    raw = path.read_bytes()
    header = moe_arrays["header"].tobytes()
    assert raw[:len(header)] == header and len(raw) == MOE["bytes"]
    r = GGUFReader(path)
    assert {k: {"type": f.types[0].name, "value": f.contents()} for k, f in r.fields.items()
            if not k.startswith("GGUF.")} == MOE["metadata"]
    assert [{"name": t.name, "shape": [int(n) for n in t.shape], "type": t.tensor_type.name}
            for t in r.tensors] == MOE["tensors"]
    assert {"name": "blk.0.ffn_down_exps.weight.in_sum2", "shape": [256, 64], "type": "F32"} in MOE["tensors"]
    back = read_imatrix(path)
    mean = load_imatrix(path)
    for name in ("blk.0.ffn_down_exps.weight", "blk.7.ffn_gate_exps.weight"):
        np.testing.assert_array_equal(back.counts[name], moe_imatrix.counts[name])
        np.testing.assert_array_equal(back.sums[name], moe_imatrix.sums[name])
        c = moe_imatrix.counts[name][:, None].astype(np.float32)
        want = np.where(c > 0, moe_imatrix.sums[name] / np.maximum(c, 1), 1).astype(np.float32)
        np.testing.assert_allclose(mean[name], want, rtol=1e-6)
