"""The decode step a CUDA graph captures (strata.runtime.graphs.step), run as is on the
CPU, gives the model's own decode logits and keys: the graph replays exactly this code.

Tolerance: 1e-5 of the largest |logit|. Both run the same weights in float32; they
differ in attention's summation (the step attends over the cache's whole capacity with
the unwritten positions masked, the model over the written ones), measured about 1e-7."""
from __future__ import annotations

import pytest
import torch

from strata.load import load_model
from strata.runtime.graphs import DecodeGraph


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    return load_model(smollm2_gguf, dtype=torch.float32, kernels="torch")


def test_graph_step_equals_the_models_decode(model):
    prompt = [1, 504, 3458, 314, 2113]
    a, b = model.new_cache(16), model.new_cache(16)
    model(prompt, a, last_only=True)
    model(prompt, b, last_only=True)
    g = DecodeGraph(model, b)
    tok = 42
    for _ in range(4):
        want = model([tok], a, last_only=True)
        got = g(tok)
        assert b.length == a.length
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5
        n = a.length
        scale = a.k[:, :, :n].abs().max()
        assert float((b.k[:, :, :n] - a.k[:, :, :n]).abs().max() / scale) < 1e-5  # keys written alike
        tok = int(want.argmax())


def test_a_graph_holds_the_rope_rows_it_reads(model):
    """A captured graph reads RoPE's rows by address: a longer table made after it (for
    another, longer cache) registers new buffers, and must not free the graph's."""
    cache = model.new_cache(16)
    model([1, 504], cache)
    g = DecodeGraph(model, cache)
    rope = model.blocks[0].attn.rope
    cos, sin = rope.cos, rope.sin
    rope._table(cos.shape[0] * 2)
    assert rope.cos is not cos and g.rope_rows[0] is cos and g.rope_rows[1] is sin


def test_the_logits_a_replay_returns_outlive_the_next_replay(model):
    """A replay writes the graph's one output buffer: what a caller holds is its own."""
    cache = model.new_cache(16)
    model([1, 504], cache)
    g = DecodeGraph(model, cache)

    class Replay:  # a captured graph's replay: the step again, into the same buffer
        def replay(self):
            g.out.copy_(torch.randn_like(g.out))

    g.out, g.graph = torch.zeros(1, 8), Replay()
    first = g(42)
    kept = first.clone()
    second = g(43)
    assert torch.equal(first, kept) and torch.equal(second, g.out) and second is not g.out


def test_decode_on_cuda_takes_the_graph_only_where_it_can(model, monkeypatch):
    # on the CPU the model decodes eagerly; a graph is made for CUDA caches only
    cache = model.new_cache(8)
    model([1, 2, 3], cache, last_only=True)
    model([4], cache, last_only=True)
    assert getattr(cache, "graph", None) is None
