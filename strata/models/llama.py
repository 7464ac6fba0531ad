"""The dense `llama` architecture (SmolLM2 and kin), composed from strata.nn modules.

The math is Hugging Face's LlamaForCausalLM. llama.cpp's converter stores the Q and K
rows of each head interleaved for its RoPE layout; here they are put back in Hugging Face
order at load (`_unpermute`), so that RoPE is the rotate-half form.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from strata.gguf import GGUFFile
from strata.nn import Attention, KVCache, QuantLinear, RMSNorm, Rope
from strata.nn.linear import DenseBudget
from strata.runtime import graphs
from triton_kernels.backend import choose_kernels
from triton_kernels.dequant import dequantize_torch
from triton_kernels.ops import impl


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    norm_eps: float
    vocab_size: int
    context_length: int

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaConfig":
        a = g.arch
        dim = int(g.require(f"{a}.embedding_length"))
        n_heads = int(g.require(f"{a}.attention.head_count"))
        head_dim = dim // n_heads
        return cls(
            n_layers=int(g.require(f"{a}.block_count")), dim=dim,
            ffn_dim=int(g.require(f"{a}.feed_forward_length")), n_heads=n_heads,
            n_kv_heads=int(g.get(f"{a}.attention.head_count_kv", n_heads)), head_dim=head_dim,
            rope_dim=int(g.get(f"{a}.rope.dimension_count", head_dim)),
            rope_theta=float(g.get(f"{a}.rope.freq_base", 10000.0)),
            norm_eps=float(g.require(f"{a}.attention.layer_norm_rms_epsilon")),
            vocab_size=int(g.get(f"{a}.vocab_size", g.tensor("token_embd.weight").shape[0])),
            context_length=int(g.get(f"{a}.context_length", 4096)))


def _unpermute(n_heads: int, rows: int) -> np.ndarray:
    """Row order that undoes llama.cpp's permute(): its row h*D + 2i + s holds Hugging
    Face's row h*D + s*D/2 + i."""
    d = rows // n_heads
    h, s, i = np.meshgrid(np.arange(n_heads), np.arange(2), np.arange(d // 2), indexing="ij")
    return (h * d + 2 * i + s).reshape(-1)


class Block(torch.nn.Module):
    def __init__(self, g: GGUFFile, i: int, cfg: LlamaConfig, rope: Rope, dtype, device, budget, kernels):
        super().__init__()
        t = lambda n: g.tensor(f"blk.{i}.{n}.weight")  # noqa: E731
        lin = lambda w, **kw: QuantLinear(w, dtype, device, budget=budget, kernels=kernels, **kw)  # noqa: E731
        self.attn_norm = RMSNorm(torch.from_numpy(t("attn_norm").numpy()), cfg.norm_eps)
        self.ffn_norm = RMSNorm(torch.from_numpy(t("ffn_norm").numpy()), cfg.norm_eps)
        qkv = lin([t("attn_q"), t("attn_k"), t("attn_v")],
                  rows=[_unpermute(cfg.n_heads, cfg.dim),
                        _unpermute(cfg.n_kv_heads, cfg.n_kv_heads * cfg.head_dim), None])
        self.attn = Attention(i, qkv, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, rope, lin(t("attn_output")))
        self.gate_up = lin([t("ffn_gate"), t("ffn_up")])
        self.down = lin(t("ffn_down"))
        self.ffn_dim = cfg.ffn_dim

    def forward(self, x: torch.Tensor, segments: list[tuple[KVCache, int, int]]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), segments)
        gate, up = self.gate_up(self.ffn_norm(x)).split(self.ffn_dim, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(torch.nn.Module):
    def __init__(self, g: GGUFFile, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 budget: DenseBudget | None = None, kernels: str | None = None):
        """`kernels`: "triton" or "torch" for every op (None: the device's default, see
        triton_kernels.backend.choose_kernels)."""
        super().__init__()
        self.gguf, self.cfg, self.dtype, self.device = g, LlamaConfig.from_gguf(g), dtype, torch.device(device)
        self.kernels = kernels = choose_kernels(kernels, device)
        cfg = self.cfg
        self.budget = budget = budget or DenseBudget()
        self.embedding = g.tensor("token_embd.weight")
        rope = Rope(cfg.rope_dim, cfg.rope_theta, max_pos=min(cfg.context_length, 8192))
        self.blocks = torch.nn.ModuleList(Block(g, i, cfg, rope, dtype, device, budget, kernels)
                                          for i in range(cfg.n_layers))
        self.norm = RMSNorm(torch.from_numpy(g.tensor("output_norm.weight").numpy()), cfg.norm_eps)
        out = g.tensors.get("output.weight", self.embedding)  # none in the file: tied
        self.output = QuantLinear(out, dtype, device, budget=budget, kernels=kernels)
        self.tied = "output.weight" not in g.tensors
        self.to(self.device)  # norms and RoPE tables (the weights went to `device` as loaded)

    def plan_line(self) -> str:
        """One line: what the model is and where/how its weights are held."""
        from collections import Counter
        g, c = self.gguf, self.cfg
        n_weights = sum(int(np.prod(t.shape)) for t in g.tensors.values())
        file_mib = sum(t.nbytes for t in g.tensors.values()) / 2**20
        fmts = Counter(t.fmt.name for t in g.tensors.values())
        held: dict[str, list] = {}
        for m in self.modules():
            if isinstance(m, QuantLinear):
                h = held.setdefault(m.mode, [0, 0])
                h[0] += 1
                h[1] += m.held_bytes()
        how = ", ".join(f"{k} {n} ({b / 2**20:.0f} MiB)" for k, (n, b) in sorted(held.items()))
        return (f"{g.get('general.name', g.path.name)} ({g.arch}, {c.n_layers} layers, dim {c.dim}, "
                f"{n_weights / 1e6:.1f}M weights in {file_mib:.0f} MiB: "
                + ", ".join(f"{k} x{v}" for k, v in fmts.most_common())
                + f"{', output tied to token_embd' if self.tied else ''}) on {self.device}, "
                f"{self.kernels} kernels, {str(self.dtype).replace('torch.', '')}, "
                f"{torch.get_num_threads()} threads; "
                f"matmuls: {how}")

    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32, self.device, capacity)

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of token ids held on the model's device, gathered there (the decode
        graph's embedding: no trip to the host). The table's blocks go to the device once,
        or are the tied output's when it holds them already."""
        if getattr(self, "_embedding_blocks", None) is None:
            held = getattr(self.output, "blocks", None) if self.tied else None
            self._embedding_blocks = held if held is not None and held.device == self.device \
                else torch.from_numpy(np.array(self.embedding.data)).to(self.device)  # a copy: the map is read-only
        rows = self._embedding_blocks[tokens]
        return impl("dequantize", self.kernels)(rows, self.embedding.fmt).reshape(tokens.numel(), -1).float()

    def rope_table(self, n: int) -> None:
        """RoPE rows for positions up to n (a decode graph reads them by device index)."""
        rope = self.blocks[0].attn.rope
        if rope.cos.shape[0] < n:
            rope._table(n)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.embedding.shape[0]:
            raise ValueError(f"token ids must lie in 0..{self.embedding.shape[0] - 1}")
        rows = torch.from_numpy(np.take(self.embedding.data, tokens.numpy(), axis=0))  # those rows only
        return dequantize_torch(rows, self.embedding.fmt).to(self.device)

    @torch.inference_mode()
    def forward(self, tokens, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Logits (S, vocab) float32 for tokens that continue the cache's sequence. On
        CUDA a one-token step replays the cache's decode graph (strata.runtime.graphs)."""
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if toks.numel() == 1 and self.device.type == "cuda" and graphs.enabled():
            cache.reserve(cache.length + 1)
            g = getattr(cache, "graph", None)
            if g is None or g.capacity != cache.k.shape[2]:  # new, or the cache grew: capture again
                g = cache.graph = graphs.DecodeGraph(self, cache)
            return g(int(toks[0]))
        return self.forward_batch([(tokens, cache)], last_only=last_only)[0]

    @torch.inference_mode()
    def forward_batch(self, items: list[tuple[list[int], KVCache]], last_only: bool = True) -> list[torch.Tensor]:
        """Several sequences in one pass, each (tokens, cache) continuing at its cache's end.
        The matmuls see all rows at once; a row's result does not depend on its neighbours
        (each output row is its own dot products), so batching changes no value."""
        toks = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t, _ in items]
        segments = []
        for t, (_, cache) in zip(toks, items):
            cache.reserve(cache.length + t.numel())
            segments.append((cache, cache.length, t.numel()))
        x = self.embed(torch.cat(toks))
        for block in self.blocks:
            x = block(x, segments)
        outs, row = [], 0
        for cache, start, n in segments:
            cache.length = start + n
            outs.append(x[row + n - 1:row + n] if last_only else x[row:row + n])
            row += n
        logits = self.output(self.norm(torch.cat(outs)))
        sizes = [o.shape[0] for o in outs]
        return list(logits.split(sizes))
