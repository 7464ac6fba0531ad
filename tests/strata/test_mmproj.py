"""strata convert --mmproj: the vision tower of a tiny random Qwen4ExpForConditionalGeneration
-> mmproj GGUF, against llama.cpp's converter.

The golden data (tests/data/mmproj_golden.json, from `scripts/golden_convert.py --mmproj`) is
llama.cpp's `convert_hf_to_gguf.py --mmproj` output for the same checkpoint (flash-tiny's
text model with synth's tiny vision tower, float32, seed 0, folder `flash-tiny-vision`),
read by gguf-py, for every --outtype both write: the sha256 of each whole file and a digest
that names the metadata key or tensor where a file that differs differs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from strata.cli import main as cli
from strata.convert import ConvertError, convert, mmproj_sidecar
from strata.convert.checkpoint import Checkpoint
from strata.convert.mmproj import ARCH as MMPROJ_ARCH
from strata.convert.mmproj import MmprojConverter
from strata.convert.synth import build_qwen4exp_checkpoint
from strata.convert.writer import write_streamed
from strata.gguf import open_gguf
from strata.hub import FLASH_TINY

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "data" / "mmproj_golden.json").read_text())
sys.path.insert(0, str(ROOT / "scripts"))
import golden_convert

VISION_MARKERS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smollm2_gguf):
    out = tmp_path_factory.mktemp("ckpt") / GOLDEN["checkpoint_name"]  # general.name comes from it
    return build_qwen4exp_checkpoint(out, FLASH_TINY, seed=GOLDEN["seed"], dtype="float32",
                                     tokenizer_gguf=smollm2_gguf.path, vision={})


def test_checkpoint_is_the_golden_one(hf_dir):
    # otherwise the comparisons below would blame the converter for a changed checkpoint
    assert golden_convert.digest_checkpoint(hf_dir, golden_convert.VISUAL_PREFIX) == GOLDEN["checkpoint"], (
        "the synthetic vision tower differs from the one the golden digests were made from (torch or "
        "transformers changed its random draws?): rerun scripts/golden_convert.py --mmproj")


def _mmproj_alone(hf_dir: Path, path: Path, outtype: str) -> Path:
    # the sidecar without the text model, whose 570 MB (in f32) take most of a convert()
    # and whose bytes are test_convert's business
    conv = MmprojConverter(Checkpoint(hf_dir), outtype)
    infos = [(t.name, t.shape, t.fmt) for t in conv.tensors]
    return write_streamed(path, MMPROJ_ARCH, conv.metadata(), infos, lambda i: conv.data(conv.tensors[i]))


def test_mmproj_equals_llama_cpp(hf_dir, tmp_path):
    out = tmp_path / "tiny-f16.gguf"
    written = convert(hf_dir, out, "f16", progress=False, mmproj=True)
    assert written == [out, mmproj_sidecar(out)]
    golden_convert.assert_matches(mmproj_sidecar(out), GOLDEN["outtypes"]["f16"], "mmproj f16")


# f16 is compared above, f32 in test_cli_convert_mmproj, both through convert()
@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_mmproj_equals_llama_cpp_other_outtypes(hf_dir, tmp_path, outtype):
    path = _mmproj_alone(hf_dir, tmp_path / f"mmproj-{outtype}.gguf", outtype)
    golden_convert.assert_matches(path, GOLDEN["outtypes"][outtype], f"mmproj {outtype}")


def test_cli_convert_mmproj(hf_dir, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert cli(["convert", str(hf_dir), str(out), "--mmproj", "--outtype", "f32"]) == 0
    err = capsys.readouterr().err
    side = mmproj_sidecar(out)
    assert side.name == f"mmproj-{out.name}"
    assert f"wrote {out}" in err and f"wrote {side}" in err
    assert "[34/34]" in err and "MB" in err and "v.patch_embd.weight.1" in err
    golden_convert.assert_matches(side, GOLDEN["outtypes"]["f32"], "mmproj f32")

    # the rules the digest encodes, spelled out: the Conv3D kernel's two frames as two
    # Conv2D kernels, the merger's fc1/fc2 as mm.0/mm.2, its norm as v.post_ln
    g = open_gguf(side)
    with safe_open(hf_dir / "model.safetensors", framework="pt") as f:
        hf = lambda name: f.get_tensor(f"model.visual.{name}")
        t = lambda name: torch.from_numpy(g.tensor(name).numpy())
        conv3d = hf("patch_embed.proj.weight")
        assert torch.equal(t("v.patch_embd.weight"), conv3d[:, :, 0])
        assert torch.equal(t("v.patch_embd.weight.1"), conv3d[:, :, 1])
        assert torch.equal(t("mm.0.weight"), hf("merger.linear_fc1.weight"))
        assert torch.equal(t("mm.2.bias"), hf("merger.linear_fc2.bias"))
        assert torch.equal(t("v.post_ln.weight"), hf("merger.norm.weight"))
        assert torch.equal(t("v.blk.1.attn_qkv.weight"), hf("blocks.1.attn.qkv.weight"))
    assert g.metadata["clip.projector_type"] == "qwen3vl_merger"
    assert g.metadata["clip.vision.projection_dim"] == FLASH_TINY["hidden_size"]

    # the text model keeps the release's vision markers in its vocabulary
    text = open_gguf(out)
    assert text.metadata["tokenizer.ggml.tokens"][3:7] == VISION_MARKERS
    assert text.metadata["qwen4exp.ple.image_token_id"] == 5


@pytest.mark.slow
def test_error_no_vision_tower(tmp_path, smollm2_gguf):
    src = build_qwen4exp_checkpoint(tmp_path / "text-only", seed=0, tokenizer_gguf=smollm2_gguf.path, mtp=False)
    with pytest.raises(ConvertError, match=r"text-only: the checkpoint has no vision tower \(no vision_config"):
        convert(src, tmp_path / "x.gguf", "f32", progress=False, mmproj=True)
    # a vision_config alone is no vision tower either
    cfg_path = src / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "vision_config": {"depth": 2, "hidden_size": 64}}))
    with pytest.raises(ConvertError, match=r"text-only: the checkpoint has no vision tower \(no model\.visual\."):
        convert(src, tmp_path / "x.gguf", "f32", progress=False, mmproj=True)
    assert not list(tmp_path.glob("*.gguf*"))  # refused before anything was written
