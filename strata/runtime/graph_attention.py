"""The attention layers of Flash-Next's decode graph step (strata.runtime.graphs_qwen4exp,
whose module says what a graph fixes): keys, values and indexer keys written at device
positions into buffers of the graph's capacity, QSA's block keys pooled there, and the
attention over them.

With the Triton kernels and a float cache, a layer's inputs take one launch
(triton_kernels.attention_rows: q and k normed and roped, the rows stored, the block keys
pooled, the indexer queries normed and roped), then the scores, the choice of blocks
(triton_kernels.qsa_select: select_sorted's blocks in one launch), the attention and the
output projection. An int8 cache (its rows need their scales) and torch's kernels run the
same steps op by op.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from strata.nn import kv
from strata.nn.gated_attention import AttentionState, output, project
from triton_kernels import invariant
from triton_kernels.ops import impl
from triton_kernels.qsa import select_sorted


def attention(m, a: torch.Tensor, st: AttentionState, at: "Where") -> torch.Tensor:
    """The gated attention of rows a (T, dim) at the device positions at.P (T,), the
    state's buffers written in place."""
    sparse = m.qsa and not m.dense_only
    q, qi, gate = _inputs(m, a, st, at, sparse)
    product = None
    if sparse:
        # a dp4a output projection's input gated in the attention's launch (sigmoid_mul's)
        if m.kernels == "triton" and m.o.product_apart(q.shape[1]):
            out = product = _sparse(m, q, qi, st, at, gate)
        else:
            out = _sparse(m, q, qi, st, at)
    else:
        scales = st.kv_scales()
        keys = _rows(st._k, None if scales is None else scales[0])
        vals = _rows(st._v, None if scales is None else scales[1])
        T = q.shape[1]
        out = _rowwise(q, keys.expand(T, *keys.shape), vals.expand(T, *vals.shape), at.causal)
    return output(m.o, out, gate, m.kernels, product)


def keys(m, a: torch.Tensor, st: AttentionState, at: "Where") -> None:
    """Only the keys, values and indexer keys of rows a written (the MTP block's, which a
    draft attends to; MTPHead.keys)."""
    _inputs(m, a, st, at, False)


def _inputs(m, a: torch.Tensor, st: AttentionState, at: "Where", pool: bool):
    """(q (H, T, D) normed and roped, with `pool` the indexer's queries normed and roped
    (n_idx, T, d), else None, the output gate (T, H*D)): the keys, values and indexer keys
    stored at at.P, and with `pool` each position's block key pooled (see the module)."""
    parts = m.proj.outputs(a)
    if m.kernels == "triton" and st.kind != "int8":
        return m.stored_inputs(parts, st, *at.rope_args("triton"), queries=pool, pool=pool)
    q, k, v, idx_q, idx_k, gate = project(parts, *m.project_args(), *at.rope_args(m.kernels))
    _write_rows(m, st, k, v, idx_k, at.P)
    if not pool:
        return q, None, gate
    impl("qsa_pool", m.kernels)(st._idx, st._is, at.P, m.ratio, m.idx_k_norm, m.eps, m.rope.cos, m.rope.sin,
                                st._blocks)
    qi = idx_q.reshape(q.shape[1], m.n_idx, m.idx_dim)
    return q, impl("norm_rope", m.kernels)(qi, m.idx_q_norm, m.eps, *at.rope_args(m.kernels)), gate


def _sparse(m, q, qi, st: AttentionState, at: "Where", gate=None) -> torch.Tensor:
    """QSA for the step's queries q, their indexer queries qi (n_idx, T, d): (H, T, D) (see
    graphs_qwen4exp); with `gate`, which the Triton kernels alone take, the output
    projection's gated input rows instead (qsa_attention(gate=))."""
    T, keep = q.shape[1], min(m.budget // m.ratio, st._blocks.shape[0])
    blocks = st._blocks                                                          # (NB, d)
    if m.kernels == "triton":
        return _sparse_kernels(m, q, qi, blocks, keep, st, at, gate)
    if invariant.enabled():
        scores = invariant.scores(qi, blocks)
    else:
        scores = (qi.float() @ blocks.T).relu().sum(dim=0)                      # (T, NB)
    unseen, block_rows, tail_at, tail_ok = at.choice
    scores = (scores / math.sqrt(m.idx_dim)).masked_fill(unseen, float("-inf"))
    best, sel = select_sorted(scores, keep)                                      # (T, keep)
    tokens = torch.cat([block_rows[sel].reshape(T, -1), tail_at], dim=1)        # (T, S)
    chosen = (best > float("-inf"))[:, :, None].expand(T, keep, m.ratio).reshape(T, -1)
    ok = torch.cat([chosen, tail_ok], dim=1)
    scales = st.kv_scales()
    k = _rows(st._k[:, tokens], None if scales is None else scales[0][:, tokens])  # (Hkv, T, S, D)
    v = _rows(st._v[:, tokens], None if scales is None else scales[1][:, tokens])
    return _rowwise(q, k.transpose(0, 1), v.transpose(0, 1), ok)


def _write_rows(m, st: AttentionState, k: torch.Tensor, v: torch.Tensor, idx_k: torch.Tensor | None,
                at: torch.Tensor) -> None:
    """Keys, values and indexer keys stored at positions `at` where no Triton launch stores
    them (`_inputs`), a buffer at a time (int8 rows with their scales)."""
    _write(st, "k", k, at)
    _write(st, "v", v, at)
    if idx_k is not None:
        _write(st, "idx", idx_k, at)


def _write(st: AttentionState, name: str, x: torch.Tensor, at: torch.Tensor) -> None:
    """Rows x (..., T, d) stored at positions `at` (T,) of buffer `name` (k, v, idx)."""
    data, scale = kv.encode(x, st.kind)
    buf = st._idx if name == "idx" else getattr(st, "_" + name)
    buf.index_copy_(buf.dim() - 2, at, data)
    if scale is not None:
        s = st._is if name == "idx" else getattr(st, f"_{name}s")
        s.index_copy_(s.dim() - 2, at, scale)


def _rows(data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return data.float() if scale is None else kv.decode(data, scale)


class Where:
    """What every attention layer of a step reads at the step's positions P (T,), computed
    once a step for each (RoPE table, QSA block size, capacity): RoPE's rows, the causal
    mask over the capacity, and QSA's indices (see the module)."""

    def __init__(self, P: torch.Tensor, rope, ratio: int, capacity: int, nb: int = 0):
        self.rope, self.P, self.C, self.ratio, self.nb = rope, P, capacity, ratio, nb

    def rope_args(self, kernels: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(cos, sin, pos) for the norm-rope ops: the Triton kernels read the tables' rows at
        P themselves (no gather launched); torch's take the rows, gathered once a step."""
        if kernels == "triton":
            return self.rope.cos, self.rope.sin, self.P
        return (*self._rows, None)

    @functools.cached_property
    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.cos[self.P], self.rope.sin[self.P]

    @functools.cached_property
    def choice(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What torch's QSA gathers by (the kernels find it themselves): (unseen (T, NB),
        the blocks' rows (NB, r), the open tail's rows (T, r) and which of them are live)."""
        P, r, dev = self.P, self.ratio, self.P.device
        span = torch.arange(r, device=dev)
        seen = (P + 1) // r                                                      # complete blocks a query sees
        unseen = torch.arange(self.nb, device=dev)[None, :] >= seen[:, None]
        block_rows = (torch.arange(self.nb, device=dev)[:, None] * r + span).clamp(max=self.C - 1)
        tail = seen[:, None] * r + span
        return unseen, block_rows, tail.clamp(max=self.C - 1), tail <= P[:, None]

    @functools.cached_property
    def causal(self) -> torch.Tensor:
        """(T, C): True where a query attends (its position and those before)."""
        return torch.arange(self.C, device=self.P.device)[None, :] <= self.P[:, None]


def _sparse_kernels(m, q, qi, blocks, keep: int, st: AttentionState, at: Where, gate=None) -> torch.Tensor:
    """_sparse's scores and attention with the QSA kernels (triton_kernels.qsa), which read
    the first position from the device: the scores (-inf past each query's visible blocks)
    in one launch, and the chosen blocks' and the tail's rows gathered inside the
    attention's, which counts a block the query cannot see yet (sorted last) as none. A
    query's sums are its own program's, whatever T: batch-invariant as they stand."""
    start = at.P[:1]
    scores = impl("qsa_scores", "triton")(qi, blocks, start, m.ratio)          # (T, NB)
    sel = impl("qsa_select", "triton")(scores, keep)                             # select_sorted's, one launch
    scales = st.kv_scales()
    return impl("qsa_attention", "triton")(q, *st.kv_cache(), sel, start, m.ratio, gate=gate,
                                           **({} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}))


def _rowwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Attention of queries q (H, T, D), query t over its own keys and values k[t], v[t]
    (Hkv, S, D) where ok[t] (S,): (H, T, D). Batch-invariant mode runs the queries one by
    one, each by the very ops of a one-token step (a verify's row is that step's, bit for
    bit); otherwise in one call."""
    if invariant.enabled() and q.shape[1] > 1:
        return torch.cat([_rowwise(q[:, t:t + 1], k[t:t + 1], v[t:t + 1], ok[t:t + 1])
                          for t in range(q.shape[1])], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(2), k, v, attn_mask=ok[:, None, None, :],
                                         enable_gqa=True)  # (T, H, 1, D)
    return out[:, :, 0].transpose(0, 1)


def where_of(cache: dict, P: torch.Tensor, m, st: AttentionState, pool: bool) -> "Where":
    """The step's Where for layer m (one a RoPE table, block size and capacity, kept in `cache`)."""
    ratio = m.ratio if pool and m.qsa and not m.dense_only else 0
    C, nb = st._k.shape[1], st._blocks.shape[0] if ratio else 0
    key = (id(m.rope), ratio, C, nb)
    if key not in cache:
        cache[key] = Where(P, m.rope, ratio, C, nb)
    return cache[key]
