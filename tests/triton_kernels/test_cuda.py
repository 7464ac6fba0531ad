"""The same properties on a GPU: the compiled kernels (inline PTX, the device's own
rounding) against the numpy references, with device tensors. Marked `cuda`: they run under
scripts/gpu_check.sh (STRATA_TEST_DEVICE=cuda, no interpreter) and are skipped elsewhere.

Bounds are the interpreter tests' own: dequant bit for bit (test_dequant.py), quantize_x
bit for bit with its torch twin (test_int8.py), the dp4a GEMV within test_int8.py's float32
bound of x̂ @ W.T, the MoE dp4a path within test_moe.py's rounded reference. The float
GEMV and the GEMM round x and the weights to bf16 for the tensor cores on a GPU: their
check here is the bf16 bound, 2^-8 S (inputs rounded once each) plus float32's gamma_K S.
"""
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from tests.tiers import examples

import quant
from tests.blocks import blocks, same_bits
from tests.triton_kernels.test_int8 import assert_within, gemv_x, reference
from tests.triton_kernels.test_qmatmul import weights
from triton_kernels import dequantize, moe, qmatmul
from triton_kernels.decode import UNITS
from triton_kernels.int8 import gemv_dp4a, quantize_x, quantize_x_torch

pytestmark = pytest.mark.cuda
FORMATS = list(quant.FORMATS.values())
UNIT_FORMATS = [quant.get(n) for n in UNITS]
U = 2.0 ** -24


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequant_on_the_gpu_is_bit_exact(fmt, dtype):
    """The unit formats store a word's four values at once, bf16 and float16 pairs packed
    by one cvt (triton_kernels.dequant.store_packed): each dtype's own rounding."""
    @given(blocks(fmt, max_blocks=64))
    @settings(max_examples=examples(50))
    def prop(raw):
        want = torch.from_numpy(fmt.dequantize(raw)).to(dtype)
        got = dequantize(torch.from_numpy(raw).cuda(), fmt, dtype).cpu()
        assert same_bits(got.float().numpy(), want.float().numpy())
    prop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quantize_x_on_the_gpu_equals_the_torch_twin(dtype):
    @given(m=st.integers(1, 8), g=st.integers(1, 64), seed=st.integers(0, 2 ** 32 - 1))
    @settings(max_examples=examples(50))
    def prop(m, g, seed):
        x = gemv_x(np.random.default_rng(seed), m, 32 * g).to(dtype)
        a, b = quantize_x(x.cuda()), quantize_x_torch(x)
        for got, want in zip(a, b):
            assert torch.equal(got.cpu(), want)
    prop()


@pytest.mark.parametrize("fmt", UNIT_FORMATS, ids=lambda f: f.name)
def test_gemv_dp4a_on_the_gpu_within_the_bound(fmt):
    @given(n=st.integers(1, 300), nb=st.integers(1, 24), m=st.integers(1, 4),
           tiles=st.sampled_from([None, (4, 32), (16, 8)]), split=st.sampled_from([None, 1, 3, 16]),
           seed=st.integers(0, 2 ** 32 - 1), data=st.data())
    @settings(max_examples=examples(30))
    def prop(n, nb, m, tiles, split, seed, data):
        K = nb * fmt.block_elems
        q = data.draw(weights(fmt, n, nb))
        x8 = quantize_x_torch(gemv_x(np.random.default_rng(seed), m, K))
        ref, _, t = reference(x8, q, fmt)
        x8c = type(x8)(*(v.cuda() for v in x8))
        qc = torch.from_numpy(q).cuda()
        y = gemv_dp4a(x8c, qc, fmt, n, tiles=tiles, split=split)
        assert_within(y.cpu(), ref, 2 * (K / 16 + 8) * U * t + K * 2.0 ** -149, f"n={n} K={K}")
        # split K's reduction in one launch: the same bits on every call (the last program
        # adds the partials in split order), the counts left at zero
        for _ in range(3):
            assert torch.equal(gemv_dp4a(x8c, qc, fmt, n, tiles=tiles, split=split), y)
    prop()


@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_float_paths_on_the_gpu_within_the_bf16_bound(fmt, path):
    @given(m=st.integers(1, 40), n=st.integers(1, 200), nb=st.integers(1, 8),
           seed=st.integers(0, 2 ** 32 - 1), data=st.data())
    @settings(max_examples=examples(10))
    def prop(m, n, nb, seed, data):
        K = nb * fmt.block_elems
        q = data.draw(weights(fmt, n, nb))
        x = torch.from_numpy(np.random.default_rng(seed).uniform(-1, 1, (m, K))).to(torch.bfloat16)
        w = torch.from_numpy(fmt.dequantize(q)).double()
        ref, s = x.double() @ w.T, x.double().abs() @ w.abs().T
        y = qmatmul(x.cuda(), torch.from_numpy(q).cuda(), fmt, path=path).cpu()
        tol = 2.0 ** -8 * s + 2 * (K + 2) * U * s + 2.0 ** -8 * ref.abs()
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), float((err - tol).max())
    prop()


@pytest.mark.parametrize("fmts", [(f, f, f) for f in UNIT_FORMATS], ids=lambda fs: fs[0].name)
def test_moe_dp4a_on_the_gpu(fmts):
    from tests.triton_kernels.test_moe import assert_close, dp4a_reference, make, routing_weights

    @given(E=st.integers(1, 16), T=st.integers(1, 4), seed=st.integers(0, 2 ** 32 - 1), data=st.data())
    @settings(max_examples=examples(10))
    def prop(E, T, seed, data):
        H, I = 512, 256 if fmts[0].block_elems == 256 else 96
        k = data.draw(st.integers(1, E))
        ids = torch.tensor([data.draw(st.permutations(range(E)))[:k] for _ in range(T)], dtype=torch.int32)
        x, wg, wu, wd, rng = make(fmts, E, H, I, T, seed, torch.float32)
        w = routing_weights(rng, T, k)
        ref, bound = dp4a_reference(x, wg, wu, wd, fmts, ids, w)
        args = [torch.from_numpy(a).cuda() for a in (wg, wu, wd)]
        y = moe(x.cuda(), *args, *fmts, w.cuda(), ids.cuda(), path="dp4a").cpu()
        assert_close(y, ref, bound, torch.float32, "moe dp4a (cuda)")
    prop()


@pytest.mark.cuda(ci="CI compiles the launches a bf16 model makes, their rows and dots in bf16 (tests/strata/"
                     "test_trace.py), and checks the dot path's sums under the interpreter (test_moe.py), "
                     "where the rounding is float32's")
@pytest.mark.parametrize("fmt", [quant.get(n) for n in ("IQ3_XXS", "Q4_K", "BF16")], ids=lambda f: f.name)
def test_the_moe_dot_path_in_a_models_dtype_gives_the_bits_of_its_rows_rounded(fmt):
    """moe(dtype=torch.bfloat16) of float32 x (an expert store's call) gives the bits of
    moe() of x rounded to bf16: a prompt's rows rounded before the launches, a decode's in
    the kernels, the SwiGLU product stored in bf16 either way (the bits the down kernel's
    own rounding gave); on units (IQ3_XXS, Q4_K) and per weight (BF16)."""
    from tests.triton_kernels.test_moe import make, routing_weights
    fmts = (fmt,) * 3
    for T in (1, 40):
        x, wg, wu, wd, r = make(fmts, 8, 256, 256, T, T, torch.float32)
        ids = torch.from_numpy(np.stack([r.permutation(8)[:2] for _ in range(T)])).int().cuda()
        w = routing_weights(r, T, 2).cuda()
        args = [torch.from_numpy(a).cuda() for a in (wg, wu, wd)]
        got = moe(x.cuda(), *args, *fmts, w, ids, path="dot", slots=True, dtype=torch.bfloat16)
        want = moe(x.bfloat16().cuda(), *args, *fmts, w, ids, path="dot", slots=True)
        assert got.dtype == torch.float32 and torch.equal(got, want), (fmt.name, T)


@pytest.mark.parametrize("fmt", [quant.get(n) for n in ("Q8_0", "Q4_0", "IQ4_NL", "Q4_K", "IQ3_XXS", "Q6_K", "FP8_E4M3")],
                         ids=lambda f: f.name)
def test_batch_invariant_rows_on_the_gpu(fmt):
    """The batch-invariant GPU path (triton_kernels.invariant): a row's result is the same
    bits alone, among m rows and at any offset, on the device: the dp4a GEMV where the
    format has int8 units, the one-tile GEMM otherwise (FP8_E4M3); the MoE likewise a token
    alone and among T. The interpreter checks the dp4a rows (test_invariant.py); this is
    the device's own arithmetic."""
    from tests.triton_kernels.test_moe import make, routing_weights
    from triton_kernels import invariant

    @given(m=st.integers(1, 40), cut=st.integers(0, 39), seed=st.integers(0, 2 ** 16))
    @settings(max_examples=examples(20), deadline=None)
    def prop(m, cut, seed):
        rng = np.random.default_rng(seed)
        K, N = 4 * 256, 96
        q = torch.from_numpy(fmt.quantize(rng.standard_normal((N, K)).astype(np.float32))).cuda()
        x = torch.from_numpy(rng.standard_normal((m, K)).astype(np.float32)).cuda()
        cut = min(cut, m - 1)
        with invariant.batch_invariant():
            whole = qmatmul(x, q, fmt)
            assert torch.equal(qmatmul(x[cut:cut + 1], q, fmt), whole[cut:cut + 1])
            assert torch.equal(qmatmul(x[cut:], q, fmt), whole[cut:])
            fmts = (fmt,) * 3
            xe, wg, wu, wd, r = make(fmts, 8, 256, 256, m, seed, torch.float32)
            ids = torch.from_numpy(np.stack([r.permutation(8)[:2] for _ in range(m)])).int()
            w = routing_weights(r, m, 2)
            args = [torch.from_numpy(a).cuda() for a in (wg, wu, wd)]
            full = moe(xe.cuda(), *args, *fmts, w.cuda(), ids.cuda())
            one = moe(xe[cut:cut + 1].cuda(), *args, *fmts, w[cut:cut + 1].cuda(), ids[cut:cut + 1].cuda())
            assert torch.equal(one, full[cut:cut + 1])
    prop()


def test_the_align_kernel_on_the_gpu_gives_the_torch_tensors():
    from triton_kernels.moe_align import ALIGN_MAX_SLOTS, moe_align_block_size, moe_align_block_size_torch

    @given(E=st.integers(1, 600), n=st.integers(1, ALIGN_MAX_SLOTS), block_m=st.sampled_from([1, 16, 64]),
           seed=st.integers(0, 2 ** 32 - 1))
    @settings(max_examples=examples(50))
    def prop(E, n, block_m, seed):
        ids = torch.randint(-1, E + 1, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        for a, b in zip(moe_align_block_size(ids.cuda(), E, block_m), moe_align_block_size_torch(ids, E, block_m)):
            assert torch.equal(a.cpu(), b)
    prop()


def test_the_elementwise_kernels_on_the_gpu_within_their_bounds():
    """norm_rope, silu_mul and gated_add against their torch twins on the CPU, within the
    interpreter tests' float64 bounds doubled (both sides err; test_rope.py,
    test_shared_expert.py), with exp's few ulp on a GPU inside the gamma(8) margin."""
    from triton_kernels.rope import norm_rope, norm_rope_torch
    from triton_kernels.shared_expert import gated_add, gated_add_torch, silu_mul, silu_mul_torch

    @given(T=st.integers(1, 4), H=st.integers(1, 8), D=st.sampled_from([64, 128, 256]),
           N=st.integers(1, 3000), seed=st.integers(0, 2 ** 32 - 1))
    @settings(max_examples=examples(30))
    def prop(T, H, D, N, seed):
        g = torch.Generator().manual_seed(seed)
        x, w, ang = torch.randn(T, H, D, generator=g), torch.randn(D, generator=g), torch.randn(T, D // 2, generator=g)
        cos, sin = ang.cos(), ang.sin()
        want = norm_rope_torch(x, w, 1e-6, cos, sin)
        got = norm_rope(*(t.cuda() for t in (x, w)), 1e-6, cos.cuda(), sin.cuda()).cpu()
        assert ((got - want).abs() <= 2 * (D + 9) * U * (want.abs() + 1)).all()
        a, b, gate = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g), torch.randn(T, 1, generator=g)
        s = silu_mul_torch(a, b)
        assert ((silu_mul(a.cuda(), b.cuda()).cpu() - s).abs() <= 2 * (8 + a.abs()) * U * s.abs() + 1e-36).all()
        y = gated_add_torch(a, gate, b)
        tol = 2 * (10 + gate.abs()) * U * (a.abs() + b.abs())
        assert ((gated_add(a.cuda(), gate.cuda(), b.cuda()).cpu() - y).abs() <= tol).all()
    prop()


def test_the_qsa_kernels_on_the_gpu_within_their_bounds_at_a_device_position():
    """The QSA scores and attention at a position read from the device (a decode graph's,
    strata.runtime.graphs_qwen4exp), blocks not yet visible in the selection among them,
    within test_qsa.py's bounds of its references."""
    from tests.triton_kernels.test_qsa import (attention_bound, attention_reference, gamma, random_selection,
                                               scores_reference)
    from triton_kernels.qsa import qsa_attention, qsa_scores, visible_blocks

    @given(T=st.integers(1, 4), start=st.integers(0, 60), ratio=st.integers(1, 4), keep=st.integers(1, 6),
           seed=st.integers(0, 2 ** 16))
    @settings(max_examples=examples(30))
    def prop(T, start, ratio, keep, seed):
        g = torch.Generator().manual_seed(seed)
        N = start + T + 8
        at = torch.tensor([start]).cuda()
        q, k, v = torch.randn(4, T, 32, generator=g), torch.randn(2, N, 32, generator=g), torch.randn(2, N, 32, generator=g)
        sel = random_selection(g, T, start, ratio, keep, True)
        unseen = torch.where(sel < 0, visible_blocks(start, T, ratio)[:, None], sel)  # as a graph sorts them
        want = attention_reference(q, k[:, :start + T], v[:, :start + T], sel, start, ratio)
        got = qsa_attention(q.cuda(), k.cuda(), v.cuda(), unseen.cuda(), at, ratio).cpu()
        assert float((got - want).abs().max()) <= attention_bound(q, k, v, sel, ratio)
        qi, blocks = torch.randn(4, T, 32, generator=g), torch.randn(N // ratio, 32, generator=g)
        want = scores_reference(qi, blocks, start, ratio)
        got = qsa_scores(qi.cuda(), blocks.cuda(), at, ratio).cpu()
        seen = torch.isfinite(want)
        assert torch.equal(seen, torch.isfinite(got))
        bound = gamma(32 + 4 + 1) * (qi.abs() @ blocks.abs().T).sum(0) / 32 ** 0.5
        assert bool(((got - want).abs()[seen] <= bound[seen] + 1e-30).all())
    prop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_attention_rows_launch_is_the_separate_launches_on_the_gpu(dtype):
    """attention_rows on the GPU: q, the indexer queries, the caches and the block keys
    are the separate launches' (norm_rope2, norm_rope, qsa_pool after the rows' stores)
    bit for bit, as test_attention_rows.py checks them under the interpreter; positions
    within one block or across two, read from the device. Flash-Next's widths (head_dim
    256, the indexer's 128, RoPE on 64): a row's sum of squares reduces in the lanes'
    order of its width's tile, which the launch must keep per part."""
    from tests.triton_kernels.test_attention_rows import EPS, layer, run, same
    from triton_kernels.attention_rows import attention_rows, cache_write_torch
    from triton_kernels.qsa import qsa_pool
    from triton_kernels.rope import norm_rope, norm_rope2

    @given(T=st.integers(1, 4), p0=st.integers(0, 20), ratio=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
    @settings(max_examples=examples(20), deadline=None)
    def prop(T, p0, ratio, seed):
        rows, w, tables, caches = layer(seed, T, 4, 2, 256, 2, 128, 64, p0 + T + 3, ratio, dtype)
        rows, w = ({n: x.cuda() for n, x in d.items()} for d in (rows, w))
        tables, caches = [t.cuda() for t in tables], [c.cuda() for c in caches]
        pos = torch.arange(p0, p0 + T).cuda()
        apart = [c.clone() for c in caches]
        q, k = norm_rope2(rows["q"], w["wq"], rows["k"], w["wk"], EPS, *tables, pos)
        cache_write_torch(apart[:3], [k, rows["v"].transpose(0, 1), rows["ik"]], pos)
        qsa_pool(apart[2], None, pos, ratio, w["wik"], EPS, *tables, apart[3])
        qi = norm_rope(rows["iq"].reshape(T, 2, 128), w["wiq"], EPS, *tables, pos)
        fused = [c.clone() for c in caches]
        q2, qi2 = run(attention_rows, rows, w, tables, fused, pos, ratio, True, True, True)
        assert same(q2, q) and same(qi2, qi) and all(same(a, b) for a, b in zip(fused, apart))
    prop()


def test_a_deltanet_tokens_one_launch_is_the_three_launches_on_the_gpu():
    """deltanet_decode on the GPU: a token's rows, their int8 form, the state and the window
    moved on (in place or not) are deltanet_conv_inputs', deltanet_step's and
    deltanet_gated_norm's bit for bit; T rows in one launch (a verify's, and their replay
    in keep without the int8 form) are T one-token launches' bits, and so are the separate
    launches over the rows: no fused multiply-add in any of them, the same tile widths, the
    norm's width a runtime number in both norms; as test_deltanet_decode.py checks them
    under the interpreter. At Flash-Next's heads (16 key heads, 48 value heads, 128 wide,
    4 taps) and small ones (96 wide: a width whose reciprocal is inexact), two tokens in a
    row (each key head's count left at 0)."""
    from tests.triton_kernels.test_deltanet_decode import decoded, layer, run, separate, separate_rows
    from triton_kernels.deltanet import deltanet_step
    from triton_kernels.deltanet_decode import deltanet_decode
    from triton_kernels.deltanet_inputs import deltanet_conv_inputs, deltanet_gated_norm

    def on_gpu(d):
        return {n: (x.cuda() if isinstance(x, torch.Tensor) else x) for n, x in d.items()}

    @given(shape=st.sampled_from([(16, 3, 128, 128), (2, 2, 64, 32), (1, 3, 40, 96)]), in_place=st.booleans(),
           T=st.integers(2, 5), seed=st.integers(0, 2 ** 16))
    @settings(max_examples=examples(10), deadline=None)
    def prop(shape, in_place, T, seed):
        p = on_gpu(layer(np.random.default_rng(seed), *shape, 4))
        q = {**p, "state": p["state"].clone(), "window": p["window"].clone()}
        for _ in range(2):
            rows, p["window"] = run(deltanet_decode, p, quantize=True, in_place=in_place)
            want, q["window"] = separate(deltanet_conv_inputs, deltanet_step, deltanet_gated_norm, q)
            assert torch.equal(rows, want) and torch.equal(p["window"], q["window"])
            assert torch.equal(p["state"], q["state"])
            assert all(torch.equal(a, b) for a, b in zip(quantize_x(rows), quantize_x(want)))
        p = on_gpu(layer(np.random.default_rng(seed), *shape, 4, T=T))
        q, r = ({**p, "state": p["state"].clone(), "window": p["window"].clone()} for _ in range(2))
        want, want_window = decoded(q)
        rows, window = run(deltanet_decode, p, quantize=in_place, in_place=in_place)
        assert torch.equal(rows, want) and torch.equal(window, want_window) and torch.equal(p["state"], q["state"])
        apart, apart_window = separate_rows(r)
        assert torch.equal(apart, want) and torch.equal(apart_window, want_window)
        assert torch.equal(r["state"], q["state"])
    prop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", UNIT_FORMATS, ids=lambda f: f.name)
def test_the_ple_gather_on_the_gpu_is_its_torch_twins(fmt, dtype):
    """The gather's units path stores as dequant's (store_packed): the torch twin's bits."""
    from triton_kernels.ple import ple_gather, ple_gather_torch

    @given(rows=st.integers(1, 40), T=st.integers(1, 4), H=st.integers(1, 6), seed=st.integers(0, 2 ** 32 - 1))
    @settings(max_examples=examples(10))
    def prop(rows, T, H, seed):
        rng = np.random.default_rng(seed)
        table = torch.from_numpy(fmt.quantize(rng.standard_normal((rows, 2 * fmt.block_elems)).astype(np.float32)))
        ids = torch.from_numpy(rng.integers(0, rows, (T, H)))
        want = ple_gather_torch(table, ids, fmt, scale=0.5, out_dtype=dtype)
        got = ple_gather(table.cuda(), ids.cuda(), fmt, scale=0.5, out_dtype=dtype).cpu()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    prop()


def test_the_launches_that_quantize_what_they_write_give_quantize_xs_bits_on_the_gpu():
    """hc_mix, hc_write_norm, hc_write_moe, silu_mul, sigmoid_mul and deltanet_gated_norm
    with `quantize` (as the engine calls them on a GPU): the float output as without it,
    and quantize_x of it (the launch's int8 form, int8.attach) the torch twin's bits."""
    from triton_kernels.deltanet_inputs import deltanet_gated_norm
    from triton_kernels.hc_moe_write import hc_write_moe
    from triton_kernels.hyperconn import hc_mix, hc_write_norm
    from triton_kernels.shared_expert import sigmoid_mul, silu_mul

    @given(T=st.integers(1, 3), S=st.integers(1, 4), G=st.integers(1, 90), R=st.integers(1, 40),
           seed=st.integers(0, 2 ** 32 - 1))
    @settings(max_examples=examples(10))
    def prop(T, S, G, R, seed):
        g = torch.Generator().manual_seed(seed)

        def t(*shape):
            return torch.randn(*shape, generator=g).cuda()
        H, dv = 32 * G, 32 * (G % 8 + 1)
        x, inj, w = t(T, S * H), t(T, S), t(S, H)
        calls = [(hc_mix, (t(T, R + S), t(S * H, R), t(T, S * H), R, S), 0),
                 (hc_write_norm, (x, t(T, H), inj, w, 1e-6), 1),
                 (hc_write_moe, (x, t(T, 2, H), t(T, 1), t(T, H), inj, w, 1e-6), 1),
                 (silu_mul, (t(T, H), t(T, H)), None), (sigmoid_mul, (t(T, H), t(T, H)), None),
                 (deltanet_gated_norm, (t(T, 3, dv), t(T, 3 * dv), t(dv), 1e-6), None)]
        for f, args, at in calls:
            plain, quantized = f(*args), f(*args, quantize=True)
            y, y0 = (quantized, plain) if at is None else (quantized[at], plain[at])
            assert torch.equal(y, y0), f.__name__
            for a, b in zip(quantize_x(y), quantize_x_torch(y.cpu())):
                assert torch.equal(a.cpu(), b), f.__name__
    prop()


def test_topk_on_the_gpu_keeps_the_lower_of_tied_blocks_as_a_graphs_sort_does():
    """The eager step's choice (select_blocks: topk over exactly each query's visible
    scores) and a decode graph's (select_sorted: a stable sort of the whole row, unseen
    blocks at -inf) keep the same blocks on an NVIDIA GPU, ties everywhere
    (triton_kernels.qsa says why; on the CPU they may differ)."""
    from triton_kernels.qsa import select_blocks, select_sorted, visible_blocks

    @given(T=st.integers(1, 6), start=st.integers(0, 9000), ratio=st.sampled_from([1, 4, 8]),
           keep=st.integers(1, 64), levels=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
    @settings(max_examples=examples(40))
    def prop(T, start, ratio, keep, levels, seed):
        g = torch.Generator().manual_seed(seed)
        nb = (start + T) // ratio + 3  # a graph's row runs past the visible blocks
        scores = torch.randint(0, levels, (T, nb), generator=g).float()
        n = visible_blocks(start, T, ratio)
        scores[torch.arange(nb)[None, :] >= n[:, None]] = float("-inf")
        eager = select_blocks(scores.cuda(), start, ratio, keep).cpu()
        best, graph = (t.cpu() for t in select_sorted(scores.cuda(), keep))
        for t in range(T):
            want = sorted(b for b in eager[t].tolist() if b >= 0)
            got = sorted(b for b, s in zip(graph[t].tolist(), best[t].tolist()) if s > float("-inf"))
            assert got == want, (t, int(n[t]))
    prop()


@pytest.mark.parametrize("nb, keep", [(65, 16), (8192, 512), (20000, 512)])
def test_the_select_launch_keeps_a_stable_sorts_blocks_on_the_gpu(nb, keep, monkeypatch):
    """qsa_select (a decode graph's one launch) keeps select_sorted's blocks in its order on
    the device: rows of 65 and 8,192 blocks (Flash-Next's keep 512 at 32K tokens), relu's
    zeros tied and unseen blocks at -inf; and a longer row (20,000) keeps the sort, with no
    launch."""
    import triton

    from tests.triton_kernels.test_qsa_select import launches
    from triton_kernels.backend import rdna
    from triton_kernels.qsa import select_sorted
    from triton_kernels.qsa_select import SELECT_HELD, SELECT_HELD_RDNA, qsa_select
    g = torch.Generator().manual_seed(nb)
    scores = torch.randn(4, nb, generator=g).relu()
    scores[1:, nb // 2:] = float("-inf")
    grids = launches(monkeypatch)
    got = qsa_select(scores.cuda(), keep).cpu()
    held = SELECT_HELD_RDNA if rdna(torch.device("cuda")) else SELECT_HELD
    assert len(grids) == (triton.next_power_of_2(nb) <= held), grids
    assert torch.equal(got, select_sorted(scores.cuda(), keep)[1].cpu())
    assert torch.equal(got, torch.from_numpy(np.argsort(-scores.numpy(), axis=1, kind="stable")[:, :keep]))


def test_a_verifys_rows_in_one_recurrence_launch_are_one_token_steps_on_the_gpu():
    """triton_kernels.deltanet's kernel: T tokens in one launch give the T one-token
    launches' outputs and state bit for bit on the device too (the compiled loop's
    arithmetic is the one-token kernel's), which batch-invariant verifies promise
    (strata.nn.deltanet.DeltaNetState.keep)."""
    from triton_kernels.deltanet import deltanet_step
    steps = [deltanet_step]

    @given(T=st.integers(2, 9), Hv=st.integers(1, 32), dk=st.sampled_from([64, 128]), dv=st.sampled_from([64, 128]),
           seed=st.integers(0, 2 ** 32 - 1))
    @settings(max_examples=examples(20))
    def prop(T, Hv, dk, dv, seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.nn.functional.normalize(torch.randn(T, Hv, dk, generator=g), dim=-1) * dk ** -0.5
        k = torch.nn.functional.normalize(torch.randn(T, Hv, dk, generator=g), dim=-1)
        v = torch.randn(T, Hv, dv, generator=g)
        gate, beta = -torch.rand(T, Hv, generator=g), torch.rand(T, Hv, generator=g)
        s0 = torch.randn(Hv, dk, dv, generator=g)
        args = [t.cuda() for t in (q, k, v, gate, beta)]
        for step in steps:
            s_all, s_one = s0.cuda(), s0.cuda()
            o_all = step(*args, s_all)
            o_one = torch.stack([step(*(a[t] for a in args), s_one) for t in range(T)])
            assert torch.equal(o_all, o_one) and torch.equal(s_all, s_one), step.__name__
    prop()


def test_the_router_gemvs_launch_is_the_gemv_and_route_align_launches_on_the_gpu():
    """triton_kernels.router_gemv on the device, the dp4a GEMV (Q4_0, Q8_0) and the float
    one (F32, BF16 weights; bfloat16 activations as a bf16 model's), the float one with a
    pair (the shared expert's gate and up in Q4_0 or IQ4_NL, as a released file's): the
    output, the routing, the counters and the shared expert's SwiGLU with its int8 are the
    separate launches' bits (qmatmul as QuantLinear runs it, then route_align), which a
    verify's rows take, and the count left at 0 for the next launch (run twice)."""
    from triton_kernels.route_align import route_align
    from triton_kernels.router_gemv import pair_path, path, router_gemv

    @given(fmt=st.sampled_from(["Q4_0", "Q8_0", "F32", "BF16"]), E=st.sampled_from([64, 512]),
           shared=st.sampled_from([0, 640]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
           pair=st.sampled_from([None, "Q4_0", "IQ4_NL"]), seed=st.integers(0, 2 ** 32 - 1))
    @settings(max_examples=examples(8), deadline=None)  # each draw may compile a kernel: step 1's time
    def prop(fmt, E, shared, dtype, pair, seed):
        rng = np.random.default_rng(seed)
        f = quant.get(fmt)
        pair = pair if f.name in ("F32", "BF16") else None  # a pair joins the float GEMV's launch
        if pair and not pair_path(f, torch.device("cuda"), E + 1, 2560, quant.get(pair), 1280):
            pair = None  # tiles of other warps on this GPU: the router's launch alone
        N, N2, K = E + 1 + (0 if pair else 2 * shared), 1280 if pair else 0, 2560

        def weight(fm, n):
            return torch.from_numpy(fm.quantize(rng.standard_normal((n, K)).astype(np.float32) / 50).reshape(-1)).cuda()
        q = weight(f, N)
        q2 = weight(quant.get(pair), N2) if pair else None
        x = torch.from_numpy(rng.standard_normal((1, K)).astype(np.float32)).cuda()
        kind = path(f, q.device, N, K)
        assume(kind is not None)  # a dp4a GEMV this GPU splits: the launches stay apart
        for _ in range(2):
            hits, hits2 = torch.zeros(E, dtype=torch.int64).cuda(), torch.zeros(E, dtype=torch.int64).cuda()
            got = router_gemv(x, q, f, N, 10, True, 0, E, E, shared, hits, dtype=dtype,
                              pair=(q2, pair, N2) if pair else None)
            out = qmatmul(x if kind == "dp4a" else x.to(dtype), q, f, n=N).float()
            if pair:
                out = torch.cat([out, qmatmul(x, q2, pair, n=N2).float()], dim=1)
            n = N + N2
            sw = (out[:, n - 2 * shared:n - shared], out[:, n - shared:]) if shared else None
            want = (out, *route_align(out[:, :E], 10, True, 0, E, hits2, swiglu=sw))
            for i, (a, b) in enumerate(zip(got, want)):
                if i != 7:  # the unaligned length nothing reads
                    assert torch.equal(a, b), (fmt, pair, i)
            assert torch.equal(hits, hits2)
            if shared:
                assert all(torch.equal(a, b) for a, b in zip(quantize_x(got[-1]), quantize_x(want[-1].clone())))
    prop()


@pytest.mark.parametrize("ffmt, dfmt, nf, nd", [("F32", "Q4_0", 640, 13312), ("BF16", "IQ4_NL", 513, 1280),
                                                ("F16", "Q8_0", 64, 2560)])
def test_the_pairs_launch_gives_each_gemvs_bits_on_the_gpu(ffmt, dfmt, nf, nd):
    """triton_kernels.gemv_pair on the device at Flash-Next's shapes (an attention's F32
    indexer rows beside its quantized Q, K, V; the routers beside the shared expert's gate
    and up): each part's rows are its own GEMV's bits (qmatmul as QuantLinear runs it),
    in either order, where a GPU's reductions follow the launch's layout."""
    from triton_kernels.gemv_pair import gemv_pair, takes
    rng = np.random.default_rng(7)
    K = 2560
    ff, fd = quant.get(ffmt), quant.get(dfmt)
    qf = torch.from_numpy(ff.quantize(rng.standard_normal((nf, K)).astype(np.float32) / 50).reshape(-1)).cuda()
    qd = torch.from_numpy(fd.quantize(rng.standard_normal((nd, K)).astype(np.float32) / 50).reshape(-1)).cuda()
    x = torch.from_numpy(rng.standard_normal((1, K)).astype(np.float32)).cuda()
    if not takes([(qf, ff, nf), (qd, fd, nd)], K):
        pytest.skip(f"this GPU's {dfmt} GEMV of {nd} rows splits K or runs other warps than the float one: "
                    "no shared launch to check (gemv_pair.pair_path)")
    for dtype in (torch.float32, torch.bfloat16):
        for parts in ([(qf, ff, nf), (qd, fd, nd)], [(qd, fd, nd), (qf, ff, nf)]):
            got = gemv_pair(x, parts, dtype)
            want = torch.cat([qmatmul(x if f is fd else x.to(dtype), q, f, n=n).float() for q, f, n in parts], dim=1)
            assert torch.equal(got, want), (ffmt, dfmt, dtype)


@pytest.mark.cuda(ci="CI checks split K's sums and the router's routing bit for bit through the interpreter "
                     "(test_int8.py, test_router_gemv.py), which runs programs one after another, and that the "
                     "graphs capture on their warm-up's stream (test_graphs_qwen4exp.py's stand-in capture)")
def test_the_last_program_reductions_hold_over_many_graph_replays():
    """The launches that finish a reduction in their last program to count itself in (split
    K's sum, int8._sum_split; the router GEMV's routing, router_gemv; a DeltaNet token's
    gated norm and window, deltanet_decode, from the same state and window each replay)
    captured in one CUDA graph, on the warm-up's stream as the engine captures, and
    replayed 500 times: every replay gives the eager launches' bits, and the counts are
    left at zero (a program that saw a stale count would skip the sum, or route twice)."""
    from tests.triton_kernels.test_deltanet_decode import layer, run
    from triton_kernels import int8
    from triton_kernels.deltanet_decode import deltanet_decode
    from triton_kernels.router_gemv import path, router_gemv
    rng = np.random.default_rng(5)
    f, E, K = quant.get("Q4_0"), 512, 2560
    q = torch.from_numpy(f.quantize(rng.standard_normal((E + 1, K)).astype(np.float32) / 50).reshape(-1)).cuda()
    qs = torch.from_numpy(f.quantize(rng.standard_normal((640, K)).astype(np.float32) / 50).reshape(-1)).cuda()
    x = torch.from_numpy(rng.standard_normal((1, K)).astype(np.float32)).cuda()
    if path(f, q.device, E + 1, K) is None:
        pytest.skip("this GPU splits the router's dp4a GEMV: its launch stays apart (router_gemv.path)")

    dn = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in layer(rng, 16, 3, 128, 128, 4).items()}
    s0, w0 = dn["state"].clone(), dn["window"].clone()

    def step():
        x8 = quantize_x(x)
        dn["state"].copy_(s0)
        dn["window"].copy_(w0)
        rows, _ = run(deltanet_decode, dn, in_place=True)
        return (gemv_dp4a(x8, qs, f, 640, split=4), router_gemv(x, q, f, E + 1, 10, True, 0, E, E)[:3],
                (rows, dn["state"], dn["window"]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want = step()
        want = (*want[:2], tuple(t.clone() for t in want[2]))  # the state and window the graph moves on
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        got = step()
    for i in range(500):
        g.replay()
        assert torch.equal(got[0], want[0]), i
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1])), i
        assert all(torch.equal(a, b) for a, b in zip(got[2], want[2])), i
    torch.cuda.synchronize()
    assert all(not c.any() for c in int8._COUNTS.values())


def test_the_shared_experts_down_gemv_in_the_down_launch_gives_its_bits_on_the_gpu():
    """moe(pair=) on the device at Flash-Next's widths (IQ3_XXS gate/up and IQ4_NL down of
    640 x 2560 experts, the shared expert's Q4_0 down of 2560 x 640): the routed slots'
    rows are the call's without the pair, out2 the shared expert's GEMV as QuantLinear.gated
    runs it (qmatmul's dp4a GEMV, rounded to bfloat16), where a GPU's reductions follow the
    launch's layout."""
    from triton_kernels.moe import down_pair_path
    rng = np.random.default_rng(11)
    E, H, I = 8, 2560, 640
    fg, fd, f2 = quant.get("IQ3_XXS"), quant.get("IQ4_NL"), quant.get("Q4_0")

    def w(f, shape):
        return torch.from_numpy(f.quantize(rng.standard_normal((int(np.prod(shape[:-1])), shape[-1]))
                                           .astype(np.float32) / 50).reshape(*shape[:-1], -1)).cuda()
    wg, wu, wd, q2 = w(fg, (E, I, H)), w(fg, (E, I, H)), w(fd, (E, H, I)), w(f2, (H, I)).reshape(-1)
    x = torch.from_numpy(rng.standard_normal((1, H)).astype(np.float32)).cuda()
    product = torch.from_numpy(rng.standard_normal((1, I)).astype(np.float32)).cuda()
    ids = torch.tensor([[1, 5, 6]]).cuda()
    weights = torch.tensor([[0.5, 0.3, 0.2]]).cuda()
    if not down_pair_path(fd, f2, x.device, H, I):
        pytest.skip("this GPU's Q4_0 GEMV of 2560 x 640 splits K or runs other warps than the down kernel: "
                    "no shared launch to check (moe.down_pair_path)")
    args = (wg, wu, wd, fg, fg, fd, weights, ids)
    out2 = torch.empty(1, H, device="cuda")
    got = moe(x, *args, path="dp4a", slots=True, pair=(product, q2, f2, H, torch.bfloat16, out2))
    assert torch.equal(got, moe(x, *args, path="dp4a", slots=True))
    assert torch.equal(out2, qmatmul(product, q2, f2, n=H).to(torch.bfloat16).float())


@pytest.mark.cuda(ci="CI checks the float pair's bits against the separate launches through the interpreter "
                     "(test_moe.py) and in a planned MoE step (test_expert_cache.py)")
def test_the_shared_experts_gated_down_gemv_in_the_float_down_launch_gives_its_bits_on_the_gpu():
    """moe(pair=) of BF16 experts (the dot path's per-weight down kernel, as flash-tiny's
    file holds them, at Flash-Next's widths): the routed slots' rows are the call's without
    the pair, out2 the shared expert's gated down GEMV as QuantLinear.gated runs it
    (gated_qmatmul's launch, rounded to bfloat16), where a GPU's reductions follow the
    launch's layout."""
    from triton_kernels.gated_gemv import gated_qmatmul
    from triton_kernels.moe import down_pair_path
    rng = np.random.default_rng(12)
    E, H, I = 8, 2560, 640
    f = quant.get("BF16")

    def w(shape):
        return torch.from_numpy(f.quantize(rng.standard_normal((int(np.prod(shape[:-1])), shape[-1]))
                                           .astype(np.float32) / 50).reshape(*shape[:-1], -1)).cuda()
    wg, wu, wd, q2 = w((E, I, H)), w((E, I, H)), w((E, H, I)), w((H, I))
    x = torch.from_numpy(rng.standard_normal((1, H)).astype(np.float32)).cuda()
    row = torch.from_numpy(rng.standard_normal((1, 2 * I)).astype(np.float32)).cuda()
    g, u = row[:, :I], row[:, I:]
    ids = torch.tensor([[1, 5, 6]]).cuda()
    weights = torch.tensor([[0.5, 0.3, 0.2]]).cuda()
    if not down_pair_path(f, f, x.device, H, I, "dot"):
        pytest.skip("this GPU's BF16 GEMV runs other warps than the MoE's down kernel: no shared launch to "
                    "check (moe.down_pair_path)")
    args = (wg, wu, wd, f, f, f, weights, ids)
    out2 = torch.empty(1, H, device="cuda")
    got = moe(x, *args, path="dot", slots=True, pair=((g, u), q2, f, H, torch.bfloat16, out2))
    assert torch.equal(got, moe(x, *args, path="dot", slots=True))
    assert torch.equal(out2, gated_qmatmul(g, u, q2, f, True, torch.bfloat16).float())


@pytest.mark.cuda(ci="CI checks the staged path's bits (tests/strata/test_expert_cache.py, the cache tier "
                     "against the resident one) and moe()'s refusal of pageable host weights "
                     "(test_moe.py); a kernel reading pinned host memory needs a GPU")
def test_the_moe_reads_experts_in_pinned_host_memory_as_in_vram_and_as_staged():
    """The two ways a routed expert that misses the cache can be read over PCIe, as
    `strata bench kernels` times them: the MoE kernels given pinned host weights (unified
    addressing), and stage_rows copying the k experts into VRAM rows first (the expert
    cache's path). Both give the resident call's bits: the kernels meet the same bytes."""
    from triton_kernels.stage import stage_rows
    rng = np.random.default_rng(12)
    E, H, I, k = 16, 512, 256, 6
    fg, fd = quant.get("IQ3_XXS"), quant.get("IQ4_NL")

    def w(f, shape):
        return torch.from_numpy(f.quantize(rng.standard_normal((int(np.prod(shape[:-1])), shape[-1]))
                                           .astype(np.float32) / 50).reshape(*shape[:-1], -1)).cuda()
    dev = [w(fg, (E, I, H)), w(fg, (E, I, H)), w(fd, (E, H, I))]
    host = [t.cpu().pin_memory() for t in dev]
    x = torch.from_numpy(rng.standard_normal((1, H)).astype(np.float32)).cuda()
    ids = torch.from_numpy(rng.permutation(E)[:k].astype(np.int64)).reshape(1, k).cuda()
    weights = torch.full((1, k), 1.0 / k, device="cuda")
    resident = moe(x, *dev, fg, fg, fd, weights, ids, path="dp4a")
    assert torch.equal(moe(x, *host, fg, fg, fd, weights, ids, path="dp4a"), resident)
    staged = [torch.empty((k, *t.shape[1:]), dtype=t.dtype, device="cuda") for t in dev]
    stage_rows([h.view(E, -1) for h in host], [s.view(k, -1) for s in staged], ids.reshape(-1),
               torch.full((k,), -1, dtype=torch.int64, device="cuda"), 0)
    local = torch.arange(k, device="cuda").reshape(1, k)
    assert torch.equal(moe(x, *staged, fg, fg, fd, weights, local, path="dp4a"), resident)
    with pytest.raises(ValueError, match="must be pinned"):
        moe(x, *[t.cpu() for t in dev], fg, fg, fd, weights, ids, path="dp4a")
