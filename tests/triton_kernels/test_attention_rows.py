"""attention_rows (triton_kernels.attention_rows): a decode graph's attention inputs in one
launch. The launch is the separate launches' result bit for bit (norm_rope2, norm_rope,
qsa_pool after the rows' index_copy_), each of which tests/triton_kernels/test_rope.py and
test_qsa.py bound against float64; the torch twin is checked against float64 here: q, k
and the indexer queries within norm_rope's bound gamma(D + 9) of their magnitudes (the
test_rope module's), v and the indexer keys stored as their own rounding to the cache's
dtype, every other row of the caches untouched, the pooled block keys within qsa_pool's
bound (test_qsa.py's)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from tests.triton_kernels.test_rope import gamma, reference
from triton_kernels.attention_rows import attention_rows, attention_rows_torch, cache_write_torch
from triton_kernels.backend import interpreter_on
from triton_kernels.qsa import qsa_pool
from triton_kernels.rope import norm_rope, norm_rope2

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="the kernel runs on the CPU under TRITON_INTERPRET=1 (the suite sets it)")

EPS = 1e-6


def layer(seed: int, T: int, H: int, Hk: int, D: int, NI: int, DI: int, R: int, C: int, ratio: int, dtype):
    """A fused projection's rows cut as gated_attention.heads cuts them (strided views), the
    weights, RoPE tables over the capacity, and caches holding earlier rows."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(T, H * 2 * D + 2 * Hk * D + NI * DI + DI, generator=g) * 3
    qg, k, v, iq, ik = wide.split([H * 2 * D, Hk * D, Hk * D, NI * DI, DI], -1)
    rows = dict(q=qg.reshape(T, H, 2 * D)[..., :D], k=k.reshape(T, Hk, D), v=v.reshape(T, Hk, D), iq=iq, ik=ik)
    w = {n: torch.randn(d, generator=g) for n, d in (("wq", D), ("wk", D), ("wiq", DI), ("wik", DI))}
    ang = torch.randn(C, R // 2, generator=g)
    tables = (torch.cat([ang.cos(), ang.cos()], 1), torch.cat([ang.sin(), ang.sin()], 1))
    caches = [torch.randn(Hk, C, D, generator=g).to(dtype), torch.randn(Hk, C, D, generator=g).to(dtype),
              torch.randn(C, DI, generator=g).to(dtype), torch.randn(C // ratio + 1, DI, generator=g)]
    return rows, w, tables, caches


def run(f, rows, w, tables, caches, pos, ratio, idx: bool, queries: bool, pool: bool, slots=None):
    kc, vc, ic, blocks = caches
    i = (rows["iq"] if queries else None, w["wiq"], rows["ik"], ic) if idx else None
    return f(rows["q"], w["wq"], rows["k"], w["wk"], rows["v"], EPS, *tables, pos, kc, vc, i,
             (ratio, w["wik"], blocks) if pool else None, slots)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # -0.0 and NaN too


shapes = dict(T=st.integers(1, 4), p0=st.integers(0, 20), ratio=st.integers(1, 5), H=st.integers(1, 4),
              Hk=st.integers(1, 2), D=st.sampled_from([16, 32]), NI=st.integers(1, 3), DI=st.sampled_from([8, 16]),
              seed=st.integers(0, 2 ** 16))


@settings(max_examples=examples(25), deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       parts=st.sampled_from(["kv", "idx", "queries", "pool", "slots"]), **shapes)
def test_one_launch_is_the_separate_launches_bit_for_bit(dtype, parts, T, p0, ratio, H, Hk, D, NI, DI, seed):
    """Whatever part it takes (keys and values; the indexer's key; its queries; the block
    keys, the step's positions within one block or across two; rows stored at slots other
    than the positions, as after an image), from caches whose other rows hold earlier keys."""
    R, C = 8, p0 + T + 3
    rows, w, tables, caches = layer(seed, T, H, Hk, D, NI, DI, R, C, ratio, dtype)
    pos = torch.arange(p0, p0 + T)
    idx, queries, pool = parts != "kv", parts in ("queries", "pool", "slots"), parts == "pool"
    slots = torch.arange(C - T, C) if parts == "slots" else None  # the last rows: past the positions
    apart = [c.clone() for c in caches]
    q, k = norm_rope2(rows["q"], w["wq"], rows["k"], w["wk"], EPS, *tables, pos)
    cache_write_torch([apart[0], apart[1]] + ([apart[2]] if idx else []),
                      [k, rows["v"].transpose(0, 1)] + ([rows["ik"]] if idx else []), pos if slots is None else slots)
    if pool:
        qsa_pool(apart[2], None, pos, ratio, w["wik"], EPS, *tables, apart[3])
    qi = norm_rope(rows["iq"].reshape(T, NI, DI), w["wiq"], EPS, *tables, pos) if queries else None
    fused = [c.clone() for c in caches]
    q2, qi2 = run(attention_rows, rows, w, tables, fused, pos, ratio, idx, queries, pool, slots)
    assert same(q2, q) and (qi2 is None if qi is None else same(qi2, qi))
    assert all(same(a, b) for a, b in zip(fused, apart))


@settings(max_examples=examples(15), deadline=None)
@given(**shapes)
def test_the_torch_twin_within_float32_rounding_of_float64(T, p0, ratio, H, Hk, D, NI, DI, seed):
    R, C = 8, p0 + T + 3
    rows, w, tables, caches = layer(seed, T, H, Hk, D, NI, DI, R, C, ratio, torch.float32)
    pos = torch.arange(p0, p0 + T)
    cos, sin = (t[pos] for t in tables)
    got = [c.clone() for c in caches]
    q, qi = run(attention_rows_torch, rows, w, tables, got, pos, ratio, True, True, True)
    for y, x, wt, d in ((q, rows["q"], w["wq"], D), (qi, rows["iq"].reshape(T, NI, DI), w["wiq"], DI),
                        (got[0][:, pos], rows["k"], w["wk"], D)):
        ref, mag = reference(x, wt, EPS, cos, sin)
        assert bool(((y.double() - ref).abs() <= gamma(d + 9) * mag).all())
    assert torch.equal(got[1][:, pos], rows["v"].transpose(0, 1)) and torch.equal(got[2][pos], rows["ik"])
    others = torch.ones(C, dtype=torch.bool)
    others[pos] = False
    assert all(torch.equal(a[..., others, :], b[..., others, :]) for a, b in zip(got[:3], caches[:3]))
    # the block keys: the mean of a block's stored rows, normed, roped at its first position
    touched = sorted({p // ratio for p in pos.tolist()})
    for b in range(got[3].shape[0]):
        if b not in touched:
            assert torch.equal(got[3][b], caches[3][b])
            continue
        block = got[2][[min(b * ratio + j, C - 1) for j in range(ratio)]].double()
        x = block.mean(0)
        rms = torch.sqrt((x * x).mean() + EPS)
        y = x / rms * w["wik"].double()
        turned = torch.cat([-y[R // 2:R], y[:R // 2]])
        ref = torch.cat([y[:R] * tables[0][b * ratio].double() + turned * tables[1][b * ratio].double(), y[R:]])
        bound = 2 * w["wik"].abs().max() * (gamma(ratio + 1) * block.abs().max() / rms + gamma(DI + 8))
        assert float((got[3][b].double() - ref).abs().max()) <= bound


def test_attention_rows_names_what_it_takes():
    rows, w, tables, caches = layer(0, 1, 2, 1, 16, 1, 8, 8, 8, 4, torch.float32)
    pos = torch.tensor([3])
    int8 = [c.to(torch.int8) for c in caches[:3]] + caches[3:]
    with pytest.raises(ValueError, match="an int8 cache's rows need their scales"):
        run(attention_rows, rows, w, tables, int8, pos, 4, False, False, False)
    with pytest.raises(ValueError, match="pooling the block keys needs the indexer's rows"):
        run(attention_rows, rows, w, tables, caches, pos, 4, False, False, True)
    with pytest.raises(ValueError, match="give no slots with a pool"):
        run(attention_rows, rows, w, tables, caches, pos, 4, True, True, True, slots=pos + 1)
    with pytest.raises(ValueError, match=r"k_cache and v_cache must be \(1, capacity, 16\)"):
        run(attention_rows, rows, w, tables, [caches[0][:, :, :8]] + caches[1:], pos, 4, False, False, False)
