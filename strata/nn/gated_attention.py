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

Cost: past the budget, a query's attention reads budget + ratio - 1 tokens whatever the
context (triton_kernels.qsa gathers them inside the attention); the indexer reads one
pooled key a block (ratio tokens). Pooled keys are kept in the state: the first forward
past the budget pools every complete block, each later one only the blocks it completes
(a decode step at most one).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from triton_kernels import invariant
from triton_kernels.ops import impl
from triton_kernels.qsa import select_blocks

from . import kv
from .linear import QuantLinear
from .mrope import Positions
from .rope import Rope, rotate


class AttentionState:
    """One layer's keys and values (kv_heads, n, head_dim), raw indexer keys (n, idx_dim) and
    the pooled indexer key of each complete block (n_blocks, idx_dim), in buffers that grow
    by doubling (a decode step appends one token without copying all).

    Every read and write of the K/V rows goes through `append`, `kv_cache` and the `k`/`v`
    views. `kind` (strata.nn.kv) is how K, V and the raw indexer keys are stored: f32, bf16,
    f16, or int8 codes with a bfloat16 scale per head and token (`_ks`, `_vs`, `_is`); the
    pooled block keys stay float32 (one a block)."""

    def __init__(self, kind: str = "f32"):
        self.kind = kv.check(kind)
        self._k = self._v = self._idx = self._blocks = None
        self._ks = self._vs = self._is = None
        self.n = 0
        self.n_blocks = 0  # pooled block keys held: they cover tokens [0, n_blocks * ratio)
        self._block_ratio = 0
        self._reserved = 0

    def reserve(self, n: int) -> None:
        """Size the buffers for n tokens when they next grow (a context of known length is
        allocated once, not copied at each doubling: 1 GiB for 128K tokens of flash-tiny)."""
        self._reserved = max(self._reserved, n)

    @staticmethod
    def _fit(buf, shape, dtype, device, need, n, reserved=0):
        """`buf` with room for `need` rows of `shape` (the rows' count aside), its first n rows
        kept: grown by doubling, or made."""
        if buf is None or buf.shape[-2] < need:
            shape = list(shape)
            shape[-2] = max(need, 2 * (buf.shape[-2] if buf is not None else 0), 64, reserved)
            grown = torch.empty(shape, dtype=dtype, device=device)
            if buf is not None:
                grown[..., :n, :] = buf[..., :n, :]
            buf = grown
        return buf

    @staticmethod
    def _grow(buf, new, n, reserved=0):
        need = n + new.shape[-2]
        buf = AttentionState._fit(buf, new.shape, new.dtype, new.device, need, n, reserved)
        buf[..., n:need, :] = new
        return buf

    def room(self, T: int, kv_heads: int, head_dim: int, idx_dim: int = 0, device=None) -> None:
        """Float buffers with room for T rows past the n held, unwritten: a kernel stores them
        in place (triton_kernels.attention_rows), and then they count (n += T)."""
        if self.kind == "int8":
            raise ValueError("an int8 cache's rows come with their scales: append them")
        n, store = self.n, kv.store_dtype(self.kind)
        for name, shape in (("_k", (kv_heads, T, head_dim)), ("_v", (kv_heads, T, head_dim)),
                            ("_idx", (T, idx_dim) if idx_dim else None)):
            if shape is not None:
                setattr(self, name, self._fit(getattr(self, name), shape, store, device, n + T, n, self._reserved))

    def append(self, k, v, idx):
        n, r = self.n, self._reserved
        for name, x in (("k", k), ("v", v), ("i", idx)):
            if x is None:
                continue
            data, scale = kv.encode(x, self.kind)
            buf = "_idx" if name == "i" else "_" + name
            setattr(self, buf, self._grow(getattr(self, buf), data, n, r))
            if scale is not None:
                setattr(self, f"_{name}s", self._grow(getattr(self, f"_{name}s"), scale, n, r))
        self.n = n + k.shape[-2]

    def hold(self, capacity: int, kv_heads: int, head_dim: int, idx_dim: int = 0, ratio: int = 0,
             device=None) -> None:
        """Buffers of exactly `capacity` rows (and capacity // ratio + 1 pooled block keys),
        the rows held kept and the rest zero: a decode graph reads the whole capacity,
        masked, and writes in place (a zero row under the mask adds nothing; garbage
        could be NaN, which a mask does not silence)."""
        if (self._held is not None and self._held is self._k and self._k.shape[-2] >= capacity
                and (not (idx_dim and ratio) or self._blocks.shape[0] > capacity // ratio)):
            return  # held already (a graph of another window shares the buffers)
        dev = device if device is not None else (self._k.device if self._k is not None else "cpu")
        store, n = kv.store_dtype(self.kind), self.n

        def sized(buf, shape, dtype, rows):
            new = torch.zeros(shape, dtype=dtype, device=dev)
            if buf is not None and rows:
                new[..., :rows, :] = buf[..., :rows, :]
            return new

        int8 = self.kind == "int8"
        for name, shape in (("k", (kv_heads, capacity, head_dim)), ("v", (kv_heads, capacity, head_dim)),
                            ("idx", (capacity, idx_dim) if idx_dim else None)):
            if shape is None:
                continue
            setattr(self, "_" + name, sized(getattr(self, "_" + name), shape, store, n))
            if int8:
                s = "_is" if name == "idx" else f"_{name}s"
                setattr(self, s, sized(getattr(self, s), (*shape[:-1], 1), kv.SCALE_DTYPE, n))
        if idx_dim and ratio:
            self._blocks = sized(self._blocks, (capacity // ratio + 1, idx_dim), torch.float32, self.n_blocks)
            self._block_ratio = ratio
        self._reserved = max(self._reserved, capacity)
        self._held = self._k

    _held = None  # the K buffer `hold` made (a buffer grown since is not held)

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens (drafted tokens rejected): the rows past n and
        every pooled block key that read them are dropped; the buffers stay allocated."""
        if not 0 <= n <= self.n:
            raise ValueError(f"an attention state of {self.n} tokens cannot be truncated to {n}")
        self.n = n
        if self._block_ratio * self.n_blocks > n:
            self.n_blocks = n // self._block_ratio

    def _rows(self, data, scale, a: int = 0, b: int | None = None):
        """Rows a..b (default: to n) as float32, or as stored for a float kind."""
        if data is None:
            return None
        b = self.n if b is None else b
        if self.kind != "int8":
            return data[..., a:b, :]
        return kv.decode(data[..., a:b, :], scale[..., a:b, :])

    @property
    def k(self):
        return self._rows(self._k, self._ks)

    @property
    def v(self):
        return self._rows(self._v, self._vs)

    @property
    def idx(self):
        return self._rows(self._idx, self._is)

    def idx_rows(self, a: int, b: int) -> torch.Tensor:
        """The raw indexer keys of tokens a..b (to pool a block)."""
        return self._rows(self._idx, self._is, a, b)

    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as stored, (kv_heads, capacity, head_dim) in the cache's dtype, for kernels
        that gather rows in place (rows from n on are spare capacity: a reader never asks for
        them). Whole buffers, not the `k`/`v` views: torch's index_select copies a
        non-contiguous view whole before it gathers (86 ms for 32K rows against 0.01 ms)."""
        return self._k, self._v

    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """int8: the scales of `kv_cache`'s rows, (kv_heads, capacity, 1) bfloat16; else None."""
        return (self._ks, self._vs) if self.kind == "int8" else None

    # -- the indexer's pooled block keys, kept as blocks complete --------------------------------

    def blocks(self, ratio: int) -> torch.Tensor | None:
        """The pooled keys of the first `n_blocks` blocks of `ratio` tokens."""
        if self.n_blocks and self._block_ratio != ratio:
            raise ValueError(f"this attention state pooled blocks of {self._block_ratio} tokens, not {ratio}")
        return None if self._blocks is None else self._blocks[:self.n_blocks]

    def add_blocks(self, pooled: torch.Tensor, ratio: int) -> None:
        """Append the pooled keys (m, idx_dim) of the blocks that follow the `n_blocks` held."""
        self._blocks = self._grow(self._blocks, pooled, self.n_blocks, self._reserved // ratio)
        self.n_blocks += pooled.shape[0]
        self._block_ratio = ratio

    def nbytes(self) -> int:
        """Bytes of the rows held for the n tokens (K, V, raw indexer keys, pooled block
        keys); the buffers' spare capacity (up to as much again) not counted."""
        ts = [None if t is None else t[..., :self.n, :] for t in (self._k, self._v, self._ks, self._vs)]
        ts += [None if t is None else t[:self.n] for t in (self._idx, self._is)]
        ts.append(self.blocks(self._block_ratio) if self.n_blocks else None)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def copy(self) -> "AttentionState":
        c = AttentionState(self.kind)
        c._k, c._v, c._idx, c._blocks = (None if t is None else t.clone()
                                         for t in (self._k, self._v, self._idx, self._blocks))
        c._ks, c._vs, c._is = (None if t is None else t.clone() for t in (self._ks, self._vs, self._is))
        c.n, c.n_blocks, c._block_ratio, c._reserved = self.n, self.n_blocks, self._block_ratio, self._reserved
        return c


def _heads_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, w.shape, w, eps)


def heads(parts: torch.Tensor | list[torch.Tensor], splits, n_heads: int, n_kv: int, head_dim: int):
    """The fused projection's rows (T, sum(splits)), or its weights' outputs apart
    (QuantLinear.outputs, float32), by head: q (T, H, D) and the output gate (T, H*D) from
    the per-head halves, k and v (T, Hkv, D), the indexer's queries (T, n_idx*d) and key
    (T, d) (None without an indexer). Views where the rows allow."""
    if isinstance(parts, torch.Tensor):
        parts = parts.split(splits, dim=-1)
    T = parts[0].shape[0]
    qg = parts[0].reshape(T, n_heads, 2 * head_dim)
    idx_q, idx_k = (parts[3], parts[4]) if len(parts) > 3 else (None, None)
    return (qg[..., :head_dim], qg[..., head_dim:].reshape(T, n_heads * head_dim),
            parts[1].reshape(T, n_kv, head_dim), parts[2].reshape(T, n_kv, head_dim), idx_q, idx_k)


def project(parts: torch.Tensor | list[torch.Tensor], splits, q_norm, k_norm, eps: float, n_heads: int, n_kv: int,
            head_dim: int, rope_dim: int, norm_rope, cos: torch.Tensor, sin: torch.Tensor,
            pos: torch.Tensor | None = None):
    """`heads`' rows as the attention's inputs: q (H, T, D) and k (Hkv, T, D) normed per head
    and roped by `cos`/`sin` (Rope._rows; with `pos`, tables the Triton op reads at those
    positions itself), v (Hkv, T, D), the indexer's queries (T, n_idx*d) and key (T, d)
    (None without an indexer), and the output gate (T, H*D). `norm_rope`: the Triton op
    that norms and ropes q and k in one launch (triton_kernels.rope.norm_rope2), or None
    for torch's ops. A function of tensors: a compiled decode step traces it too
    (strata.models.qwen4exp_step)."""
    q, gate, k, v, idx_q, idx_k = heads(parts, splits, n_heads, n_kv, head_dim)
    if norm_rope is not None:
        q, k = norm_rope(q, q_norm, k, k_norm, eps, cos, sin, pos)  # (H, T, D)
    else:
        if pos is not None:
            cos, sin = cos[pos], sin[pos]
        q = rotate(_heads_norm(q, q_norm, eps).transpose(0, 1), cos, sin, rope_dim)           # (H, T, D)
        k = rotate(_heads_norm(k, k_norm, eps).transpose(0, 1), cos, sin, rope_dim)
    return q, k, v.transpose(0, 1), idx_q, idx_k, gate


def finish(out: torch.Tensor, gate: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """The attention's output (H, T, D) as rows (T, H*D), gated: the output projection's input
    (with the Triton kernels the gate and product one launch, triton_kernels.shared_expert)."""
    rows = out.transpose(0, 1).reshape(gate.shape)
    if kernels == "triton":
        return impl("sigmoid_mul", "triton")(gate, rows.float())
    return rows * torch.sigmoid(gate)


def output(o, out: torch.Tensor | None, gate: torch.Tensor, kernels: str = "torch",
           product: torch.Tensor | None = None) -> torch.Tensor:
    """o(finish(out, gate, kernels)): with the Triton kernels the gate in the output
    projection's launch where its GEMV takes it (QuantLinear.gated). `product`: the gated
    rows as the attention's launch wrote them (qsa_attention(gate=)), out then unused."""
    if product is not None:
        return o.gated(gate, product, silu=False, product=product)
    if kernels == "triton":
        return o.gated(gate, out.transpose(0, 1).reshape(gate.shape).float(), silu=False)
    return o(finish(out, gate, kernels))


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
        self.kernels = proj.kernels
        # a dict to add the seconds of the indexer and of attention to (STRATA_DECODE_TIMING)
        self.clock: dict | None = None
        if self.qsa and budget < ratio:
            raise ValueError(f"QSA budget {budget} is less than one block of {ratio} tokens: "
                             "a query could attend to nothing")
        self.splits = [n_heads * 2 * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim]
        if n_idx:
            self.splits += [n_idx * idx_dim, idx_dim]

    def forward(self, x: torch.Tensor, st: AttentionState, start: int,
                positions: Positions | None = None) -> torch.Tensor:
        """x (T, dim) at token indices start..; `positions`: the sequence's M-RoPE positions
        where they are not the indices (an image is in it)."""
        T = x.shape[0]
        pos = self.positions(start, T, positions)
        parts = self.proj.outputs(x)
        if self.kernels == "triton" and st.kind != "int8" and pos.dim() == 1:
            # one launch: q and k normed and roped at their positions' rows of the tables, k,
            # v and the indexer key stored at their indices (triton_kernels.attention_rows)
            if st.n != start:
                raise RuntimeError(f"attention state holds {st.n} tokens, the step starts at {start}")
            st.room(T, self.n_kv_heads, self.head_dim, self.idx_dim if self.n_idx else 0, x.device)
            cos, sin, P = self.rope.tables(pos, x.device)
            # the cache rows at the token indices, apart from the RoPE positions after an image
            index = None if positions is None else torch.arange(start, start + T)
            slots = None if index is None or torch.equal(pos, index) else self.rope.on_device(index, x.device)
            q, qi, gate = self.stored_inputs(parts, st, cos, sin, P, queries=self.sparse(start, T), slots=slots)
            st.n += T  # (held once stored)
            out = self.attend_held(q, None, st, start, pos, positions, qi)
        else:
            cos, sin = self.rope._rows(pos, x.device)
            q, k, v, idx_q, idx_k, gate = project(parts, *self.project_args(), cos, sin)
            out = self.attend(q, k, v, idx_q, idx_k, st, start, pos, positions)
        return output(self.o, out, gate, self.kernels)

    def stored_inputs(self, parts, st: AttentionState, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                      queries: bool = False, pool: bool = False, slots: torch.Tensor | None = None):
        """(q (H, T, D) normed and roped, with `queries` the indexer's queries normed and roped
        (n_idx, T, d) else None, the output gate (T, H*D)) from the projection's outputs
        `parts`, in one launch that also stores k, v and the indexer key in the state's
        float buffers at `slots` (default: the positions pos, rows of the tables cos and
        sin, on the device) and with `pool` pools each position's block key
        (triton_kernels.attention_rows)."""
        q, gate, k, v, idx_q, idx_k = heads(parts, self.splits, self.n_heads, self.n_kv_heads, self.head_dim)
        idx = None if idx_k is None else (idx_q if queries else None, self.idx_q_norm, idx_k, st._idx)
        pooled = (self.ratio, self.idx_k_norm, st._blocks) if pool else None
        q, qi = impl("attention_rows", "triton")(q, self.q_norm, k, self.k_norm, v, self.eps, cos, sin, pos, st._k,
                                                 st._v, idx, pooled, slots=slots)
        return q, qi, gate

    @staticmethod
    def positions(start: int, T: int, positions: Positions | None = None) -> torch.Tensor:
        """The rotary positions of T tokens at start..: (T,), or (3, T) where an image is in
        the sequence (on the host: RoPE takes its rows from there)."""
        pos = positions.of(start, T) if positions is not None else None
        return torch.arange(start, start + T) if pos is None else pos

    def project_args(self) -> tuple:
        """`project`'s arguments between the projection and RoPE's rows."""
        return (self.splits, self.q_norm, self.k_norm, self.eps, self.n_heads, self.n_kv_heads,
                self.head_dim, self.rope.dim, impl("norm_rope2", "triton") if self.kernels == "triton" else None)

    def attend(self, q, k, v, idx_q, idx_k, st: AttentionState, start: int, pos: torch.Tensor,
               positions: Positions | None = None) -> torch.Tensor:
        """Append k, v (and the indexer's key) to the state and attend: (H, T, D)."""
        st.append(k, v, idx_k)
        return self.attend_held(q, idx_q, st, start, pos, positions)

    def sparse(self, start: int, T: int) -> bool:
        """Whether T queries at start.. attend to chosen blocks: past the budget, and within it
        as well in batch-invariant mode, where a query's sums must run in one order
        whatever the chunk (SDPA's differ)."""
        end = start + T
        return self.qsa and not self.dense_only and (end // self.ratio > self.budget // self.ratio
                                                     or invariant.enabled())

    def attend_held(self, q, idx_q, st: AttentionState, start: int, pos: torch.Tensor,
                    positions: Positions | None = None, qi: torch.Tensor | None = None) -> torch.Tensor:
        """Attend the T queries q (H, T, D) at start.. to the state, which holds their own
        keys already: (H, T, D). `qi`: the indexer's queries normed and roped (n_idx, T, d),
        where a launch made them (else made here from idx_q, the projection's rows)."""
        T = q.shape[1]
        dev = q.device
        end = start + T
        clock = self.clock
        t0 = _now(dev) if clock is not None else 0.0
        if self.sparse(start, T):
            sel = self._select(idx_q, st, start, pos, positions, qi)
            t1 = _now(dev) if clock is not None else 0.0
            scales = st.kv_scales()
            out = impl("qsa_attention", self.kernels)(q, *st.kv_cache(), sel, start, self.ratio,
                                                      **({} if scales is None else
                                                         {"k_scale": scales[0], "v_scale": scales[1]}))
        else:
            # every query keeps all its blocks (or QSA is off): dense causal attention
            t1 = t0
            mask = None if T == 1 else torch.ones(T, end, dtype=torch.bool, device=dev).tril(diagonal=start)
            out = F.scaled_dot_product_attention(q.unsqueeze(0), st.k.float().unsqueeze(0),
                                                 st.v.float().unsqueeze(0), attn_mask=mask, enable_gqa=True)[0]
        if clock is not None:
            t2 = _now(dev)
            clock["indexer"] = clock.get("indexer", 0.0) + (t1 - t0)
            clock["attention"] = clock.get("attention", 0.0) + (t2 - t1)
        return out

    def _blocks(self, st: AttentionState, positions: Positions | None) -> torch.Tensor:
        """The pooled keys of every complete block in `st`, pooling only the blocks that
        completed since the last call: mean of the block's raw keys, normed, roped at the
        block's first position."""
        r = self.ratio
        have, nb = st.n_blocks, st.n // r
        if nb > have:
            raw = st.idx_rows(have * r, nb * r).float().reshape(nb - have, r, self.idx_dim).mean(dim=1)
            first = torch.arange(have, nb) * r
            if positions is not None:
                first = positions.at(first)
            st.add_blocks(self.rope(_heads_norm(raw, self.idx_k_norm, self.eps).unsqueeze(0), first)[0], r)
        return st.blocks(r)

    def _select(self, idx_q: torch.Tensor, st: AttentionState, start: int, pos: torch.Tensor | None = None,
                positions: Positions | None = None, qi: torch.Tensor | None = None) -> torch.Tensor:
        """Each query's chosen blocks, (T, budget // ratio) int64, -1 in unused slots
        (triton_kernels.qsa.select_blocks). idx_q: the indexer queries (T, n_idx*d) at
        rotary positions `pos` (default: their indices), or `qi` as they are normed and
        roped (n_idx, T, d)."""
        T = idx_q.shape[0] if qi is None else qi.shape[1]
        if qi is None:
            pos = torch.arange(start, start + T) if pos is None else pos
            qi = idx_q.reshape(T, self.n_idx, self.idx_dim)
            qi = self.rope(_heads_norm(qi, self.idx_q_norm, self.eps).transpose(0, 1), pos)  # (n_idx, T, d)
        keep, blocks = self.budget // self.ratio, self._blocks(st, positions)
        if blocks is None or blocks.shape[0] <= keep:
            # no query sees more blocks than it keeps (batch-invariant mode within the
            # budget): every query takes all its blocks, and no score is needed
            scores = qi.new_empty(T, 0)
        else:
            scores = impl("qsa_scores", self.kernels)(qi, blocks, start, self.ratio)
        return select_blocks(scores, start, self.ratio, keep)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
