"""A one-token step's routing in one program (triton_kernels/route_align.py): the router's
top-k, an expert cache's lookup and counters, the alignment and the shared expert's
SwiGLU, through the interpreter, against the four kernels it replaces (bit for bit: the
same code) and against its torch twin and a numpy reference of the lookup (integers:
equal), the weights within float32 rounding of the torch router's, the SwiGLU within
float32 rounding of torch's (exp may round otherwise)."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiers import examples
from triton_kernels.backend import interpreter_on
from triton_kernels.int8 import quantize_x
from triton_kernels.moe import route
from triton_kernels.moe_align import moe_align_block_size
from triton_kernels.route_align import route_align, route_align_torch
from triton_kernels.shared_expert import silu_mul
from triton_kernels.stage import cache_lookup


@settings(max_examples=examples(12), deadline=None)
@given(E=st.integers(1, 70), k_frac=st.floats(0, 1), block_m=st.sampled_from([0, 16, 32, 64]),
       cache=st.booleans(), count=st.booleans(), norm=st.booleans(), seed=st.integers(0, 2 ** 32 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), shared=st.sampled_from([0, 24, 64, 1056]))
def test_route_align_is_the_four_launches_and_its_torch_twin(E, k_frac, block_m, cache, count, norm, seed, dtype,
                                                            shared):
    assert interpreter_on()
    rng = np.random.default_rng(seed)
    k = max(1, min(E, round(k_frac * E)))
    logits = torch.from_numpy(rng.standard_normal((1, E)).astype(np.float32)).to(dtype)
    lut = torch.from_numpy(np.where(rng.random(E) < 0.5, rng.integers(0, 9, E), -1)) if cache else None
    first = 9
    rows = first + k if cache else E
    counters = [torch.from_numpy(rng.integers(0, 5, E)) for _ in range(3)]  # hits, routed, missed
    # the shared expert's gate and up: column ranges of one fused projection's row, as the MoE's
    proj = torch.from_numpy(rng.standard_normal((1, 2 * shared + 3)).astype(np.float32) * 4)
    swiglu = (proj[:, 1:1 + shared], proj[:, 1 + shared:1 + 2 * shared]) if shared else None

    def run(f):
        hits, routed, missed = (c.clone() for c in counters)
        out = f(logits, k, norm, block_m, rows, hits if count else None, lut, routed if cache else None,
                missed if cache else None, first, swiglu)
        return out, (hits, routed, missed)

    (w, ids, local, slots, *aligned, product), tallies = run(route_align)
    # the separate launches
    hits, routed, missed = (c.clone() for c in counters)
    w1, ids1 = route(logits, k, norm, hits=hits if count else None)
    assert torch.equal(w, w1) and torch.equal(ids, ids1)
    if cache:
        slots1, local1 = cache_lookup(ids1.reshape(-1), lut, routed, missed, first)
        assert torch.equal(slots, slots1) and torch.equal(local.reshape(-1), local1)
        # the numpy reference of the lookup
        want = lut.numpy()[ids.reshape(-1).numpy()]
        assert slots.tolist() == want.tolist()
        assert local.reshape(-1).tolist() == np.where(want >= 0, want, first + np.arange(k)).tolist()
    else:
        assert torch.equal(local, ids) and slots.tolist() == [-1] * k
    for a, b in zip(tallies, (hits, routed, missed)):
        assert torch.equal(a, b)
    if block_m:
        for a, b in zip(aligned, moe_align_block_size(local, rows, block_m)):
            assert torch.equal(a, b)
    else:
        assert aligned[0].numel() == aligned[1].numel() == 0
    if shared:  # silu_mul's launch, and the int8 that quantize_x would write, attached
        assert torch.equal(product, silu_mul(*swiglu))
        if shared % 32 == 0:
            want = quantize_x(product.clone())
            got = quantize_x(product)  # the attached one: nothing launched
            assert got.q.data_ptr() != want.q.data_ptr()
            for a, b in zip(got, want):
                assert torch.equal(a, b)
    else:
        assert product.shape == (1, 0)
    # the torch twin: integers equal where no two probabilities tie (torch's top-k orders
    # ties its own way), weights within rounding
    probs = torch.softmax(logits.float(), dim=-1)
    if probs.unique().numel() < E:
        return
    (tw, tids, tlocal, tslots, *taligned, tproduct), ttallies = run(route_align_torch)
    assert torch.equal(tids, ids) and torch.equal(tlocal, local) and torch.equal(tslots, slots)
    torch.testing.assert_close(tw, w, rtol=4e-6, atol=1e-7)
    torch.testing.assert_close(tproduct, product, rtol=4e-6, atol=1e-6)
    for a, b in zip(ttallies, tallies):
        assert torch.equal(a, b)
    for a, b in zip(taligned, aligned) if block_m else ():
        assert torch.equal(a, b)
