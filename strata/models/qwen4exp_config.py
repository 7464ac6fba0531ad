"""Qwen3.8-Flash-Next's shape, read from a GGUF file's `qwen4exp.*` metadata."""
from __future__ import annotations

from dataclasses import dataclass, field

from strata.gguf import GGUFFile
from strata.names import TOKEN_EMBD


@dataclass(frozen=True)
class Qwen4ExpConfig:
    n_layers: int
    dim: int
    vocab_size: int
    context_length: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    norm_eps: float
    recurrent: tuple[bool, ...]
    n_experts: int
    top_k: int
    expert_dim: int
    shared_dim: int
    conv_kernel: int
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    streams: int
    hc_rank: int
    idx_heads: int
    idx_dim: int
    idx_budget: int
    compress_ratios: tuple[int, ...]
    ple_layers: tuple[int, ...]
    ple: dict = field(default_factory=dict)
    rope_sections: tuple[int, int, int] | None = None  # M-RoPE's (t, h, w) rotary pairs
    image_token: int | None = None  # the placeholder an image's tokens take in the prompt

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Qwen4ExpConfig":
        a = g.arch
        req = (lambda k: g.require(f"{a}.{k}"))
        opt = (lambda k, d=None: g.get(f"{a}.{k}", d))
        n = int(req("block_count"))
        rec = opt("attention.recurrent_layers")
        if rec is None:
            every = int(opt("full_attention_interval", 4))
            rec = [(i + 1) % every != 0 for i in range(n)]
        v_heads = int(req("ssm.time_step_rank"))
        ple_layers = tuple(int(i) for i in (opt("ple.layers") or []))
        ple = {}
        if ple_layers:
            ple = dict(multipliers=[int(m) for m in req("ple.layer_multipliers")],
                       head_vocab_sizes=[int(s) for s in req("ple.head_vocab_sizes")],
                       head_offsets=[int(o) for o in req("ple.head_offsets")],
                       eos_id=int(req("ple.eos_token_id")),
                       heads_per_ngram=int(req("ple.heads_per_ngram")),
                       conv_kernel=int(req("ple.conv_kernel")),
                       row_dim=int(req("embedding_length_per_layer_input")))
        ratios = [int(r) for r in (opt("attention.compress_ratios") or [0] * n)]
        return cls(
            n_layers=n, dim=int(req("embedding_length")),
            vocab_size=int(g.tensor(TOKEN_EMBD).shape[0]),
            context_length=int(opt("context_length", 4096)),
            n_heads=int(req("attention.head_count")), n_kv_heads=int(req("attention.head_count_kv")),
            head_dim=int(req("attention.key_length")), rope_dim=int(req("rope.dimension_count")),
            rope_theta=float(req("rope.freq_base")),
            norm_eps=float(req("attention.layer_norm_rms_epsilon")),
            recurrent=tuple(bool(r) for r in rec[:n]),
            n_experts=int(req("expert_count")), top_k=int(req("expert_used_count")),
            expert_dim=int(req("expert_feed_forward_length")),
            shared_dim=int(req("expert_shared_feed_forward_length")),
            conv_kernel=int(req("ssm.conv_kernel")), k_heads=int(req("ssm.group_count")),
            v_heads=v_heads, dk=int(req("ssm.state_size")), dv=int(req("ssm.inner_size")) // v_heads,
            streams=int(req("hyper_connection.count")), hc_rank=int(req("hyper_connection.low_rank")),
            idx_heads=int(opt("attention.indexer.head_count", 0)),
            idx_dim=int(opt("attention.indexer.key_length", 0)),
            idx_budget=int(opt("attention.indexer.top_k", 0)),
            compress_ratios=tuple(ratios[:n]), ple_layers=ple_layers, ple=ple,
            rope_sections=tuple(int(x) for x in opt("rope.dimension_sections"))[:3]
            if opt("rope.dimension_sections") is not None else None,
            image_token=int(opt("ple.image_token_id")) if opt("ple.image_token_id") is not None else None)
