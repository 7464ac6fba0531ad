"""Flash-Next's (`qwen4exp`) decode step as one CUDA graph: captured once per state and
window of T tokens, then replayed each step.

As for llama (strata.runtime.graphs), the graph fixes every address and shape, so the step
it holds is written for that (`step`):

- the tokens and the first one's position are device tensors the replay reads; the
  embedding rows are gathered on the device (Qwen4Exp.embed);
- attention layers write keys, values and indexer keys at the device positions by
  `index_copy_` into buffers of the graph's whole capacity (AttentionState.hold: the spare
  rows zero); dense attention runs over the whole capacity with the positions past each
  query masked out;
- QSA: each query pools the indexer keys of the block its position lies in and writes
  that block's key at its index (complete once the block is: a block is visible to a
  query only then); it scores every block of the capacity, the ones it cannot see at
  -inf, keeps the `budget / ratio` best, and attends to their tokens and the
  open tail's, gathered into budget + ratio slots, those past it or not chosen masked.
  Within the budget that is every visible block: dense attention, as the eager step's.
  Among blocks of exactly equal score (relu makes zeros common) the lower block is kept:
  the eager step's topk over a row of exactly the visible blocks chooses by its own
  order, which moves with the row's length (triton_kernels.qsa), so where a tie straddles
  the cut the two may keep different blocks;
- DeltaNet conv windows, recurrent states and the PLE block's n-gram history and conv
  window are written in place (`copy_`), not replaced;
- RoPE rows are taken by device position from tables that cover the capacity.

What stays on the host happens between replays: the expert caches' promotions
(`rebalance`, which updates their device tables), and the states' lengths.

`step` is plain torch and Triton, so on the CPU it runs as is (the tests check it against
the model's own decode); only the capture needs CUDA. The graph is taken for a state
holding text alone, one token at a time, outside a speculative verify, without an MTP head
tracking it, with the PLE table and the experts readable from the device without the host
(`usable`); anything else decodes eagerly.

Batch-invariant mode (triton_kernels.invariant) is read when the graph is captured: a
graph captured in one mode is not replayed in the other (`Qwen4ExpGraph.mode`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from strata.nn import deltanet, kv
from strata.nn.gated_attention import AttentionState, _heads_norm, finish, project
from strata.nn.hyperconn import HyperConnection
from strata.nn.ple import mix
from strata.nn.rope import rotate
from strata.runtime.graphs import enabled
from triton_kernels import backend, invariant
from triton_kernels.ops import impl


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


class _Where:
    """What every attention layer of a step reads at the step's positions P (T,), computed
    once a step for each (RoPE table, QSA block size, capacity): RoPE's rows, the causal
    mask over the capacity, and QSA's indices (see the module)."""

    def __init__(self, P: torch.Tensor, rope, ratio: int, capacity: int):
        dev, C = P.device, capacity
        self.cos, self.sin = rope.cos[P], rope.sin[P]
        self.causal = torch.arange(C, device=dev)[None, :] <= P[:, None]        # (T, C): True attends
        if not ratio:
            return
        r, span = ratio, torch.arange(ratio, device=dev)
        self.block = P // r                                                      # the block p lies in
        first = self.block * r
        self.pool_at = (first[:, None] + span).clamp(max=C - 1)                  # (T, r)
        self.pool_cos, self.pool_sin = rope.cos[first], rope.sin[first]
        seen = (P + 1) // r                                                      # complete blocks a query sees
        nb = C // r + 1
        self.unseen = torch.arange(nb, device=dev)[None, :] >= seen[:, None]     # (T, NB)
        self.block_rows = (torch.arange(nb, device=dev)[:, None] * r + span).clamp(max=C - 1)  # (NB, r)
        tail = seen[:, None] * r + span                                          # the open tail, (T, r)
        self.tail_ok, self.tail_at = tail <= P[:, None], tail.clamp(max=C - 1)


def _pool(m, st: AttentionState, at: _Where) -> None:
    """Write the pooled indexer key of the block each position lies in: the mean of its
    raw keys, normed, roped at its first position (GatedAttention._blocks)."""
    rows = at.pool_at                                                            # (T, r)
    raw = _rows(st._idx[rows], None if st._is is None else st._is[rows]).mean(dim=1)  # (T, d)
    key = rotate(_heads_norm(raw, m.idx_k_norm, m.eps).unsqueeze(0), at.pool_cos, at.pool_sin, m.rope.dim)[0]
    st._blocks.index_copy_(0, at.block, key)


def _sparse(m, q, idx_q, st: AttentionState, at: _Where) -> torch.Tensor:
    """QSA for the step's queries: (H, T, D) (see the module)."""
    T, keep = q.shape[1], m.budget // m.ratio
    _pool(m, st, at)
    qi = idx_q.reshape(T, m.n_idx, m.idx_dim)
    qi = rotate(_heads_norm(qi, m.idx_q_norm, m.eps).transpose(0, 1), at.cos, at.sin, m.rope.dim)
    blocks = st._blocks                                                          # (NB, d)
    if invariant.enabled():
        scores = invariant.scores(qi, blocks)
    else:
        scores = (qi.float() @ blocks.T).relu().sum(dim=0)                      # (T, NB)
    scores = (scores / math.sqrt(m.idx_dim)).masked_fill(at.unseen, float("-inf"))
    # the best `keep`, ties to the lower block (a fixed rule: topk's choice among equal
    # scores moves with the row's length, and the graph's row is the capacity's)
    best, sel = (t[:, :keep] for t in scores.sort(dim=-1, descending=True, stable=True))  # (T, keep)
    tokens = torch.cat([at.block_rows[sel].reshape(T, -1), at.tail_at], dim=1)  # (T, S)
    chosen = (best > float("-inf"))[:, :, None].expand(T, keep, m.ratio).reshape(T, -1)
    ok = torch.cat([chosen, at.tail_ok], dim=1)
    scales = st.kv_scales()
    k = _rows(st._k[:, tokens], None if scales is None else scales[0][:, tokens])  # (Hkv, T, S, D)
    v = _rows(st._v[:, tokens], None if scales is None else scales[1][:, tokens])
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=ok[:, None, None, :], enable_gqa=True)  # (T, H, 1, D)
    return out[:, :, 0].transpose(0, 1)


def _attention(m, a: torch.Tensor, st: AttentionState, P: torch.Tensor, at: _Where) -> torch.Tensor:
    """The gated attention of rows a (T, dim) at device positions P (T,), the state's
    buffers written in place."""
    q, k, v, idx_q, idx_k, gate = project(m.proj(a).float(), *m.project_args(), at.cos, at.sin)
    _write(st, "k", k, P)
    _write(st, "v", v, P)
    if idx_k is not None:
        _write(st, "idx", idx_k, P)
    if m.qsa and not m.dense_only:
        out = _sparse(m, q, idx_q, st, at)
    else:
        scales = st.kv_scales()
        keys = _rows(st._k, None if scales is None else scales[0])
        vals = _rows(st._v, None if scales is None else scales[1])
        out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0),
                                             attn_mask=at.causal, enable_gqa=True)[0]
    return m.o(finish(out, gate))


def _deltanet(m, a: torch.Tensor, st) -> torch.Tensor:
    """GatedDeltaNet.forward for rows a (T, dim) token by token, its conv window written in
    place; the recurrent state is updated in place by the one-token op."""
    Hk, Hv, dk, dv = heads = m.k_heads, m.v_heads, m.dk, m.dv
    qkv, z, b, g = m.proj(a).float().split([2 * Hk * dk + Hv * dv, Hv * dv, Hv, Hv], dim=-1)
    q, k, v, g, beta, window = deltanet._inputs(qkv, b, g, st.conv, m.conv, m.dt_bias, m.a_coef, heads,
                                                gpu=m.proj.kernels == "triton")
    o = deltanet.recurrent(q, k, v, g, beta, st.rec, impl("deltanet_step", m.proj.kernels))
    st.conv.copy_(window)
    return m.out(deltanet._gated_norm(o, z, m.norm, dv, m.eps))


def _ple(p, x: torch.Tensor, tok: torch.Tensor, st) -> torch.Tensor:
    """NgramPLE.forward with the n-gram history and the conv window written in place."""
    history = st.history
    ids = p.ids(tok, st)
    history.copy_(st.history)
    st.history = history
    e = p.table.gather(ids)
    step = impl("conv_step", "triton") if p.key.kernels == "triton" else None
    x, window = mix(x, e, p.key, p.value, *p.mix_args(), st.conv, conv_step=step)
    st.conv.copy_(window)
    return x


def step(model, tok: torch.Tensor, pos: torch.Tensor, state) -> torch.Tensor:
    """Logits (T, vocab) of tokens `tok` (T,) at positions pos.. (`pos`: shape (1,)), both
    device tensors; the state's tensors written in place (its lengths the caller advances).
    The state's attention buffers must hold the positions (AttentionState.hold)."""
    T = tok.numel()
    P = pos + torch.arange(T, device=pos.device)
    x = model.embed(tok).repeat(1, model.cfg.streams)
    where: dict = {}
    for layer, st in zip(model.layers, state.layers):
        if layer.ple is not None:
            x = _ple(layer.ple, x, tok, state.ple)
        a, w = layer.attn_hc.read(x)
        if layer.recurrent:
            y = _deltanet(layer.mixer, a, st)
        else:
            m = layer.mixer
            ratio = m.ratio if m.qsa and not m.dense_only else 0
            key = (id(m.rope), ratio, st._k.shape[1])
            at = where.get(key) or where.setdefault(key, _Where(P, m.rope, ratio, st._k.shape[1]))
            y = _attention(m, a, st, P, at)
        x = HyperConnection.write(x, y, w)
        m, w = layer.ffn_hc.read(x)
        x = HyperConnection.write(x, layer.moe(m), w)
    return model.logits(x)


def usable(model, state, T: int) -> bool:
    """Whether the graph can take this forward on CUDA (see the module)."""
    if not enabled() or model.device.type != "cuda" or model.pipe is not None or T != 1:
        return False
    if state.mtp is not None or state._verify is not None or state.media is not None \
            or state.positions.rows is not None:
        return False
    if model.ple is not None and getattr(model.ple.table, "host", True) is None:
        return False  # the table's rows come from a file through the host (mmap, direct)
    for layer in model.layers:
        s = layer.moe.experts
        dc = getattr(s, "device_cache", None)
        if layer.moe.share is not None or not (
                getattr(getattr(s, "hits", None), "device", torch.device("cpu")).type != "cpu"
                or (dc is not None and T * model.cfg.top_k <= dc.staging)):
            return False
    return True


def _capacity(need: int) -> int:
    return max(256, 1 << (need - 1).bit_length())


class Qwen4ExpGraph:
    """`step` for one state and T tokens, captured as a CUDA graph (on CUDA) or run as is
    (elsewhere). The attention buffers are held at `capacity` positions; a forward past
    them, or an eager forward that moved a state tensor, needs a new one (`fits`)."""

    @torch.inference_mode()
    def __init__(self, model, state, T: int = 1, capacity: int | None = None):
        self.model, self.state, self.T = model, state, T
        self.capacity = capacity or _capacity(state.length + T)
        self.mode = invariant.enabled()
        dev = model.device
        for layer, st in zip(model.layers, state.layers):
            m = layer.mixer
            if not layer.recurrent:
                st.hold(self.capacity, m.n_kv_heads, m.head_dim, m.idx_dim if m.n_idx else 0,
                        m.ratio if m.qsa else 0, dev)
                if m.qsa:
                    m._blocks(st, state.positions)  # the complete blocks not pooled yet: the step pools its own
                if m.rope.cos.shape[0] < self.capacity + T:
                    m.rope._table(self.capacity + T)
        self.tensors = self._tensors()
        self.tok = torch.zeros(T, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph = None
        if dev.type == "cuda" and backend._fake is None:
            self._capture(dev)

    def _tensors(self) -> list[torch.Tensor]:
        """Every state tensor and table the step reads by address: kept alive, and checked."""
        out = []
        for layer, st in zip(self.model.layers, self.state.layers):
            if layer.recurrent:
                out += [st.conv, st.rec]
            else:
                out += [t for t in (st._k, st._v, st._idx, st._blocks, st._ks, st._vs, st._is) if t is not None]
                out += [layer.mixer.rope.cos, layer.mixer.rope.sin]
        if self.state.ple is not None:
            out += [self.state.ple.history, self.state.ple.conv]
        return out

    def fits(self, state, T: int) -> bool:
        """Whether this graph can run T tokens of `state` now."""
        return (state is self.state and T == self.T and state.length + T <= self.capacity
                and self.mode == invariant.enabled()
                and all(a is b for a, b in zip(self._tensors(), self.tensors)))

    def _changed(self) -> list[torch.Tensor]:
        """What a warm-up step changes for good: the recurrent states, the PLE block's, and
        the experts' counters (the rows it writes at the position the next step rewrites)."""
        out = [t for st in self.state.layers if not isinstance(st, AttentionState) for t in (st.conv, st.rec)]
        if self.state.ple is not None:
            out += [self.state.ple.history, self.state.ple.conv]
        for layer in self.model.layers:
            s = layer.moe.experts
            dc = getattr(s, "device_cache", None)
            out += [t for t in (getattr(s, "hits", None), getattr(dc, "routed", None), getattr(dc, "missed", None))
                    if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
        return out

    def _capture(self, dev) -> None:
        changed = self._changed()
        keep = [t.clone() for t in changed]  # the warm-up steps change the state: put it back
        self.pos.fill_(self.state.length)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compiles every kernel and sizes the allocator's pool
            for _ in range(2):
                step(self.model, self.tok, self.pos, self.state)
        torch.cuda.current_stream(dev).wait_stream(side)
        for t, k in zip(changed, keep):
            t.copy_(k)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = step(self.model, self.tok, self.pos, self.state)

    @torch.inference_mode()
    def __call__(self, tokens) -> torch.Tensor:
        """Logits (T, vocab) of `tokens` (T ids) continuing the state."""
        model, state, T = self.model, self.state, self.T
        for layer in model.layers:
            layer.moe.experts.rebalance()  # between steps: the device caches' promotions
        if T == 1:
            self.tok.fill_(int(torch.as_tensor(tokens).reshape(-1)[0]))
        else:
            self.tok.copy_(torch.as_tensor(tokens, dtype=torch.long).reshape(-1))
        self.pos.fill_(state.length)
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = step(model, self.tok, self.pos, state)
        state.length += T
        for layer, st in zip(model.layers, state.layers):
            if not layer.recurrent:
                st.n = state.length
                if layer.mixer.qsa:
                    st.n_blocks = state.length // layer.mixer.ratio
        return out
