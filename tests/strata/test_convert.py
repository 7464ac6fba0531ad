"""strata convert: a tiny random Qwen4Exp checkpoint -> GGUF, against llama.cpp's converter.

The golden data (tests/data/convert_golden.json, from scripts/golden_convert.py) is llama.cpp's
converter's output for the same checkpoint (seed 0, folder `flash-tiny`), read by gguf-py:
the sha256 of each whole file, for every --outtype both write (f32, f16, bf16, q8_0), and a
digest (metadata keys in order with types and value hashes, tensors in order with names,
shapes, types, offsets and byte hashes) that says where a file that differs differs.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.cli import main as cli
from strata.convert import ConvertError, convert, mtp_sidecar_path
from strata.convert.qwen4exp import Checkpoint, Qwen4ExpConverter
from strata.convert.synth import build_qwen4exp_checkpoint
from strata.gguf import open_gguf

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "data" / "convert_golden.json").read_text())
sys.path.insert(0, str(ROOT / "scripts"))
import golden_convert


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smollm2_gguf):
    out = tmp_path_factory.mktemp("ckpt") / GOLDEN["checkpoint_name"]
    return build_qwen4exp_checkpoint(out, seed=GOLDEN["seed"], tokenizer_gguf=smollm2_gguf.path)


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """outtype -> GGUF path, each converted once."""
    out_dir = tmp_path_factory.mktemp("gguf")
    cache: dict[str, Path] = {}

    def get(outtype: str) -> Path:
        if outtype not in cache:
            path = out_dir / f"tiny-{outtype}.gguf"
            convert(hf_dir, path, outtype, progress=False)
            cache[outtype] = path
        return cache[outtype]
    return get


def _hf(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for part in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(part))
    return out


def test_checkpoint_is_the_golden_one(hf_dir):
    # otherwise the comparisons below would blame the converter for a changed checkpoint
    assert golden_convert.digest_checkpoint(hf_dir) == GOLDEN["checkpoint"], (
        "the synthetic checkpoint differs from the one the golden digests were made from "
        "(torch or transformers changed its random draws?): rerun scripts/golden_convert.py")


def _assert_matches_golden(path: Path, outtype: str) -> None:
    """The whole file equals llama.cpp's, byte for byte (golden_convert.assert_matches).

    One exception, and it is bounded: the `.ssm_a` tensors hold -exp(A_log), and torch's
    float32 exp (which llama.cpp's converter and Strata both call) sets the last bit
    differently on CPUs with and without AVX-512; where this machine's bits differ from the
    golden machine's they must be within 1 ulp, and llama.cpp's are put in their place
    before the whole file is hashed. test_layout checks those values against torch here."""
    golden_convert.assert_matches(path, GOLDEN["outtypes"][outtype], outtype)


# bf16 is compared in test_cli_convert_shows_progress
@pytest.mark.parametrize("outtype", ["f32"] + [pytest.param(t, marks=pytest.mark.slow) for t in ("f16", "q8_0")])
def test_conversion_equals_llama_cpp(converted, outtype):
    _assert_matches_golden(converted(outtype), outtype)


def test_layout(hf_dir, converted):
    """The rules the digests encode, spelled out: +1 folding of the zero-centred norms (and
    not of the DeltaNet's gated norm), A_log -> -exp, V heads regrouped from grouped-by-k to
    tiled, the indexer projection split, convolutions squeezed, the PLE shards stacked, the
    hash constants as exact UINT64 metadata."""
    g, hf = open_gguf(converted("f32")), _hf(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    n_k, n_v, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                         "linear_key_head_dim", "linear_value_head_dim"))
    r = n_v // n_k
    t = lambda name: torch.from_numpy(g.tensor(name).numpy())
    h = lambda name: hf[name].float()

    assert torch.equal(t("blk.0.hc_attn_norm.weight"), h("model.layers.0.attn_hyper_connection.hc_norm.weight") + 1)
    assert torch.equal(t("output_hc_norm.weight"), h("model.hyper_connection_mixer.hc_norm.weight") + 1)
    assert torch.equal(t("blk.3.indexer.q_norm.weight"), h("model.layers.3.self_attn.indexer.q_layernorm.weight") + 1)
    assert torch.equal(t("blk.1.ple_norm_conv.weight"), h("model.layers.1.ple.norm_conv.weight") + 1)
    assert torch.equal(t("blk.0.ssm_norm.weight"), h("model.layers.0.linear_attn.norm.weight"))

    # v head j of k head k (HF row block k*r + j) lands at tiled position j*n_k + k
    qkv, hf_qkv = t("blk.0.attn_qkv.weight"), h("model.layers.0.linear_attn.in_proj_qkv.weight")
    a_log, ssm_a = h("model.layers.0.linear_attn.A_log"), t("blk.0.ssm_a")
    out, hf_out = t("blk.0.ssm_out.weight"), h("model.layers.0.linear_attn.out_proj.weight")
    qk = 2 * n_k * dk
    assert torch.equal(qkv[:qk], hf_qkv[:qk])
    for k in range(n_k):
        for j in range(r):
            src, dst = k * r + j, j * n_k + k
            assert torch.equal(qkv[qk + dst * dv:qk + (dst + 1) * dv], hf_qkv[qk + src * dv:qk + (src + 1) * dv])
            assert torch.equal(out[:, dst * dv:(dst + 1) * dv], hf_out[:, src * dv:(src + 1) * dv])
            assert ssm_a[dst] == -torch.exp(a_log[src])

    n_q = cfg["indexer_n_heads"] * cfg["indexer_head_dim"]
    qk_proj = h("model.layers.3.self_attn.indexer.index_qk_proj.weight")
    assert torch.equal(t("blk.3.indexer.q_proj.weight"), qk_proj[:n_q])
    assert torch.equal(t("blk.3.indexer.k_proj.weight"), qk_proj[n_q:])
    assert torch.equal(t("blk.1.ple_conv1d.weight"), h("model.layers.1.ple.conv1d.weight").squeeze(1))
    assert torch.equal(t("blk.2.ffn_up_exps.weight")[5], h("model.layers.2.mlp.experts.5.up_proj.weight"))

    shards = [h(f"model.layers.1.ple.ple_embedding.ngram_embedding.shard_{i}.weight")
              for i in range(cfg["split_ngram_parts"])]
    assert torch.equal(t("per_layer_token_embd.weight"), torch.cat(shards))
    mult = hf["model.layers.1.ple.ple_embedding.layer_multipliers"].tolist()
    assert g.metadata["qwen4exp.ple.layer_multipliers"] == mult and max(mult) > 2**40
    assert g.metadata_types["qwen4exp.ple.layer_multipliers"].name == "UINT64"
    assert g.metadata["qwen4exp.attention.compress_ratios"] == [0, 0, 0, cfg["indexer_compress_ratio"]]
    assert not any(n.startswith("blk.4.") for n in g.tensors)  # MTP stays out of the main file


def test_q8_0_within_q8_0_error_of_f32(converted):
    ref, q8 = open_gguf(converted("f32")), open_gguf(converted("q8_0"))
    kinds = {}
    for name, t in q8.tensors.items():
        x = ref.tensor(name).numpy()
        y = t.numpy()
        kinds.setdefault(t.fmt.name, []).append(name)
        if t.fmt.name == "F32":
            assert np.array_equal(x, y), name
        elif t.fmt.name == "F16":  # rows too short for 32-weight blocks
            np.testing.assert_allclose(y, x, rtol=2**-11, atol=2**-24, err_msg=name)
        else:
            assert t.fmt.name == "Q8_0", name
            xb, yb = x.reshape(-1, 32), y.reshape(-1, 32)
            # one scale d = max|x|/127 per block, codes round(x/d): |x - q*d| <= d/2; the scale
            # is stored as fp16 (relative error <= 2^-11), which adds up to 127 * d * 2^-11
            bound = (0.5 + 127 * 2**-11) * np.abs(xb).max(axis=1, keepdims=True) / 127 * (1 + 2**-11)
            assert (np.abs(yb - xb) <= bound).all(), name
    assert "blk.0.ssm_conv1d.weight" in kinds["F32"] and "blk.0.ffn_gate_inp.weight" in kinds["F32"]
    assert set(kinds["F16"]) == {"blk.1.ple_conv1d.weight", "per_layer_token_embd.weight"}
    assert "blk.0.ffn_down_exps.weight" in kinds["Q8_0"] and "token_embd.weight" in kinds["Q8_0"]


def test_mtp_sidecar_holds_the_mtp_weights(hf_dir, converted):
    main = converted("f32")
    side = open_gguf(mtp_sidecar_path(main))
    assert mtp_sidecar_path(main).name == f"mtp-{main.name}"
    hf = _hf(hf_dir)
    n = open_gguf(main).metadata["qwen4exp.block_count"]
    assert side.metadata["qwen4exp.block_count"] == n + 1
    assert side.metadata["qwen4exp.nextn_predict_layers"] == 1
    assert side.metadata["qwen4exp.attention.recurrent_layers"][-1] is False
    assert all(name.startswith(f"blk.{n}.") for name in side.tensors)
    t = lambda name: torch.from_numpy(side.tensor(f"blk.{n}.{name}").numpy())
    assert torch.equal(t("nextn.eh_proj.weight"), hf["mtp.fc.weight"].float())
    assert torch.equal(t("nextn.enorm.weight"), hf["mtp.pre_fc_norm_embedding.weight"].float() + 1)
    assert torch.equal(t("nextn.hnorm.weight"), hf["mtp.pre_fc_norm_hidden.weight"].float() + 1)
    assert torch.equal(t("nextn.shared_head_norm.weight"), hf["mtp.norm.weight"].float() + 1)
    assert torch.equal(t("attn_q.weight"), hf["mtp.layers.0.self_attn.q_proj.weight"].float())
    assert torch.equal(t("attn_q_norm.weight"), hf["mtp.layers.0.self_attn.q_norm.weight"].float() + 1)
    assert torch.equal(t("ffn_gate_exps.weight")[3], hf["mtp.layers.0.mlp.experts.3.gate_proj.weight"].float())
    # every mtp.* weight is there: experts stack 3 * n_experts into 3, the indexer splits 1 into 2
    n_mtp = sum(1 for k in hf if k.startswith("mtp."))
    n_exp = json.loads((hf_dir / "config.json").read_text())["num_experts"]
    assert len(side.tensors) == n_mtp - 3 * n_exp + 3 + 1


def _copy_without(hf_dir: Path, dst: Path, drop: set[str], mtp: bool = True,
                  extra: dict[str, torch.Tensor] | None = None) -> Path:
    dst.mkdir()
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors" and (mtp or "mtp" not in f.name and "index" not in f.name):
            shutil.copy(f, dst / f.name)
    kept = {k: v for k, v in load_file(hf_dir / "model.safetensors").items() if k not in drop}
    kept.update(extra or {})
    save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    if mtp and (drop or extra):  # keep the index consistent with the parts
        index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in drop}
        index["weight_map"].update({k: "model.safetensors" for k in extra or {}})
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_no_mtp_block_no_sidecar(hf_dir, tmp_path):
    src = _copy_without(hf_dir, tmp_path / "no-mtp", set(), mtp=False)
    conv = Qwen4ExpConverter(Checkpoint(src), "f32")  # convert() writes a sidecar only for conv.mtp
    assert conv.mtp == [] and len(conv.main) == len(GOLDEN["outtypes"]["f32"]["tensors"])


@pytest.mark.slow
def test_cli_convert_shows_progress(hf_dir, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert cli(["convert", str(hf_dir), str(out), "--outtype", "bf16"]) == 0
    err = capsys.readouterr().err
    assert "[113/113]" in err and "MB" in err and "per_layer_token_embd.weight" in err
    assert f"wrote {out}" in err and f"wrote {mtp_sidecar_path(out)}" in err
    _assert_matches_golden(out, "bf16")


def test_error_no_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match=r"empty: no config\.json"):
        convert(tmp_path / "empty", tmp_path / "x.gguf")


def test_error_not_qwen4exp(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConvertError, match=r"model_type 'llama' .* is not Qwen4Exp"):
        convert(d, tmp_path / "x.gguf")


def test_error_missing_tensors_are_named(hf_dir, tmp_path):
    drop = {"model.layers.2.linear_attn.out_proj.weight", "model.layers.0.mlp.experts.7.up_proj.weight"}
    src = _copy_without(hf_dir, tmp_path / "cut", drop)
    with pytest.raises(ConvertError, match="2 tensors the config needs are missing") as e:
        convert(src, tmp_path / "x.gguf", "f32", progress=False)
    assert all(name in str(e.value) for name in drop)
    assert not (tmp_path / "x.gguf").exists()


def test_error_unknown_tensor_is_named(hf_dir, tmp_path):
    src = _copy_without(hf_dir, tmp_path / "extra", set(), mtp=False,
                        extra={"model.layers.0.linear_attn.mystery.weight": torch.zeros(4, 4)})
    with pytest.raises(ConvertError, match=r"cannot map to qwen4exp names: model\.layers\.0\.linear_attn\.mystery"):
        convert(src, tmp_path / "x.gguf", "f32", progress=False)


def test_error_unknown_outtype(hf_dir, tmp_path, capsys):
    with pytest.raises(ConvertError, match=r"--outtype 'q4_0' .* f32, f16, bf16, q8_0"):
        convert(hf_dir, tmp_path / "x.gguf", "q4_0")
    assert cli(["convert", str(hf_dir), str(tmp_path / "x.gguf"), "--outtype", "q4_0"]) == 2
    assert "--outtype 'q4_0'" in capsys.readouterr().err


def test_fused_experts_give_the_same_stacks(hf_dir, converted, tmp_path):
    # transformers' in-memory layout (gate_up_proj [E, 2F, H], down_proj [E, H, F]) is read too
    src = _copy_without(hf_dir, tmp_path / "fused", set(), mtp=False)
    tensors = load_file(src / "model.safetensors")
    n_exp = json.loads((src / "config.json").read_text())["num_experts"]
    p = "model.layers.0.mlp.experts."
    gate_up = [torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
               for e in range(n_exp)]
    tensors[p + "gate_up_proj"] = torch.stack(gate_up)
    tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(n_exp)])
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})

    conv = Qwen4ExpConverter(Checkpoint(src), "f32")
    ref = open_gguf(converted("f32"))
    planned = {t.name: t for t in conv.plan(conv.main)}
    for kind in ("gate", "up", "down"):
        name = f"blk.0.ffn_{kind}_exps.weight"
        data = b"".join(piece.tobytes() for piece in conv.data(planned[name]))
        assert planned[name].shape == ref.tensor(name).shape and data == ref.tensor(name).data.tobytes(), name
