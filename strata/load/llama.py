"""The `llama` architecture's loader: strata.models.llama's modules from GGUF names
(strata.names.llama), as a LoadPlan says."""
from __future__ import annotations

import numpy as np
import torch

from strata.models.llama import Block, Llama, LlamaConfig
from strata.names import llama as n
from strata.nn import Attention, QuantLinear, RMSNorm, Rope
from strata.nn.linear import DenseBudget


def _unpermute(n_heads: int, rows: int) -> np.ndarray:
    """Row order that undoes llama.cpp's permute(): its row h*D + 2i + s holds Hugging
    Face's row h*D + s*D/2 + i (RoPE's rotate-half layout)."""
    d = rows // n_heads
    h, s, i = np.meshgrid(np.arange(n_heads), np.arange(2), np.arange(d // 2), indexing="ij")
    return (h * d + 2 * i + s).reshape(-1)


def build(plan) -> Llama:
    g, dtype, device, kernels = plan.gguf, plan.dtype, plan.device, plan.kernels
    cfg = LlamaConfig.from_gguf(g)
    budget = DenseBudget()
    lin = lambda w, **kw: QuantLinear(w, dtype, device, budget=budget, kernels=kernels, **kw)  # noqa: E731
    norm = lambda name: RMSNorm(torch.from_numpy(g.tensor(name).numpy()), cfg.norm_eps)  # noqa: E731
    rope = Rope(cfg.rope_dim, cfg.rope_theta, max_pos=min(plan.context, 8192), scaling=plan.rope)
    blocks = []
    for i in range(cfg.n_layers):
        t = lambda name: g.tensor(n.blk(i, name))  # noqa: E731
        qkv = lin([t(n.ATTN_Q), t(n.ATTN_K), t(n.ATTN_V)],
                  rows=[_unpermute(cfg.n_heads, cfg.dim), _unpermute(cfg.n_kv_heads, cfg.n_kv_heads * cfg.head_dim),
                        None])
        attn = Attention(i, qkv, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, rope, lin(t(n.ATTN_OUT)))
        blocks.append(Block(norm(n.blk(i, n.ATTN_NORM)), attn, norm(n.blk(i, n.FFN_NORM)),
                            lin([t(n.FFN_GATE), t(n.FFN_UP)]), lin(t(n.FFN_DOWN)), cfg.ffn_dim))
    embedding = g.tensor(n.TOKEN_EMBD)
    tied = n.OUTPUT not in g.tensors  # no output in the file: it is the embedding
    output = lin(g.tensors.get(n.OUTPUT, embedding))
    return Llama(g, cfg, embedding, blocks, norm(n.OUTPUT_NORM), output, tied, dtype, device, kernels,
                 kv=plan.kv)
