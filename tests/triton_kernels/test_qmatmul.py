"""qmatmul: both Triton kernels (GEMV and GEMM, through the interpreter) and the torch path
against a float64 reference, for every format.

Reference: ref = x.double() @ W.double().T, with W = fmt.dequantize(q) (the numpy codec,
which the decode functions match bit for bit) and x the input's exact values (float16
widens exactly, so half inputs add no error of their own).

Tolerance, elementwise, with u = 2^-24 (float32 unit roundoff) and S = |x| @ |W|.T:

    float32 result:  |y - ref| <= tol32 = 2 * (K + 2) * u * S + K * 2^-149
    float16 result:  |y - ref| <= tol32 + 2^-11 * (|ref| + tol32) + 2^-25

Why: a float32 dot product of K terms, summed in any order (tl.sum trees, tl.dot,
K-tile after K-tile, torch's blocked matmul), errs by at most gamma_K * S with
gamma_K = K*u / (1 - K*u) (Higham, Accuracy and Stability of Numerical Algorithms, 3.1):
each product rounds once and each addition rounds a partial sum no larger than S. One u*S
more covers Q4_1's d*q+m, which FMA contraction (enable_fp_fusion is on) may round once
instead of twice (Q5_1's too; the K-quants' (d*sc)*q - dmin*m round their d*sc*q exactly,
at most 11 + 6 + 5 significant bits, so fusing changes nothing there), and one more the final rounding of the sum. K*u <= 768 * 2^-24, so
gamma_K < 1.0001 * K*u: the factor 2 is margin on a proven bound, not a fitted constant.
K * 2^-149 covers products that would underflow into float32 subnormals (none do at these
ranges). A float16 result is the float32 one rounded to nearest: relative error 2^-11,
or 2^-25 absolute among the subnormals.

Elementwise against S, not against |ref|: ref can cancel to nearly zero while the
rounding errors of its terms do not. Ranges keep every float16 result finite: scales in
[-1/8, 1/8] (narrower for Q4_K, Q5_K, Q6_K: SCALE_BOUND), x in [-1, 1], so |w| <= 64 and
|y| <= 768 * 64 < 65504 (IQ3_XXS: 7.75 * 62 / 8 per weight; Q5_K: 2016 / 32).

On a GPU the GEMM rounds its inputs to fp16/bf16/tf32 for the tensor cores, a looser
bound that these interpreter tests (float32 dot inputs) do not check.

Examples per format are fewer than the profile's 200: each one runs three products, and
the interpreter runs a GEMV with M=64 as four programs of 16 unrolled rows.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from tests.tiers import examples

import quant
from tests.blocks import blocks, has_scales
from triton_kernels import qmatmul, qmatmul_torch
from triton_kernels import backend
from triton_kernels.backend import interpreter_on
from triton_kernels.qmatmul import GEMV_MAX_M

FORMATS = list(quant.FORMATS.values())
U = 2.0 ** -24
moderate_scales = st.floats(-0.125, 0.125, width=16)  # exact fp16 endpoints
# K-quants whose unit super-scale gives weights above 60: |w| <= bound * 1008 (Q4_K:
# 63 * 15 + 63), 2016 (Q5_K: 63 * 31 + 63), 4096 (Q6_K: 128 * 32), so at most 64 here
# and IQ4_XS: |w| <= bound * 32 * 127
SCALE_BOUND = {"Q4_K": 2.0 ** -4, "Q5_K": 2.0 ** -5, "Q6_K": 2.0 ** -6, "IQ4_XS": 2.0 ** -6}


def scales_for(fmt):
    bound = SCALE_BOUND.get(fmt.name)
    return moderate_scales if bound is None else st.floats(-bound, bound, width=16)


def tiles(fmt) -> list:
    """The defaults, and small tiles: with M <= 64 and N <= 48 both give several programs
    along M and N with ragged edges; the small ones also take K in several steps, each
    shorter than a block for the 32- and 256-weight formats (16 < 32, 128 < 256). The
    default GEMV step of 256 weights covers K = 32..96 with one ragged step, and the
    default GEMM step of 64 splits 256-weight blocks in four."""
    return [None, (16, 16, 128 if fmt.block_elems == 256 else 16)]


def per_format(fmt) -> int:
    return examples(6 if fmt.block_elems == 256 else 12)


def reference(x: torch.Tensor, q: np.ndarray, fmt):
    """(ref, S): the float64 product and |x| @ |W|.T."""
    w = torch.from_numpy(fmt.dequantize(q)).double()
    xd = x.double()
    return xd @ w.T, xd.abs() @ w.abs().T


def tolerance(ref: torch.Tensor, s: torch.Tensor, K: int, dtype: torch.dtype) -> torch.Tensor:
    tol = 2 * (K + 2) * U * s + K * 2.0 ** -149
    if dtype == torch.float16:
        tol = tol + 2.0 ** -11 * (ref.abs() + tol) + 2.0 ** -25
    return tol


def assert_close(y: torch.Tensor, ref, s, K, dtype, what: str):
    assert y.dtype == dtype and y.shape == ref.shape, what
    err = (y.double() - ref).abs()
    tol = tolerance(ref, s, K, dtype)
    bad = ~(err <= tol)  # NaN counts as bad
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outputs off; worst "
                           f"err {err[bad].max().item():.3g} vs tol {tol[bad].min().item():.3g}")


@st.composite
def weights(draw, fmt, n: int, blocks_per_row: int) -> np.ndarray:
    """(n, row bytes) uint8. Quantized formats: free bytes with moderate finite scales;
    float formats (whose free bytes include NaN and Inf): random weights, quantized."""
    if has_scales(fmt):
        flat = draw(blocks(fmt, min_blocks=n * blocks_per_row, max_blocks=n * blocks_per_row,
                           scales=scales_for(fmt)))
        return flat.reshape(n, blocks_per_row * fmt.block_bytes)
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    w = rng.uniform(-2.0, 2.0, (n, blocks_per_row)).astype(np.float32)
    return fmt.quantize(w)


def test_the_interpreter_is_on():
    assert interpreter_on()  # else qmatmul() on CPU tensors would test the torch path


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_both_kernels_and_torch_agree_with_the_reference(fmt):
    # K: 1..3 blocks; the one-weight float formats take 1..96 so that K spans several tiles
    max_blocks = 96 if fmt.block_elems == 1 else 3

    @given(m=st.integers(1, 64), n=st.integers(1, 48), nb=st.integers(1, max_blocks),
           half=st.booleans(), gemv_tiles=st.sampled_from(tiles(fmt)),
           gemm_tiles=st.sampled_from(tiles(fmt)), seed=st.integers(0, 2 ** 32 - 1),
           data=st.data())
    @settings(max_examples=per_format(fmt))
    def prop(m, n, nb, half, gemv_tiles, gemm_tiles, seed, data):
        q = data.draw(weights(fmt, n, nb))
        K = nb * fmt.block_elems
        dtype = torch.float16 if half else torch.float32
        x = torch.from_numpy(np.random.default_rng(seed).uniform(-1, 1, (m, K))).to(dtype)
        ref, s = reference(x, q, fmt)
        qt = torch.from_numpy(q)
        assert_close(qmatmul(x, qt, fmt, path="gemv", tiles=gemv_tiles), ref, s, K, dtype, "gemv")
        assert_close(qmatmul(x, qt, fmt, path="gemm", tiles=gemm_tiles), ref, s, K, dtype, "gemm")
        assert_close(qmatmul_torch(x, qt, fmt), ref, s, K, dtype, "torch")
    prop()


def _case(fmt_name="Q4_0", m=3, n=5, nb=2, seed=0):
    fmt = quant.get(fmt_name)
    rng = np.random.default_rng(seed)
    q = fmt.quantize(rng.standard_normal((n, nb * fmt.block_elems)).astype(np.float32))
    x = torch.from_numpy(rng.uniform(-1, 1, (m, nb * fmt.block_elems)).astype(np.float32))
    return fmt, x, q


@pytest.mark.parametrize("fmt_name,m,path", [
    ("Q4_0", 1, "dp4a"), ("Q4_0", GEMV_MAX_M, "dp4a"), ("Q4_0", GEMV_MAX_M + 1, "gemm"),
    ("FP8_E4M3", 1, "gemv"), ("FP8_E4M3", GEMV_MAX_M, "gemv"), ("FP8_E4M3", GEMV_MAX_M + 1, "gemm")])
def test_default_path_is_a_gemv_for_few_rows_and_gemm_after(fmt_name, m, path):
    # dp4a where the format has int8 units (test_int8.py checks its bound), the float GEMV
    # elsewhere (FP8, one weight a block: 64 of them)
    fmt, x, q = _case(fmt_name, m=m, nb=max(2, 64 // quant.get(fmt_name).block_elems))
    qt = torch.from_numpy(q)
    # the interpreter is deterministic: the same kernel gives the same bits
    assert torch.equal(qmatmul(x, qt, fmt), qmatmul(x, qt, fmt, path=path))


@pytest.mark.parametrize("path", ["dp4a", "gemv", "gemm"])
def test_leading_axes_flat_weights_and_strided_x(path):
    fmt, x, q = _case("IQ4_NL", m=6, n=7)
    qt = torch.from_numpy(q)
    want = qmatmul(x, qt, fmt, path=path)
    assert want.shape == (6, 7)
    assert torch.equal(qmatmul(x.reshape(2, 3, -1), qt, fmt, path=path), want.reshape(2, 3, 7))
    assert torch.equal(qmatmul(x[0], qt, fmt, path=path), want[0])  # 1-D x -> (N,)
    flat = qt.reshape(-1)
    assert torch.equal(qmatmul(x, flat, fmt, path=path), want)      # N inferred from K
    assert torch.equal(qmatmul(x, flat, fmt, n=7, path=path), want)
    assert torch.equal(qmatmul(x, qt, fmt, n=7, path=path), want)
    # a column-major x: strides passed to the kernel, no copy needed
    xt = x.T.contiguous().T
    assert xt.stride() == (1, 6)
    assert torch.equal(qmatmul(xt, qt, fmt, path=path), want)


@pytest.mark.parametrize("path", ["gemv", "gemm"])  # dp4a's bound: test_int8.py
def test_bfloat16_x_gives_a_bfloat16_result(path):
    fmt, x, q = _case("Q8_0", m=4, n=9)
    xb = x.to(torch.bfloat16)
    ref, s = reference(xb, q, fmt)
    y = qmatmul(xb, torch.from_numpy(q), fmt, path=path)
    assert y.dtype == torch.bfloat16
    tol32 = tolerance(ref, s, x.shape[1], torch.float32)
    assert ((y.double() - ref).abs() <= tol32 + 2.0 ** -8 * (ref.abs() + tol32)).all()


def test_cpu_tensors_without_the_interpreter_take_the_torch_path(monkeypatch):
    fmt, x, q = _case("IQ3_S", m=2, n=3, nb=1)
    qt = torch.from_numpy(q)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch.equal(qmatmul(x, qt, fmt, path="gemm"), qmatmul_torch(x, qt, fmt))


@pytest.mark.parametrize("triton_v,numpy_v,fails", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False)])
def test_an_interpreter_that_cannot_run_says_what_to_install(monkeypatch, triton_v, numpy_v, fails):
    import triton
    monkeypatch.setattr(triton, "__version__", triton_v)
    monkeypatch.setattr(np, "__version__", numpy_v)
    backend.interpreter_check.cache_clear()
    try:
        if fails:
            with pytest.raises(RuntimeError, match=r"Triton 3\.6\.0.*numpy 2\.4\.6.*pip install 'numpy<2\.4'"):
                fmt, x, q = _case("Q8_0", m=1, n=2, nb=1)
                qmatmul(x, torch.from_numpy(q), fmt)
        else:
            assert backend.interpreter_check() is None
    finally:
        backend.interpreter_check.cache_clear()


@pytest.mark.parametrize("fn", [qmatmul, qmatmul_torch])
def test_empty_products(fn):
    q = torch.zeros((3, 36), dtype=torch.uint8)
    assert fn(torch.zeros((0, 64)), q, "Q4_0").shape == (0, 3)
    assert fn(torch.zeros((2, 64)), q[:0], "Q4_0").shape == (2, 0)
    y = fn(torch.ones((2, 0)), torch.zeros((3, 0), dtype=torch.uint8), "Q4_0")
    assert y.shape == (2, 3) and not y.any()


@pytest.mark.parametrize("fn", [qmatmul, qmatmul_torch])
def test_bad_input_raises_value_error_naming_the_format(fn):
    q = torch.zeros((4, 18), dtype=torch.uint8)
    x = torch.zeros((2, 32))
    with pytest.raises(ValueError, match=r"Q4_0: weight has 18 bytes per row = 32 weights, but x has K=64"):
        fn(torch.zeros((2, 64)), q, "Q4_0")
    with pytest.raises(ValueError, match=r"Q4_0: x has K=40, not a multiple of the 32-weight block"):
        fn(torch.zeros((2, 40)), q, "Q4_0")
    with pytest.raises(ValueError, match=r"IQ3_S: x must be float32, float16 or bfloat16, got torch.int32"):
        fn(torch.zeros((2, 256), dtype=torch.int32), torch.zeros((1, 110), dtype=torch.uint8), "IQ3_S")
    with pytest.raises(ValueError, match=r"Q4_0: x must have shape \(\.\.\., K\), got a scalar"):
        fn(torch.tensor(1.0), q, "Q4_0")
    with pytest.raises(ValueError, match=r"Q4_0: quantized data must be a uint8 tensor, got torch.float32"):
        fn(x, torch.zeros((4, 18)), "Q4_0")
    with pytest.raises(ValueError, match=r"Q4_0: 17 bytes per row is not a whole number of blocks"):
        fn(x, torch.zeros((4, 17), dtype=torch.uint8), "Q4_0")
    with pytest.raises(ValueError, match=r"Q4_0: n=3, but the weight has 4 rows"):
        fn(x, q, "Q4_0", n=3)
    with pytest.raises(ValueError, match=r"Q4_0: weight has 72 bytes, but n=3 rows of K=32 weights take 54"):
        fn(x, q.reshape(-1), "Q4_0", n=3)
    with pytest.raises(ValueError, match=r"Q4_0: weight has 72 bytes, not whole rows of K=96 weights \(54 bytes a row\)"):
        fn(torch.zeros((2, 96)), q.reshape(-1), "Q4_0")
    with pytest.raises(ValueError, match=r"Q4_0: x is on meta but the weight is on cpu"):
        fn(x.to("meta"), q, "Q4_0")
    with pytest.raises(ValueError, match=r"Q4_0: weight must be \(N, row bytes\) or flat 1-D blocks, got shape \(2, 2, 18\)"):
        fn(x, q.reshape(2, 2, 18), "Q4_0")
    with pytest.raises(ValueError, match="unknown quantization format 'Q3_Z'"):
        fn(x, q, "Q3_Z")


def test_bad_path_and_tiles():
    fmt, x, q = _case()
    qt = torch.from_numpy(q)
    with pytest.raises(ValueError, match=r"Q4_0: path must be 'dp4a', 'gemv', 'gemm' or None, got 'dot'"):
        qmatmul(x, qt, fmt, path="dot")
    with pytest.raises(ValueError, match=r"Q4_0: dp4a tiles must be \(BLOCK_N, BLOCK_U\), powers of two, got \(16, 16, 16\)"):
        qmatmul(x, qt, fmt, path="dp4a", tiles=(16, 16, 16))
    with pytest.raises(ValueError, match=r"FP8_E4M3: no int8 unit decode for this format; use path='gemv'"):
        qmatmul(x, torch.from_numpy(quant.get("FP8_E4M3").quantize(x.numpy()[:2])), "FP8_E4M3", path="dp4a")
    with pytest.raises(ValueError, match=r"Q4_0: tiles must be powers of two >= 16 for gemm, got \(16, 8, 16\)"):
        qmatmul(x, qt, fmt, path="gemm", tiles=(16, 8, 16))
    with pytest.raises(ValueError, match=r"Q4_0: tiles must be powers of two, got \(3, 16, 16\)"):
        qmatmul(x, qt, fmt, path="gemv", tiles=(3, 16, 16))


def test_the_dots_input_precision_is_one_every_gpu_takes(monkeypatch):
    """dot_types: x's own type on a GPU, or the model's dtype where the caller names one (an
    expert store's float32 x, multiplied in bf16); TF32 only for float32 on NVIDIA (Triton's
    CUDA default). 16-bit dots ask for "ieee", the same code on sm_90 and gfx942, because
    Triton's AMD backend takes "tf32" on gfx942 alone (gfx90a, gfx1100 refuse to compile
    it: tests/strata/test_trace.py compiles a model's launches for gfx1100)."""
    import importlib

    import triton.language as tl
    from torch._subclasses.fake_tensor import FakeTensorMode
    qm = importlib.import_module("triton_kernels.qmatmul")  # the module (the package's qmatmul is its launcher)
    assert qm.dot_types(torch.zeros(2, 2, dtype=torch.bfloat16)) == (tl.float32, "ieee")  # the interpreter's
    with FakeTensorMode():
        x32, x16 = torch.empty(2, 2, device="cuda"), torch.empty(2, 2, device="cuda", dtype=torch.bfloat16)
        monkeypatch.setattr(qm, "backend_name", lambda: "cuda")  # (whatever build of torch runs the test)
        assert qm.dot_types(x32) == (tl.float32, "tf32") and qm.dot_types(x16) == (tl.bfloat16, "ieee")
        assert qm.dot_types(x32, torch.bfloat16) == (tl.bfloat16, "ieee")
        monkeypatch.setattr(qm, "backend_name", lambda: "hip")
        assert qm.dot_types(x32) == (tl.float32, "ieee") and qm.dot_types(x16) == (tl.bfloat16, "ieee")
        assert qm.dot_types(x32, torch.bfloat16) == (tl.bfloat16, "ieee")


@pytest.mark.slow
def test_the_unit_gemms_warps_follow_the_configuration_family():
    """The unit GEMM's launch takes configs' "unit_num_warps" for its device's family:
    recorded (bf16 rows), then compiled as launched for sm_90, gfx942 and gfx1100 (RDNA3),
    Q6_K takes 8 warps on gfx1100 alone (at 4 it spilled 340-488 bytes a lane there) and
    Q4_K 4 on each; none spills on sm_90 or gfx942 (RDNA3's prompt kernels: test_static)."""
    from triton_kernels.analysis.launches import compile_calls, record
    from triton_kernels.ops import impl
    rng = np.random.default_rng(0)
    with record() as calls:
        for name in ("Q6_K", "Q4_K"):
            fmt = quant.get(name)
            q = torch.from_numpy(fmt.quantize(rng.standard_normal((32, 256)).astype(np.float32)))
            impl("qmatmul", "triton")(torch.randn(16, 256).bfloat16(), q, fmt, path="gemm")  # a bf16 model's
    results = [r for r in compile_calls(calls, ("sm_90", "gfx942", "gfx1100")) if r.kernel == "_gemm_units_kernel"]
    warps = {(r.target, "Q6_K" if "q6_k" in r.constexprs else "Q4_K"): r.num_warps for r in results}
    assert warps == {("sm_90", "Q6_K"): 4, ("gfx942", "Q6_K"): 4, ("gfx1100", "Q6_K"): 8,
                     ("sm_90", "Q4_K"): 4, ("gfx942", "Q4_K"): 4, ("gfx1100", "Q4_K"): 4}, warps
    assert not [r.problems for r in results if r.problems and r.target != "gfx1100"]
