"""Sparse QSA in GatedAttention: for any split of a sequence into chunks, and after rolling
the state back, the layer gives what one pass of the dense-masked reference gives.

Tolerance 1e-5 relative to the largest |output|: both sides are float32 and differ only
in the order of the softmax sums (sparse gathers the selected tokens, the reference masks
the whole row); a wrong selection (a block or the open tail lost) moves outputs by 1e-2 or
more at these sizes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.tiers import examples

import quant
from strata.nn import QuantLinear, Rope
from strata.nn.gated_attention import AttentionState, GatedAttention
from strata.tensors import QTensor
from triton_kernels.qsa import token_mask

DIM = 48


def _lin(g: torch.Generator, rows: int, cols: int, name: str) -> QTensor:
    w = (torch.randn(rows, cols, generator=g) / cols ** 0.5).numpy().astype(np.float32)
    return QTensor(name, quant.get("F32"), (rows, cols), w.view(np.uint8).reshape(rows, -1))


def layer(seed: int = 0, H: int = 4, Hkv: int = 2, D: int = 32, n_idx: int = 2, d: int = 16,
          budget: int = 16, ratio: int = 4) -> GatedAttention:
    """A small random gated-attention layer with an indexer (keeps budget // ratio blocks)."""
    g = torch.Generator().manual_seed(seed)
    proj = [_lin(g, H * 2 * D, DIM, "q"), _lin(g, Hkv * D, DIM, "k"), _lin(g, Hkv * D, DIM, "v"),
            _lin(g, n_idx * d, DIM, "iq"), _lin(g, d, DIM, "ik")]
    norm = (lambda n: 1 + 0.1 * torch.randn(n, generator=g))
    return GatedAttention(QuantLinear(proj), QuantLinear(_lin(g, DIM, H * D, "o")), norm(D), norm(D), H, Hkv, D,
                          Rope(8, 10000.0), 1e-6, norm(d), norm(d), n_idx, d, budget, ratio)


def run(attn: GatedAttention, x: torch.Tensor, cuts, state: AttentionState | None = None) -> torch.Tensor:
    state = state if state is not None else AttentionState()
    with torch.inference_mode():
        return torch.cat([attn(x[a:b], state, a) for a, b in zip(cuts[:-1], cuts[1:])])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def attn() -> GatedAttention:
    return layer()


def test_truncate_rolls_back_to_the_first_n_tokens(attn):
    x = torch.randn(40, DIM, generator=torch.Generator().manual_seed(1))
    want = run(attn, x, [0, 40])
    state = AttentionState()
    run(attn, x, [0, 30], state)
    drafts = torch.cat([x[:30], torch.randn(7, DIM)])
    run(attn, drafts, [30, 37], state)                # drafted tokens 30..36, then rejected
    assert state.n == 37 and state.n_blocks == 9      # block 8 (tokens 32..35) pooled from drafts
    state.truncate(30)
    assert state.n == 30 and state.n_blocks == 7      # block 7 (28..31) read token 30: dropped
    assert state.k.shape[1] == 30 and state.idx.shape[0] == 30
    got = torch.cat([run(attn, x, [t, t + 1], state) for t in range(30, 40)])
    assert rel(got, want[30:]) < 1e-5
    with pytest.raises(ValueError, match="cannot be truncated to 41"):
        state.truncate(41)


def test_copy_is_independent(attn):
    x = torch.randn(30, DIM, generator=torch.Generator().manual_seed(2))
    st = AttentionState()
    run(attn, x, [0, 26], st)
    c = st.copy()
    want = run(attn, x, [26, 30], st)
    assert c.n == 26 and c.n_blocks == 6 and st.n_blocks == 7
    assert torch.equal(run(attn, x, [26, 30], c), want)


def test_reserve_allocates_the_context_once(attn):
    x = torch.randn(150, DIM, generator=torch.Generator().manual_seed(3))
    state = AttentionState()
    state.reserve(150)
    run(attn, x, [0, 1], state)
    k = state.kv_cache()[0]
    assert k.shape[1] == 150
    run(attn, x, [1, 80, 150], state)
    assert state.kv_cache()[0] is k  # never grown: no copy of the cache on the way


@settings(max_examples=examples(15), deadline=None)
@given(n=st.integers(1, 90), cuts=st.lists(st.integers(1, 89), max_size=6), seed=st.integers(0, 2**16))
@example(n=70, cuts=[15, 16, 17, 18, 19, 20], seed=0)  # token by token across the budget (16 tokens)
def test_any_split_into_chunks_equals_one_pass(attn, n, cuts, seed):
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))
    cuts = sorted({0, n, *(c for c in cuts if c < n)})
    assert rel(run(attn, x, cuts), run(attn, x, [0, n])) < 1e-5


def _dense_masked(q, k, v, sel, start, ratio):
    mask = token_mask(sel, start, ratio, start + q.shape[1])
    return F.scaled_dot_product_attention(q[None], k[None, :, :start + q.shape[1]],
                                          v[None, :, :start + q.shape[1]], attn_mask=mask, enable_gqa=True)[0]


def test_sparse_attention_equals_dense_attention_under_the_selection(attn, monkeypatch):
    import strata.nn.gated_attention as ga
    x = torch.randn(60, DIM, generator=torch.Generator().manual_seed(4))
    cuts = [0, 10, 33, 34, 35, 60]
    want = run(attn, x, cuts)
    real = ga.impl
    monkeypatch.setattr(ga, "impl", lambda op, k: _dense_masked if op == "qsa_attention" else real(op, k))
    assert rel(run(attn, x, cuts), want) < 1e-5


def test_triton_kernels_equal_the_torch_twins(attn):
    x = torch.randn(27, DIM, generator=torch.Generator().manual_seed(5))
    cuts = [0, 19, 26, 27]  # dense (19 tokens: 4 blocks, all kept), a sparse chunk, a sparse step
    want = run(attn, x, cuts)
    try:
        attn.kernels = "triton"  # the interpreter (tests/conftest.py)
        got = run(attn, x, cuts)
    finally:
        attn.kernels = "torch"
    assert rel(got, want) < 1e-5
