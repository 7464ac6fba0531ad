"""The Hugging Face checkpoint `strata convert` reads: config.json (text_config merged to
the top, as llama.cpp reads it) and the safetensors tensors, by name, without loading
them until asked."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .errors import ConvertError

MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")

# transformers' defaults for keys a config.json may leave out
_DEFAULTS = {"ngram_size": 3, "heads_per_ngram": 8, "ple_conv_kernel_size": 4, "linear_conv_kernel_dim": 4,
             "split_ngram_parts": 512, "ple_layer_ids": [], "tie_word_embeddings": False}

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class Checkpoint:
    """A Hugging Face model directory: its config (text_config merged to the top, as
    llama.cpp reads it) and its safetensors tensors, by name, in llama.cpp's order (parts
    sorted, names sorted within each part)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        cfg_path = self.dir / "config.json"
        if not self.dir.is_dir():
            raise ConvertError(f"{self.dir}: no such directory; give a Hugging Face model directory")
        if not cfg_path.is_file():
            raise ConvertError(f"{self.dir}: no config.json; give the directory of a Hugging Face "
                               f"checkpoint (config.json beside the *.safetensors files)")
        try:
            raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConvertError(f"{cfg_path}: not valid JSON: {e}") from None
        archs = raw.get("architectures") or []
        mtype = raw.get("model_type")
        if mtype not in MODEL_TYPES and not any(a in ARCHITECTURES for a in archs):
            raise ConvertError(f"{cfg_path}: model_type {mtype!r} (architectures {archs}) is not Qwen4Exp; "
                               f"strata convert reads Qwen3.8-Flash-Next checkpoints (model_type "
                               f"{' or '.join(MODEL_TYPES)}, {ARCHITECTURES[0]})")
        self.hparams = {**_DEFAULTS, **raw, **raw.get("text_config", {})}
        if quant := self.hparams.get("quantization_config"):
            # FP8 / GPTQ / NVFP4 weights need their scales applied, which is not done here;
            # widening the raw codes would write wrong weights without a word
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ConvertError(f"{cfg_path}: a quantized checkpoint (quantization_config, quant_method "
                               f"{method!r}); strata convert reads unquantized (bf16/f16/f32) weights: "
                               f"convert the bf16 release")
        self.files, self.shapes, self.dtypes = self._index()
        self._handles: dict[Path, Any] = {}

    def _index(self) -> tuple[dict[str, Path], dict[str, tuple[int, ...]], dict[str, str]]:
        from safetensors import safe_open

        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
            parts = sorted(set(weight_map.values()))
        else:
            weight_map = {}
            parts = sorted(p.name for p in self.dir.glob("model*.safetensors"))
        if not parts:
            raise ConvertError(f"{self.dir}: no model*.safetensors files; strata convert reads safetensors "
                               f"checkpoints")
        files, shapes, dtypes = {}, {}, {}
        self.keys: dict[str, str] = {}  # canonical name -> the name in its file
        for part in parts:
            path = self.dir / part
            if not path.is_file():
                missing = sorted(n for n, f in weight_map.items() if f == part)
                raise ConvertError(f"{index}: lists {part}, which is missing ({len(missing)} tensors, e.g. "
                                   f"{missing[:3]}); download the whole checkpoint")
            with safe_open(path, framework="pt") as f:
                for name in sorted(f.keys()):
                    sl = f.get_slice(name)
                    key, name = name, _canonical(name)
                    self.keys[name] = key
                    files[name], shapes[name], dtypes[name] = path, tuple(sl.get_shape()), sl.get_dtype()
        return files, shapes, dtypes

    def load(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._handles:  # one open per part: a layer stacks hundreds of experts
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_tensor(self.keys[name])

    def meta(self, name: str) -> torch.Tensor:
        """A tensor of the stored shape and dtype on the meta device: transforms run on it to
        plan the output without reading data."""
        dtype = _ST_DTYPES.get(self.dtypes[name])
        if dtype is None:  # FP8 among them: its codes mean nothing without their scales
            raise ConvertError(f"{self.files[name]}: tensor {name!r} has dtype {self.dtypes[name]}, which "
                               f"strata convert does not read; convert a bf16, f16 or f32 checkpoint")
        return torch.empty(self.shapes[name], dtype=dtype, device="meta")


def _canonical(name: str) -> str:
    # a multimodal checkpoint nests the text model; llama.cpp drops "language_model."
    name = name.replace("language_model.", "")
    if name.startswith("model.mtp."):
        name = name[len("model."):]
    return name
