"""Qwen3.8-Flash-Next (transformers `Qwen4ExpForCausalLM`) checkpoint -> GGUF `qwen4exp`.

The output is what llama.cpp's converter (conversion/qwen4exp.py, 0.3.36) writes for the
same checkpoint: the same metadata keys, values, types and order, the same tensors in the
same order with the same names, shapes, types and bytes. Strata carries its own table; the
rules, with llama.cpp's reasons:

  HF name (model.layers.N. unless global)       GGUF name (blk.N.)          transform
  model.embed_tokens.weight                     token_embd.weight
  lm_head.weight                                output.weight
  model.hyper_connection_mixer.hc_norm.weight   output_hc_norm.weight       +1
  model.hyper_connection_mixer.input_mix_weight_{down,up}.weight  output_hc_{down,up}.weight
  {attn,mlp}_hyper_connection.hc_norm.weight    hc_{attn,ffn}_norm.weight   +1
  {attn,mlp}_hyper_connection.input_mix_weight_{down,up}.weight   hc_{attn,ffn}_{down,up}.weight
  {attn,mlp}_hyper_connection.block_inject_weight.weight          hc_{attn,ffn}_inject.weight
  linear_attn.in_proj_qkv.weight                attn_qkv.weight             V rows reordered
  linear_attn.in_proj_z.weight                  attn_gate.weight            V rows reordered
  linear_attn.in_proj_b.weight                  ssm_beta.weight             V rows reordered
  linear_attn.in_proj_a.weight                  ssm_alpha.weight            V rows reordered
  linear_attn.A_log                             ssm_a                       -exp(A_log), reordered
  linear_attn.dt_bias                           ssm_dt.bias                 reordered
  linear_attn.conv1d.weight [C,1,K]             ssm_conv1d.weight [C,K]     squeezed, V channels reordered
  linear_attn.norm.weight                       ssm_norm.weight             (a plain gated RMSNorm: no +1)
  linear_attn.out_proj.weight                   ssm_out.weight              V columns reordered
  self_attn.{q,k,v}_proj.weight                 attn_{q,k,v}.weight         (q rows: [q|gate] per head)
  self_attn.o_proj.weight                       attn_output.weight
  self_attn.{q,k}_norm.weight                   attn_{q,k}_norm.weight      +1
  self_attn.indexer.index_qk_proj.weight        indexer.q_proj.weight, indexer.k_proj.weight  split rows
  self_attn.indexer.{q,k}_layernorm.weight      indexer.{q,k}_norm.weight   +1
  mlp.gate.weight                               ffn_gate_inp.weight
  mlp.experts.E.{gate,up,down}_proj.weight      ffn_{gate,up,down}_exps.weight  stacked over E
  mlp.experts.{gate_up_proj,down_proj}          the same, from the fused layout
  mlp.shared_expert.{gate,up,down}_proj.weight  ffn_{gate,up,down}_shexp.weight
  mlp.shared_expert_gate.weight                 ffn_gate_inp_shexp.weight
  ple.{key,value}_proj.weight                   ple_{key,value}.weight
  ple.norm_{key,query,conv}.weight              ple_norm_{key,query,conv}.weight  +1
  ple.conv1d.weight [C,1,K]                     ple_conv1d.weight [C,K]     squeezed
  ple.ple_embedding.ngram_embedding.shard_S.weight  per_layer_token_embd.weight  shards concatenated by S
  ple.ple_embedding.{layer_multipliers,ngram_heads_offsets,ngram_heads_vocab_sizes}
                                                metadata qwen4exp.ple.* (UINT64: int64 constants
                                                would lose bits as float tensors)

+1: the model's RMSNorms multiply by (1 + w) (Gemma-style, zero-centred); GGUF stores 1 + w.
V reordering: the DeltaNet has fewer k heads than v heads; HF groups the v heads by their k
head ([k0: v0 v1 .. v(r-1)], [k1: ...]), llama.cpp wants them tiled ([v0 of k0, v0 of k1,
..., v1 of k0, ...]) so that ggml broadcasts k over v without an interleaved repeat: along
the v-head axis, a (n_k, r, d) view is transposed to (r, n_k, d).

The arithmetic runs in torch in the checkpoint's dtype when that is f16 or f32, else in
f32 (bf16 and others are widened first), as llama.cpp does; the +1 of an f16 checkpoint
therefore rounds in f16. Output types: F32 for 1-D tensors, `*_norm.weight`, names not
ending in `.weight`, ffn_gate_inp, ffn_gate_inp_shexp and ssm_conv1d; everything else
takes --outtype, and a Q8_0 tensor whose rows are not whole 32-weight blocks falls back to
F16 (ple_conv1d, and the PLE table when its rows are narrower than 32).

config.json is read as written (text_config merged to the top). llama.cpp's converter reads
it through transformers' AutoConfig when transformers knows the model, and transformers
5.23 renames the layer type `full_attention` to `indexed_attention`, after which that
converter writes `attention.compress_ratios` 0 for every layer, turning QSA off. Strata
writes the indexer's ratio for every layer that is not linear attention, whichever the
spelling: that is llama.cpp's output wherever transformers does not rewrite the config,
and what the model means (scripts/golden_convert.py takes its digests that way).

MTP. llama.cpp's qwen4exp converter drops the `mtp.*` block and its loader refuses unknown
tensors, so the MTP block goes to a sidecar `mtp-<OUT name>` next to OUT (the prefix
llama.cpp's MTP-only mode gives its file). It holds only the MTP weights (embedding and
lm_head are shared with OUT), under llama.cpp's nextn naming for Qwen3.5 MTP, layer index
`L = num_hidden_layers + i`:

  mtp.fc.weight                       blk.L.nextn.eh_proj.weight
  mtp.pre_fc_norm_embedding.weight    blk.L.nextn.enorm.weight         +1
  mtp.pre_fc_norm_hidden.weight       blk.L.nextn.hnorm.weight         +1
  mtp.norm.weight                     blk.L.nextn.shared_head_norm.weight  +1
  mtp.layers.i.<per-layer name>       blk.L.<GGUF per-layer name>      as in the table above
  mtp.layers.i.input_layernorm.weight           blk.L.attn_norm.weight            +1
  mtp.layers.i.post_attention_layernorm.weight  blk.L.post_attention_norm.weight  +1

Its metadata is OUT's without the tokenizer, with block_count = num_hidden_layers + n_mtp,
`qwen4exp.nextn_predict_layers` = n_mtp, recurrent_layers extended with False and
compress_ratios extended with the indexer ratio where the MTP layer has an indexer.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFValueType, GGUFWriter, Metadata, size_label

import quant

from .errors import ConvertError
from .vocab import gpt2_vocab_metadata

ARCH = "qwen4exp"
MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")

# --outtype -> (default tensor format, general.file_type as llama.cpp's LlamaFileType)
OUTTYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7)}

# transformers' defaults for keys a config.json may leave out
_DEFAULTS = {"ngram_size": 3, "heads_per_ngram": 8, "ple_conv_kernel_size": 4, "linear_conv_kernel_dim": 4,
             "split_ngram_parts": 512, "ple_layer_ids": [], "tie_word_embeddings": False}

_SUB = {"attn": "attn", "mlp": "ffn"}

# per-layer names: HF suffix -> (GGUF suffix, transform key or None)
_LAYER = {
    "self_attn.q_proj.weight": ("attn_q.weight", None),
    "self_attn.k_proj.weight": ("attn_k.weight", None),
    "self_attn.v_proj.weight": ("attn_v.weight", None),
    "self_attn.o_proj.weight": ("attn_output.weight", None),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "plus1"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "plus1"),
    "self_attn.indexer.q_layernorm.weight": ("indexer.q_norm.weight", "plus1"),
    "self_attn.indexer.k_layernorm.weight": ("indexer.k_norm.weight", "plus1"),
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", "v_qkv"),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", "v_rows"),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", "v_heads"),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", "v_heads"),
    "linear_attn.A_log": ("ssm_a", "a_log"),
    "linear_attn.dt_bias": ("ssm_dt.bias", "v_heads"),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", "v_conv"),
    "linear_attn.norm.weight": ("ssm_norm.weight", None),
    "linear_attn.out_proj.weight": ("ssm_out.weight", "v_cols"),
    "mlp.gate.weight": ("ffn_gate_inp.weight", None),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", None),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", None),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", None),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", None),
    "ple.key_proj.weight": ("ple_key.weight", None),
    "ple.value_proj.weight": ("ple_value.weight", None),
    "ple.norm_key.weight": ("ple_norm_key.weight", "plus1"),
    "ple.norm_query.weight": ("ple_norm_query.weight", "plus1"),
    "ple.norm_conv.weight": ("ple_norm_conv.weight", "plus1"),
    "ple.conv1d.weight": ("ple_conv1d.weight", "squeeze"),
    # Qwen3.5-style norms an MTP layer may carry
    "input_layernorm.weight": ("attn_norm.weight", "plus1"),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", "plus1"),
}
for _hf, _gg in _SUB.items():
    _LAYER[f"{_hf}_hyper_connection.hc_norm.weight"] = (f"hc_{_gg}_norm.weight", "plus1")
    _LAYER[f"{_hf}_hyper_connection.input_mix_weight_down.weight"] = (f"hc_{_gg}_down.weight", None)
    _LAYER[f"{_hf}_hyper_connection.input_mix_weight_up.weight"] = (f"hc_{_gg}_up.weight", None)
    _LAYER[f"{_hf}_hyper_connection.block_inject_weight.weight"] = (f"hc_{_gg}_inject.weight", None)

_GLOBAL = {
    "model.embed_tokens.weight": ("token_embd.weight", None),
    "lm_head.weight": ("output.weight", None),
    "model.hyper_connection_mixer.hc_norm.weight": ("output_hc_norm.weight", "plus1"),
    "model.hyper_connection_mixer.input_mix_weight_down.weight": ("output_hc_down.weight", None),
    "model.hyper_connection_mixer.input_mix_weight_up.weight": ("output_hc_up.weight", None),
}
_MTP_GLOBAL = {  # mtp.<name> -> nextn name, all folded but eh_proj
    "fc.weight": ("nextn.eh_proj.weight", None),
    "pre_fc_norm_embedding.weight": ("nextn.enorm.weight", "plus1"),
    "pre_fc_norm_hidden.weight": ("nextn.hnorm.weight", "plus1"),
    "norm.weight": ("nextn.shared_head_norm.weight", "plus1"),
}
_PLE_CONSTANTS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")
# always F32 (llama.cpp keeps these unquantized: routers, the conv kernel)
_F32_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_SHARD_RE = re.compile(r"^ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


# ---------------------------------------------------------------------------------------
# the checkpoint


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


def _skipped(name: str) -> bool:
    # vision tower and buffers llama.cpp never writes
    return ("visual." in name or "vision" in name or name.startswith("mlp")
            or name.endswith((".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")))


# ---------------------------------------------------------------------------------------
# transforms


def _widen(t: torch.Tensor) -> torch.Tensor:
    # llama.cpp computes in the stored dtype when it is f16 or f32, else in f32
    return t if t.dtype in (torch.float16, torch.float32) else t.to(torch.float32)


def _reorder_v(t: torch.Tensor, dim: int, n_k: int, r: int, d: int) -> torch.Tensor:
    """V heads grouped by k head -> tiled, along `dim` (n_k * r * d long)."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], n_k, r, d, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


class _Transforms:
    def __init__(self, hp: dict[str, Any]):
        self.n_k = hp.get("linear_num_key_heads", 0)
        self.n_v = hp.get("linear_num_value_heads", 0)
        self.dk = hp.get("linear_key_head_dim", 0)
        self.dv = hp.get("linear_value_head_dim", 0)
        self.reorder = self.n_k > 0 and self.n_v > 0 and self.n_k != self.n_v

    def __call__(self, key: str | None, t: torch.Tensor) -> torch.Tensor:
        r = self.n_v // self.n_k if self.reorder else 1
        if key is None:
            return t
        if key == "plus1":
            return t + 1
        if key == "squeeze":
            return t.squeeze()
        if key == "a_log":
            t = -torch.exp(t)
            return _reorder_v(t, 0, self.n_k, r, 1) if self.reorder else t
        if key == "v_conv":
            t = t.squeeze()
            if self.reorder:
                qk = self.dk * self.n_k * 2
                t = torch.cat([t[:qk], _reorder_v(t[qk:], 0, self.n_k, r, self.dv)], dim=0)
            return t
        if not self.reorder:
            return t
        if key == "v_qkv":
            qk = self.dk * self.n_k * 2
            return torch.cat([t[:qk], _reorder_v(t[qk:], 0, self.n_k, r, self.dv)], dim=0)
        if key == "v_rows":
            return _reorder_v(t, 0, self.n_k, r, self.dv)
        if key == "v_heads":
            return _reorder_v(t, 0, self.n_k, r, 1)
        if key == "v_cols":
            return _reorder_v(t, 1, self.n_k, r, self.dv)
        raise AssertionError(key)


# ---------------------------------------------------------------------------------------
# the plan: every output tensor, in order, with a function that makes its data


@dataclass
class OutTensor:
    name: str
    # loader -> the tensor, or (the PLE table) a list of zero-argument loaders of its row blocks
    make: Callable[[Callable[[str], torch.Tensor]], torch.Tensor | list[Callable[[], torch.Tensor]]]
    # set by plan(): logical shape (torch order) and format
    shape: tuple[int, ...] = ()
    fmt: quant.Format | None = None

    @property
    def nbytes(self) -> int:
        rows = math.prod(self.shape[:-1])
        return rows * self.fmt.row_bytes(self.shape[-1])


def _tensor_format(name: str, shape: tuple[int, ...], outtype: str) -> quant.Format:
    if len(shape) <= 1 or name.endswith("_norm.weight") or name.endswith(_F32_SUFFIXES) \
            or not name.endswith(".weight"):
        return quant.F32
    fmt = quant.get(OUTTYPES[outtype][0])
    if shape[-1] % fmt.block_elems:  # as gguf-py's QuantError fallback
        return quant.F16
    return fmt


class Qwen4ExpConverter:
    """Plans and produces the tensors and metadata of a qwen4exp GGUF (and its MTP sidecar)."""

    def __init__(self, ckpt: Checkpoint, outtype: str):
        if outtype not in OUTTYPES:
            raise ConvertError(f"--outtype {outtype!r} is not one strata convert writes; choose one of "
                               f"{', '.join(OUTTYPES)}")
        self.ck = ckpt
        self.hp = ckpt.hparams
        self.outtype = outtype
        self.n_layer = int(self._need("num_hidden_layers"))
        self.tf = _Transforms(self.hp)
        self.constants: dict[str, list[int]] = {}
        self.ple_row_dim: int | None = None
        self.main, self.mtp = self._build()

    def _need(self, key: str) -> Any:
        if key not in self.hp:
            raise ConvertError(f"{self.ck.dir / 'config.json'}: key {key!r} is missing; a Qwen4Exp config "
                               f"sets it")
        return self.hp[key]

    # -- tensors -----------------------------------------------------------------------

    def _simple(self, gguf_name: str, hf: str, key: str | None) -> OutTensor:
        tf = self.tf
        return OutTensor(gguf_name, lambda load, hf=hf, key=key: tf(key, _widen(load(hf))))

    def _build(self) -> tuple[list[OutTensor], list[OutTensor]]:
        ck, hp = self.ck, self.hp
        n_exp = int(self._need("num_experts"))
        n_parts = int(hp["split_ngram_parts"])
        main: list[OutTensor] = []
        mtp: list[OutTensor] = []
        experts: dict[tuple[str, int], dict[tuple[int, str], str]] = {}
        shards: dict[int, dict[int, str]] = {}
        unknown: list[str] = []
        for name in ck.files:
            if _skipped(name):
                continue
            if name.startswith("mtp."):
                self._mtp_tensor(name, mtp, experts, unknown)
                continue
            if name in _GLOBAL:
                main.append(self._simple(_GLOBAL[name][0], name, _GLOBAL[name][1]))
                continue
            m = _LAYER_RE.match(name)
            if not m:
                unknown.append(name)
                continue
            bid, rest = int(m.group(1)), m.group(2)
            self._layer_tensor(bid, rest, name, main, experts, shards, unknown, prefix="model.layers")
        if unknown:
            raise ConvertError(f"{ck.dir}: {len(unknown)} tensors strata convert cannot map to qwen4exp "
                               f"names: {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
        self._check_complete(n_exp, n_parts, experts, shards)
        return main, mtp

    def _layer_tensor(self, bid: int, rest: str, name: str, out: list[OutTensor], experts, shards,
                      unknown: list[str], prefix: str, gguf_bid: int | None = None) -> None:
        gbid = bid if gguf_bid is None else gguf_bid
        blk = f"blk.{gbid}."
        n_exp = int(self.hp["num_experts"])
        if rest in _LAYER:
            gg, key = _LAYER[rest]
            out.append(self._simple(blk + gg, name, key))
        elif m := _EXPERT_RE.match(rest):
            group = experts.setdefault((prefix, bid), {})
            group[(int(m.group(1)), m.group(2))] = name
            if len(group) >= n_exp * 3:  # the layer's last expert weight: write the three stacks
                for kind in ("down", "gate", "up"):
                    names = [group[(e, kind)] for e in range(n_exp)]
                    out.append(OutTensor(f"{blk}ffn_{kind}_exps.weight",
                                         lambda load, names=names: torch.stack([_widen(load(n)) for n in names])))
                group.clear()
                group[("done", "")] = ""
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight"):
            def half(load, i, name=name):
                t = _widen(load(name))
                n_ff = t.shape[-2] // 2
                return t[..., i * n_ff:(i + 1) * n_ff, :].contiguous()
            out.append(OutTensor(f"{blk}ffn_gate_exps.weight", lambda load: half(load, 0)))
            out.append(OutTensor(f"{blk}ffn_up_exps.weight", lambda load: half(load, 1)))
            experts.setdefault((prefix, bid), {})[("done", "")] = ""
        elif rest in ("mlp.experts.down_proj", "mlp.experts.down_proj.weight"):
            out.append(self._simple(f"{blk}ffn_down_exps.weight", name, None))
        elif rest == "self_attn.indexer.index_qk_proj.weight":
            n_q = int(self._need("indexer_n_heads")) * int(self._need("indexer_head_dim"))
            out.append(OutTensor(f"{blk}indexer.q_proj.weight", lambda load, n=name: _widen(load(n))[:n_q]))
            out.append(OutTensor(f"{blk}indexer.k_proj.weight", lambda load, n=name: _widen(load(n))[n_q:]))
        elif m := _SHARD_RE.match(rest):
            group = shards.setdefault(bid, {})
            group[int(m.group(1))] = name
            self.ple_row_dim = int(self.ck.shapes[name][-1])
            if len(group) == int(self.hp["split_ngram_parts"]):
                names = [group[i] for i in sorted(group)]
                for n in names:
                    if self.ck.shapes[n][-1] != self.ple_row_dim:
                        raise ConvertError(f"{self.ck.files[n]}: PLE shard {n!r} has rows of "
                                           f"{self.ck.shapes[n][-1]}, the others {self.ple_row_dim}")
                # a list of loaders: the table (hundreds of GB in f32) is written shard by
                # shard, one resident at a time
                out.append(OutTensor("per_layer_token_embd.weight", lambda load, names=names: [
                    (lambda n=n: load(n).to(torch.float32)) for n in names]))
        elif rest.startswith("ple.ple_embedding.") and rest.rsplit(".", 1)[-1] in _PLE_CONSTANTS:
            # int64 hash constants: exact integers, kept for metadata
            self.constants[rest.rsplit(".", 1)[-1]] = [int(x) for x in self.ck.load(name).to(torch.int64).tolist()]
        else:
            unknown.append(name)

    def _mtp_tensor(self, name: str, out: list[OutTensor], experts, unknown: list[str]) -> None:
        rest = name[len("mtp."):]
        if rest in _MTP_GLOBAL:
            gg, key = _MTP_GLOBAL[rest]
            out.append(self._simple(f"blk.{self.n_layer}.{gg}", name, key))
            return
        m = _MTP_LAYER_RE.match(name)
        if not m:
            unknown.append(name)
            return
        idx = int(m.group(1))
        self._layer_tensor(idx, m.group(2), name, out, experts, {}, unknown, prefix="mtp.layers",
                           gguf_bid=self.n_layer + idx)

    def _check_complete(self, n_exp: int, n_parts: int, experts, shards) -> None:
        hp, have = self.hp, set(self.ck.files)
        need = [g for g in _GLOBAL if g != "lm_head.weight" or not hp.get("tie_word_embeddings")]
        types = hp.get("layer_types") or []
        ple = [i - 1 for i in hp.get("ple_layer_ids") or []]
        for i in range(self.n_layer):
            p = f"model.layers.{i}."
            sub = ["mlp.gate.weight", "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                   "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"]
            sub += [k for k in _LAYER if "_hyper_connection." in k and "inject" not in k]
            sub += [f"{h}_hyper_connection.block_inject_weight.weight" for h in _SUB]
            if (types[i] if i < len(types) else "") == "linear_attention":
                sub += [k for k in _LAYER if k.startswith("linear_attn.")]
            else:
                sub += [k for k in _LAYER if k.startswith("self_attn.") and "indexer" not in k]
                if hp.get("indexer_n_heads"):
                    sub += ["self_attn.indexer.index_qk_proj.weight", "self_attn.indexer.q_layernorm.weight",
                            "self_attn.indexer.k_layernorm.weight"]
            if i in ple:
                sub += [k for k in _LAYER if k.startswith("ple.")]
                sub += [f"ple.ple_embedding.{c}" for c in _PLE_CONSTANTS]
                sub += [f"ple.ple_embedding.ngram_embedding.shard_{s}.weight" for s in range(n_parts)]
            if ("model.layers", i) not in experts:
                sub += [f"mlp.experts.{e}.{k}_proj.weight" for e in range(n_exp) for k in ("gate", "up", "down")]
            need += [p + s for s in sub]
        missing = [n for n in need if n not in have]
        for (prefix, bid), group in experts.items():
            if ("done", "") not in group:
                missing += [f"{prefix}.{bid}.mlp.experts.{e}.{k}_proj.weight" for e in range(n_exp)
                            for k in ("gate", "up", "down") if (e, k) not in group]
        for bid, group in shards.items():
            if len(group) != n_parts:  # the table's rows would be cut or padded wrongly
                raise ConvertError(f"{self.ck.dir}: layer {bid} has {len(group)} PLE table shards "
                                   f"(shard_{min(group)}..shard_{max(group)}) but split_ngram_parts is "
                                   f"{n_parts} in config.json")
        if missing:
            raise ConvertError(f"{self.ck.dir}: {len(missing)} tensors the config needs are missing from the "
                               f"checkpoint: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; "
                               f"is a safetensors file missing or cut short?")

    # -- planning ----------------------------------------------------------------------

    def plan(self, tensors: list[OutTensor]) -> list[OutTensor]:
        """Shapes and formats of `tensors`, worked out on the meta device."""
        for t in tensors:
            made = t.make(self.ck.meta)
            if isinstance(made, list):
                parts = [part() for part in made]
                shape = (sum(int(x.shape[0]) for x in parts), int(parts[0].shape[-1]))
            else:
                shape = tuple(int(n) for n in made.shape)
            t.shape = shape
            t.fmt = _tensor_format(t.name, shape, self.outtype)
        return tensors

    # -- metadata ----------------------------------------------------------------------

    def _eos(self) -> int:
        eos = self.hp.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[-1] if eos else None  # the PLE hash resets n-grams on the primary EOS
        if eos is None:
            raise ConvertError(f"{self.ck.dir / 'config.json'}: eos_token_id is not set; the PLE hash "
                               f"resets its n-grams on it")
        return int(eos)

    def model_metadata(self, tensors: list[OutTensor], n_mtp: int = 0,
                       mtp_has_indexer: bool = False) -> list[tuple[str, Any, GGUFValueType]]:
        """(key, value, type), in llama.cpp's order, tokenizer excluded."""
        hp, a = self.hp, ARCH
        U32, I32, F32, U64, B = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
                                 GGUFValueType.UINT64, GGUFValueType.BOOL)
        md: list[tuple[str, Any, GGUFValueType]] = [("general.type", "model", GGUFValueType.STRING)]
        md += _general_metadata(self.ck.dir, tensors)

        def first(*keys):
            return next((hp[k] for k in keys if k in hp), None)

        md.append((f"{a}.block_count", self.n_layer + n_mtp, U32))
        if (v := first("max_position_embeddings", "n_ctx", "n_positions", "max_length",
                       "max_sequence_length", "model_max_length")) is not None:
            md.append((f"{a}.context_length", int(v), U32))
        md.append((f"{a}.embedding_length", int(self._need("hidden_size")), U32))
        if (v := first("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size",
                       "n_inner", "hidden_dim")) is not None:
            md.append((f"{a}.feed_forward_length", int(v), U32))
        md.append((f"{a}.attention.head_count", int(self._need("num_attention_heads")), U32))
        md.append((f"{a}.attention.head_count_kv", int(self._need("num_key_value_heads")), U32))
        if hp.get("is_causal") is False:
            md.append((f"{a}.attention.causal", False, B))
        rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
        if "rope_theta" not in rope and (th := first("rope_theta", "rotary_emb_base")) is not None:
            rope["rope_theta"] = th
        if "partial_rotary_factor" not in rope and (pr := first("partial_rotary_factor")) is not None:
            rope["partial_rotary_factor"] = pr
        rtype = rope.get("rope_type", rope.get("type"))
        if rtype not in (None, "default", "mrope"):
            raise ConvertError(f"{self.ck.dir / 'config.json'}: rope_type {rtype!r}; strata convert writes "
                               f"unscaled RoPE only (rope_type default)")
        if "mrope_section" in rope:
            sections = list(rope["mrope_section"])[:4]
            md.append((f"{a}.rope.dimension_sections", sections + [0] * (4 - len(sections)), I32))
        if rope.get("rope_theta") is not None:
            md.append((f"{a}.rope.freq_base", float(rope["rope_theta"]), F32))
        if (v := first("rms_norm_eps", "norm_eps")) is not None:
            md.append((f"{a}.attention.layer_norm_rms_epsilon", float(v), F32))
        md.append((f"{a}.expert_count", int(self._need("num_experts")), U32))
        md.append((f"{a}.expert_used_count", int(self._need("num_experts_per_tok")), U32))
        if (hd := hp.get("head_dim")) is not None:
            md.append((f"{a}.attention.key_length", int(hd), U32))
            md.append((f"{a}.attention.value_length", int(hd), U32))
        md.append(("general.file_type", OUTTYPES[self.outtype][1], U32))
        if (v := hp.get("moe_intermediate_size")) is not None:
            md.append((f"{a}.expert_feed_forward_length", int(v), U32))
        if (v := hp.get("shared_expert_intermediate_size")) is not None:
            md.append((f"{a}.expert_shared_feed_forward_length", int(v), U32))
        md.append((f"{a}.ssm.conv_kernel", int(hp["linear_conv_kernel_dim"]), U32))
        md.append((f"{a}.ssm.state_size", int(self._need("linear_key_head_dim")), U32))
        md.append((f"{a}.ssm.group_count", int(self._need("linear_num_key_heads")), U32))
        md.append((f"{a}.ssm.time_step_rank", int(self._need("linear_num_value_heads")), U32))
        md.append((f"{a}.ssm.inner_size",
                   int(self._need("linear_value_head_dim")) * int(hp["linear_num_value_heads"]), U32))
        types = hp.get("layer_types")
        if types is not None:
            if len(types) != self.n_layer:
                raise ConvertError(f"{self.ck.dir / 'config.json'}: layer_types has {len(types)} entries, "
                                   f"num_hidden_layers is {self.n_layer}")
            md.append((f"{a}.attention.recurrent_layers",
                       [t == "linear_attention" for t in types] + [False] * n_mtp, B))
        else:
            types = ["linear_attention" if (i + 1) % hp.get("full_attention_interval", 4) else "full_attention"
                     for i in range(self.n_layer)]
        md.append((f"{a}.full_attention_interval", int(hp.get("full_attention_interval", 4)), U32))
        head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        md.append((f"{a}.rope.dimension_count", int(head_dim * rope.get("partial_rotary_factor", 0.25)), U32))
        if "mrope_section" not in rope:  # Qwen3.5's loaders require the sections
            md.append((f"{a}.rope.dimension_sections", [11, 11, 10, 0], I32))
        md.append((f"{a}.hyper_connection.count", int(self._need("hc_count")), U32))
        md.append((f"{a}.hyper_connection.low_rank", int(self._need("hc_lowrank")), U32))
        md.append((f"{a}.attention.indexer.head_count", int(self._need("indexer_n_heads")), U32))
        md.append((f"{a}.attention.indexer.key_length", int(self._need("indexer_head_dim")), U32))
        md.append((f"{a}.attention.indexer.top_k", int(self._need("indexer_budget")), U32))
        ratio = int(self._need("indexer_compress_ratio"))
        # QSA runs on every attention layer: the release's config.json names them
        # "full_attention", transformers renames them "indexed_attention" when it saves
        md.append((f"{a}.attention.compress_ratios",
                   [0 if t == "linear_attention" else ratio for t in types]
                   + [ratio if mtp_has_indexer else 0] * n_mtp, I32))
        ple_layers = [i - 1 for i in hp.get("ple_layer_ids") or []]
        if ple_layers:
            md.append((f"{a}.ple.layers", ple_layers, I32))
            md.append((f"{a}.ple.ngram_size", int(hp["ngram_size"]), U32))
            md.append((f"{a}.ple.heads_per_ngram", int(hp["heads_per_ngram"]), U32))
            md.append((f"{a}.ple.conv_kernel", int(hp["ple_conv_kernel_size"]), U32))
            md.append((f"{a}.ple.eos_token_id", self._eos(), U32))
            if hp.get("image_token_id") is not None:
                md.append((f"{a}.ple.image_token_id", int(hp["image_token_id"]), U32))
            if self.ple_row_dim is not None:
                md.append((f"{a}.embedding_length_per_layer_input", self.ple_row_dim, U32))
            for key, const in (("layer_multipliers", "layer_multipliers"), ("head_offsets", "ngram_heads_offsets"),
                               ("head_vocab_sizes", "ngram_heads_vocab_sizes")):
                md.append((f"{a}.ple.{key}", self.constants[const], U64))
        if n_mtp:
            md.append((f"{a}.nextn_predict_layers", n_mtp, U32))
        md.append(("general.quantization_version", 2, U32))  # GGML_QUANT_VERSION
        return md

    def metadata(self) -> list[tuple[str, Any, GGUFValueType]]:
        vocab = int(self._need("vocab_size"))
        return self.model_metadata(self.main) + gpt2_vocab_metadata(self.ck.dir, vocab)

    def mtp_metadata(self) -> list[tuple[str, Any, GGUFValueType]]:
        ids = {int(t.name.split(".")[1]) for t in self.mtp}
        has_indexer = any(".indexer." in t.name for t in self.mtp)
        return self.model_metadata(self.mtp, n_mtp=len(ids), mtp_has_indexer=has_indexer)

    # -- data --------------------------------------------------------------------------

    def data(self, t: OutTensor) -> Iterator[np.ndarray]:
        """The tensor's bytes in its format, in one piece or (the PLE table) shard by shard."""
        made = t.make(self.ck.load)
        for part in (made if isinstance(made, list) else [lambda: made]):
            yield encode(part(), t.fmt)


def encode(t: torch.Tensor, fmt: quant.Format) -> np.ndarray:
    """A tensor in GGUF bytes: float types by numpy's cast (as gguf-py), others by quant's codec."""
    x = t.detach().cpu().contiguous().numpy()
    if fmt is quant.F32:
        return x.astype(np.float32, copy=False).view(np.uint8)
    if fmt is quant.F16:
        return x.astype(np.float16, copy=False).view(np.uint8)
    flat = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    return fmt.quantize(flat.astype(np.float32, copy=False))


def _general_metadata(hf_dir: Path, tensors: list[OutTensor]) -> list[tuple[str, Any, GGUFValueType]]:
    """general.name, size_label and the rest, by gguf-py's model-card heuristics (as llama.cpp)."""
    total = shared = expert = 0
    expert_sum = n_expert_tensors = 0
    for t in tensors:
        size = math.prod(t.shape)
        if "_exps." in t.name and len(t.shape) >= 3:
            count = t.shape[0]
            expert += size // count
            expert_sum += count
            n_expert_tensors += 1
        else:
            shared += size
        total += size
    n_expert = expert_sum // n_expert_tensors if n_expert_tensors else 0
    meta = Metadata.load(None, hf_dir, None, total)
    gen = hf_dir / "generation_config.json"
    if meta.sampling_penalty_repeat is None and gen.is_file():
        # newer gguf-py also reads transformers' spelling of the repeat penalty
        meta.sampling_penalty_repeat = json.loads(gen.read_text()).get("repetition_penalty")
    if meta.name is None:
        meta.name = hf_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = size_label(total, shared, expert, n_expert)
    w = GGUFWriter(None, ARCH)
    meta.set_gguf_meta_model(w)
    out = []
    for k, v in w.kv_data[0].items():
        if k == "general.architecture":
            continue
        vtype = v.type
        if vtype == GGUFValueType.ARRAY:
            vtype = v.sub_type or GGUFValueType.get_type(v.value[0])
        out.append((k, v.value, vtype))
    return out
