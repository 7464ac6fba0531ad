"""The searches (quant/search). The K-quants' and IQ4's are llama.cpp's to the bit: their
blocks equal the bytes ggml wrote for the same rows (tests/data/quant_ggml_blocks.npz,
written by scripts/quant_rmse_limits.py --blocks), with and without an importance. The
IQ3 search decodes, is llama.cpp's loop where it claims to be, and its refinement only
ever lowers the weighted error.

Errors are weighed as the search weighs them: x^2 without an importance matrix,
imp * sqrt(sigma2 + x^2) with one (llama.cpp's choice).
"""
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers import examples

import quant
from quant import iq3
from quant.search import IQ3Options, grid_tables, iq3_search
from quant.search.iq3 import signs_and_targets, weights
from quant.search.reference import quantize_block

GGML_BLOCKS = np.load(Path(__file__).parents[1] / "data" / "quant_ggml_blocks.npz")


@pytest.mark.parametrize("key", [k for k in GGML_BLOCKS.files if k not in ("rows", "importance")])
def test_blocks_are_ggml_blocks(key):
    """Gaussian, Student-t, Q4_1-like, spiky/zero, fp16-subnormal and all-positive rows."""
    name, _, imp = key.partition("+")
    w = GGML_BLOCKS["importance"] if imp else None
    ours = quant.get(name).quantize(GGML_BLOCKS["rows"], w)
    assert np.array_equal(ours, GGML_BLOCKS[key])


FORMATS = {  # name: (grid, levels, parity, llama.cpp's scale count, fudge, eps)
    "IQ3_XXS": (iq3.XXS_GRID, iq3.XXS_LEVELS, True, 15, 1.0125, 1e-8),
    "IQ3_S": (iq3.S_GRID, iq3.S_LEVELS, False, 9, 1.033, 0.0),
}


def blocks(seed: int, n: int) -> np.ndarray:
    """Gaussian blocks of mixed scale, a few heavy outliers: what weight rows look like."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 256)) * rng.uniform(0.01, 2.0, (n, 1))
    x[rng.random(x.shape) < 0.01] *= 8
    return x.astype(np.float32)


def importance(seed: int, n: int, use: bool):
    return np.random.default_rng(seed + 1).uniform(0.05, 4.0, 256).astype(np.float32) if use else None


def werr(name: str, x: np.ndarray, q: np.ndarray, imp) -> float:
    w = weights(x, None if imp is None else np.broadcast_to(imp, x.shape))
    return float((w * (x - quant.get(name).dequantize(q)) ** 2).sum(dtype=np.float64))


def simple_search(name: str, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The quantizer this search replaced: per 32 weights 8 scales from amax, the nearest
    grid entry (exhaustive) per group of four, one fp16 d, entries picked again at the
    stored scale. It weighed errors by the importance as given, or all alike."""
    grid, _, parity = FORMATS[name][:3]
    dmul = 4.0 if name == "IQ3_XXS" else 1.0
    n = x.shape[0]
    neg, t = signs_and_targets(x, w, parity)
    t4, w4 = t.reshape(n, 8, 8, 4), w.reshape(n, 8, 8, 4)
    amax = np.abs(t).reshape(n, 8, 32).max(-1)
    best_err, best_scale = np.full((n, 8), np.inf), np.zeros((n, 8), np.float32)
    for c in np.linspace(0.75, 1.1, 8, dtype=np.float32):
        scale = amax / (np.float32(grid.max()) * c)
        _, err = iq3.nearest(t4, w4, np.broadcast_to(scale[..., None], (n, 8, 8)), grid)
        err = err.sum(-1)
        better = err < best_err
        best_err, best_scale = np.where(better, err, best_err), np.where(better, scale, best_scale)
    d = best_scale.max(-1) * np.float32(dmul / 31)
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.clip(np.where(d16[:, None] > 0, np.rint((best_scale * dmul / d16[:, None] - 1) / 2), 0), 0, 15)
    s = s.astype(np.uint8)
    db = d16[:, None] * ((0.5 + s) * 0.5 if dmul == 4 else (1 + 2 * s)).astype(np.float32)
    idx, _ = iq3.nearest(t4, w4, np.broadcast_to(db[..., None], (n, 8, 8)), grid)
    # pack through the format's own writer by handing it the fields it would compute
    return _pack(name, d16, s, idx.reshape(n, 64), neg)


def _pack(name, d, s, idx, neg):
    n = d.shape[0]
    d16 = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    if name == "IQ3_XXS":
        bits = neg.reshape(n, 8, 4, 8)[..., :7].astype(np.uint32)
        sidx = (bits << np.arange(7, dtype=np.uint32)).sum(-1)
        words = (sidx << np.array([0, 7, 14, 21], dtype=np.uint32)).sum(-1) | (s.astype(np.uint32) << 28)
        return np.concatenate([d16, idx.astype(np.uint8), words.astype("<u4").view(np.uint8)], -1)
    qh = np.packbits((idx >> 8).astype(np.uint8).reshape(n, 8, 8), axis=-1, bitorder="little")
    signs = np.packbits(neg.reshape(n, 32, 8), axis=-1, bitorder="little")
    return np.concatenate([d16, (idx & 0xFF).astype(np.uint8), qh.reshape(n, 8), signs.reshape(n, 32),
                           s[:, 0::2] | (s[:, 1::2] << 4)], -1)


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=examples(15), deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 6), use_imp=st.booleans(),
       scale=st.sampled_from([1e-6, 1e-2, 1.0, 1e3]))
def test_output_decodes_to_finite_weights_of_the_right_signs(name, seed, n, use_imp, scale):
    x = blocks(seed, n) * np.float32(scale)
    fmt = quant.get(name)
    q = fmt.quantize(x, importance(seed, n, use_imp))
    y = fmt.dequantize(q)
    assert q.shape == (n, fmt.block_bytes) and np.isfinite(y).all()
    # every weight that decodes non-zero keeps its sign, but for IQ3_XXS's one parity weight per 8
    wrong = ((np.sign(y) * np.sign(x)) < 0).reshape(n, 32, 8).sum(-1)
    assert (wrong <= (1 if name == "IQ3_XXS" else 0)).all()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("use_imp", [False, True])
def test_no_worse_than_the_simple_scale_search(name, use_imp):
    for seed in range(3):
        x, imp = blocks(seed, 32), importance(seed, 32, use_imp)
        old_w = np.ones_like(x) if imp is None else np.ascontiguousarray(np.broadcast_to(imp, x.shape))
        new = werr(name, x, quant.get(name).quantize(x, imp), imp)
        old = werr(name, x, simple_search(name, x, old_w), imp)
        assert new <= old


def _reference(name, x, imp):
    grid, levels, parity, ns, fudge, eps = FORMATS[name]
    tab = grid_tables(np.searchsorted(levels, grid))
    fields = [quantize_block(b, imp, tab, parity, ns, fudge, eps) for b in x]
    d, s, e, neg = (np.stack(f) for f in zip(*fields))
    return tab, IQ3Options(n_scales=ns, parity=parity, fudge=fudge, eps=eps, refine=False), (d, s, e, neg)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("use_imp", [False, True])
def test_vectorised_loop_is_llama_cpp_loop_and_refinement_no_worse(name, use_imp):
    x, imp = blocks(7, 3), importance(7, 3, use_imp)
    tab, opt, ref = _reference(name, x, imp)
    got = iq3_search(x, None if imp is None else np.broadcast_to(imp, x.shape), tab, opt)
    # The vectorised loop compares neighbours by sum w (c - y)^2 in level coordinates, the
    # C loop by sum w (s g - t)^2: equal up to rounding, so a near tie may fall either way.
    assert (got[2] == ref[2]).mean() >= 0.97
    assert werr(name, x, _pack(name, *got), imp) <= 1.005 * werr(name, x, _pack(name, *ref), imp)
    # the default quantizer: llama.cpp's loop plus the refinement
    refined = werr(name, x, quant.get(name).quantize(x, imp), imp)
    assert refined <= werr(name, x, _pack(name, *ref), imp)


def test_zero_and_tiny_blocks_decode_to_zero():
    for name in FORMATS:
        fmt = quant.get(name)
        x = np.zeros((2, 256), np.float32)
        x[1, :5] = 1e-9  # below IQ3_XXS's threshold, a subnormal d for IQ3_S
        y = fmt.dequantize(fmt.quantize(x))
        assert np.abs(y).max() <= 1e-8


def test_candidates_repeating_the_last_codes_are_skipped_alike(monkeypatch):
    """Rows requantized from Q4_1 keep their codes over many of Q4_K's candidate scales;
    those candidates are skipped, and the blocks are those of fitting every one."""
    from quant.search import kquants as ks
    x = quant.get("Q4_1").dequantize(quant.get("Q4_1").quantize(blocks(3, 64)))
    calls = []
    same = ks._same_codes
    monkeypatch.setattr(ks, "_same_codes", lambda l, last: calls.append(same(l, last)) or calls[-1])
    skipping = quant.get("Q4_K").quantize(x)
    assert any(calls)
    monkeypatch.setattr(ks, "_same_codes", lambda l, last: False)
    assert np.array_equal(skipping, quant.get("Q4_K").quantize(x))
