"""The expert cache's lookup and counters in one program (triton_kernels/stage.py,
cache_lookup), through the interpreter, and its torch twin, against a numpy reference.
Integers throughout (a table read, a choice, counts added one at a time), so the bound is
equality: the slots, the local ids and both counters exactly, repeated ids counted once a
slot whatever the order of the kernel's atomic adds."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.stage import cache_lookup, cache_lookup_torch


@settings(max_examples=examples(20), deadline=None)
@given(E=st.integers(1, 70), n=st.integers(0, 40), first=st.integers(0, 9), seed=st.integers(0, 2 ** 32 - 1),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_cache_lookup_gives_the_table_and_counts(E, n, first, seed, dtype):
    assert interpreter_on()
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, E, n)
    lut = np.where(rng.random(E) < 0.5, rng.integers(0, 9, E), -1)
    routed0, missed0 = rng.integers(0, 5, E), rng.integers(0, 5, E)
    slots = lut[ids]
    local = np.where(slots >= 0, slots, first + np.arange(n))
    routed, missed = routed0.copy(), missed0.copy()
    np.add.at(routed, ids, 1)
    np.add.at(missed, ids[slots < 0], 1)
    for f in (cache_lookup, cache_lookup_torch):
        r, m = torch.from_numpy(routed0.copy()), torch.from_numpy(missed0.copy())
        s, loc = f(torch.from_numpy(ids).to(dtype), torch.from_numpy(lut), r, m, first)
        assert s.dtype == torch.int64 and loc.dtype == dtype, f.__name__
        assert s.tolist() == slots.tolist() and loc.tolist() == local.tolist(), f.__name__
        assert r.tolist() == routed.tolist() and m.tolist() == missed.tolist(), f.__name__
