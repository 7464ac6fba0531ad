"""qsa_select (a decode graph's choice of QSA blocks in one launch) keeps the blocks of a
stable descending sort of each row, in its order: the numpy reference (np.argsort of the
negated row, kind="stable": of equal scores the lower block first) and the torch twin
(select_sorted's one stable sort) alike, with ties, -0 beside +0, unseen blocks at -inf,
and more chosen than a tile and a span of the places' comparisons. A choice is exact: no
tolerance."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.tiers import examples

from triton_kernels.qsa_select import qsa_select, qsa_select_torch


def reference(scores: np.ndarray, keep: int) -> np.ndarray:
    """The rows' `keep` best blocks, of equal scores the lower first (numpy's stable sort)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :keep]


# a few levels make ties common, as relu's zeros make them in the indexer's scores
LEVELS = np.array([0.0, -0.0, 0.5, 1.0, 2.5, -1.0, float("-inf"), 3e38, -3e38, 1e-45], dtype=np.float32)


def scores_of(rng: np.random.Generator, T: int, nb: int, levels: int) -> np.ndarray:
    tied = LEVELS[rng.integers(0, levels, (T, nb))]
    free = rng.standard_normal((T, nb)).astype(np.float32)
    return np.where(rng.random((T, nb)) < 0.5, tied, free).astype(np.float32)


@settings(max_examples=examples(40), deadline=None)
@given(T=st.integers(1, 4), nb=st.integers(1, 70), keep=st.integers(0, 70), levels=st.integers(1, len(LEVELS)),
       tile=st.sampled_from([4, 16]), span=st.sampled_from([8, 512]), seed=st.integers(0, 2**16))
@example(T=1, nb=1, keep=1, levels=1, tile=4, span=8, seed=0)
@example(T=2, nb=40, keep=40, levels=2, tile=4, span=8, seed=1)  # every block, +0 and -0 tied
@example(T=1, nb=36, keep=31, levels=4, tile=4, span=512, seed=4)  # a span past the row
def test_the_choice_is_a_stable_sorts_first_blocks(T, nb, keep, levels, tile, span, seed):
    """Places counted in tiles of 4 or 16 chosen against spans of 8 or 512."""
    keep = min(keep, nb)
    s = scores_of(np.random.default_rng(seed), T, nb, levels)
    want = reference(s, keep)
    got = qsa_select(torch.from_numpy(s), keep, tile=tile, span=span)
    assert got.dtype == torch.int64 and tuple(got.shape) == (T, keep)
    assert np.array_equal(got.numpy(), want), (s, keep, got, want)
    assert np.array_equal(qsa_select_torch(torch.from_numpy(s), keep).numpy(), want)


def launches(monkeypatch) -> list:
    """The grids of qsa_select's kernel launches made from here on (each still launched)."""
    import triton_kernels.qsa_select as module
    grids, kernel = [], module._select_kernel

    class Counted:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]
    monkeypatch.setattr(module, "_select_kernel", Counted())
    return grids


@pytest.mark.parametrize("held", [8192, 1024])
def test_rows_of_a_graphs_length_choose_as_the_sort(held, monkeypatch):
    """2,000 blocks, keep 128, unseen blocks at -inf: a graph's shapes at 8K tokens in blocks
    of 4, the row held by the launch, or (longer than `held`) sorted, with no launch."""
    rng = np.random.default_rng(7)
    s = np.maximum(rng.standard_normal((2, 2000)), 0).astype(np.float32)  # relu's zeros: ties
    s[1, 1500:] = float("-inf")
    grids = launches(monkeypatch)
    assert np.array_equal(qsa_select(torch.from_numpy(s), 128, held=held).numpy(), reference(s, 128))
    assert grids == ([(2,)] if held >= 2048 else []), grids


def test_wrong_arguments_are_named():
    with pytest.raises(ValueError, match="float32"):
        qsa_select(torch.zeros(2, 8, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="keep must be"):
        qsa_select(torch.zeros(2, 8), 9)


# (blocks, keep): each of _warps' choices, and the rows that spilled before the warps
# followed the row and the places compared and the padding's keys took the place of a live
# mask: (257, 257) on sm_90 and sm_89 at 4 warps, (4097, 16) on sm_89 at 8, (1025, 256) on
# sm_90 at 8, and (6001, 500) on gfx1100 at any warps (its rows past 4,096
# blocks keep the sort: SELECT_HELD_RDNA)
SHAPES = ((65, 16), (257, 257), (600, 512), (2048, 128), (1025, 256), (4096, 512), (4097, 16), (6001, 500),
          (8192, 512))


@pytest.mark.slow
def test_its_launches_compile_for_the_gpus_without_spills():
    """Rows from a short prompt's to Flash-Next's at 32K tokens (8,192 blocks held in
    registers, keep 512), at each warp count the launcher picks, compile for sm_89 (the
    RTX 4090), sm_90, gfx942 and gfx1100 (RDNA3) with no spill and within the target's
    shared memory."""
    from triton_kernels.analysis.launches import compile_calls, record
    from triton_kernels.ops import impl
    with record() as calls:
        for nb, keep in SHAPES:
            impl("qsa_select", "triton")(torch.zeros(1, nb), keep)
    results = compile_calls(calls, ("sm_89", "sm_90", "gfx942", "gfx1100"))
    warps = {t: {r.num_warps for r in results if r.target == t} for t in ("sm_90", "gfx942", "gfx1100")}
    assert warps == {"sm_90": {4, 8, 16}, "gfx942": {4, 8}, "gfx1100": {4, 8}}, warps
    assert max(int(r.constexprs.split("'BLOCK': ")[1].split(",")[0]) for r in results if r.target == "gfx1100") == 4096
    bad = [f"{r.target} {r.constexprs} {r.num_warps} warps: {r.problems}" for r in results if r.problems]
    assert not bad, bad
