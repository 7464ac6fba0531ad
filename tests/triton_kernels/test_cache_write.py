"""cache_write (triton_kernels.cache_write): a decode graph's keys, values and indexer keys
stored at device positions in one launch, as torch's index_copy_ of the rows rounded to
the cache's dtype (.to: to nearest even): bit for bit, the rows past the positions
untouched."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers import examples

from triton_kernels.backend import interpreter_on
from triton_kernels.cache_write import cache_write, cache_write_torch

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="the kernel runs on the CPU under TRITON_INTERPRET=1 (the suite sets it)")


@settings(max_examples=examples(25), deadline=None)
@given(T=st.integers(1, 4), C=st.integers(4, 20), H=st.integers(1, 3), D=st.sampled_from([8, 12, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), pairs=st.integers(1, 3),
       strided=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_cache_write_is_index_copy_of_the_rounded_rows(T, C, H, D, dtype, pairs, strided, seed):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randperm(C, generator=g)[:T]
    shapes = [(H, C, D), (H, C, D), (C, D + 4)][:pairs]  # keys, values, the indexer's keys
    dsts = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    srcs = []
    for s in shapes:
        rows = (*s[:-2], T, s[-1])
        if strided:  # a view of a wider projection, its heads apart, as v and the indexer key are
            wide = torch.randn(T, *s[:-2], 2 * s[-1], generator=g) * 1e3
            srcs.append(wide[..., :s[-1]].movedim(0, -2))
        else:
            srcs.append(torch.randn(rows, generator=g) * 1e3)
    want = [d.clone() for d in dsts]
    cache_write_torch(want, srcs, pos)
    got = [d.clone() for d in dsts]
    cache_write(got, srcs, pos)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # every bit, -0.0 and NaN too


def test_cache_write_names_what_it_takes():
    with pytest.raises(ValueError, match="a float cache and float32 rows"):
        cache_write([torch.zeros(4, 8, dtype=torch.int8)], [torch.zeros(1, 8)], torch.tensor([0]))
    with pytest.raises(ValueError, match="share one dtype"):
        cache_write([torch.zeros(4, 8), torch.zeros(4, 8).half()], [torch.zeros(1, 8)] * 2, torch.tensor([0]))
    with pytest.raises(ValueError, match="with T = 2 positions"):
        cache_write([torch.zeros(4, 8)], [torch.zeros(1, 8)], torch.tensor([0, 1]))
