"""Batch-invariant primitives (triton_kernels.invariant): a row's result does not depend on
how many rows share the call or where the row sits, bit for bit, on the machine the suite
runs on (the property the module rests on: a fixed-shape GEMM computes every row alike)."""
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.tiers import examples

from triton_kernels import invariant
from triton_kernels.qsa import qsa_scores_torch

# widths of the CPU models' matmuls (SmolLM2: 576/1536; flash-tiny: 256, 1024, 1536, 4120)
SHAPES = [(576, 1536), (1536, 576), (256, 4120), (1536, 256), (36, 1024)]


@settings(max_examples=examples(25), deadline=None)
# one the plain GEMM fails here: row 127 of 128 differs from the same row alone
@example(shape=(1536, 256), m=128, cut=127, dtype=torch.bfloat16, seed=0)
@given(shape=st.sampled_from(SHAPES), m=st.integers(1, 160), cut=st.integers(0, 159),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_mm_row_is_the_same_in_any_batch(shape, m, cut, dtype, seed):
    k, n = shape
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    cut = min(cut, m - 1)
    whole = invariant.mm(x, w)
    # the rows from `cut` on, alone (another M, other offsets in the tiles), and one at a time
    assert torch.equal(invariant.mm(x[cut:], w), whole[cut:])
    assert torch.equal(invariant.mm(x[cut:cut + 1], w), whole[cut:cut + 1])
    # and it is the product: within float32's (or bfloat16's) rounding of a k-term sum
    ref = x.double() @ w.double().T
    tol = (2.0 ** -7 if dtype == torch.bfloat16 else 1e-5) * ref.abs().max().item()
    assert (whole.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("shape", [(1536, 256), (2048, 36), (1024, 36), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_row_alone_is_the_row_in_a_batch(shape, dtype):
    """A decode step's one row against the same row among others, for hundreds of rows: a
    short call's kernel that sums in another order shows in few bfloat16 outputs (oneDNN's
    one-row GEMV for K > 1024 on an AVX-512 CPU with bfloat16 dot products: 13 of 65536),
    which one probe tile of 8 rows missed."""
    k, n = shape
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(max(64, (1 << 16) // n), k, generator=g).to(dtype)
    whole = invariant.mm(x, w)
    alone = torch.cat([invariant.mm(x[i:i + 1], w) for i in range(len(x))])
    assert int((alone != whole).sum()) == 0
    # and five rows (a verify of four drafts) at every offset
    five = torch.cat([invariant.mm(x[i:i + 5], w) for i in range(0, len(x) - 4, 5)])
    assert torch.equal(five, whole[:len(five)])


@settings(max_examples=examples(25), deadline=None)
@given(T=st.integers(1, 40), nb=st.integers(1, 150), cut=st.integers(0, 39), bcut=st.integers(1, 150),
       seed=st.integers(0, 2**16))
def test_scores_are_the_same_for_any_queries_and_blocks(T, nb, cut, bcut, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, T, 128, generator=g)
    blocks = torch.randn(nb, 128, generator=g)
    cut, bcut = min(cut, T - 1), min(bcut, nb)
    whole = invariant.scores(q, blocks)
    assert torch.equal(invariant.scores(q[:, cut:], blocks), whole[cut:])
    assert torch.equal(invariant.scores(q[:, cut:cut + 1], blocks[:bcut]), whole[cut:cut + 1, :bcut])
    # the indexer's scores: the same numbers as the plain path within float32 rounding
    with invariant.batch_invariant():
        fixed = qsa_scores_torch(q, blocks, start=10**6, ratio=4)
    plain = qsa_scores_torch(q, blocks, start=10**6, ratio=4)
    assert torch.allclose(fixed, whole / math.sqrt(128))
    assert torch.allclose(fixed, plain, rtol=1e-5, atol=1e-5)


@settings(max_examples=examples(25), deadline=None)
@given(T=st.integers(1, 600), width=st.sampled_from([1, 4, 8, 36]), cut=st.integers(0, 599),
       f=st.sampled_from([torch.sigmoid, torch.nn.functional.softplus, torch.exp]), seed=st.integers(0, 2**16))
def test_pointwise_element_is_the_same_for_any_rows(T, width, cut, f, seed):
    """A narrow activation, (T, width) or a column of a wider tensor: element (t, j) equals
    itself computed among any other number of rows, and f's own value within float32's
    rounding (the vector and scalar exp differ by an ulp, not more)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(T, width + 3, generator=g)
    cut = min(cut, T - 1)
    for x in (wide[:, :width].contiguous(), wide[:, width:width + 1]):
        with invariant.batch_invariant():
            whole = invariant.pointwise(f, x)
            assert torch.equal(invariant.pointwise(f, x[cut:]), whole[cut:])
            assert torch.equal(invariant.pointwise(f, x[cut:cut + 1]), whole[cut:cut + 1])
        assert torch.allclose(whole, f(x.double()).float(), rtol=1e-6, atol=0)


def test_the_switch_is_scoped():
    before = invariant.enabled()
    with invariant.batch_invariant(True):
        assert invariant.enabled()
        with invariant.batch_invariant(False):
            assert not invariant.enabled()
        assert invariant.enabled()
    assert invariant.enabled() == before


def test_by_default_a_speculating_models_decode_steps_alone_are_invariant():
    """The three settings against decode steps (`decoding(on)`: on for a model with a draft
    head), on this thread and not on another."""
    import threading
    want = {True: (True, True, True), False: (False, False, False), None: (False, True, False)}
    for setting, (outside, speculating, plain) in want.items():
        with invariant.batch_invariant(setting):
            assert invariant.enabled() is outside and invariant.decode_steps() is (setting is not False)
            with invariant.decoding():
                assert invariant.enabled() is speculating
                other = []
                t = threading.Thread(target=lambda: other.append(invariant.enabled()))
                t.start()
                t.join()
                assert other == [outside]  # another thread's calls are not this step's
                with invariant.decoding(False):
                    assert invariant.enabled() is plain
            assert invariant.enabled() is outside


@settings(max_examples=examples(25), deadline=None)
@given(fmt=st.sampled_from(["Q4_1", "Q4_0", "Q8_0"]), shape=st.sampled_from([(576, 1536), (1536, 576), (256, 512)]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), m=st.integers(1, 24), cut=st.integers(0, 23),
       seed=st.integers(0, 2**16))
def test_quant_linear_row_is_the_same_in_any_batch(fmt, shape, dtype, m, cut, seed):
    """The CPU model's linear layers, batch-invariant, in each of their modes (the packed
    int4 kernel for Q4_0/Q4_1 in bfloat16, a dequantized weight otherwise), short calls
    probed or padded: a row is the same alone, among m rows, at any offset."""
    import quant
    from strata.nn.linear import QuantLinear
    from strata.tensors import QTensor
    k, n = shape
    rng = np.random.default_rng(seed)
    f = quant.get(fmt)
    lin_blocks = f.quantize(rng.standard_normal((n, k)).astype(np.float32))
    lin = QuantLinear(QTensor("w", f, (n, k), lin_blocks), dtype, torch.device("cpu"), kernels="torch")
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    cut = min(cut, m - 1)
    with invariant.batch_invariant():
        whole = lin(x)
        assert torch.equal(lin(x[cut:]), whole[cut:])
        assert torch.equal(lin(x[cut:cut + 1]), whole[cut:cut + 1])
    if dtype == torch.float32:
        assert torch.allclose(whole, lin(x), rtol=1e-5, atol=1e-2)
    else:
        # bfloat16 both ways, or (8 rows or more on a CPU without bfloat16 dot products,
        # backend.upcast) float32 plainly: x and the output rounded to bfloat16 on one side
        # at most, 2^-8 of each term and of the sum, so within 2^-6 of sum |x||w|
        size = x.abs().double() @ torch.from_numpy(np.abs(f.dequantize(lin_blocks)).reshape(n, k)).double().T
        assert ((whole - lin(x)).abs().double() <= 2.0 ** -6 * size).all()


def test_the_gpu_kernels_take_one_path_and_tile_for_any_rows():
    """The GPU path, batch-invariant: one kernel for any number of rows. qmatmul and the MoE
    take dp4a (a program a row or slot, the format's own tiles) where the formats have int8
    units, else the GEMM / dot kernel with one tile whatever the rows."""
    import importlib

    import quant
    qmatmul, moe = (importlib.import_module(f"triton_kernels.{m}") for m in ("qmatmul", "moe"))  # the modules
    f, g = quant.get("Q4_0"), quant.get("FP8_E4M3")  # with int8 units, without
    assert [qmatmul.choose_path(f, m) for m in (1, 64)] == ["dp4a", "gemm"]  # plain: by M
    assert [moe.choose_path(f, f, f, t) for t in (1, 64)] == ["dp4a", "dot"]
    assert moe._default_tiles(1, 8) != moe._default_tiles(512, 8)
    with invariant.batch_invariant():
        assert {qmatmul.choose_path(f, m) for m in (1, 7, 64, 4096)} == {"dp4a"}
        assert {qmatmul.choose_path(g, m) for m in (1, 7, 64, 4096)} == {"gemm"}
        assert {moe.choose_path(f, f, f, t) for t in (1, 4, 512)} == {"dp4a"}
        assert {moe.choose_path(g, g, g, t) for t in (1, 4, 512)} == {"dot"}
    # and the MoE dot call's own tile choice: one tile whatever the slots
    seen = []
    real = moe._default_tiles
    try:
        moe._default_tiles = lambda n, E: seen.append((n, E)) or real(n, E)
        x = torch.randn(3, 32)
        w = torch.from_numpy(g.quantize(np.random.default_rng(0).standard_normal((2 * 32, 32)).astype(np.float32)))
        w = w.reshape(2, 32, -1)
        for T in (1, 3):
            with invariant.batch_invariant():
                moe.moe(x[:T], w, w, w, g, g, g, torch.full((T, 1), 1.0), torch.zeros(T, 1, dtype=torch.int32))
    finally:
        moe._default_tiles = real
    assert seen == [(64 * 2, 2), (64 * 2, 2)]


@settings(max_examples=examples(6), deadline=None)  # the interpreter runs a program a row
@given(fmt=st.sampled_from(["Q4_0", "Q8_0", "IQ4_NL"]), m=st.integers(1, 24), cut=st.integers(0, 23),
       seed=st.integers(0, 2**16))
@pytest.mark.slow
def test_the_dp4a_path_gives_a_row_the_same_bits_in_any_batch(fmt, m, cut, seed):
    """What the GPU path runs batch-invariant for these formats, here under the interpreter
    (its integer dots are exact, and each program sums one row in the kernel's order): a row
    alone and the same row among m agree bit for bit (plain, past GEMV_MAX_M rows the whole
    would take the GEMM and differ)."""
    import quant
    from triton_kernels.qmatmul import qmatmul
    K, N = 256, 32
    rng = np.random.default_rng(seed)
    f = quant.get(fmt)
    q = torch.from_numpy(f.quantize(rng.standard_normal((N, K)).astype(np.float32)))
    x = torch.from_numpy(rng.standard_normal((m, K)).astype(np.float32))
    cut = min(cut, m - 1)
    with invariant.batch_invariant():
        whole = qmatmul(x, q, f)
        assert torch.equal(qmatmul(x[cut:cut + 1], q, f), whole[cut:cut + 1])
        assert torch.equal(qmatmul(x[cut:], q, f), whole[cut:])
