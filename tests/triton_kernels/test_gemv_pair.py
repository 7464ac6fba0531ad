"""Two GEMVs of one row in one launch (triton_kernels/gemv_pair.py), through the
interpreter: a float weight (F32, F16, BF16) and one with int8 units (dp4a), in either
order, GGUF order or the split device layout, give each separate GEMV's bits (qmatmul as
QuantLinear runs it: the float one from x in `dtype`, rounded to it; the dp4a one from
x's int8); QuantLinear's two-run projection takes the launch for one token. The torch
twin's rows within the bound of its inputs: on the dp4a rows |x̂ - x| <= d / 2 a value (d
its group's scale), so |y - y_twin| <= |W| |x̂ - x| plus two K-term float32 sums' rounding,
gamma(K) |W| |x| each (u = 2^-24, gamma(n) = n u / (1 - n u)); on the float rows the two
sums' rounding and the output's rounding to `dtype` (2^-8 relative for bfloat16) on both
sides."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quant
from tests.tiers import examples
from triton_kernels import layout
from triton_kernels.dequant import dequantize_torch
from triton_kernels.gemv_pair import gemv_pair, gemv_pair_torch, takes
from triton_kernels.int8 import quantize_x_torch
from triton_kernels.layout.split import TILE_BLOCKS, has_split
from triton_kernels.qmatmul import qmatmul

U = 2.0 ** -24
FLOATS, DP4A = ["F32", "F16", "BF16"], ["Q8_0", "Q4_0", "IQ4_NL", "Q4_K"]


def weight(rng, fmt, N, K, split):
    """(N, K) random weights in fmt as uint8 blocks, in the split layout where asked and held."""
    f = quant.get(fmt)
    split = split and has_split(f) and (N * K // f.block_elems) % TILE_BLOCKS == 0
    raw = f.quantize(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K)).reshape(N, -1)
    return torch.from_numpy(layout.pack(raw, f) if split else raw).reshape(-1), layout.split_format(f) if split else f


@settings(max_examples=examples(12), deadline=None)
@given(ffmt=st.sampled_from(FLOATS), dfmt=st.sampled_from(DP4A), float_first=st.booleans(), split=st.booleans(),
       nf=st.integers(1, 70), nd=st.integers(1, 70), kb=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 32 - 1))
def test_the_pair_is_each_gemvs_bits(ffmt, dfmt, float_first, split, nf, nd, kb, dtype, seed):
    rng = np.random.default_rng(seed)
    K = kb * 256
    (qf, ff), (qd, fd) = weight(rng, ffmt, nf, K, False), weight(rng, dfmt, nd, K, split)
    x = torch.from_numpy(rng.standard_normal((1, K)).astype(np.float32) * 3)
    parts = [(qf, ff, nf), (qd, fd, nd)] if float_first else [(qd, fd, nd), (qf, ff, nf)]
    assert takes(parts, K)
    got = gemv_pair(x, parts, dtype)
    yf = qmatmul(x.to(dtype), qf, ff, n=nf).float()  # as QuantLinear.forward runs each
    yd = qmatmul(x, qd, fd, n=nd).float()
    assert torch.equal(got, torch.cat([yf, yd] if float_first else [yd, yf], dim=1))
    # the torch twin (module docstring's bound)
    twin = gemv_pair_torch(x, parts, dtype)
    bound = []
    for q, f, n in parts:
        w = dequantize_torch(q, f, torch.float32, compiled=False).reshape(n, K).double().abs()
        if f.name in DP4A:
            err = (quantize_x_torch(x).dequantize().double() - x.double()).abs()
            b = err @ w.T + 2 * (K * U / (1 - K * U)) * (x.double().abs() @ w.T)
        else:
            xs = x.to(dtype).double().abs()
            b = 2 * (K * U / (1 - K * U)) * (xs @ w.T)
        bound.append(b)
    bound = torch.cat(bound, dim=1)
    if dtype != torch.float32:  # the float rows rounded to bfloat16 on each side
        bound = bound + 2 ** -8 * (twin.double().abs() + got.double().abs())
    assert bool(((twin.double() - got.double()).abs() <= bound).all())


def test_a_pair_the_launch_does_not_take_is_refused():
    """Two float weights, two dp4a ones, or three weights: no shared launch, said so."""
    rng = np.random.default_rng(1)
    (qf, ff), (qd, fd) = weight(rng, "F32", 8, 256, False), weight(rng, "Q8_0", 8, 256, False)
    x = torch.zeros(1, 256)
    for parts in ([(qf, ff, 8), (qf, ff, 8)], [(qd, fd, 8), (qd, fd, 8)]):
        assert not takes(parts, 256)
        with pytest.raises(ValueError, match="take no shared launch"):
            gemv_pair(x, parts)
    with pytest.raises(ValueError, match="takes two weights"):
        gemv_pair(x, [(qf, ff, 8)] * 3)


@pytest.mark.parametrize("fmts", [("Q4_0", "Q4_0", "F32"), ("F32", "F32", "Q8_0", "Q8_0")])
def test_a_two_run_projection_takes_one_launch_for_a_token(fmts):
    """QuantLinear in "parts" mode with the Triton kernels (an attention's quantized Q, K,
    V beside F32 indexer rows; F32 routers beside the shared expert's quantized gate and
    up): a one-token step is one gemv_pair launch with each run's bits, its outputs and
    forward alike; a verify's rows (T > 1) take a matmul a run."""
    import collections

    import triton.runtime.interpreter as interpreter

    from strata.nn.linear import QuantLinear
    from strata.tensors import QTensor
    rng = np.random.default_rng(4)
    parts = []
    for i, fmt in enumerate(fmts):
        f = quant.get(fmt)
        parts.append(QTensor(f"w{i}", f, (32, 256), f.quantize(rng.standard_normal((32, 256)).astype(np.float32) / 16)))
    lin = QuantLinear(parts, torch.bfloat16, kernels="triton")
    assert lin.mode == "parts" and len(lin.parts) == 2
    run, counts = interpreter.InterpretedFunction.run, collections.Counter()

    def counted(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        return run(self, *args, **kwargs)
    x = torch.from_numpy(rng.standard_normal((1, 256)).astype(np.float32))
    interpreter.InterpretedFunction.run = counted
    try:
        outs, y = lin.outputs(x), lin(x)
    finally:
        interpreter.InterpretedFunction.run = run
    apart = [o for p in lin.parts for o in p.outputs(x)]
    assert all(torch.equal(a, b) for a, b in zip(outs, apart)) and len(outs) == len(fmts)
    assert torch.equal(y, torch.cat(apart, dim=-1))
    assert set(counts) <= {"_gemv_pair_kernel", "_quantize_x_kernel"} and counts["_gemv_pair_kernel"] == 2, counts
    x3 = torch.from_numpy(rng.standard_normal((3, 256)).astype(np.float32))
    assert torch.equal(lin(x3), torch.cat([p(x3) for p in lin.parts], dim=-1))


def test_few_rows_take_more_programs_and_every_float_gemv_the_same_tiles(monkeypatch):
    """qmatmul.gemv_tiles on a GPU of 132 multiprocessors: 4096 rows keep 16 a program;
    513 float rows (a released file's F32 routers) take 4 a program and 1024 weights along
    K, 129 programs where 16 a program made 33; a decoded format keeps its tiles. Every
    float GEMV asks it with the weight's rows:
    the pair's float rows, the router's launch and qmatmul's GEMV agree bit for bit with
    those tiles (here through the interpreter with the GPU's count)."""
    import importlib

    from triton_kernels.route_align import route_align
    from triton_kernels.router_gemv import router_gemv
    qm = importlib.import_module("triton_kernels.qmatmul")  # the package's qmatmul is the function
    monkeypatch.setattr(qm, "multiprocessors", lambda device: 132)
    f32, q5k = quant.get("F32"), quant.get("Q5_K")
    assert qm.gemv_tiles(4096, "cpu", f32) == (16, 16, 256) and qm.gemv_tiles(513, "cpu", f32) == (16, 4, 1024)
    assert qm.gemv_tiles(2000, "cpu", f32) == (16, 8, 512) and qm.gemv_tiles(513, "cpu", q5k) == (16, 16, 256)
    rng = np.random.default_rng(5)
    K = 512
    (qf, ff), (qd, fd) = weight(rng, "F32", 40, K, False), weight(rng, "Q4_0", 24, K, False)
    x = torch.from_numpy(rng.standard_normal((1, K)).astype(np.float32))
    for dtype in (torch.float32, torch.bfloat16):
        yf = qmatmul(x.to(dtype), qf, ff, n=40).float()
        got = gemv_pair(x, [(qf, ff, 40), (qd, fd, 24)], dtype)
        assert torch.equal(got, torch.cat([yf, qmatmul(x, qd, fd, n=24).float()], dim=1))
        out, *routing = router_gemv(x, qf, ff, 40, 4, True, 0, 32, 32, dtype=dtype)
        assert torch.equal(out, yf)
        assert all(torch.equal(a, b) for a, b in zip(routing[:2], route_align(yf[:, :32], 4, True, 0, 32)[:2]))
