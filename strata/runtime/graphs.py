"""A dense model's decode step as one CUDA graph: captured once per cache, then replayed.

A decode step of SmolLM2 launches hundreds of kernels of a few microseconds each; launched
one by one from Python they cost more than the memory they read (measured on an H200:
30 tok/s, 0.07% of the copy bandwidth). A graph replays them without Python.

A graph fixes every address and shape, so the step it holds is written for that
(`step`): the token and its position are device tensors the replay reads; keys and
values are written at the position by `index_copy_`; attention runs over the cache's whole
capacity with the positions past this one masked out; RoPE takes its rows by the device
position; the embedding row is gathered from the blocks on the device. `step` is plain
torch and Triton, so on the CPU it runs as is (the tests check it against the model's
own decode); only the capture needs CUDA.

This is the `llama` architecture's step; Flash-Next's is strata.runtime.graphs_qwen4exp.
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from strata.nn.attention import one_token
from strata.nn.rope import rotate


def enabled() -> bool:
    """STRATA_CUDA_GRAPHS=0 turns capture off (for measuring what it buys)."""
    return os.environ.get("STRATA_CUDA_GRAPHS", "1") not in ("0", "")


def _attend(attn, x: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
    """Attention of one token at device position `pos` (shape (1,)) over the whole cache."""
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    qk, v = attn.qkv(x).split([(H + Hkv) * D, Hkv * D], dim=-1)
    qk = qk.reshape(1, H + Hkv, D).transpose(0, 1)                     # (H + Hkv, 1, D)
    qk = rotate(qk, attn.rope.cos[pos], attn.rope.sin[pos], attn.rope.dim)  # rows (1, rope_dim)
    q, k = qk[:H], qk[H:]
    v = v.reshape(1, Hkv, D).transpose(0, 1)
    cache.write(attn.layer, pos, k, v)
    keys, vals = cache.read(attn.layer)                                 # (Hkv, C, D) float32
    later = torch.arange(keys.shape[1], device=keys.device) > pos       # positions not yet written
    return attn.wo(one_token(q, keys, vals, later).reshape(1, H * D))


def step(model, tok: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
    """Logits (1, vocab) of token `tok` at position `pos` (device tensors of shape (1,)),
    its keys and values written into `cache` (whose length the caller advances)."""
    x = model.embed_rows(tok)
    for b in model.blocks:
        x = x + _attend(b.attn, b.attn_norm(x), pos, cache)
        gate, up = b.gate_up(b.ffn_norm(x)).split(b.ffn_dim, dim=-1)
        x = x + b.down(F.silu(gate) * up)
    return model.output(model.norm(x)).float()


class DecodeGraph:
    """`step` for one cache, captured as a CUDA graph (on CUDA) or run as is (elsewhere)."""

    def __init__(self, model, cache):
        # the cache holds its graph (cache.graph); the graph refers back weakly, so that a
        # finished request's cache frees its KV rows and the graph's pool at once, not at
        # the next cycle collection (as graphs_qwen4exp's states do)
        self.model, self._cache = model, weakref.ref(cache)
        dev = cache.k.device
        self.capacity = cache.k.shape[2]
        model.rope_table(self.capacity)
        rope = model.blocks[0].attn.rope
        # the RoPE rows the graph reads by address, held: a longer table made later (for
        # another cache: Rope._table registers new buffers) would free them under it
        self.rope_rows = (rope.cos, rope.sin)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph = None
        if dev.type == "cuda":
            keep = cache.length  # the warm-up writes at position `length`, then the real step does
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # compiles every kernel and sizes the allocator's pool
                self.pos.fill_(keep)
                for _ in range(2):
                    step(model, self.tok, self.pos, cache)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # captured on the warm-up's stream: what a launcher keeps a stream (the zeroed
            # counts of int8.zeroed_counts) was made and zeroed by the warm-up, not in the
            # capture, where a zeroing is only recorded
            with torch.cuda.graph(self.graph, stream=side):
                self.out = step(model, self.tok, self.pos, cache)

    def __call__(self, tok: int) -> torch.Tensor:
        c = self._cache()
        self.tok.fill_(tok)
        self.pos.fill_(c.length)
        if self.graph is not None:
            self.graph.replay()
            out = self.out.clone()  # the caller's: the next replay rewrites the graph's
        else:
            out = step(self.model, self.tok, self.pos, c)
        c.length += 1
        return out
