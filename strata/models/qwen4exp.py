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
history and conv window; for speculative decoding (strata.runtime.spec), the MTP block's
keys and the last position's streams, and a verify's way back (`Qwen4ExpState.keep`).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from strata.gguf import GGUFFile
from strata.models import qwen4exp_step, summary
from strata.models.qwen4exp_config import Qwen4ExpConfig
from strata.names.qwen4exp import mtp_sidecar
from strata.nn import QuantLinear
from strata.nn import kv as kv_types
from strata.nn.deltanet import GatedDeltaNet, begin_all
from triton_kernels.deltanet_fla import deltanet_path
from strata.nn.gated_attention import AttentionState
from strata.nn.hyperconn import HyperConnection, next_norm
from strata.nn.mrope import Positions
from strata.nn.moe import MoE
from strata.nn.ple import NgramPLE
from strata.runtime import graphs_qwen4exp
from strata.tensors import QTensor, host_tensor, module_to
from triton_kernels.backend import to_device
from triton_kernels.dequant import dequantize_torch
from triton_kernels.ops import impl

class Layer(torch.nn.Module):
    def __init__(self, mixer, attn_hc: HyperConnection, moe: MoE, ffn_hc: HyperConnection,
                 ple: NgramPLE | None):
        super().__init__()
        self.mixer, self.attn_hc, self.moe, self.ffn_hc, self.ple = mixer, attn_hc, moe, ffn_hc, ple
        self.recurrent = isinstance(mixer, GatedDeltaNet)

    def forward(self, x, tokens, mixer_state, ple_state, start, ple_ids=None, positions=None):
        """x (T, S*H) continuing at `start`; the states are this layer's, updated in place;
        `positions`: the sequence's M-RoPE positions (strata.nn.mrope)."""
        return self.run(x, tokens, mixer_state, ple_state, start, ple_ids, positions)[0]

    def run(self, x, tokens, mixer_state, ple_state, start, ple_ids=None, positions=None, xn=None, then=None):
        """`forward`, handing norms on: `xn`, x's streams normed by this layer's attn_hc (the
        layer before gave them, or None); `then`, the hyper-connection that reads the result
        next (the next layer's attn_hc, the output mixer), or None. (the result, its streams
        normed for `then` in the FFN write's launch, or None: with the Triton kernels only)."""
        # one token on the CPU: compiled calls where they apply (qwen4exp_step)
        if self.ple is not None:
            y = qwen4exp_step.ple_block(self, x, tokens, ple_state, ple_ids)
            x = self.ple(x, tokens, ple_state, ple_ids) if y is None else y
            xn = None  # x changed
        if not self.recurrent:
            y = qwen4exp_step.attention_layer(self, x, mixer_state, start, positions)
            if y is not None:
                return y, None
        y, xn2 = qwen4exp_step.mixer_half(self, x, mixer_state), None
        if y is None:
            a, w = self.attn_hc.read(x, xn)
            out = self.mixer(a, mixer_state) if self.recurrent else self.mixer(a, mixer_state, start, positions)
            y, xn2 = self.attn_hc.write_and_norm(x, out, w, self.ffn_hc)  # xn2: the FFN's normed streams
        x = y
        y = qwen4exp_step.ffn_half(self, x)
        if y is not None:
            return y, None
        m, w = self.ffn_hc.read(x, xn2)
        if then is not None:
            return self.ffn_hc.write_and_norm(x, self.moe.parts(m), w, then)
        return self.ffn_hc.write(x, self.moe.parts(m), w), None


class _Verify:
    """What a verify forward leaves for `Qwen4ExpState.keep`: where it started, the PLE
    state before it and the PLE block's inputs, its tokens and the streams of its rows; from
    a graph (strata.runtime.graphs_qwen4exp) its outputs, with (the graph, its replay)."""

    def __init__(self, start: int, ple):
        self.start, self.ple = start, ple
        self.tokens = self.ple_input = self.streams = self.graph = None


class Qwen4ExpState:
    """One sequence's state: `length` tokens seen.

    With `mtp`, also the MTP block's keys and values at every position seen (a draft
    attends to them) and `hidden`, the trunk's streams before the output mixer at the last
    position (the first draft's input). Between `Qwen4Exp.verify` and `keep(n)`, the state
    can be cut back to any prefix of the verified tokens (see `keep`)."""

    rewindable = False  # the DeltaNet and conv states cannot be cut back to fewer tokens
    graphs: dict | None = None  # on CUDA, its graphs by window (strata.runtime.graphs_qwen4exp)

    def __init__(self, model: "Qwen4Exp", mtp: bool = False):
        dev = model.device
        self.layers = [l.mixer.new_state(dev) if l.recurrent else AttentionState(model.kv) for l in model.layers]
        self.ple = model.ple.new_state(dev) if model.ple is not None else None
        self.mtp = AttentionState(model.kv) if mtp else None
        self.hidden: torch.Tensor | None = None
        self.length = 0
        self.positions = Positions()
        # the rows of planned images' tokens still to be fed: (token indices, rows (n, dim))
        self.media: tuple[torch.Tensor, torch.Tensor] | None = None
        self._model_ple = model.ple
        self._verify: _Verify | None = None

    def copy(self, n: int | None = None) -> "Qwen4ExpState":
        """A copy of this state; recurrent states cannot be rewound, so n must be the length."""
        if n is not None and n != self.length:
            raise ValueError(f"a qwen4exp state holds {self.length} tokens and cannot be cut to {n}: "
                             "its DeltaNet states summarise the whole sequence")
        c = Qwen4ExpState.__new__(Qwen4ExpState)
        c.layers = [s.copy() for s in self.layers]
        c.ple = self.ple.copy() if self.ple is not None else None
        c.mtp = self.mtp.copy() if self.mtp is not None else None
        c.hidden = self.hidden
        c.length = self.length
        # a copy holds what was fed: the rest of a plan belongs to the request that made it
        c.positions, c.media = self.positions.copy(self.length), None
        c._model_ple, c._verify = self._model_ple, None
        return c

    def nbytes(self) -> int:
        ts = [self.hidden]
        for s in self.layers:
            ts += [] if isinstance(s, AttentionState) else [s.conv, s.rec]
        attn = [s for s in self.layers + [self.mtp] if isinstance(s, AttentionState)]
        return sum(s.nbytes() for s in attn) + sum(t.numel() * t.element_size() for t in ts if t is not None)

    def begin_verify(self) -> None:
        """The next forward is a verify: keep what `keep` needs to cut it back."""
        begin_all([s for s in self.layers if not isinstance(s, AttentionState)])
        self._verify = _Verify(self.length, self.ple.copy() if self.ple is not None else None)

    @torch.inference_mode()
    def keep(self, n: int) -> None:
        """Keep the first n tokens of the verify forward since `begin_verify`, as if only
        they had been fed: attention rows past them are dropped (AttentionState.truncate),
        the DeltaNet states cut back (DeltaNetState.keep), the PLE state restored and the
        PLE block run again over the n kept rows (its conv window needs their values; one
        block over at most a verify's rows, its table rows just read), and `hidden` taken
        from row n - 1."""
        v, self._verify = self._verify, None
        if v is None or v.tokens is None:
            raise RuntimeError("Qwen4ExpState.keep: no verify forward since begin_verify()")
        if v.graph is not None and v.graph[0].replays != v.graph[1]:  # (outputs last to its next replay)
            raise RuntimeError("Qwen4ExpState.keep: the verify's graph ran again since, over what keep reads; "
                               "keep right after the verify")
        T = v.tokens.numel()
        if not 0 < n <= T:
            raise ValueError(f"a verify of {T} tokens keeps 1 to {T} of them, not {n}")
        for s in self.layers:
            if isinstance(s, AttentionState):
                s.truncate(v.start + n)
            else:
                s.keep(n)
        if self.mtp is not None:
            self.mtp.truncate(v.start + n)
            self.hidden = v.streams[n - 1].clone()
        if n < T and self.ple is not None:  # in place: a decode graph reads these tensors
            st, held = self.ple, (self.ple.history, self.ple.conv)
            st.history, st.conv = v.ple.history, v.ple.conv
            ple, tokens = self._model_ple, v.tokens[:n]
            ple(v.ple_input[:n], tokens, st, ple.ids(tokens, st))
            held[0].copy_(st.history)
            held[1].copy_(st.conv)
            st.history, st.conv = held
        self.length = v.start + n
        self.positions.truncate(self.length)


class MTPHead(torch.nn.Module):
    """The multi-token-prediction block: from the token at position p and the trunk's
    streams after position p - 1, a guess at the token at p + 1.

        e   = enorm(embed(token))                         (T, H)
        h_s = hnorm(stream s of the trunk's state)        (T, S, H)  before the output mixer
        x_s = eh_proj([e ; h_s])                          (T, S, H)  the block's streams
        x   = block(x) at position p                      one attention + MoE layer with its
                                                          hyper-connections and its own keys
        logits = output(head_norm(out_hc.read(x)))       the model's mixer and lm_head

    The streams fed are the 4-stream state before the output mixer, as the release's MTP
    drafters take it (transformers 5.23 runs no MTP: it ignores `mtp.*` on load).
    eh_proj = [fc_embedding | fc_hidden] applies to each stream alike, and hnorm is one
    weight for every stream (or one per stream where the file gives S*H). The sidecar's
    block is Qwen3.5's nextn layout, with a final norm and no stream mixer of its own, so
    the model's output mixer collapses the streams before head_norm. A chained draft feeds
    the block's output streams back as the next row's h. The block's keys and values at a
    position come from the trunk's streams (`keys`, run by every forward of a state that
    tracks them); a draft's own are dropped once it is verified."""

    def __init__(self, eh_proj: QuantLinear, enorm, hnorm, head_norm, block: Layer):
        super().__init__()
        self.eh_proj, self.block = eh_proj, block
        p = (lambda t: torch.nn.Parameter(t.float(), requires_grad=False))
        self.enorm, self.hnorm, self.head_norm = p(enorm), p(hnorm), p(head_norm)

    def inputs(self, model: "Qwen4Exp", tokens: torch.Tensor, hidden: torch.Tensor, checked=False) -> torch.Tensor:
        """The block's streams (T, S*H) for `tokens` (T,) (`checked`: ids checked, as the trunk
        does) and the streams before them (T, S*H)."""
        T, S, eps = tokens.numel(), model.cfg.streams, model.cfg.norm_eps
        H = self.enorm.numel()
        norm, w = impl("hc_norm", model.kernels), self.hnorm.reshape(-1, H)  # (a launch a norm with Triton's)
        e = norm(model.embed(tokens, checked=checked), self.enorm.reshape(1, H), eps)
        h = norm(hidden.float().reshape(-1, w.numel()), w, eps).reshape(T, S, H)  # one weight: a row a stream
        both = torch.cat([e.unsqueeze(1).expand(T, S, H), h], dim=-1)
        return self.eh_proj(both.reshape(T * S, 2 * H)).float().reshape(T, S * H)

    def keys(self, model: "Qwen4Exp", tokens, hidden, st: AttentionState, start: int,
             positions: Positions | None = None) -> None:
        """Append the block's keys and values at positions start.. (only its attention's
        input is needed: the rest of the block matters for a draft's own row); the trunk has
        checked the tokens."""
        a, _ = self.block.attn_hc.read(self.inputs(model, tokens, hidden, checked=True))
        self.block.mixer(a, st, start, positions)

    def step(self, model: "Qwen4Exp", tokens, hidden, st: AttentionState, start: int,
             positions: Positions | None = None):
        """(logits (T, vocab) float32, the block's output streams (T, S*H)) for rows at start.."""
        x = self.block(self.inputs(model, tokens, hidden), tokens, st, None, start, positions=positions)
        h, _ = model.out_hc.read(x)
        h = F.rms_norm(h, (h.shape[-1],), eps=model.cfg.norm_eps) * self.head_norm
        return model.output(h).float(), x


class Qwen4Exp(torch.nn.Module):
    def __init__(self, g: GGUFFile, cfg: Qwen4ExpConfig, embedding: QTensor, layers: list[Layer],
                 out_hc: HyperConnection, output: QuantLinear, dtype: torch.dtype, device: str, kernels: str,
                 mtp: MTPHead | None = None, mtp_file=None, qsa_fallback: bool = False, kv: str = "f32"):
        """Built by strata.load.qwen4exp from a GGUF file `g` (and the MTP sidecar
        `mtp_file`, where there is one); `embedding` stays the file's blocks; `kernels`:
        "triton" or "torch", the implementation every op takes (triton_kernels.ops);
        `qsa_fallback`: the file gave no QSA block size, the architecture's was taken; `kv`:
        how the attention layers store keys, values and indexer keys (strata.nn.kv)."""
        super().__init__()
        self.gguf, self.cfg, self.dtype = g, cfg, dtype
        self.device = torch.device(device)
        self.kernels, self.embedding = kernels, embedding
        self.layers = torch.nn.ModuleList(layers)
        self.ple = next((l.ple for l in layers if l.ple is not None), None)
        self.out_hc, self.output = out_hc, output
        self.mtp, self.mtp_file, self.qsa_fallback = mtp, mtp_file, qsa_fallback
        self.kv = kv_types.check(kv)
        # under --pp (strata.dist.Pipe): this rank's stage of the layer pipeline (`layers`
        # are the stage's); None: the whole model in this process
        self.pipe = None
        module_to(self, self.device)  # norms, conv weights, RoPE tables (the weights went as loaded)
        # on a GPU the embedding's blocks go there too: a step gathers its rows on the device
        self.embedding_blocks = (None if self.device.type == "cpu"
                                 else to_device(host_tensor(embedding.data), self.device))

    # -- what the engine reports -------------------------------------------------------------

    def kv_bytes_per_token(self, kind: str | None = None) -> int:
        """Attention-cache bytes a token adds, stored as `kind` (default: this model's): K
        and V of every attention layer, its raw indexer key, and a 1/ratio share of a pooled
        float32 block key."""
        kind, total = kind or self.kv, 0.0
        for layer in self.layers:
            if layer.recurrent:
                continue
            m = layer.mixer
            total += 2 * m.n_kv_heads * kv_types.row_bytes(kind, m.head_dim)
            if m.n_idx:
                total += kv_types.row_bytes(kind, m.idx_dim) + 4 * m.idx_dim / max(m.ratio, 1)
        return int(round(total))

    def plan_line(self) -> str:
        """One line: what the model is and where/how its parts are held."""
        from collections import Counter
        g, c = self.gguf, self.cfg
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
        mtp = (f"MTP head loaded from {self.mtp_file.name} (drafts for --spec)" if self.mtp is not None
               else "no MTP head")
        dn = next((l.mixer for l in self.layers if l.recurrent), None)
        dn_text = ("" if dn is None or dn.conv.device.type != "cuda"  # a CUDA load says whose kernels
                   else f" ({deltanet_path(dn.conv.device, dn.proj.kernels)[0]} chunks, a token one launch)")
        return (f"{summary.name(g)} ({g.arch}, {c.n_layers} layers: "
                f"{c.n_layers - n_attn} DeltaNet{dn_text} + {n_attn} attention, dim {c.dim} x {c.streams} streams, "
                f"{c.n_experts} experts top-{c.top_k}, {summary.file_summary(g)}) {summary.run_summary(self)}, "
                f"{summary.kv_summary(self)}; "
                f"experts: " + ", ".join(f"{k} x{v}" for k, v in tiers.items()) + f" ({exp_mib:.0f} MiB held); "
                f"{ple}; {qsa_text}; {mtp}")

    # -- running ---------------------------------------------------------------------------------

    def warm_compile(self) -> bool:
        """Build the CPU's compiled decode halves on a scratch state (strata.runtime.background)."""
        return qwen4exp_step.warm(self)

    def new_cache(self, capacity: int = 256, mtp: bool = False) -> Qwen4ExpState:
        """A state for one sequence; `mtp`: one that also tracks what the MTP head drafts from."""
        if mtp and self.pipe is not None:
            raise ValueError("--spec with --pp: the MTP head drafts from the last layer's streams, which "
                             "only the pipeline's last stage holds; run --spec with --ep alone")
        if mtp and self.mtp is None:
            raise ValueError(f"{self.gguf.path}: no MTP head (neither in the file nor in "
                             f"{mtp_sidecar(self.gguf.path).name} beside it), so nothing drafts for --spec")
        return Qwen4ExpState(self, mtp)

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        """Ids on the host are checked there; ids on a device, on the device (an
        asynchronous assert: a step never waits to read them)."""
        n = self.embedding.shape[0]
        if tokens.device.type != "cpu":
            # 0 <= id < n exactly where id // n == 0: a launch fewer than two comparisons and an and
            torch._assert_async((tokens // n == 0).all(), f"token ids must lie in 0..{n - 1}")
        elif tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= n):
            raise ValueError(f"token ids must lie in 0..{n - 1}")

    def embed(self, tokens: torch.Tensor, streams: int = 1, checked: bool = False) -> torch.Tensor:
        """(T, streams * dim) float32: the rows of `tokens`, `streams` times side by side, from
        the file's blocks on the host, or on a GPU from those held there in one launch;
        checked: the caller has checked the ids (a graph's runner, where it filled them)."""
        if not checked:
            self._check_tokens(tokens)
        fmt = self.embedding.fmt
        if self.embedding_blocks is None:
            x = dequantize_torch(torch.from_numpy(np.take(self.embedding.data, tokens.numpy(), axis=0)), fmt)
            return x.repeat(1, streams) if streams > 1 else x
        ids = to_device(tokens, self.device).reshape(-1, 1).expand(-1, streams)  # a view: no copy
        return impl("ple_gather", self.kernels)(self.embedding_blocks, ids, fmt, bound=self.embedding.shape[0])

    @torch.inference_mode()
    def forward(self, tokens, state: Qwen4ExpState, last_only: bool = False) -> torch.Tensor:
        """Logits (S, vocab) float32 for tokens that continue the state's sequence."""
        return self.forward_batch([(tokens, state)], last_only)[0]

    @torch.inference_mode()
    def forward_batch(self, items, last_only: bool = True) -> list[torch.Tensor]:
        """Sequences one after another (their recurrent states are separate). Under --pp a
        stage hands each sequence's streams on as soon as it has them, so the next stage
        works on that sequence while this one computes the next (the batch's sequences are
        the pipeline's micro-batches); the last stage's logits come back in one broadcast."""
        pipe, out = self.pipe, []
        for tokens, state in items:
            tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
            rows = 1 if last_only else tokens.numel()
            T = tokens.numel()
            if graphs_qwen4exp.usable(self, state, T):  # CUDA: the state's graph for T tokens
                state.graphs = state.graphs or {}
                g = state.graphs.get(T)
                if g is None or not g.fits(state, T):
                    g = state.graphs[T] = graphs_qwen4exp.Qwen4ExpGraph(self, state, T)
                out.append(g(tokens)[-rows:])
                continue
            x, xn = self._trunk(tokens, state)
            if pipe is None or pipe.last:
                out.append(self.logits(x[-rows:], None if xn is None else xn[-rows:]))
            else:
                pipe.hand_on(x)
                out.append(rows)
        return out if pipe is None else pipe.logits(out, self.cfg.vocab_size)

    def _trunk(self, tokens: torch.Tensor, state: Qwen4ExpState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The streams (T, S*H) after this model's layers (under --pp, its stage's), and
        their norm by the output mixer's weight where the last layer's write gave it."""
        pipe = self.pipe
        if pipe is None or pipe.first:
            S = self.cfg.streams  # the hyper-connections' streams start equal
            x = self.embed(tokens, S) if state.media is None else \
                self._with_media(self.embed(tokens), state).repeat(1, S)
        else:  # a later stage: checked here too, so that no stage waits on one that refused
            self._check_tokens(tokens)
            x = pipe.receive(tokens.numel(), self.cfg.streams * self.cfg.dim)
        for layer in [*self.layers, *([self.mtp.block] if self.mtp is not None else [])]:
            layer.moe.experts.rebalance()  # between steps: the device caches' promotions
        start = state.length
        verify = state._verify
        ple_ids = None
        if self.ple is not None:
            # the rows this step needs are known before the first layer: announce them now,
            # so the drive reads them while layer 0 computes
            ple_ids = self.ple.ids(tokens, state.ple)
            self.ple.table.prefetch(ple_ids)
        xn, layers = None, list(self.layers)
        last = self.out_hc if pipe is None or pipe.last else None
        for i, (layer, st) in enumerate(zip(layers, state.layers)):
            if verify is not None and layer.ple is not None:
                verify.ple_input = x
            x, xn = layer.run(x, tokens, st, state.ple, start, ple_ids, state.positions, xn,
                              next_norm(layers, i, last))
        if state.mtp is not None:
            prev = x.new_zeros(1, x.shape[1]) if state.hidden is None else state.hidden.reshape(1, -1)
            before = prev if x.shape[0] == 1 else torch.cat([prev, x[:-1]])  # the streams a row ago
            self.mtp.keys(self, tokens, before, state.mtp, start, state.positions)
            state.hidden = x[-1].clone()
        if verify is not None:
            verify.tokens, verify.streams = tokens, x
        state.length = start + tokens.numel()
        return x, xn

    def add_images(self, state: Qwen4ExpState, tokens, images: list[tuple[torch.Tensor | None, tuple[int, int]]],
                   pad: int) -> None:
        """Plan a sequence with images: `tokens` are its ids from the first (what `state`
        holds already and the prompt about to be fed, at once or in chunks), in which each
        run of the placeholder `pad` stands for the next of `images`: (its rows (n, dim) from
        strata.models.vision, or None for an image `state` has taken in whole; its (h', w')
        grid of merged patches, h' * w' = n). The runs' embeddings become the images' rows,
        and every token takes its M-RoPE position (strata.nn.mrope), as transformers'
        Qwen4ExpModel does."""
        if self.pipe is not None:
            raise ValueError("images with --pp: only the first stage would see them; run images in one process")
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        kinds, counts = torch.unique_consecutive(tokens == pad, return_counts=True)
        runs = list(zip(counts.tolist(), kinds.tolist()))  # (length, an image's) in order
        sizes = [n for n, img in runs if img]
        if sizes != [h * w for _, (h, w) in images]:
            raise ValueError(f"the prompt has runs of {sizes} image tokens for images of "
                             f"{[h * w for _, (h, w) in images]}: each image needs one run of exactly its tokens")
        grids = iter(grid for _, grid in images)
        state.positions.plan([(n, next(grids) if img else None) for n, img in runs])
        # the rows of the image tokens still to be fed, from the images they belong to
        index, todo, rows, first = torch.nonzero(tokens == pad).flatten(), [], [], 0
        for (r, _), n in zip(images, sizes):
            last = int(index[first + n - 1])
            if last >= state.length:
                if r is None:
                    raise ValueError("an image the state has not taken in whole needs its rows")
                keep = index[first:first + n] >= state.length
                todo.append(index[first:first + n][keep])
                rows.append(r[keep.to(r.device)])
            first += n
        state.media = (torch.cat(todo), to_device(torch.cat(rows).float(), self.device)) if todo else None

    def _with_media(self, x: torch.Tensor, state: Qwen4ExpState) -> torch.Tensor:
        """The token embeddings x (T, dim) of tokens state.length.., with the rows of planned
        images in place of their tokens'."""
        if state.media is None:
            return x
        index, rows = state.media
        start, T = state.length, x.shape[0]
        here = (index >= start) & (index < start + T)
        if bool(here.any()):
            x = x.clone()
            x[index[here] - start] = rows[here].to(x.dtype)
        if int(index[-1]) < start + T:  # every row placed
            state.media = None
        return x

    def logits(self, x: torch.Tensor, xn: torch.Tensor | None = None) -> torch.Tensor:
        """(T, vocab) float32 from the streams after the last layer (`xn`: their norm by the
        output mixer's weight, where the last write gave it)."""
        h, _ = self.out_hc.read(x, xn)
        return self.output(h).float()

    def verify(self, tokens, state: Qwen4ExpState) -> torch.Tensor:
        """Logits (T, vocab) of every row, as `forward`, leaving what `state.keep(n)` needs to
        cut the state back to the first n tokens."""
        state.begin_verify()
        return self.forward(tokens, state)

    @torch.inference_mode()
    def draft(self, token: int, state: Qwen4ExpState, hidden: torch.Tensor | None = None, step: int = 0):
        """One MTP row: (logits (vocab,), the block's output streams (S*H,)) for `token` at
        position state.length + step, from `hidden` (None: the trunk's streams at the last
        position). The row's keys stay in state.mtp until `state.mtp.truncate(state.length)`."""
        hidden = state.hidden if hidden is None else hidden
        if hidden is None:  # nothing seen yet: no streams before position 0
            hidden = torch.zeros(self.cfg.streams * self.cfg.dim, device=self.device)
        logits, x = self.mtp.step(self, torch.tensor([token]), hidden.reshape(1, -1), state.mtp,
                                  state.length + step, state.positions)
        return logits[0], x[0]

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
