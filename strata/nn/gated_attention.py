"""Gated full attention with the QSA block indexer (Flash-Next's every-4th layer).

Attention: q_proj yields, per head, the query and a gate (head_dim each, in that order);
q and k are RMS-normed per head (weights hold 1 + w), partial RoPE (rotate-half on the
first `rope.dim` dims), grouped-query softmax attention, output times sigmoid(gate).

QSA (query-sparse attention): an indexer projects each token to `n_idx` query heads and
one key (idx_dim each). Keys are averaged over consecutive blocks of `ratio` tokens, normed
and roped at the block's first position. A query scores every complete block visible to
it as sum over its heads of relu(q . k_block) / sqrt(idx_dim), keeps the `budget / ratio`
best blocks plus the tokens of the incomplete last block, and attends to those tokens
only. While a query sees no more complete blocks than it may keep, this is exactly dense
attention; `qsa=False` always attends densely (as llama.cpp does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import QuantLinear
from .rope import Rope


class AttentionState:
    """One layer's keys and values (kv_heads, n, head_dim) and raw indexer keys (n, idx_dim),
    in buffers that grow by doubling (a decode step appends one token without copying all)."""

    def __init__(self):
        self._k = self._v = self._idx = None
        self.n = 0

    @staticmethod
    def _grow(buf, new, n):
        need = n + new.shape[-2]
        if buf is None or buf.shape[-2] < need:
            shape = list(new.shape)
            shape[-2] = max(need, 2 * (buf.shape[-2] if buf is not None else 0), 64)
            grown = new.new_empty(shape)
            if buf is not None:
                grown[..., :n, :] = buf[..., :n, :]
            buf = grown
        buf[..., n:need, :] = new
        return buf

    def append(self, k, v, idx):
        n = self.n
        self._k, self._v = self._grow(self._k, k, n), self._grow(self._v, v, n)
        if idx is not None:
            self._idx = self._grow(self._idx, idx, n)
        self.n = n + k.shape[-2]

    @property
    def k(self):
        return None if self._k is None else self._k[..., :self.n, :]

    @property
    def v(self):
        return None if self._v is None else self._v[..., :self.n, :]

    @property
    def idx(self):
        return None if self._idx is None else self._idx[:self.n]

    def copy(self) -> "AttentionState":
        c = AttentionState()
        c._k, c._v, c._idx = (None if t is None else t.clone() for t in (self._k, self._v, self._idx))
        c.n = self.n
        return c


def _heads_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)


class GatedAttention(torch.nn.Module):
    def __init__(self, proj: QuantLinear, o: QuantLinear, q_norm, k_norm, n_heads: int, n_kv_heads: int,
                 head_dim: int, rope: Rope, eps: float, idx_q_norm=None, idx_k_norm=None, n_idx: int = 0,
                 idx_dim: int = 0, budget: int = 0, ratio: int = 0):
        """`proj` is the fused input projection: rows of q and gate (H*2D, per head q then
        gate), k (Hkv*D), v (Hkv*D), then, with an indexer, its queries (n_idx*idx_dim) and
        key (idx_dim)."""
        super().__init__()
        self.proj, self.o = proj, o
        p = (lambda t: torch.nn.Parameter(t.float(), requires_grad=False) if t is not None else None)
        self.q_norm, self.k_norm = p(q_norm), p(k_norm)
        self.idx_q_norm, self.idx_k_norm = p(idx_q_norm), p(idx_k_norm)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope, self.eps = rope, eps
        self.n_idx, self.idx_dim, self.budget, self.ratio = n_idx, idx_dim, budget, ratio
        self.qsa = n_idx > 0 and ratio > 0
        self.dense_only = False  # set by the model for `--qsa off`
        self.splits = [n_heads * 2 * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim]
        if n_idx:
            self.splits += [n_idx * idx_dim, idx_dim]

    def forward(self, x: torch.Tensor, st: AttentionState, start: int) -> torch.Tensor:
        T = x.shape[0]
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        dev = x.device
        pos = torch.arange(start, start + T)  # on the host: RoPE takes its rows from there
        parts = self.proj(x).float().split(self.splits, dim=-1)
        qg = parts[0].reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        q = self.rope(_heads_norm(q, self.q_norm, self.eps).transpose(0, 1), pos)     # (H, T, D)
        k = parts[1].reshape(T, Hkv, D)
        k = self.rope(_heads_norm(k, self.k_norm, self.eps).transpose(0, 1), pos)     # (Hkv, T, D)
        v = parts[2].reshape(T, Hkv, D).transpose(0, 1)
        st.append(k, v, parts[4] if self.n_idx else None)
        end = start + T
        mask = self._select(parts[3], st, start) if self.qsa and not self.dense_only else None
        if mask is None:
            mask = torch.ones(T, end, dtype=torch.bool, device=dev).tril(diagonal=start)
        out = F.scaled_dot_product_attention(q.unsqueeze(0), st.k.unsqueeze(0), st.v.unsqueeze(0),
                                             attn_mask=mask, enable_gqa=True)[0]
        out = out.transpose(0, 1).reshape(T, H * D) * torch.sigmoid(gate)
        return self.o(out)

    def _select(self, idx_q: torch.Tensor, st: AttentionState, start: int) -> torch.Tensor | None:
        """The boolean (T, start+T) mask of the tokens each query attends to, or None when
        every query keeps all its blocks (dense). idx_q: the indexer queries (T, n_idx*d)."""
        T, r = idx_q.shape[0], self.ratio
        end = start + T
        keep = self.budget // r
        if end // r <= keep:  # the last query sees the most complete blocks: end // r
            return None
        dev = idx_q.device
        pos = torch.arange(start, end, device=dev)
        n_blocks = (pos + 1) // r                       # complete blocks visible to each query
        nb = end // r
        blocks = st.idx[:nb * r].reshape(nb, r, self.idx_dim).mean(dim=1)
        blocks = self.rope(_heads_norm(blocks, self.idx_k_norm, self.eps).unsqueeze(0),
                           torch.arange(nb, device=dev) * r)[0]                          # (nb, d)
        qi = idx_q.reshape(T, self.n_idx, self.idx_dim)
        qi = self.rope(_heads_norm(qi, self.idx_q_norm, self.eps).transpose(0, 1), pos)  # (n_idx, T, d)
        scores = torch.relu(qi @ blocks.T).sum(dim=0) / self.idx_dim ** 0.5        # (T, nb)
        visible = torch.arange(nb, device=dev)[None, :] < n_blocks[:, None]
        chosen = visible.clone()                         # a query with few blocks keeps all
        # relu makes exact-zero scores common, so ties decide the choice: each query's
        # top-k runs over exactly its visible blocks, as the reference does, so that ties
        # break the same way (topk's order among equal values depends on the length)
        for t in (n_blocks > keep).nonzero().flatten().tolist():
            n = int(n_blocks[t])
            chosen[t, :n] = False
            chosen[t, scores[t, :n].topk(keep).indices] = True
        tok = torch.arange(end, device=dev)
        in_block = tok[None, :] < (n_blocks * r)[:, None]
        by_block = torch.zeros(T, end, dtype=torch.bool, device=dev)
        by_block[:, :nb * r] = chosen.repeat_interleave(r, dim=1)
        tail = ~in_block & (tok[None, :] <= pos[:, None])
        return (by_block & in_block) | tail
