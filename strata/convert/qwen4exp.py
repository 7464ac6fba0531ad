"""Qwen3.8-Flash-Next (transformers `Qwen4ExpForCausalLM`) checkpoint -> GGUF `qwen4exp`.

The output is what llama.cpp's converter (conversion/qwen4exp.py, 0.3.36) writes for the
same checkpoint: the same metadata keys, values, types and order, the same tensors in the
same order with the same names, shapes, types and bytes. The name table (Hugging Face
name -> GGUF name, transform) is strata.names.qwen4exp's, which the loader reads too;
checkpoint.py reads the checkpoint, transforms.py holds the transforms, output formats and
encoding, and this module the converter (the tensor plan) and the metadata. The
transforms, with llama.cpp's reasons:

- plus1: the model's RMSNorms multiply by (1 + w) (Gemma-style, zero-centred); GGUF
  stores 1 + w.
- V reordering: the DeltaNet has fewer k heads than v heads; HF groups the v heads by
  their k head ([k0: v0 v1 .. v(r-1)], [k1: ...]), llama.cpp wants them tiled ([v0 of k0,
  v0 of k1, ..., v1 of k0, ...]) so that ggml broadcasts k over v without an interleaved
  repeat: along the v-head axis, a (n_k, r, d) view is transposed to (r, n_k, d).
- The indexer's index_qk_proj is split by rows into indexer.q_proj and indexer.k_proj;
  the experts are stacked over E; the PLE table's shards are concatenated by S; the PLE
  constants (layer_multipliers, ngram_heads_offsets, ngram_heads_vocab_sizes) become
  metadata qwen4exp.ple.* (UINT64: int64 constants would lose bits as float tensors).

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
`L = num_hidden_layers + i` (mtp.layers.i.<name> as a layer's, mtp.<name> by HF_MTP).
Its metadata is OUT's without the tokenizer, with block_count = num_hidden_layers + n_mtp,
`qwen4exp.nextn_predict_layers` = n_mtp, recurrent_layers extended with False and
compress_ratios extended with the indexer ratio where the MTP layer has an indexer.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFValueType, GGUFWriter, Metadata, size_label

from strata.names import qwen4exp as names

from .checkpoint import Checkpoint
from .errors import ConvertError
from .transforms import OUTTYPES, OutTensor, Transforms, encode, tensor_format, widen
from .vocab import gpt2_vocab_metadata

ARCH = names.ARCH

_SUB = {"attn": "attn", "mlp": "ffn"}
_PLE_CONSTANTS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_SHARD_RE = re.compile(r"^ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")


def _skipped(name: str) -> bool:
    # vision tower and buffers llama.cpp never writes
    return ("visual." in name or "vision" in name or name.startswith("mlp")
            or name.endswith((".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")))


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
        self.tf = Transforms(self.hp)
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
        return OutTensor(gguf_name, lambda load, hf=hf, key=key: tf(key, widen(load(hf))))

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
            if name in names.HF_GLOBAL:
                gg, key = names.HF_GLOBAL[name]
                main.append(self._simple(gg, name, key))
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
        if rest in names.HF_LAYER:
            gg, key = names.HF_LAYER[rest]
            out.append(self._simple(blk + gg, name, key))
        elif m := _EXPERT_RE.match(rest):
            group = experts.setdefault((prefix, bid), {})
            group[(int(m.group(1)), m.group(2))] = name
            if len(group) >= n_exp * 3:  # the layer's last expert weight: write the three stacks
                for kind in ("down", "gate", "up"):
                    stack = [group[(e, kind)] for e in range(n_exp)]
                    out.append(OutTensor(f"{blk}ffn_{kind}_exps.weight",
                                         lambda load, stack=stack: torch.stack([widen(load(n)) for n in stack])))
                group.clear()
                group[("done", "")] = ""
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight"):
            def half(load, i, name=name):
                t = widen(load(name))
                n_ff = t.shape[-2] // 2
                return t[..., i * n_ff:(i + 1) * n_ff, :].contiguous()
            out.append(OutTensor(f"{blk}ffn_gate_exps.weight", lambda load: half(load, 0)))
            out.append(OutTensor(f"{blk}ffn_up_exps.weight", lambda load: half(load, 1)))
            experts.setdefault((prefix, bid), {})[("done", "")] = ""
        elif rest in ("mlp.experts.down_proj", "mlp.experts.down_proj.weight"):
            out.append(self._simple(f"{blk}ffn_down_exps.weight", name, None))
        elif rest == "self_attn.indexer.index_qk_proj.weight":
            n_q = int(self._need("indexer_n_heads")) * int(self._need("indexer_head_dim"))
            out.append(OutTensor(f"{blk}indexer.q_proj.weight", lambda load, n=name: widen(load(n))[:n_q]))
            out.append(OutTensor(f"{blk}indexer.k_proj.weight", lambda load, n=name: widen(load(n))[n_q:]))
        elif m := _SHARD_RE.match(rest):
            group = shards.setdefault(bid, {})
            group[int(m.group(1))] = name
            self.ple_row_dim = int(self.ck.shapes[name][-1])
            if len(group) == int(self.hp["split_ngram_parts"]):
                parts = [group[i] for i in sorted(group)]
                for n in parts:
                    if self.ck.shapes[n][-1] != self.ple_row_dim:
                        raise ConvertError(f"{self.ck.files[n]}: PLE shard {n!r} has rows of "
                                           f"{self.ck.shapes[n][-1]}, the others {self.ple_row_dim}")
                # a list of loaders: the table (hundreds of GB in f32) is written shard by
                # shard, one resident at a time
                out.append(OutTensor(names.PLE_TABLE, lambda load, parts=parts: [
                    (lambda n=n: load(n).to(torch.float32)) for n in parts]))
        elif rest.startswith("ple.ple_embedding.") and rest.rsplit(".", 1)[-1] in _PLE_CONSTANTS:
            # int64 hash constants: exact integers, kept for metadata
            self.constants[rest.rsplit(".", 1)[-1]] = [int(x) for x in self.ck.load(name).to(torch.int64).tolist()]
        else:
            unknown.append(name)

    def _mtp_tensor(self, name: str, out: list[OutTensor], experts, unknown: list[str]) -> None:
        rest = name[len("mtp."):]
        if rest in names.HF_MTP:
            gg, key = names.HF_MTP[rest]
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
        need = [g for g in names.HF_GLOBAL if g != "lm_head.weight" or not hp.get("tie_word_embeddings")]
        types = hp.get("layer_types") or []
        ple = [i - 1 for i in hp.get("ple_layer_ids") or []]
        for i in range(self.n_layer):
            p = f"model.layers.{i}."
            sub = ["mlp.gate.weight", "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                   "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"]
            sub += [k for k in names.HF_LAYER if "_hyper_connection." in k and "inject" not in k]
            sub += [f"{h}_hyper_connection.block_inject_weight.weight" for h in _SUB]
            if (types[i] if i < len(types) else "") == "linear_attention":
                sub += [k for k in names.HF_LAYER if k.startswith("linear_attn.")]
            else:
                sub += [k for k in names.HF_LAYER if k.startswith("self_attn.") and "indexer" not in k]
                if hp.get("indexer_n_heads"):
                    sub += ["self_attn.indexer.index_qk_proj.weight", "self_attn.indexer.q_layernorm.weight",
                            "self_attn.indexer.k_layernorm.weight"]
            if i in ple:
                sub += [k for k in names.HF_LAYER if k.startswith("ple.")]
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
            t.fmt = tensor_format(t.name, shape, self.outtype)
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
