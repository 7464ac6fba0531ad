"""QSA kernels: for any context length, budget and block size, with blocks at the edges and
tied scores, the block scores equal the reference's per-query loop, the selection equals
torch.topk over each query's own visible scores, and the block-sparse attention (Triton
and torch) equals dense attention under the selection's mask.

Tolerances, float32 throughout (unit roundoff u = 2^-24, gamma_n = n u / (1 - n u)):
- scores: each is a sum over n_idx heads of a d-term dot product, then a division;
  |error| <= gamma_(d + n_idx + 1) * sum_h |q_h| . |k_b| / sqrt(d) (Higham's bound for
  dot products; relu does not add error).
- attention: the output is a convex combination of V rows. A logit off by e moves each
  weight by at most a factor exp(2e), so the output moves by at most
  max|v| * (exp(2e) - 1 + gamma_(S + 2)) with e = gamma_(D + 1) * max |q| . |k| / sqrt(D)
  over S slots (the softmax's sums and the division); twice that for the two sides'
  independent roundings.
A lost or extra block moves outputs by a weight's share of max|v|, orders above these.
"""
from __future__ import annotations

import math

import pytest

import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.tiers import examples

from triton_kernels.backend import interpreter_on
from triton_kernels.qsa import (
    qsa_attention,
    qsa_attention_torch,
    qsa_pool,
    qsa_pool_torch,
    qsa_scores,
    qsa_scores_torch,
    select_blocks,
    select_sorted,
    token_mask,
    visible_blocks,
)

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def test_the_interpreter_is_on():
    assert interpreter_on()  # else the launchers would run the torch twins twice


# --- scores --------------------------------------------------------------------------------

def scores_reference(q, blocks, start, ratio):
    """transformers' loop: query by query, its visible blocks only, -inf past them."""
    n_idx, T, d = q.shape
    out = torch.full((T, blocks.shape[0]), float("-inf"))
    for t in range(T):
        n = (start + t + 1) // ratio
        if n:
            s = torch.matmul(q[:, t], blocks[:n].T).transpose(-1, -2)
            out[t, :n] = torch.relu(s).sum(dim=-1) / math.sqrt(d)
    return out


@settings(max_examples=examples(25), deadline=None)
@given(n_idx=st.integers(1, 5), d=st.sampled_from([16, 24, 32]), T=st.integers(1, 9),
       start=st.integers(0, 60), ratio=st.integers(1, 5), seed=st.integers(0, 2**16),
       zeros=st.booleans())
@example(n_idx=4, d=32, T=1, start=63, ratio=4, seed=0, zeros=True)   # a decode step, all blocks seen
def test_scores_equal_the_per_query_loop(n_idx, d, T, start, ratio, seed, zeros):
    g = torch.Generator().manual_seed(seed)
    nb = (start + T) // ratio
    q = torch.randn(n_idx, T, d, generator=g)
    blocks = torch.randn(nb, d, generator=g)
    if zeros and nb:  # blocks against which every head's dot is negative: exact-zero scores
        blocks[::2] = -blocks[::2].abs()
        q = q.abs()
    want = scores_reference(q, blocks, start, ratio)
    bound = gamma(d + n_idx + 1) * (q.abs() @ blocks.abs().T).sum(0) / math.sqrt(d)
    for got in (qsa_scores(q, blocks, start, ratio), qsa_scores_torch(q, blocks, start, ratio)):
        assert got.shape == (T, nb)
        seen = torch.isfinite(want)
        assert torch.equal(seen, torch.isfinite(got))
        assert bool(((got - want).abs()[seen] <= bound.expand_as(got)[seen] + 1e-30).all())
        if zeros and nb:
            assert bool((got[:, ::2][seen[:, ::2]] == 0).all())  # exact zeros stay exact: ties
    # a decode graph's start, read by the kernel from the device: the same bits
    assert torch.equal(qsa_scores(q, blocks, torch.tensor([start]), ratio), qsa_scores(q, blocks, start, ratio))


# --- selection -----------------------------------------------------------------------------

@settings(max_examples=examples(40), deadline=None)
@given(T=st.integers(1, 12), start=st.integers(0, 120), ratio=st.integers(1, 5), keep=st.integers(1, 8),
       seed=st.integers(0, 2**16), levels=st.integers(1, 4))
@example(T=1, start=4095, ratio=4, keep=16, seed=1, levels=1)  # all scores equal: ties everywhere
def test_selection_breaks_ties_as_topk_over_the_visible_scores(T, start, ratio, keep, seed, levels):
    g = torch.Generator().manual_seed(seed)
    nb = (start + T) // ratio
    # few distinct values (0 among them): most scores tie
    scores = torch.randint(0, levels, (T, nb), generator=g).float()
    sel = select_blocks(scores, start, ratio, keep)
    assert sel.shape == (T, keep) and sel.dtype == torch.int64
    for t in range(T):
        n = (start + t + 1) // ratio
        want = list(range(n)) if n <= keep else sorted(scores[t, :n].topk(keep).indices.tolist())
        got = sorted(b for b in sel[t].tolist() if b >= 0)
        assert got == want, (t, n)
        assert (sel[t] < 0).sum() == max(0, keep - n)


@settings(max_examples=examples(40), deadline=None)
@given(T=st.integers(1, 6), nb=st.integers(1, 40), keep=st.integers(1, 12), seed=st.integers(0, 2**16),
       levels=st.integers(1, 3))
def test_a_graphs_selection_keeps_the_lower_of_tied_blocks(T, nb, keep, seed, levels):
    """select_sorted (a decode graph's choice over its whole row, unseen blocks -inf): the
    `keep` best by (score, then the lower block), the -inf ones last, with their scores."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (T, nb), generator=g).float()
    scores[torch.rand(T, nb, generator=g) < 0.3] = float("-inf")
    best, sel = select_sorted(scores, keep)
    assert sel.shape == best.shape == (T, min(keep, nb))
    for t in range(T):
        want = sorted(range(nb), key=lambda b: (-scores[t, b].item(), b))[:keep]
        assert sel[t].tolist() == want and torch.equal(best[t], scores[t, want])


# --- attention -----------------------------------------------------------------------------

def random_selection(g, T, start, ratio, keep, edges):
    """For each query, min(keep, n_p) of its visible blocks (the first and the last one
    among them when `edges`), -1 after."""
    sel = torch.full((T, keep), -1, dtype=torch.int64)
    for t, n in enumerate(visible_blocks(start, T, ratio).tolist()):
        order = torch.randperm(n, generator=g)
        if edges and n:
            rest = order[(order != 0) & (order != n - 1)]
            order = torch.cat([torch.tensor([n - 1, 0][:min(n, 2)]), rest])
        m = min(keep, n)
        sel[t, :m] = order[:m]
    return sel


def attention_reference(q, k, v, sel, start, ratio):
    """Dense attention over the whole cache under the selection's token mask."""
    H, T, D = q.shape
    mask = token_mask(sel, start, ratio, k.shape[1])
    return F.scaled_dot_product_attention(q[None], k[None].float(), v[None].float(), attn_mask=mask,
                                          enable_gqa=True)[0]


def attention_bound(q, k, v, sel, ratio):
    D, S = q.shape[-1], sel.shape[1] * ratio + ratio - 1
    G = q.shape[0] // k.shape[0]
    qk = (q.abs().reshape(k.shape[0], G, -1, D).flatten(1, 2) @ k.float().abs().transpose(1, 2)).max()
    e = gamma(D + 1) * float(qk) / math.sqrt(D)
    return 2 * float(v.float().abs().max()) * (math.expm1(2 * e) + gamma(S + 2))


@settings(max_examples=examples(30), deadline=None)
@given(heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)]), D=st.sampled_from([16, 24, 32]),
       T=st.integers(1, 6), start=st.integers(0, 70), ratio=st.integers(1, 5), keep=st.integers(1, 5),
       extra=st.integers(0, 9), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       edges=st.booleans(), seed=st.integers(0, 2**16))
@example(heads=(4, 2), D=32, T=1, start=67, ratio=4, keep=16, extra=0, dtype=torch.float32, edges=True,
         seed=0)  # a decode step at flash-tiny's budget: 16 blocks, the open block's 3 tokens
def test_block_sparse_attention_equals_the_masked_dense_one(heads, D, T, start, ratio, keep, extra, dtype,
                                                            edges, seed):
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    N = start + T + extra  # cache rows past the last query (spare capacity) are never read
    q = torch.randn(H, T, D, generator=g)
    k = torch.randn(Hkv, N, D, generator=g).to(dtype)
    v = torch.randn(Hkv, N, D, generator=g).to(dtype)
    sel = random_selection(g, T, start, ratio, keep, edges)
    want = attention_reference(q, k[:, :start + T], v[:, :start + T], sel, start, ratio)
    tol = attention_bound(q, k, v, sel, ratio)
    for got in (qsa_attention(q, k, v, sel, start, ratio), qsa_attention_torch(q, k, v, sel, start, ratio)):
        assert got.shape == (H, T, D) and got.dtype == torch.float32
        assert float((got - want).abs().max()) <= tol


@settings(max_examples=examples(15), deadline=None)
@given(T=st.integers(1, 4), start=st.integers(0, 40), ratio=st.integers(1, 4), keep=st.integers(1, 6),
       extra=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_unseen_blocks_count_as_none_and_a_device_start_as_its_value(T, start, ratio, keep, extra, seed):
    """A decode graph's selection (its scores sorted, strata.runtime.graphs_qwen4exp) puts
    blocks a query does not yet see where eager selection puts -1, and its start is a
    device tensor: both kernels attend exactly as to the eager selection at an int start."""
    g = torch.Generator().manual_seed(seed)
    N = start + T + extra
    q, k, v = torch.randn(4, T, 16, generator=g), torch.randn(2, N, 16, generator=g), torch.randn(2, N, 16, generator=g)
    sel = random_selection(g, T, start, ratio, keep, True)
    n_vis = visible_blocks(start, T, ratio)
    unseen = torch.where(sel < 0, n_vis[:, None] + torch.randint(0, 1 + N // ratio, sel.shape, generator=g), sel)
    want = qsa_attention(q, k, v, sel, start, ratio)
    assert torch.equal(qsa_attention(q, k, v, unseen, torch.tensor([start]), ratio), want)
    assert torch.equal(qsa_attention_torch(q, k, v, unseen, start, ratio), qsa_attention_torch(q, k, v, sel, start, ratio))


@settings(max_examples=examples(12), deadline=None)
@given(heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]), D=st.sampled_from([16, 24, 32, 64]), T=st.integers(1, 4),
       start=st.integers(0, 40), ratio=st.integers(1, 4), keep=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_the_gated_launch_writes_sigmoid_muls_rows_and_their_int8(heads, D, T, start, ratio, keep, seed):
    """With `gate` the launch writes the output projection's input, sigmoid_mul(gate, out
    as rows (T, H*D)), bit for bit, and with D a multiple of 32 the int8 quantize_x would
    write of it, attached; the torch twin's likewise from its own rows."""
    from triton_kernels.int8 import quantize_x
    from triton_kernels.shared_expert import sigmoid_mul, sigmoid_mul_torch
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    N = start + T
    q, k, v = torch.randn(H, T, D, generator=g), torch.randn(Hkv, N, D, generator=g), torch.randn(Hkv, N, D, generator=g)
    sel = random_selection(g, T, start, ratio, keep, True)
    gate = (torch.randn(T, H * D + 3, generator=g) * 4)[:, 3:]  # a column range of a fused projection
    rows = qsa_attention(q, k, v, sel, start, ratio).transpose(0, 1).reshape(T, H * D)
    got = qsa_attention(q, k, v, sel, torch.tensor([start]), ratio, gate=gate)
    assert torch.equal(got, sigmoid_mul(gate, rows))
    if D % 32 == 0:
        x8, want = quantize_x(got), quantize_x(got.clone())
        assert x8.q.data_ptr() != want.q.data_ptr() and all(torch.equal(a, b) for a, b in zip(x8, want))
    twin = qsa_attention_torch(q, k, v, sel, start, ratio).transpose(0, 1).reshape(T, H * D)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter: the torch twin
        assert torch.equal(qsa_attention(q, k, v, sel, start, ratio, gate=gate), sigmoid_mul_torch(gate, twin))
    with pytest.raises(ValueError, match="gate must be float32 rows"):
        qsa_attention(q, k, v, sel, start, ratio, gate=gate[:, 1:])


def test_a_lost_block_is_seen():
    # the property's tolerance is far below what one dropped block moves
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(4, 2, 32, generator=g), torch.randn(2, 40, 32, generator=g), torch.randn(2, 40, 32, generator=g)
    sel = random_selection(g, 2, 38, 4, 3, True)
    fewer = sel.clone()
    fewer[:, 0] = -1
    diff = (qsa_attention(q, k, v, fewer, 38, 4) - attention_reference(q, k[:, :40], v[:, :40], sel, 38, 4)).abs()
    assert float(diff.max()) > 1e3 * attention_bound(q, k, v, sel, 4)


@settings(max_examples=examples(15), deadline=None)
@given(heads=st.sampled_from([(2, 1), (4, 2)]), D=st.sampled_from([16, 32]), T=st.integers(1, 4),
       start=st.integers(0, 40), ratio=st.integers(1, 4), keep=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_an_int8_cache_attends_as_its_decoded_rows(heads, D, T, start, ratio, keep, seed):
    # `--kv int8` (strata.nn.kv): the kernels read the codes and scale each row as they load
    # it, so the answer is the float path's on the decoded rows, within the same bound
    from strata.nn import kv
    g = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    N = start + T
    q = torch.randn(H, T, D, generator=g)
    (k, ks), (v, vs) = (kv.encode(torch.randn(Hkv, N, D, generator=g) * 3, "int8") for _ in range(2))
    kd, vd = kv.decode(k, ks), kv.decode(v, vs)
    sel = random_selection(g, T, start, ratio, keep, True)
    want = attention_reference(q, kd, vd, sel, start, ratio)
    tol = attention_bound(q, kd, vd, sel, ratio)
    for got in (qsa_attention(q, k, v, sel, start, ratio, ks, vs), qsa_attention_torch(q, k, v, sel, start, ratio, ks, vs)):
        assert float((got - want).abs().max()) <= tol
    with pytest.raises(ValueError, match="k_scale"):
        qsa_attention_torch(q, k, v, sel, start, ratio)


# --- a decode graph's block keys ------------------------------------------------------------

@settings(max_examples=examples(20), deadline=None)
@given(T=st.integers(1, 4), p0=st.integers(0, 40), ratio=st.integers(1, 5), d=st.sampled_from([16, 24]),
       rope=st.sampled_from([8, 16]), kind=st.sampled_from(["f32", "bf16", "int8"]), seed=st.integers(0, 2**16))
def test_the_pooled_block_keys_of_a_graph_within_float32_rounding_of_float64(T, p0, ratio, d, rope, kind, seed):
    """qsa_pool (one launch) and its torch twin write each position's block key: the mean
    of the block's raw keys as stored (the rows past the capacity the last one's), normed,
    roped at the block's first position; the other blocks untouched. Bound, against the
    same in float64: the mean's error, gamma(ratio + 1) of the rows' largest |value|,
    over the key's rms, plus the norm's and the rope's own, gamma(d + 8), all times the
    output's scale 2 max|w|."""
    from strata.nn import kv
    g = torch.Generator().manual_seed(seed)
    C = p0 + T + int(torch.randint(0, 6, (1,), generator=g))
    data, scale = kv.encode(torch.randn(C, d, generator=g) * 3, kind)
    pos = torch.arange(p0, p0 + T)
    w, ang = torch.randn(d, generator=g), torch.randn(C + 8, rope // 2, generator=g)
    cos, sin = torch.cat([ang.cos(), ang.cos()], 1), torch.cat([ang.sin(), ang.sin()], 1)
    nb = C // ratio + 1
    before = torch.randn(nb, d, generator=g)
    rows = kv.decode(data, scale).double()  # int8 codes times bf16 scales: exact in float32
    want, bound = before.double().clone(), torch.zeros(nb, dtype=torch.float64)
    for b in sorted({p // ratio for p in pos.tolist()}):
        block = rows[[min(b * ratio + j, C - 1) for j in range(ratio)]]
        x = block.mean(0)
        rms = torch.sqrt((x * x).mean() + 1e-6)
        y = x / rms * w.double()
        rot = torch.cat([-y[rope // 2:rope], y[:rope // 2]])
        want[b] = torch.cat([y[:rope] * cos[b * ratio].double() + rot * sin[b * ratio].double(), y[rope:]])
        bound[b] = 2 * w.abs().max() * (gamma(ratio + 1) * block.abs().max() / rms + gamma(d + 8))
    touched = bound > 0
    for f in (qsa_pool, qsa_pool_torch):
        got = before.clone()
        f(data, scale, pos, ratio, w, 1e-6, cos, sin, got)
        assert torch.equal(got[~touched], before[~touched]), f.__name__
        err = (got.double() - want).abs().amax(dim=1)
        assert bool((err[touched] <= bound[touched]).all()), (f.__name__, err[touched], bound[touched])
