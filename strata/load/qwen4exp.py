"""The `qwen4exp` loader: strata.models.qwen4exp's modules from GGUF names
(strata.names.qwen4exp), with the routed experts and the PLE table where the LoadPlan
puts them, and the MTP block from the file or its sidecar."""
from __future__ import annotations

import torch

from strata import dist
from strata.gguf import GGUFError, GGUFFile, open_gguf
from strata.models.qwen4exp import Layer, MTPHead, Qwen4Exp, Qwen4ExpConfig
from strata.names import qwen4exp as n
from strata.nn import QuantLinear, Rope
from strata.nn.deltanet import GatedDeltaNet
from strata.nn.gated_attention import GatedAttention
from strata.nn.hyperconn import HyperConnection
from strata.nn.linear import DenseBudget
from strata.nn.moe import MoE
from strata.nn.ple import NgramPLE
from strata.storage import io
from strata.storage.experts import ExpertStore
from strata.storage.ple_gather import InMemoryTable, StoredTable
from strata.tensors import QTensor

# The architecture's QSA block size: llama.cpp's converter writes a per-layer ratio only
# for layers typed "full_attention", and transformers 5.x renames that type on load, so a
# file converted with transformers installed can carry zeros for a model that has an indexer.
QSA_BLOCK = 4


def _matrix(t: QTensor) -> QTensor:
    # a one-row weight (the shared expert's gate) may be stored 1-D: llama-quantize writes
    # ne [H] where the converter wrote [H, 1]
    return QTensor(t.name, t.fmt, (1, t.shape[0]), t.data.reshape(1, -1)) if len(t.shape) == 1 else t


def sidecar(g: GGUFFile) -> GGUFFile | None:
    """`mtp-<name>` beside the model's file (where `strata convert` writes the MTP block)."""
    path = n.mtp_sidecar(g.path)
    return open_gguf(path) if path.is_file() else None


class _Loader:
    """The modules of one model: each method reads one module's names from a file."""

    def __init__(self, plan, cfg: Qwen4ExpConfig):
        self.plan, self.cfg = plan, cfg
        self.dtype, self.device, self.kernels = plan.dtype, plan.device, plan.kernels
        self.budget = DenseBudget()
        self.rope = Rope(cfg.rope_dim, cfg.rope_theta, max_pos=min(plan.context, 8192), scaling=plan.rope,
                         sections=cfg.rope_sections)
        self.qsa_fallback = False

    def lin(self, f: GGUFFile, *names: str) -> QuantLinear:
        # several projections of one input become one matmul (a decode step is per-op overhead)
        ws = [_matrix(f.tensor(x)) for x in names]
        return QuantLinear(ws if len(ws) > 1 else ws[0], self.dtype, self.device, budget=self.budget,
                           kernels=self.kernels)

    @staticmethod
    def vec(f: GGUFFile, name: str) -> torch.Tensor:
        return torch.from_numpy(f.tensor(name).numpy().reshape(-1).copy())

    def hc(self, f: GGUFFile, prefix: str, inject: bool) -> HyperConnection:
        h = n.hc(prefix)
        down = [h["down"]] + ([h["inject"]] if inject else [])
        return HyperConnection(self.vec(f, h["norm"]), self.lin(f, *down), self.lin(f, h["up"]),
                               self.cfg.hc_rank, self.cfg.streams, self.cfg.norm_eps)

    def attention(self, f: GGUFFile, i: int, ratio: int) -> GatedAttention:
        c, a = self.cfg, {k: n.blk(i, v) for k, v in n.ATTENTION.items()}
        has_idx = a["idx_q"] in f.tensors
        if has_idx and ratio == 0:
            ratio, self.qsa_fallback = QSA_BLOCK, True
        proj = [a["q"], a["k"], a["v"]]
        idx = {}
        if has_idx:
            proj += [a["idx_q"], a["idx_k"]]
            idx = dict(idx_q_norm=self.vec(f, a["idx_q_norm"]), idx_k_norm=self.vec(f, a["idx_k_norm"]),
                       n_idx=c.idx_heads, idx_dim=c.idx_dim, budget=c.idx_budget, ratio=ratio)
        mixer = GatedAttention(self.lin(f, *proj), self.lin(f, a["out"]), self.vec(f, a["q_norm"]),
                               self.vec(f, a["k_norm"]), c.n_heads, c.n_kv_heads, c.head_dim, self.rope,
                               c.norm_eps, **idx)
        mixer.dense_only = not self.plan.options.qsa
        return mixer

    def deltanet(self, f: GGUFFile, i: int) -> GatedDeltaNet:
        c, d = self.cfg, {k: n.blk(i, v) for k, v in n.DELTANET.items()}
        conv = f.tensor(d["conv"]).numpy().reshape(-1, c.conv_kernel)
        return GatedDeltaNet(self.lin(f, d["qkv"], d["gate"], d["beta"], d["alpha"]), self.lin(f, d["out"]),
                             torch.from_numpy(conv.copy()), self.vec(f, d["dt_bias"]), self.vec(f, d["a"]),
                             self.vec(f, d["norm"]), c.k_heads, c.v_heads, c.dk, c.dv, c.norm_eps)

    def moe(self, f: GGUFFile, i: int) -> MoE:
        c, m = self.cfg, {k: n.blk(i, v) for k, v in n.MOE.items()}
        layout = self.plan.layout
        mine = layout.experts(c.n_experts) if layout is not None else None
        experts = ExpertStore(f.tensor(m["gate_exps"]), f.tensor(m["up_exps"]), f.tensor(m["down_exps"]),
                              self.dtype, self.device, self.budget, kernels=self.kernels,
                              experts=mine, top_k=c.top_k, **self.plan.experts.store_kwargs())
        # the routers first (llama-quantize leaves both unquantized: one matmul), the shared
        # expert's gate and up after them
        proj = self.lin(f, m["router"], m["shexp_router"], m["shexp_gate"], m["shexp_up"])
        moe = MoE(proj, experts, c.n_experts, c.top_k, c.shared_dim, self.lin(f, m["shexp_down"]))
        if layout is not None and layout.ep > 1:
            moe.shard(dist.ExpertShare(dist.comm(), mine, f"layer {i}'s experts"))
        return moe

    def ple_table(self, g: GGUFFile):
        choice = self.plan.ple
        if choice is None:
            raise GGUFError(f"{g.path}: the model has PLE layers {list(self.cfg.ple_layers)} but the file holds "
                            f"no {n.PLE_TABLE!r}; pass the file that does with --ple-gguf")
        if choice.mode is None:
            return InMemoryTable(g.tensor(n.PLE_TABLE), self.device, self.kernels, host=choice.host)
        from strata.storage.ple import PleTable
        table = PleTable(choice.source, choice.mode, depth=choice.depth, prefetch=choice.prefetch)
        hints = "hints on" if table.hinting else "no hints"
        lock = ", locked" if table.locked else (", unlocked" if choice.mode == "ram" else "")
        io.log(f"strata: PLE table opened: {choice.mode}, {hints}{lock}")
        return StoredTable(table, self.device, self.kernels)  # gathered where the model computes

    def ple(self, g: GGUFFile, i: int) -> NgramPLE:
        c, p = self.cfg, {k: n.blk(i, v) for k, v in n.PLE.items()}
        if not c.recurrent[i]:
            raise GGUFError(f"{g.path}: PLE layer {i} is not a linear-attention layer")
        conv = g.tensor(p["conv"]).numpy().reshape(-1, c.ple["conv_kernel"])
        hash_args = {k: c.ple[k] for k in ("multipliers", "head_vocab_sizes", "head_offsets", "eos_id",
                                            "heads_per_ngram")}
        return NgramPLE(self.ple_table(g), hash_args, self.lin(g, p["key"]), self.lin(g, p["value"]),
                        self.vec(g, p["norm_key"]), self.vec(g, p["norm_query"]), self.vec(g, p["norm_conv"]),
                        torch.from_numpy(conv.copy()), c.streams, c.norm_eps, dilation=len(c.ple["multipliers"]))

    def layer(self, f: GGUFFile, i: int, ratio: int) -> Layer:
        # built in the order the layer runs: the DenseBudget goes to the first comers
        mixer = self.deltanet(f, i) if i < self.cfg.n_layers and self.cfg.recurrent[i] else \
            self.attention(f, i, ratio)
        ple = self.ple(f, i) if i in self.cfg.ple_layers else None
        return Layer(mixer, self.hc(f, n.blk(i, "hc_attn"), True), self.moe(f, i),
                     self.hc(f, n.blk(i, "hc_ffn"), True), ple)

    def mtp(self, g: GGUFFile) -> tuple[MTPHead | None, object]:
        """The MTP head (the speculative draft): its block follows the last layer
        (blk.<n_layers>), in the file itself or in the sidecar `strata convert` writes."""
        i = self.cfg.n_layers
        for f in (g, sidecar(g)):
            if f is None or n.blk(i, n.MTP["eh_proj"]) not in f.tensors:
                continue
            ratios = f.get(f"{n.ARCH}.attention.compress_ratios") or []
            block = self.layer(f, i, int(ratios[i]) if len(ratios) > i else 0)
            m = {k: n.blk(i, v) for k, v in n.MTP.items()}
            return MTPHead(self.lin(f, m["eh_proj"]), self.vec(f, m["enorm"]), self.vec(f, m["hnorm"]),
                           self.vec(f, m["head_norm"]), block), f.path
        return None, None


def build(plan) -> Qwen4Exp:
    """The model as `plan` says; under --ep/--pp (plan.layout) the layers and experts of
    this rank alone, with the output head on the last stage only."""
    g = plan.gguf
    cfg = Qwen4ExpConfig.from_gguf(g)
    ld = _Loader(plan, cfg)
    layout = plan.layout
    mine = layout.layers(cfg.n_layers) if layout is not None else range(cfg.n_layers)
    layers = [ld.layer(g, i, cfg.compress_ratios[i] if i < len(cfg.compress_ratios) else 0) for i in mine]
    mtp, mtp_file = ld.mtp(g) if layout is None or layout.pp == 1 else (None, None)
    last = layout is None or layout.last
    out_hc, output = (ld.hc(g, n.OUTPUT_HC, False), ld.lin(g, n.OUTPUT)) if last else (None, None)
    embedding = g.tensor(n.TOKEN_EMBD)
    # its rows are read a token at a time from the mapping: a fault would otherwise read the
    # disk's readahead window around the row (read_ahead_kb 8192 made a decoded token of
    # flash-shape read 8 MiB of embedding for its 1100-byte row: 96 MB a token, not 88)
    io.advise_random(embedding.data)
    model = Qwen4Exp(g, cfg, embedding, layers, out_hc, output, plan.dtype, plan.device,
                     plan.kernels, mtp, mtp_file, ld.qsa_fallback, kv=plan.kv)
    if layout is not None and layout.pp > 1:
        model.pipe = dist.Pipe(dist.comm())
    return model
