"""Small random Qwen3.8-Flash-Next checkpoints with the real structure, for tests and demos.

`build_qwen4exp_checkpoint(out_dir)` writes what a Hugging Face release holds, scaled down:
config.json (with the real file's spellings: layer type `full_attention`, not the
`indexed_attention` transformers saves), model.safetensors (per-expert weights, the PLE
table in `split_ngram_parts` shards, the int64 hash constants), tokenizer.json,
tokenizer_config.json and chat_template.jinja (SmolLM2's tokenizer, read from its GGUF by
transformers), and, unless `mtp=False`, an `mtp.*` block in model-mtp.safetensors (listed
in model.safetensors.index.json) as the real checkpoint ships it beside the model:
transformers ignores those weights on load, so they are made here by hand.

Every parameter is drawn from N(0, 0.02) under `torch.manual_seed(seed)`, norms included
(transformers initialises the zero-centred norms and the PLE conv to zeros, which would
hide a missing `+1` or a wrong reshape), except `A_log` and `dt_bias`, which keep
transformers' draws (A_log must stay finite under exp).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from strata.cache import cache_dir, locked, sha256

# The real model's structure at test size: 4 layers, every 4th full attention, partial
# interleaved M-RoPE, QSA indexer, 8 experts top-2, hyper-connections of 4 streams, PLE at
# layer index 1 (one-indexed id 2 in the config) with a small n-gram table.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "max_position_embeddings": 4096,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # 2 v heads per k head: the V reordering is visible
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "hc_count": 4,
    "hc_lowrank": 32,
    "ple_layer_ids": [2],
    "heads_per_ngram": 8,
    "ple_embed_dim": 256,
    "ngram_vocab_size_base": 1000,
    "split_ngram_parts": 4,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
    "output_gate_type": "sigmoid",
    "eos_token_id": 2,  # <|im_end|> in SmolLM2's vocabulary
    "tie_word_embeddings": False,
}

_KEEP_INIT = (".A_log", ".dt_bias")


def _save_tokenizer(out_dir: Path, tokenizer_gguf: str | os.PathLike) -> None:
    """The GGUF's tokenizer as transformers saves it, into `out_dir`. Converted once per GGUF
    (by its sha256) and transformers version, then copied from the cache: transformers' GGUF
    reader takes about 9 s for SmolLM2's 49,152 tokens on 2 cores, and every flash-tiny and
    test checkpoint takes that same tokenizer."""
    import transformers

    path = Path(tokenizer_gguf)
    kept = cache_dir() / "tokenizers" / f"{sha256(path)[:16]}-transformers-{transformers.__version__}"
    if not kept.is_dir():
        with locked(kept.parent):  # parallel test workers convert it once
            if not kept.is_dir():
                tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
                with tempfile.TemporaryDirectory(dir=kept.parent) as tmp:
                    tok.save_pretrained(Path(tmp) / "t")
                    os.replace(Path(tmp) / "t", kept)
    shutil.copytree(kept, out_dir, dirs_exist_ok=True)


def _mtp_tensors(model, config, dtype, generator) -> dict[str, Any]:
    """One MTP block as a Qwen3.5-style checkpoint names it: `mtp.fc` (embedding and hidden
    state concatenated, projected back), its two input norms, the final norm, and one
    full-attention decoder layer `mtp.layers.0.*` with the model's own layer structure."""
    import torch
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (
        Qwen4ExpTextDecoderLayer,
    )

    full = next(i for i, t in enumerate(config.layer_types) if t != "linear_attention")
    layer = Qwen4ExpTextDecoderLayer(config, full)  # full attention: a layer without PLE
    h = config.hidden_size
    out = {
        "mtp.fc.weight": torch.empty(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": torch.empty(h),
        "mtp.pre_fc_norm_hidden.weight": torch.empty(h),
        "mtp.norm.weight": torch.empty(h),
    }
    for k, v in layer.state_dict().items():
        v = v.detach().clone()
        if k == "mlp.experts.gate_up_proj":  # stored per expert, as save_pretrained stores the layers
            n_ff = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = v[e, :n_ff].clone()
                out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = v[e, n_ff:].clone()
        elif k == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = v[e].clone()
        else:
            out[f"mtp.layers.0.{k}"] = v
    for name, t in out.items():
        if not name.endswith(_KEEP_INIT):
            t.normal_(0.0, 0.02, generator=generator)
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def _dtype(name: str):
    import torch
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype {name!r}: choose one of {', '.join(dtypes)}")
    return dtypes[name]


def _draw_and_save(model, seed: int, dtype, out: Path):
    """Every parameter of `model` from N(0, 0.02) but _KEEP_INIT's, stored as `dtype` in
    `out`; returns the generator, for draws that follow."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(_KEEP_INIT):
                p.normal_(0.0, 0.02, generator=gen)
    model.to(dtype)
    model.save_pretrained(out)
    return gen


def build_qwen4exp_checkpoint(out_dir: str | os.PathLike, config_overrides: Mapping[str, Any] | None = None,
                              seed: int = 0, *, dtype: str = "bfloat16", mtp: bool = True,
                              tokenizer_gguf: str | os.PathLike, vision: Mapping[str, Any] | None = None) -> Path:
    """Write a random Qwen4ExpForCausalLM checkpoint to `out_dir` and return it.

    `config_overrides` replace keys of TINY_CONFIG (a full-size model is only a matter of
    overrides, and of memory). `dtype` is the stored dtype ("bfloat16", as the release, or
    "float32", "float16"). `tokenizer_gguf` is the GGUF whose tokenizer is saved (flash-tiny
    takes SmolLM2's: strata.hub.pull_smollm2).

    With `vision` (keys of TINY_VISION to replace; {} for none), the checkpoint is the
    release's Qwen4ExpForConditionalGeneration instead: the text model under
    `model.language_model.`, a vision tower under `model.visual.`, a preprocessor_config.json,
    and four of the tokenizer's unused special tokens renamed to the release's vision markers
    (VISION_TOKENS), so that prompts name them as the release's vocabulary does. No MTP block."""
    if vision is not None:
        return _build_with_vision(Path(out_dir), {**TINY_CONFIG, **dict(config_overrides or {})},
                                  {**TINY_VISION, **dict(vision)}, seed, dtype, tokenizer_gguf)
    import torch
    from safetensors.torch import load_file, save_file
    try:
        from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig
    except ImportError as e:
        raise ImportError(f"building a Qwen4Exp checkpoint needs transformers with qwen4_exp (5.23 or "
                          f"later): pip install 'transformers>=5.23' ({e})") from None

    torch_dtype = _dtype(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    values = {**TINY_CONFIG, **dict(config_overrides or {})}

    torch.manual_seed(seed)
    config = Qwen4ExpTextConfig(**values)
    config.architectures = ["Qwen4ExpForCausalLM"]
    model = Qwen4ExpForCausalLM(config)
    gen = _draw_and_save(model, seed, torch_dtype, out)

    # transformers rewrites the layer type to its own name and writes defaults the release
    # does not carry; the converters read the release's spelling
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["layer_types"] = list(values["layer_types"])
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")

    if mtp:
        tensors = _mtp_tensors(model, config, torch_dtype, gen)
        save_file(tensors, out / "model-mtp.safetensors", metadata={"format": "pt"})
        main = load_file(out / "model.safetensors")
        total = sum(t.numel() * t.element_size() for t in (*main.values(), *tensors.values()))
        weight_map = {k: "model.safetensors" for k in main}
        weight_map.update({k: "model-mtp.safetensors" for k in tensors})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    _save_tokenizer(out, tokenizer_gguf)
    return out


# A Qwen3-VL vision tower at test size: 2 blocks of width 64 (2 heads of 32, so the axial
# 2-D RoPE has 8 frequencies per axis), 16-pixel patches, 2x2 merge, 2 frames per temporal
# patch, and a learned position grid of 8 x 8 that is resampled to each image's grid.
TINY_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
}

# SmolLM2's unused special tokens (ids 3-6) take the release's vision markers' names.
VISION_TOKENS = {"vision_start_token_id": (3, "<|vision_start|>"), "vision_end_token_id": (4, "<|vision_end|>"),
                 "image_token_id": (5, "<|image_pad|>"), "video_token_id": (6, "<|video_pad|>")}

# The release's preprocessor_config.json (Qwen3-VL's image processor settings): the pixel
# bounds are the release's too, so an image gets at least 64 merged tokens.
TINY_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def _rename_tokens(out_dir: Path) -> None:
    path = out_dir / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    names = {i: name for i, name in VISION_TOKENS.values()}
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        if added["id"] in names:
            del vocab[added["content"]]
            added["content"] = names[added["id"]]
            vocab[added["content"]] = added["id"]
    path.write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    cfg_path = out_dir / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
            if int(key) in names:
                entry["content"] = names[int(key)]
        cfg_path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def _build_with_vision(out: Path, text: dict[str, Any], vision: dict[str, Any], seed: int, dtype: str,
                       tokenizer_gguf: str | os.PathLike) -> Path:
    import torch
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    torch_dtype = _dtype(dtype)
    out.mkdir(parents=True, exist_ok=True)
    vision = {**vision, "out_hidden_size": text["hidden_size"]}
    torch.manual_seed(seed)
    config = Qwen4ExpConfig(text_config=text, vision_config=vision,
                            **{k: i for k, (i, _) in VISION_TOKENS.items()})
    config.architectures = ["Qwen4ExpForConditionalGeneration"]
    _draw_and_save(Qwen4ExpForConditionalGeneration(config), seed, torch_dtype, out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["text_config"]["layer_types"] = list(text["layer_types"])
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2) + "\n")
    _save_tokenizer(out, tokenizer_gguf)
    _rename_tokens(out)
    return out
