"""The vision tower of a Qwen3.8-Flash-Next checkpoint -> an mmproj GGUF (`strata convert --mmproj`).

The file goes beside OUT as `mmproj-<OUT name>` (strata.names.qwen4exp.mmproj_sidecar): a
GGUF of architecture `clip`, general.type `mmproj`, holding the `model.visual.*` weights (a
Qwen3-VL ViT and its patch merger) and the `clip.*` metadata llama.cpp's mtmd loader reads.
It is what llama.cpp's converter writes with `--mmproj` for the same checkpoint and outtype,
byte for byte: conversion/qwen4exp.py's Qwen4ExpVisionModel, which is conversion/qwen3vl.py's
Qwen3VLVisionModel on conversion/base.py's MmprojModel, with the names of
gguf-py/gguf/tensor_mapping.py (llama.cpp as vendored by llama-cpp-python 0.3.36).

Tensors, in checkpoint order (parts sorted, names sorted within each part), `visual.` for
`model.visual.`:

- blocks.N.{attn.qkv, attn.proj, norm1, norm2, mlp.linear_fc1, mlp.linear_fc2} ->
  v.blk.N.{attn_qkv, attn_out, ln1, ln2, ffn_up, ffn_down}
- merger.linear_fc1 -> mm.0, merger.linear_fc2 -> mm.2 (Qwen2-VL's indices), merger.norm ->
  v.post_ln, pos_embed -> v.position_embd, patch_embed.proj.bias -> v.patch_embd.bias
- patch_embed.proj.weight, a Conv3D [C_out, C_in, 2, P, P], -> two Conv2D kernels, frame 0
  as v.patch_embd.weight and frame 1 as v.patch_embd.weight.1 (ggml has no Conv3D; a
  temporal patch size other than 2 is refused, as llama.cpp refuses it).

Types: F32 for 1-D tensors (norms, biases) and v.position_embd.weight; the patch kernels F16
under --outtype f16 and F32 under every other outtype (MmprojModel.tensor_force_quant:
ggml's Conv2D takes F16 or F32 kernels); everything else takes --outtype, Q8_0 falling back to
F16 for rows that are not whole 32-weight blocks. Bytes as the text model's: widened to f32
unless stored f16/f32, then cast or quantized.

Metadata, in llama.cpp's order: general.type `mmproj`; general.name, finetune, basename,
size_label (gguf-py's model-card heuristics on the folder's name, over the mmproj's own
tensors); general.file_type; clip.has_vision_encoder; clip.vision.projection_dim (the text
model's hidden_size); clip.vision.image_size (image_size, else sqrt(num_position_embeddings)
* patch_size); patch_size, embedding_length, feed_forward_length, block_count (depth),
attention.head_count (num_heads); image_mean and image_std (preprocessor_config.json, then
processor_config.json over it); clip.projector_type `qwen3vl_merger`; clip.use_gelu true;
clip.vision.spatial_merge_size; clip.vision.attention.layer_norm_epsilon (text_config's
rms_norm_eps, 1e-6 without one); clip.vision.is_deepstack_layers (one bool per block);
general.quantization_version.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
from gguf import GGUFValueType

import quant

from .checkpoint import Checkpoint
from .errors import ConvertError
from .qwen4exp import _general_metadata
from .transforms import OUTTYPES, OutTensor, encode, tensor_format, widen

ARCH = "clip"
PROJECTOR_TYPE = "qwen3vl_merger"  # gguf.VisionProjectorType.QWEN3VL

# per block: HF (visual.blocks.N.) -> GGUF (v.blk.N.), before .weight / .bias
HF_BLOCK = {
    "attn.qkv": "attn_qkv",
    "attn.proj": "attn_out",
    "norm1": "ln1",
    "norm2": "ln2",
    "mlp.linear_fc1": "ffn_up",
    "mlp.linear_fc2": "ffn_down",
}
HF_GLOBAL = {
    "merger.linear_fc1": "mm.0",
    "merger.linear_fc2": "mm.2",
    "merger.norm": "v.post_ln",
    "pos_embed": "v.position_embd",
    "patch_embed.proj": "v.patch_embd",
}
PATCH_EMBD = "v.patch_embd.weight"

_PREFIXES = ("model.visual.", "visual.")
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(.+)\.(weight|bias)$")

# MmprojModel.n_block_keys: the first present is the block count
_BLOCK_KEYS = ("n_layers", "num_hidden_layers", "n_layer", "num_layers", "depth", "layers", "encoder_layers",
               "vt_num_hidden_layers")


def tensor_format_mmproj(name: str, shape: tuple[int, ...], outtype: str) -> quant.Format:
    """The format the mmproj tensor `name` of `shape` takes under --outtype `outtype`."""
    if len(shape) <= 1:
        return quant.F32
    if PATCH_EMBD in name:  # both halves, `.weight` and `.weight.1`
        return quant.F16 if outtype == "f16" else quant.F32
    if name == "v.position_embd.weight":  # on llama.cpp's always-F32 list, as the text models' POS_EMBD
        return quant.F32
    return tensor_format(name, shape, outtype)


class MmprojConverter:
    """Plans and produces the tensors and metadata of a checkpoint's mmproj GGUF, for an
    `outtype` of OUTTYPES (convert() checks the flag)."""

    def __init__(self, ckpt: Checkpoint, outtype: str):
        self.ck, self.outtype = ckpt, outtype
        self.hp = ckpt.hparams
        vision = self.hp.get("vision_config")
        visual = [n for n in ckpt.files if n.startswith(_PREFIXES)]
        if not isinstance(vision, dict) or not visual:
            lacks = "vision_config in config.json" if not isinstance(vision, dict) else "model.visual.* tensors"
            raise ConvertError(f"{ckpt.dir}: the checkpoint has no vision tower (no {lacks}), so there is no "
                               f"mmproj to write; convert without --mmproj, or give the "
                               f"Qwen4ExpForConditionalGeneration checkpoint")
        # Qwen3VLVisionModel's renames, which decide what the generic keys below find
        self.vision = {**vision, "num_attention_heads": vision.get("num_heads"),
                       "num_hidden_layers": vision.get("depth")}
        self.depth = int(self._vparam("depth"))
        self.tensors = self._plan(self._build(visual))
        self._metadata = self._make_metadata()  # its errors come before any file is written

    def _vparam(self, *keys: str) -> Any:
        value = next((self.vision[k] for k in keys if self.vision.get(k) is not None), None)
        if value is None:
            raise ConvertError(f"{self.ck.dir / 'config.json'}: vision_config sets none of "
                               f"{', '.join(keys)}; a Qwen3-VL vision tower's config sets {keys[0]}")
        return value

    def _build(self, visual: list[str]) -> list[OutTensor]:
        out: list[OutTensor] = []
        unknown: list[str] = []
        for name in visual:
            rest = name[len(next(p for p in _PREFIXES if name.startswith(p))):]
            if rest == "patch_embed.proj.weight":
                kt = self.ck.shapes[name][2] if len(self.ck.shapes[name]) == 5 else None
                if kt != 2:
                    raise ConvertError(f"{self.ck.files[name]}: {name} has shape {list(self.ck.shapes[name])}; "
                                       f"the mmproj's patch embedding takes a Conv3D kernel of 2 frames "
                                       f"[C_out, C_in, 2, P, P] (temporal_patch_size 2), as llama.cpp's does")
                for i, gg in enumerate((PATCH_EMBD, PATCH_EMBD + ".1")):
                    out.append(OutTensor(gg, lambda load, n=name, i=i: widen(load(n))[:, :, i]))
                continue
            gg = None
            if (m := _BLOCK_RE.match(rest)) and int(m.group(1)) < self.depth and m.group(2) in HF_BLOCK:
                gg = f"v.blk.{m.group(1)}.{HF_BLOCK[m.group(2)]}.{m.group(3)}"
            elif (m := _GLOBAL_RE.match(rest)) and m.group(1) in HF_GLOBAL:
                gg = f"{HF_GLOBAL[m.group(1)]}.{m.group(2)}"
            if gg is None:
                unknown.append(name)
            else:
                out.append(OutTensor(gg, lambda load, n=name: widen(load(n))))
        if unknown:  # e.g. deepstack mergers, which the Qwen4Exp tower does not have
            raise ConvertError(f"{self.ck.dir}: {len(unknown)} vision tensors strata convert cannot map to "
                               f"mmproj names (depth {self.depth}): {', '.join(unknown[:8])}"
                               f"{' ...' if len(unknown) > 8 else ''}; it writes Qwen3-VL towers without "
                               f"deepstack mergers, the Qwen4Exp release's")
        # llama.cpp writes whatever is there; an mmproj short of a tensor fails only when loaded
        need = [f"v.blk.{i}.{g}.{s}" for i in range(self.depth) for g in HF_BLOCK.values() for s in ("weight", "bias")]
        need += [f"{g}.{s}" for g in HF_GLOBAL.values() for s in ("weight", "bias") if g != "v.position_embd"]
        need += ["v.position_embd.weight", PATCH_EMBD + ".1"]
        missing = sorted(set(need) - {t.name for t in out})
        if missing:
            raise ConvertError(f"{self.ck.dir}: the vision tower lacks {len(missing)} tensors the mmproj needs "
                               f"(as GGUF names): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; "
                               f"is a safetensors file missing or cut short?")
        return out

    def _plan(self, tensors: list[OutTensor]) -> list[OutTensor]:
        for t in tensors:
            t.shape = tuple(int(n) for n in t.make(self.ck.meta).shape)
            t.fmt = tensor_format_mmproj(t.name, t.shape, self.outtype)
        return tensors

    def data(self, t: OutTensor) -> Iterator[np.ndarray]:
        yield encode(t.make(self.ck.load), t.fmt)

    # -- metadata ----------------------------------------------------------------------

    def _preprocessor(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {}
        for fname, nested in (("preprocessor_config.json", "media_proc_cfg"),
                              ("processor_config.json", "image_processor")):
            path = self.ck.dir / fname
            if path.is_file():
                raw = json.loads(path.read_text(encoding="utf-8"))
                cfg.update({**raw, **(raw.get(nested) or {})})
        return cfg

    def metadata(self) -> list[tuple[str, Any, GGUFValueType]]:
        """(key, value, type), in llama.cpp's order."""
        return list(self._metadata)

    def _make_metadata(self) -> list[tuple[str, Any, GGUFValueType]]:
        v, hp = self.vision, self.hp
        U32, F32, B, S = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL, GGUFValueType.STRING
        n_embd_text = hp.get("hidden_size", hp.get("n_embd"))
        if not n_embd_text:
            raise ConvertError(f"{self.ck.dir / 'config.json'}: the text model's hidden_size is missing; the "
                               f"mmproj projects into it")
        image_size = v.get("image_size")
        if image_size is None:
            image_size = int(v.get("num_position_embeddings", 2304) ** 0.5 * v.get("patch_size", 16))
        pre = self._preprocessor()
        for key in ("image_mean", "image_std"):
            if not pre.get(key):
                raise ConvertError(f"{self.ck.dir}: no {key} in preprocessor_config.json (or "
                                   f"processor_config.json); copy the release's preprocessor_config.json "
                                   f"into the checkpoint directory")
        md: list[tuple[str, Any, GGUFValueType]] = [("general.type", "mmproj", S)]
        md += _general_metadata(self.ck.dir, self.tensors)
        md += [
            ("general.file_type", OUTTYPES[self.outtype][1], U32),
            ("clip.has_vision_encoder", True, B),
            ("clip.vision.projection_dim", int(n_embd_text), U32),
            ("clip.vision.image_size", int(image_size), U32),
            ("clip.vision.patch_size", int(self._vparam("patch_size")), U32),
            ("clip.vision.embedding_length", int(self._vparam("hidden_size", "width", "vt_hidden_size")), U32),
            ("clip.vision.feed_forward_length", int(self._vparam("intermediate_size", "vt_intermediate_size")), U32),
            ("clip.vision.block_count", int(self._vparam(*_BLOCK_KEYS)), U32),
            ("clip.vision.attention.head_count",
             int(self._vparam("num_attention_heads", "num_heads", "heads", "vt_num_attention_heads")), U32),
            ("clip.vision.image_mean", list(pre["image_mean"]), GGUFValueType.get_type(pre["image_mean"][0])),
            ("clip.vision.image_std", list(pre["image_std"]), GGUFValueType.get_type(pre["image_std"][0])),
            ("clip.projector_type", PROJECTOR_TYPE, S),
            ("clip.use_gelu", True, B),
        ]
        if v.get("spatial_merge_size") is not None:
            md.append(("clip.vision.spatial_merge_size", int(v["spatial_merge_size"]), U32))
        # the vision blocks' LayerNorms take the text model's epsilon, as in llama.cpp
        eps = (hp.get("text_config") or {}).get("rms_norm_eps", 1e-6)
        md.append(("clip.vision.attention.layer_norm_epsilon", float(eps), F32))
        if self.depth:
            deepstack = set(v.get("deepstack_visual_indexes") or [])
            md.append(("clip.vision.is_deepstack_layers", [i in deepstack for i in range(self.depth)], B))
        md.append(("general.quantization_version", 2, U32))  # GGML_QUANT_VERSION
        return md
