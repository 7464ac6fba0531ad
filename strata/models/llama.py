"""The dense `llama` architecture (SmolLM2 and kin), composed from strata.nn modules.

The math is Hugging Face's LlamaForCausalLM, with RoPE in the rotate-half form (the
loader, strata.load.llama, puts llama.cpp's interleaved Q and K rows back in Hugging
Face's order).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from strata.gguf import GGUFFile
from strata.models import summary
from strata.names import TOKEN_EMBD
from strata.nn import Attention, KVCache, QuantLinear, RMSNorm, kv
from strata.tensors import QTensor, module_to
from strata.runtime import cpu_step, graphs
from triton_kernels.backend import to_device
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
            vocab_size=int(g.get(f"{a}.vocab_size", g.tensor(TOKEN_EMBD).shape[0])),
            context_length=int(g.get(f"{a}.context_length", 4096)))


class Block(torch.nn.Module):
    def __init__(self, attn_norm: RMSNorm, attn: Attention, ffn_norm: RMSNorm, gate_up: QuantLinear,
                 down: QuantLinear, ffn_dim: int):
        """`gate_up`: the gate and up projections fused (2 x ffn_dim rows)."""
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm = attn_norm, attn, ffn_norm
        self.gate_up, self.down, self.ffn_dim = gate_up, down, ffn_dim

    def forward(self, x: torch.Tensor, segments: list[tuple[KVCache, int, int]]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), segments)
        gate, up = self.gate_up(self.ffn_norm(x)).split(self.ffn_dim, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(torch.nn.Module):
    def __init__(self, g: GGUFFile, cfg: LlamaConfig, embedding: QTensor, blocks: list[Block], norm: RMSNorm,
                 output: QuantLinear, tied: bool, dtype: torch.dtype, device: str, kernels: str,
                 kv: str = "f32"):
        """Built by strata.load.llama from a GGUF file `g`; `embedding` stays the file's
        blocks (rows are gathered as tokens come); `kernels`: "triton" or "torch", the
        implementation every op takes (triton_kernels.ops); `kv`: how the KV cache stores
        keys and values (strata.nn.kv)."""
        super().__init__()
        self.gguf, self.cfg, self.dtype, self.device = g, cfg, dtype, torch.device(device)
        self.kv = kv
        self.kernels, self.embedding, self.tied = kernels, embedding, tied
        self.blocks = torch.nn.ModuleList(blocks)
        self.norm, self.output = norm, output
        module_to(self, self.device)  # norms and RoPE tables (the weights went to `device` as loaded)

    def plan_line(self) -> str:
        """One line: what the model is and where/how its weights are held."""
        g, c = self.gguf, self.cfg
        held: dict[str, list] = {}
        for m in self.modules():
            if isinstance(m, QuantLinear):
                h = held.setdefault(m.mode, [0, 0])
                h[0] += 1
                h[1] += m.held_bytes()
        how = ", ".join(f"{k} {n} ({b / 2**20:.0f} MiB)" for k, (n, b) in sorted(held.items()))
        return (f"{summary.name(g)} ({g.arch}, {c.n_layers} layers, dim {c.dim}, {summary.file_summary(g)}"
                f"{', output tied to token_embd' if self.tied else ''}) {summary.run_summary(self)}, "
                f"{summary.kv_summary(self)}; "
                f"matmuls: {how}")

    def warm_compile(self) -> bool:
        """Build the CPU's compiled decode step on a scratch cache (strata.runtime.background)."""
        return cpu_step.warm(self)

    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, device=self.device, capacity=capacity, kind=self.kv)

    def kv_bytes_per_token(self, kind: str | None = None) -> int:
        """KV-cache bytes a token adds, stored as `kind` (default: this model's)."""
        c = self.cfg
        return 2 * c.n_layers * c.n_kv_heads * kv.row_bytes(kind or self.kv, c.head_dim)

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of token ids held on the model's device, gathered there (the decode
        graph's embedding: no trip to the host). The table's blocks go to the device once,
        or are the tied output's when it holds them already."""
        if getattr(self, "_embedding_blocks", None) is None:
            held = getattr(self.output, "blocks", None) if self.tied else None
            self._embedding_blocks = held if held is not None and held.device == self.device \
                else to_device(torch.from_numpy(np.array(self.embedding.data)), self.device)  # a copy: the map is read-only
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
        return to_device(dequantize_torch(rows, self.embedding.fmt), self.device)

    @torch.inference_mode()
    def forward(self, tokens, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Logits (S, vocab) float32 for tokens that continue the cache's sequence. On
        CUDA a one-token step replays the cache's decode graph (strata.runtime.graphs); on
        the CPU it runs the compiled step (strata.runtime.cpu_step)."""
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if toks.numel() == 1 and self.device.type == "cuda" and graphs.enabled():
            cache.reserve(cache.length + 1)
            g = getattr(cache, "graph", None)
            if g is None or g.capacity != cache.k.shape[2]:  # new, or the cache grew: capture again
                g = cache.graph = graphs.DecodeGraph(self, cache)
            return g(int(toks[0]))
        if toks.numel() == 1 and self.device.type == "cpu":
            out = cpu_step.decode(self, int(toks[0]), cache)
            if out is not None:
                return out
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
