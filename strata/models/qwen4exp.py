"""Qwen3.8-Flash-Next (GGUF architecture `qwen4exp`), composed from strata.nn modules.

The math is transformers' Qwen4ExpForCausalLM (5.23); the tensor names and layout are
those of llama.cpp's qwen4exp converter (Gemma-style norm weights hold 1 + w, value heads
in tiled order, ssm_a = -exp(A_log)). Per layer:

    x (T, S*H), S residual streams
    [PLE layer]   x = x + ple(x, tokens)
    a, w = attn_hc.read(x);  x = write(x, mixer(a), w)     mixer: gated DeltaNet, or gated
                                                           attention with QSA every 4th layer
    m, w = ffn_hc.read(x);   x = write(x, moe(m), w)
    logits = output(out_hc.read(x))                        no final norm

State per sequence (`Qwen4ExpState`): keys/values and indexer keys of the attention
layers, conv windows and recurrent states of the DeltaNet layers, the PLE block's n-gram
history and conv window.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from strata.gguf import GGUFFile
from strata.models import summary
from strata.names import TOKEN_EMBD
from strata.nn import QuantLinear
from strata.nn.deltanet import GatedDeltaNet
from strata.nn.gated_attention import AttentionState
from strata.nn.hyperconn import HyperConnection
from strata.nn.moe import MoE
from strata.nn.ple import NgramPLE
from strata.tensors import QTensor
from triton_kernels.dequant import dequantize_torch

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
            compress_ratios=tuple(ratios[:n]), ple_layers=ple_layers, ple=ple)


class Layer(torch.nn.Module):
    def __init__(self, mixer, attn_hc: HyperConnection, moe: MoE, ffn_hc: HyperConnection,
                 ple: NgramPLE | None):
        super().__init__()
        self.mixer, self.attn_hc, self.moe, self.ffn_hc, self.ple = mixer, attn_hc, moe, ffn_hc, ple
        self.recurrent = isinstance(mixer, GatedDeltaNet)

    def forward(self, x, tokens, mixer_state, ple_state, start, ple_ids=None):
        """x (T, S*H) continuing at `start`; the states are this layer's, updated in place."""
        if self.ple is not None:
            x = self.ple(x, tokens, ple_state, ple_ids)
        a, w = self.attn_hc.read(x)
        x = HyperConnection.write(x, self.mixer(a, mixer_state) if self.recurrent
                                  else self.mixer(a, mixer_state, start), w)
        m, w = self.ffn_hc.read(x)
        return HyperConnection.write(x, self.moe(m), w)


class Qwen4ExpState:
    """One sequence's state: `length` tokens seen."""

    rewindable = False  # the DeltaNet and conv states cannot be cut back to fewer tokens

    def __init__(self, model: "Qwen4Exp"):
        dev = model.device
        self.layers = [l.mixer.new_state(dev) if l.recurrent else AttentionState() for l in model.layers]
        self.ple = model.ple.new_state(dev) if model.ple is not None else None
        self.length = 0

    def copy(self, n: int | None = None) -> "Qwen4ExpState":
        """A copy of this state; recurrent states cannot be rewound, so n must be the length."""
        if n is not None and n != self.length:
            raise ValueError(f"a qwen4exp state holds {self.length} tokens and cannot be cut to {n}: "
                             "its DeltaNet states summarise the whole sequence")
        c = Qwen4ExpState.__new__(Qwen4ExpState)
        c.layers = [s.copy() for s in self.layers]
        c.ple = self.ple.copy() if self.ple is not None else None
        c.length = self.length
        return c

    def nbytes(self) -> int:
        ts = []
        for s in self.layers:
            ts += [s.k, s.v, s.idx] if isinstance(s, AttentionState) else [s.conv, s.rec]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class MTPHead(torch.nn.Module):
    """The multi-token-prediction block's weights: the embedding and the hidden state, each
    normed, joined and projected (eh_proj), one attention + MoE block with its
    hyper-connections, a final norm before the shared lm_head. Loaded so that a speculative
    decoder can use it; nothing runs it yet."""

    def __init__(self, eh_proj: QuantLinear, enorm, hnorm, head_norm, block: Layer):
        super().__init__()
        self.eh_proj, self.block = eh_proj, block
        p = (lambda t: torch.nn.Parameter(t.float(), requires_grad=False))
        self.enorm, self.hnorm, self.head_norm = p(enorm), p(hnorm), p(head_norm)


class Qwen4Exp(torch.nn.Module):
    def __init__(self, g: GGUFFile, cfg: Qwen4ExpConfig, embedding: QTensor, layers: list[Layer],
                 out_hc: HyperConnection, output: QuantLinear, dtype: torch.dtype, device: str, kernels: str,
                 mtp: MTPHead | None = None, mtp_file=None, qsa_fallback: bool = False):
        """Built by strata.load.qwen4exp from a GGUF file `g` (and the MTP sidecar
        `mtp_file`, where there is one); `embedding` stays the file's blocks; `kernels`:
        "triton" or "torch", the implementation every op takes (triton_kernels.ops);
        `qsa_fallback`: the file gave no QSA block size, the architecture's was taken."""
        super().__init__()
        self.gguf, self.cfg, self.dtype = g, cfg, dtype
        self.device = torch.device(device)
        self.kernels, self.embedding = kernels, embedding
        self.layers = torch.nn.ModuleList(layers)
        self.ple = next((l.ple for l in layers if l.ple is not None), None)
        self.out_hc, self.output = out_hc, output
        self.mtp, self.mtp_file, self.qsa_fallback = mtp, mtp_file, qsa_fallback
        self.to(self.device)  # norms, conv weights, RoPE tables (the weights went as loaded)

    # -- what the engine reports -------------------------------------------------------------

    def plan_line(self) -> str:
        """One line: what the model is and where/how its parts are held."""
        from collections import Counter
        g, c = self.gguf, self.cfg
        stores = [l.moe.experts for l in self.layers]
        tiers = Counter(s.describe() if hasattr(s, "describe") else s.tier for s in stores)
        exp_mib = sum(s.held_bytes() for s in stores) / 2**20
        n_attn = sum(not r for r in c.recurrent)
        qsa = [l.mixer for l in self.layers if not l.recurrent]
        qsa_on = any(m.qsa and not m.dense_only for m in qsa)
        qsa_text = (f"QSA on (top {c.idx_budget} tokens in blocks of {qsa[0].ratio}"
                    f"{', block size from the architecture: the file has no ratio' if self.qsa_fallback else ''})"
                    if qsa_on else "dense attention (QSA off)")
        ple = (f"PLE table {self.ple.table.where} at layer {c.ple_layers[0]}" if self.ple is not None
               else "no PLE")
        mtp = f"MTP head loaded from {self.mtp_file.name} (not run)" if self.mtp is not None else "no MTP head"
        return (f"{summary.name(g)} ({g.arch}, {c.n_layers} layers: "
                f"{c.n_layers - n_attn} DeltaNet + {n_attn} attention, dim {c.dim} x {c.streams} streams, "
                f"{c.n_experts} experts top-{c.top_k}, {summary.file_summary(g)}) {summary.run_summary(self)}; "
                f"experts: " + ", ".join(f"{k} x{v}" for k, v in tiers.items()) + f" ({exp_mib:.0f} MiB held); "
                f"{ple}; {qsa_text}; {mtp}")

    # -- running ---------------------------------------------------------------------------------

    def new_cache(self, capacity: int = 256) -> Qwen4ExpState:
        return Qwen4ExpState(self)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.embedding.shape[0]:
            raise ValueError(f"token ids must lie in 0..{self.embedding.shape[0] - 1}")
        rows = torch.from_numpy(np.take(self.embedding.data, tokens.numpy(), axis=0))
        return dequantize_torch(rows, self.embedding.fmt).to(self.device)

    @torch.inference_mode()
    def forward(self, tokens, state: Qwen4ExpState, last_only: bool = False) -> torch.Tensor:
        """Logits (S, vocab) float32 for tokens that continue the state's sequence."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        x = self.embed(tokens).repeat(1, self.cfg.streams)
        start = state.length
        ple_ids = None
        if self.ple is not None:
            # the rows this step needs are known before the first layer: announce them now,
            # so the drive reads them while layer 0 computes
            ple_ids = self.ple.ids(tokens, state.ple)
            self.ple.table.prefetch(ple_ids)
        for layer, st in zip(self.layers, state.layers):
            x = layer(x, tokens, st, state.ple, start, ple_ids)
        state.length = start + tokens.numel()
        if last_only:
            x = x[-1:]
        h, _ = self.out_hc.read(x)
        return self.output(h).float()

    def io_stats(self) -> dict:
        """Counters of the storage tiers: the PLE table's and the experts' (summed)."""
        out = {"ple": self.ple.table.stats() if self.ple is not None else {}}
        stores = [l.moe.experts for l in self.layers]
        ex: dict = {}
        for s in stores:
            for k, v in (s.stats() if hasattr(s, "stats") else {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    ex[k] = ex.get(k, 0) + v
        out["experts"] = ex
        return out

    def forward_batch(self, items, last_only: bool = True) -> list[torch.Tensor]:
        """Sequences one after another (their recurrent states are separate)."""
        return [self.forward(t, s, last_only=last_only) for t, s in items]

