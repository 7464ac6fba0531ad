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

from strata.gguf import GGUFError, GGUFFile
from strata.nn import QuantLinear, Rope
from strata.nn.deltanet import GatedDeltaNet
from strata.nn.gated_attention import AttentionState, GatedAttention
from strata.nn.hyperconn import HyperConnection
from strata.nn.linear import DenseBudget
from strata.nn.moe import MoE
from strata.nn.ple import NgramPLE
from strata.storage.experts import ExpertStore
from strata.storage.ple_gather import InMemoryTable, StoredTable
from strata.tensors import QTensor
from triton_kernels.backend import choose_kernels
from triton_kernels.dequant import dequantize_torch

# The architecture's QSA block size: llama.cpp's converter writes a per-layer ratio only
# for layers typed "full_attention", and transformers 5.x renames that type on load, so a
# file converted with transformers installed can carry zeros for a model that has an indexer.
QSA_BLOCK = 4


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
            vocab_size=int(g.tensor("token_embd.weight").shape[0]),
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


def _sidecar(g: GGUFFile) -> GGUFFile | None:
    """`mtp-<name>` beside the model's file (where `strata convert` writes the MTP block)."""
    from strata.gguf import open_gguf
    path = g.path.with_name(f"mtp-{g.path.name}")
    return open_gguf(path) if path.is_file() else None


class Qwen4Exp(torch.nn.Module):
    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 budget: DenseBudget | None = None, qsa: bool = True, expert_tier: str | None = None,
                 ple_table=None, expert_opts: dict | None = None, kernels: str | None = None):
        """`expert_tier` (or expert_opts["tier"]): where the routed experts live, see
        strata.storage.experts (None: dense in RAM while the budget lasts, else the raw
        blocks); `expert_opts`: the rest of ExpertStore's options (strata.storage.experts.
        store_kwargs makes them from the --experts flags); `ple_table`: a StoredTable (the
        --ple-io flags: a strata.storage.ple table, or a StoredTable), else the table's blocks
        in memory; `kernels`: "triton" or "torch" for every op (None: the device's default,
        see triton_kernels.backend.choose_kernels)."""
        super().__init__()
        self.gguf, self.cfg, self.dtype = g, Qwen4ExpConfig.from_gguf(g), dtype
        self.device = torch.device(device)
        self.kernels = kernels = choose_kernels(kernels, device)
        c = self.cfg
        self.budget = budget = budget or DenseBudget()
        lin = (lambda name, f=g: QuantLinear(f.tensor(name), dtype, device, budget=budget, kernels=kernels))
        vec = (lambda name, f=g: torch.from_numpy(f.tensor(name).numpy().reshape(-1).copy()))
        self.embedding = g.tensor("token_embd.weight")
        rope = Rope(c.rope_dim, c.rope_theta, max_pos=min(c.context_length, 8192))

        def matrix(t: QTensor) -> QTensor:
            # a one-row weight (the shared expert's gate) may be stored 1-D: llama-quantize
            # writes ne [H] where the converter wrote [H, 1]
            return QTensor(t.name, t.fmt, (1, t.shape[0]), t.data.reshape(1, -1)) if len(t.shape) == 1 else t

        def fused(names: list[str], f=g) -> QuantLinear:
            # one matmul for projections of the same input (a decode step is per-op overhead)
            return QuantLinear([matrix(f.tensor(n)) for n in names], dtype, device, budget=budget, kernels=kernels)

        def hc(prefix: str, inject: bool, f=g) -> HyperConnection:
            down = [f"{prefix}_down.weight"] + ([f"{prefix}_inject.weight"] if inject else [])
            return HyperConnection(vec(f"{prefix}_norm.weight", f), fused(down, f), lin(f"{prefix}_up.weight", f),
                                   c.hc_rank, c.streams, c.norm_eps)

        def attention(f: GGUFFile, i: int, ratio: int) -> GatedAttention:
            p = f"blk.{i}."
            has_idx = (p + "indexer.q_proj.weight") in f.tensors
            if has_idx and ratio == 0:
                ratio, self.qsa_fallback = QSA_BLOCK, True
            names = ["attn_q.weight", "attn_k.weight", "attn_v.weight"]
            idx = {}
            if has_idx:
                names += ["indexer.q_proj.weight", "indexer.k_proj.weight"]
                idx = dict(idx_q_norm=vec(p + "indexer.q_norm.weight", f),
                           idx_k_norm=vec(p + "indexer.k_norm.weight", f), n_idx=c.idx_heads,
                           idx_dim=c.idx_dim, budget=c.idx_budget, ratio=ratio)
            mixer = GatedAttention(fused([p + n for n in names], f), lin(p + "attn_output.weight", f),
                                   vec(p + "attn_q_norm.weight", f), vec(p + "attn_k_norm.weight", f),
                                   c.n_heads, c.n_kv_heads, c.head_dim, rope, c.norm_eps, **idx)
            mixer.dense_only = not qsa
            return mixer

        def moe(f: GGUFFile, i: int) -> MoE:
            p = f"blk.{i}."
            opts = dict(expert_opts or {})
            tier = opts.pop("tier", None) or expert_tier
            experts = ExpertStore(f.tensor(p + "ffn_gate_exps.weight"), f.tensor(p + "ffn_up_exps.weight"),
                                  f.tensor(p + "ffn_down_exps.weight"), dtype, device, budget, tier,
                                  kernels=kernels, **opts)
            return MoE(fused([p + n for n in ("ffn_gate_inp.weight", "ffn_gate_shexp.weight",
                                              "ffn_up_shexp.weight", "ffn_gate_inp_shexp.weight")], f),
                       experts, c.n_experts, c.top_k, c.shared_dim, lin(p + "ffn_down_shexp.weight", f))

        self.qsa_fallback = False
        self.ple = None
        layers = []
        for i in range(c.n_layers):
            p = f"blk.{i}."
            if c.recurrent[i]:
                conv = g.tensor(p + "ssm_conv1d.weight").numpy().reshape(-1, c.conv_kernel)
                proj = fused([p + n for n in ("attn_qkv.weight", "attn_gate.weight",
                                              "ssm_beta.weight", "ssm_alpha.weight")])
                mixer = GatedDeltaNet(proj, lin(p + "ssm_out.weight"), torch.from_numpy(conv.copy()),
                                      vec(p + "ssm_dt.bias"), vec(p + "ssm_a"), vec(p + "ssm_norm.weight"),
                                      c.k_heads, c.v_heads, c.dk, c.dv, c.norm_eps)
            else:
                mixer = attention(g, i, c.compress_ratios[i] if i < len(c.compress_ratios) else 0)
            ple = None
            if i in c.ple_layers:
                if not c.recurrent[i]:
                    raise GGUFError(f"{g.path}: PLE layer {i} is not a linear-attention layer")
                if ple_table is None:
                    table = InMemoryTable(g.tensor("per_layer_token_embd.weight"), device, kernels)
                else:  # the storage tier's table, gathered where the model computes
                    table = StoredTable(getattr(ple_table, "table", ple_table), device, kernels)
                conv = g.tensor(p + "ple_conv1d.weight").numpy().reshape(-1, c.ple["conv_kernel"])
                hash_args = {k: c.ple[k] for k in ("multipliers", "head_vocab_sizes", "head_offsets",
                                                    "eos_id", "heads_per_ngram")}
                ple = self.ple = NgramPLE(table, hash_args, lin(p + "ple_key.weight"), lin(p + "ple_value.weight"),
                                          vec(p + "ple_norm_key.weight"), vec(p + "ple_norm_query.weight"),
                                          vec(p + "ple_norm_conv.weight"), torch.from_numpy(conv.copy()),
                                          c.streams, c.norm_eps, dilation=len(c.ple["multipliers"]))
            layers.append(Layer(mixer, hc(p + "hc_attn", True), moe(g, i), hc(p + "hc_ffn", True), ple))

        # The MTP head (the speculative draft): held, not yet run. Its block follows the last
        # layer (blk.<n_layers>), in the file itself or in the sidecar `strata convert` writes.
        self.mtp, self.mtp_file = None, None
        n = c.n_layers
        for f in (g, _sidecar(g)):
            if f is not None and f"blk.{n}.nextn.eh_proj.weight" in f.tensors:
                p = f"blk.{n}."
                ratios = f.get(f"{g.arch}.attention.compress_ratios") or []
                block = Layer(attention(f, n, int(ratios[n]) if len(ratios) > n else 0),
                              hc(p + "hc_attn", True, f), moe(f, n), hc(p + "hc_ffn", True, f), None)
                self.mtp = MTPHead(lin(p + "nextn.eh_proj.weight", f), vec(p + "nextn.enorm.weight", f),
                                   vec(p + "nextn.hnorm.weight", f), vec(p + "nextn.shared_head_norm.weight", f),
                                   block)
                self.mtp_file = f.path
                break
        self.layers = torch.nn.ModuleList(layers)
        self.out_hc = hc("output_hc", False)
        self.output = lin("output.weight")
        self.to(self.device)  # norms, conv weights, RoPE tables (the weights went as loaded)

    # -- what the engine reports -------------------------------------------------------------

    def plan_line(self) -> str:
        from collections import Counter
        g, c = self.gguf, self.cfg
        n_weights = sum(int(np.prod(t.shape)) for t in g.tensors.values())
        file_mib = sum(t.nbytes for t in g.tensors.values()) / 2**20
        fmts = Counter(t.fmt.name for t in g.tensors.values())
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
        return (f"{g.get('general.name', g.path.name)} ({g.arch}, {c.n_layers} layers: "
                f"{c.n_layers - n_attn} DeltaNet + {n_attn} attention, dim {c.dim} x {c.streams} streams, "
                f"{c.n_experts} experts top-{c.top_k}, {n_weights / 1e6:.1f}M weights in {file_mib:.0f} MiB: "
                + ", ".join(f"{k} x{v}" for k, v in fmts.most_common())
                + f") on {self.device}, {self.kernels} kernels, {str(self.dtype).replace('torch.', '')}, "
                f"{torch.get_num_threads()} threads; "
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

