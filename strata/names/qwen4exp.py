"""Tensor names of Qwen3.8-Flash-Next: the GGUF names (architecture `qwen4exp`, as
llama.cpp's converter writes them), by the module that reads them, and the Hugging Face
checkpoint names they come from, with the transform `strata convert` applies on the way.

Transforms (strata.convert.qwen4exp applies them, with llama.cpp's reasons there):
  plus1    the model's RMSNorms multiply by (1 + w) (Gemma-style); GGUF stores 1 + w
  v_*      the DeltaNet's value heads, grouped by k head in HF, tiled in GGUF
  a_log    ssm_a = -exp(A_log), value heads reordered
  squeeze  a conv1d weight [C, 1, K] stored [C, K]
The routed experts (mlp.experts.E.{gate,up,down}_proj.weight, or the fused
mlp.experts.{gate_up_proj,down_proj}) are stacked over E into ffn_{gate,up,down}_exps;
the PLE table's shards (ple.ple_embedding.ngram_embedding.shard_S.weight) are
concatenated by S into PLE_TABLE; the MTP block (mtp.*) goes to a sidecar file under
llama.cpp's nextn names, its layer index following the last layer.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from strata.names import OUTPUT, TOKEN_EMBD  # noqa: F401  (this architecture's, too)

ARCH = "qwen4exp"
PLE_TABLE = "per_layer_token_embd.weight"
PLE_ROWS_PER_TOKEN = 16  # the n-gram heads: 8 bigram and 8 trigram (REFERENCE §3)
OUTPUT_HC = "output_hc"  # the final stream mixer: output_hc_{norm,down,up}.weight

# blk.N.<name>, by module
DELTANET = {"qkv": "attn_qkv.weight", "gate": "attn_gate.weight", "beta": "ssm_beta.weight",
            "alpha": "ssm_alpha.weight", "out": "ssm_out.weight", "conv": "ssm_conv1d.weight",
            "dt_bias": "ssm_dt.bias", "a": "ssm_a", "norm": "ssm_norm.weight"}
ATTENTION = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "out": "attn_output.weight",
             "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
             "idx_q": "indexer.q_proj.weight", "idx_k": "indexer.k_proj.weight",
             "idx_q_norm": "indexer.q_norm.weight", "idx_k_norm": "indexer.k_norm.weight"}
MOE = {"router": "ffn_gate_inp.weight", "gate_exps": "ffn_gate_exps.weight", "up_exps": "ffn_up_exps.weight",
       "down_exps": "ffn_down_exps.weight", "shexp_gate": "ffn_gate_shexp.weight",
       "shexp_up": "ffn_up_shexp.weight", "shexp_down": "ffn_down_shexp.weight",
       "shexp_router": "ffn_gate_inp_shexp.weight"}
PLE = {"key": "ple_key.weight", "value": "ple_value.weight", "norm_key": "ple_norm_key.weight",
       "norm_query": "ple_norm_query.weight", "norm_conv": "ple_norm_conv.weight", "conv": "ple_conv1d.weight"}
MTP = {"eh_proj": "nextn.eh_proj.weight", "enorm": "nextn.enorm.weight", "hnorm": "nextn.hnorm.weight",
       "head_norm": "nextn.shared_head_norm.weight"}
EXPERTS = (MOE["gate_exps"], MOE["up_exps"], MOE["down_exps"])
# a routed-expert tensor: groups (layer, gate|up|down)
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def hc(prefix: str) -> dict[str, str]:
    """A hyper-connection's names: prefix `hc_attn`, `hc_ffn` (blk.N.) or OUTPUT_HC."""
    return {k: f"{prefix}_{k}.weight" for k in ("norm", "down", "up", "inject")}


def blk(i: int, name: str) -> str:
    return f"blk.{i}.{name}"


def mtp_sidecar(path: str | os.PathLike) -> Path:
    """The file beside a model's GGUF that holds its MTP block: `mtp-<name>` (llama.cpp's
    converter drops the block, so `strata convert` writes it there)."""
    path = Path(path)
    return path.with_name(f"mtp-{path.name}")


def mmproj_sidecar(path: str | os.PathLike) -> Path:
    """The file beside a model's GGUF that holds its vision tower: `mmproj-<name>`, the
    prefix llama.cpp's converter gives an mmproj file (`strata convert --mmproj`)."""
    path = Path(path)
    return path.with_name(f"mmproj-{path.name}")


# --- Hugging Face -> GGUF, for strata convert ----------------------------------------------

# per layer: HF suffix (model.layers.N.) -> (GGUF suffix (blk.N.), transform or None)
HF_LAYER = {
    "self_attn.q_proj.weight": (ATTENTION["q"], None),  # rows: [q | gate] per head
    "self_attn.k_proj.weight": (ATTENTION["k"], None),
    "self_attn.v_proj.weight": (ATTENTION["v"], None),
    "self_attn.o_proj.weight": (ATTENTION["out"], None),
    "self_attn.q_norm.weight": (ATTENTION["q_norm"], "plus1"),
    "self_attn.k_norm.weight": (ATTENTION["k_norm"], "plus1"),
    "self_attn.indexer.q_layernorm.weight": (ATTENTION["idx_q_norm"], "plus1"),
    "self_attn.indexer.k_layernorm.weight": (ATTENTION["idx_k_norm"], "plus1"),
    # self_attn.indexer.index_qk_proj.weight: split by rows into idx_q and idx_k
    "linear_attn.in_proj_qkv.weight": (DELTANET["qkv"], "v_qkv"),
    "linear_attn.in_proj_z.weight": (DELTANET["gate"], "v_rows"),
    "linear_attn.in_proj_b.weight": (DELTANET["beta"], "v_heads"),
    "linear_attn.in_proj_a.weight": (DELTANET["alpha"], "v_heads"),
    "linear_attn.A_log": (DELTANET["a"], "a_log"),
    "linear_attn.dt_bias": (DELTANET["dt_bias"], "v_heads"),
    "linear_attn.conv1d.weight": (DELTANET["conv"], "v_conv"),
    "linear_attn.norm.weight": (DELTANET["norm"], None),  # a plain gated RMSNorm: no +1
    "linear_attn.out_proj.weight": (DELTANET["out"], "v_cols"),
    "mlp.gate.weight": (MOE["router"], None),
    "mlp.shared_expert.gate_proj.weight": (MOE["shexp_gate"], None),
    "mlp.shared_expert.up_proj.weight": (MOE["shexp_up"], None),
    "mlp.shared_expert.down_proj.weight": (MOE["shexp_down"], None),
    "mlp.shared_expert_gate.weight": (MOE["shexp_router"], None),
    "ple.key_proj.weight": (PLE["key"], None),
    "ple.value_proj.weight": (PLE["value"], None),
    "ple.norm_key.weight": (PLE["norm_key"], "plus1"),
    "ple.norm_query.weight": (PLE["norm_query"], "plus1"),
    "ple.norm_conv.weight": (PLE["norm_conv"], "plus1"),
    "ple.conv1d.weight": (PLE["conv"], "squeeze"),
    # Qwen3.5-style norms an MTP layer may carry
    "input_layernorm.weight": ("attn_norm.weight", "plus1"),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", "plus1"),
}
for _hf, _gg in {"attn": "attn", "mlp": "ffn"}.items():
    _n = hc(f"hc_{_gg}")
    HF_LAYER[f"{_hf}_hyper_connection.hc_norm.weight"] = (_n["norm"], "plus1")
    HF_LAYER[f"{_hf}_hyper_connection.input_mix_weight_down.weight"] = (_n["down"], None)
    HF_LAYER[f"{_hf}_hyper_connection.input_mix_weight_up.weight"] = (_n["up"], None)
    HF_LAYER[f"{_hf}_hyper_connection.block_inject_weight.weight"] = (_n["inject"], None)

_out = hc(OUTPUT_HC)
HF_GLOBAL = {
    "model.embed_tokens.weight": (TOKEN_EMBD, None),
    "lm_head.weight": (OUTPUT, None),
    "model.hyper_connection_mixer.hc_norm.weight": (_out["norm"], "plus1"),
    "model.hyper_connection_mixer.input_mix_weight_down.weight": (_out["down"], None),
    "model.hyper_connection_mixer.input_mix_weight_up.weight": (_out["up"], None),
}
HF_MTP = {  # mtp.<name> -> blk.L.<nextn name>, L = num_hidden_layers + i; every norm +1
    "fc.weight": (MTP["eh_proj"], None),
    "pre_fc_norm_embedding.weight": (MTP["enorm"], "plus1"),
    "pre_fc_norm_hidden.weight": (MTP["hnorm"], "plus1"),
    "norm.weight": (MTP["head_norm"], "plus1"),
}
