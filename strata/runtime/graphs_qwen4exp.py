"""Flash-Next's (`qwen4exp`) decode step as one CUDA graph: captured once per state and
window of T tokens, then replayed each step.

As for llama (strata.runtime.graphs), the graph fixes every address and shape, so the step
it holds is written for that (`step`):

- the tokens and the first one's position are device tensors the replay reads, filled
  by the runner from the host, which checks the ids there; the embedding rows are
  gathered on the device into every stream in one launch (Qwen4Exp.embed);
- attention layers write keys, values and indexer keys at the device positions into
  buffers of the graph's whole capacity (AttentionState.hold: the spare rows zero), with
  the Triton kernels and a float cache in the launch that norms and ropes q and k
  (strata.runtime.graph_attention says what else it does), else by `index_copy_`; dense
  attention runs over the whole capacity with the positions past each query masked out;
- QSA: each query pools the indexer keys of the block its position lies in and writes
  that block's key at its index (complete once the block is: a block is visible to a
  query only then); it scores every block of the capacity, the ones it cannot see at
  -inf, keeps the `budget / ratio` best, and attends to their tokens and the
  open tail's, gathered into budget + ratio slots, those past it or not chosen masked.
  Within the budget that is every visible block: dense attention, as the eager step's.
  Among blocks of exactly equal score (relu makes zeros common) the lower block is kept
  (triton_kernels.qsa.select_sorted; with the Triton kernels qsa_select, which keeps the
  same blocks in one launch): on NVIDIA GPUs the eager step's topk keeps the same;
  on the CPU its topk chooses by an order that moves with the row's length, so there,
  where a tie straddles the cut, the two may keep different blocks;
- DeltaNet conv windows, recurrent states and the PLE block's n-gram history and conv
  window are written in place, not replaced: with the Triton kernels by the launches that
  move them on (no copy launched after them), with torch's by `copy_`;
- RoPE rows are taken by device position from tables that cover the capacity (the
  Triton norm-rope kernels read them there themselves);
- with the MTP head tracking the state (`--spec`), the step also writes the MTP block's
  keys, from the trunk's streams at the position before (a buffer the runner fills from
  `Qwen4ExpState.hidden` before each replay).

What stays on the host happens between replays: the expert caches' promotions
(`rebalance`, which updates their device tables), the states' lengths, and for a verify
what `Qwen4ExpState.keep` reads (the rows' streams, the PLE block's input, each DeltaNet
layer's inputs): the graph's own outputs, which its next replay rewrites, so `keep` must
come first (it raises otherwise).

`step` is plain torch and Triton, so on the CPU it runs as is (the tests check it against
the model's own decode); only the capture needs CUDA. A state has a graph per window: one
token (a decode, a server slot's step), or the T = N + 1 rows of a speculative verify,
all reading the same held buffers. The graph is taken for a state holding text alone
(no image positions), with the PLE table and the experts readable from the device
without the host (`holds`: resident experts, or a device cache whose staging rows take
the window's routed slots); anything else, prefill included, runs eagerly.

Batch-invariant mode (triton_kernels.invariant) is read when the graph is captured: a
graph captured in one mode is not replayed in the other (`Qwen4ExpGraph.fits`). In it
every part of the step computes a row as a one-token step does (the modules' own
batch-invariant calls; attention a query at a time), so a verify's row through its graph
is the one-token graph's at that position, bit for bit.
"""
from __future__ import annotations

import weakref

import torch

from strata.nn import deltanet
from strata.nn.gated_attention import AttentionState
from strata.nn.hyperconn import next_norm
from strata.nn.ple import mix
from strata.runtime.graph_attention import attention, keys, where_of
from strata.runtime.graphs import enabled
from triton_kernels import backend, invariant


def _deltanet(m, x: torch.Tensor, st, rows: list | None = None) -> torch.Tensor:
    """GatedDeltaNet.forward for rows x (T, dim) token by token, its conv window written in
    place; the recurrent state is updated in place. `rows`: where a verify's inputs go
    (DeltaNetState.keep replays them)."""
    Hk, Hv, dk, dv = heads = m.k_heads, m.v_heads, m.dk, m.dv
    qkv, z, b, a = m.proj(x).float().split([2 * Hk * dk + Hv * dv, Hv * dv, Hv, Hv], dim=-1)
    if m.one_launch():  # the tokens in one launch, as GatedDeltaNet.forward runs them
        y, _ = m.tokens(qkv, z, b, a, st, in_place=True)
        if rows is not None:
            rows.append((qkv, z, b, a))
        return m.out(y)
    q, k, v, g, beta, window = deltanet._inputs(qkv, b, a, st.conv, m.conv, m.dt_bias, m.a_coef, heads,
                                                m.proj.kernels)
    o = m.recurrence(x.device)[1](q, k, v, g, beta, st.rec)
    st.conv.copy_(window)  # (torch's conv gives a new window)
    if rows is not None:
        rows.append((qkv, q, k, v, g, beta))
    return m.out(m.gated_norm(o, z))


def _ple(p, x: torch.Tensor, tok: torch.Tensor, st) -> torch.Tensor:
    """NgramPLE.forward with the n-gram history and the conv window written in place."""
    ids = p.ids(tok, st, in_place=True)  # the history written by the hash's own launch
    e = p.table.gather(ids, bound=p.id_bound)
    x, window = mix(x, e, p.key, p.value, *p.mix_args(), st.conv, **p.kernels(), in_place=True)
    if window is not st.conv:  # (the Triton launches move it on in place)
        st.conv.copy_(window)
    return x


def step(model, tok: torch.Tensor, pos: torch.Tensor, state, prev: torch.Tensor | None = None):
    """(logits (T, vocab), the streams after the last layer (T, S*H), what a verify keeps)
    for tokens `tok` (T,) at positions pos.. (`pos`: shape (1,)), both device tensors; the
    state's tensors written in place (its lengths the caller advances). The state's
    attention buffers must hold the positions (AttentionState.hold). With the state's MTP
    keys, `prev` (1, S*H) holds the streams at the position before. What a verify keeps
    (T > 1): {"ple_input": the PLE block's input, "rows": each DeltaNet layer's inputs}."""
    T = tok.numel()
    P = pos if T == 1 else pos + torch.arange(T, device=pos.device)  # (a decode: pos itself, no launch)
    x = model.embed(tok, model.cfg.streams, checked=True)  # checked where the runner filled `tok`
    where: dict = {}
    kept: dict = {"rows": []} if T > 1 else {}
    layers, xn = list(model.layers), None  # xn: x's streams normed for the next read (Layer.run)
    for i, (layer, st) in enumerate(zip(layers, state.layers)):
        if layer.ple is not None:
            if kept:
                kept["ple_input"] = x
            x, xn = _ple(layer.ple, x, tok, state.ple), None
        a, w = layer.attn_hc.read(x, xn)
        if layer.recurrent:
            y = _deltanet(layer.mixer, a, st, kept.get("rows"))
        else:
            y = attention(layer.mixer, a, st, where_of(where, P, layer.mixer, st, True))
        x, xn = layer.attn_hc.write_and_norm(x, y, w, layer.ffn_hc)
        m, w = layer.ffn_hc.read(x, xn)
        then = next_norm(layers, i, model.out_hc)
        if then is not None:
            x, xn = layer.ffn_hc.write_and_norm(x, layer.moe.parts(m), w, then)
        else:
            x, xn = layer.ffn_hc.write(x, layer.moe.parts(m), w), None
    if state.mtp is not None:
        mtp = model.mtp
        before = prev if T == 1 else torch.cat([prev, x[:-1]])  # the streams a row ago
        a, _ = mtp.block.attn_hc.read(mtp.inputs(model, tok, before, checked=True))
        keys(mtp.block.mixer, a, state.mtp, where_of(where, P, mtp.block.mixer, state.mtp, False))
    return model.logits(x, xn), x, kept


def usable(model, state, T: int) -> bool:
    """Whether the graph takes this forward: on CUDA, where `holds` does."""
    return model.device.type == "cuda" and holds(model, state, T)


def holds(model, state, T: int) -> bool:
    """Whether a graph can hold this forward (see the module): one token, or a verify's
    window; graphs on; the step's parts readable on the device without the host."""
    if not enabled() or model.pipe is not None:
        return False
    if (T > 1) != (state._verify is not None) or state.media is not None or state.positions.rows is not None:
        return False
    gpu = model.device.type != "cpu"  # (on the CPU every part is where the step runs)
    if gpu and model.ple is not None and getattr(model.ple.table, "host", True) is None:
        return False  # the table's rows come from a file through the host (mmap, direct)
    for layer in [*model.layers, *([model.mtp.block] if state.mtp is not None else [])]:
        s = layer.moe.experts
        dc = getattr(s, "device_cache", None)
        resident = getattr(getattr(s, "hits", None), "device", None)
        if layer.moe.share is not None or (gpu and not (
                (resident is not None and resident.type != "cpu")
                or (dc is not None and T * model.cfg.top_k <= dc.staging))):
            return False
    return True


def captures(dev: torch.device) -> bool:
    """Whether a graph is captured on `dev` (a real GPU), rather than its step run as is."""
    return dev.type == "cuda" and backend._fake is None


def _capacity(need: int) -> int:
    return max(256, 1 << (need - 1).bit_length())


class Qwen4ExpGraph:
    """`step` for one state and T tokens (a decode, or a verify of T - 1 drafts), captured
    as a CUDA graph (on CUDA) or run as is (elsewhere). The attention buffers are held at
    `capacity` positions, shared by the state's graphs of other windows; a forward past
    them, or an eager forward that moved a state tensor, needs a new one (`fits`)."""

    @torch.inference_mode()
    def __init__(self, model, state, T: int = 1, capacity: int | None = None):
        # the state holds its graphs; a graph refers back weakly, so that a dropped state
        # frees its graphs' memory pools at once, not at the next cycle collection
        self.model, self._state, self.T = model, weakref.ref(state), T
        # a context of known length (AttentionState.reserve) held at once, else doubled as it grows
        want = capacity or _capacity(max([state.length + T, *(st._reserved for _, st in self._attention())]))
        self.mode = invariant.enabled()
        dev = model.device
        for m, st in self._attention():
            st.hold(want, m.n_kv_heads, m.head_dim, m.idx_dim if m.n_idx else 0, m.ratio if m.qsa else 0, dev)
            if m.qsa and st is not state.mtp:
                m._blocks(st, state.positions)  # the complete blocks not pooled yet: the step pools its own
        # (a model of DeltaNet layers alone holds no positions: the wanted capacity bounds it)
        self.capacity = min((st._k.shape[1] for _, st in self._attention()), default=want)
        for m, _ in self._attention():
            if m.rope.cos.shape[0] < self.capacity + T:
                m.rope._table(self.capacity + T)
        self.tensors = self._tensors()
        self.tok = torch.zeros(T, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.prev = torch.zeros(1, model.cfg.streams * model.cfg.dim, device=dev) if state.mtp is not None else None
        self.graph = None
        self.replays = 0  # what a verify leaves are views of this graph's outputs: valid until the next
        if captures(dev):
            self._capture(dev)

    @property
    def state(self):
        return self._state()

    def _attention(self):
        """(mixer, its AttentionState) of every attention layer, the MTP block's too."""
        out = [(layer.mixer, st) for layer, st in zip(self.model.layers, self.state.layers) if not layer.recurrent]
        if self.state.mtp is not None:
            out.append((self.model.mtp.block.mixer, self.state.mtp))
        return out

    def _tensors(self) -> list[torch.Tensor]:
        """Every state tensor and table the step reads by address: kept alive, and checked."""
        out = [t for st in self.state.layers if not isinstance(st, AttentionState) for t in (st.conv, st.rec)]
        for m, st in self._attention():
            out += [t for t in (st._k, st._v, st._idx, st._blocks, st._ks, st._vs, st._is) if t is not None]
            out += [m.rope.cos, m.rope.sin]
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
        for s in self._stores():
            dc = getattr(s, "device_cache", None)
            out += [t for t in (getattr(s, "hits", None), getattr(dc, "routed", None), getattr(dc, "missed", None))
                    if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
        return out

    def _counters(self) -> list[dict]:
        """The host's counters a step adds to (the expert stores', the PLE table's reads):
        a replay runs no Python, so each replay adds what the captured step added."""
        ple = getattr(self.model.ple, "table", None)  # an InMemoryTable, or a StoredTable over its tier
        tables = [ple, getattr(ple, "table", None)]
        return [c for c in [*(getattr(s, "_counts", None) for s in self._stores()),
                            *(getattr(t, "_counts", None) for t in tables)] if isinstance(c, dict)]

    def _stores(self) -> list:
        """The expert stores a step runs: the layers', and the MTP block's where it writes keys."""
        mtp = [self.model.mtp.block] if self.state.mtp is not None else []
        return [layer.moe.experts for layer in [*self.model.layers, *mtp]]

    def _capture(self, dev) -> None:
        counters = self._counters()
        counted = [dict(c) for c in counters]
        changed = self._changed()
        keep = [t.clone() for t in changed]  # the warm-up steps change the state: put it back
        self.pos.fill_(self.state.length)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compiles every kernel and sizes the allocator's pool
            for _ in range(2):
                step(self.model, self.tok, self.pos, self.state, self.prev)
        torch.cuda.current_stream(dev).wait_stream(side)
        for t, k in zip(changed, keep):
            t.copy_(k)
        for c, was in zip(counters, counted):
            c.update(was)
        self.graph = torch.cuda.CUDAGraph()
        # on the warm-up's stream, whose counts (int8.zeroed_counts) the warm-up made and
        # zeroed: made in a capture, their zeroing is only recorded (graphs.DecodeGraph)
        with torch.cuda.graph(self.graph, stream=side):
            self.out = step(self.model, self.tok, self.pos, self.state, self.prev)
        # what one step adds (not times: a replay's are not the capture's), then undone
        self.counts = [{k: v - was[k] for k, v in c.items() if k in was and not k.endswith("_s")
                        and isinstance(v, (int, float)) and v != was[k]} for c, was in zip(counters, counted)]
        for c, was in zip(counters, counted):
            c.update(was)

    @torch.inference_mode()
    def __call__(self, tokens) -> torch.Tensor:
        """Logits (T, vocab) of `tokens` (T ids) continuing the state; for a verify, what
        `Qwen4ExpState.keep` needs is left as the eager forward leaves it."""
        model, state, T = self.model, self.state, self.T
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        model._check_tokens(tokens)  # (on the host, where they are: the step itself checks none)
        for store in self._stores():
            store.rebalance()  # between steps: the device caches' promotions
        if T == 1:
            self.tok.fill_(int(tokens[0]))
        else:  # from pinned memory: a pageable copy would make the host wait for the queue
            self.tok.copy_(backend.to_device(tokens, self.tok.device))
        self.pos.fill_(state.length)
        if self.prev is not None:
            if state.hidden is None:
                self.prev.zero_()
            else:
                self.prev.copy_(state.hidden.reshape(1, -1))
        self.replays += 1
        if self.graph is not None:
            self.graph.replay()
            logits, x, kept = self.out
            logits = logits.clone()  # the caller's: the next replay rewrites the graph's
            for c, add in zip(self._counters(), self.counts):
                for k, v in add.items():
                    c[k] += v
        else:
            logits, x, kept = step(model, self.tok, self.pos, state, self.prev)
        start = state.length
        state.length += T
        for layer, st in zip(model.layers, state.layers):
            if not layer.recurrent:
                st.n = state.length
                if layer.mixer.qsa:
                    st.n_blocks = state.length // layer.mixer.ratio
        if state.mtp is not None:
            state.mtp.n = state.length
            state.hidden = x[-1].clone()
        v = state._verify
        if v is not None and v.start == start:
            # the graph's own outputs, not copies (a real verify's are hundreds of launches):
            # `keep` comes before this graph's next replay, and checks that it does
            v.tokens, v.streams, v.graph = tokens, x, (self, self.replays)
            if "ple_input" in kept:
                v.ple_input = kept["ple_input"]
            rows = iter(kept["rows"])
            for layer, st in zip(model.layers, state.layers):
                if layer.recurrent:
                    st.trail.rows = tuple(next(rows))
                    st.trail.replay = layer.mixer.replay_of(x.device)
        return logits
