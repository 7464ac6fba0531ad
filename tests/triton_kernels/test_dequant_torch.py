"""dequantize_torch's own paths: chunks, caller-given outputs, unaligned rows, and the
compiled one-pass loops (triton_kernels/cpu/dequant_compiled.py), each bit for bit against the numpy reference."""
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers import examples

import quant
import triton_kernels.dequant as dq
from tests.blocks import blocks, same_bits
from triton_kernels import dequantize_torch
from triton_kernels.cpu.dequant_compiled import FUSED

FORMATS = list(quant.FORMATS.values())
# the formats whose torch code is built for speed (int8 codes, in-place scaling)
FAST = [quant.get(n) for n in ("Q8_0", "Q4_0", "IQ4_NL", "IQ3_XXS", "IQ3_S")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FAST, ids=lambda f: f.name)
def test_chunks_and_a_ragged_tail_equal_reference(fmt, dtype, monkeypatch):
    """Two blocks a chunk over five blocks: every chunk boundary and a short last chunk,
    through the reused float32 staging tile when the output is bf16."""
    monkeypatch.setattr(dq, "_CHUNK_VALUES", 2 * fmt.block_elems)

    @given(blocks(fmt, min_blocks=5, max_blocks=5))
    @settings(max_examples=examples(10))
    def prop(raw):
        want = torch.from_numpy(fmt.dequantize(raw)).to(dtype).float().numpy()
        got = dequantize_torch(torch.from_numpy(raw), fmt, dtype, compiled=False)
        assert same_bits(got.float().numpy(), want)
    prop()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_writes_the_given_output(fmt):
    raw = np.random.default_rng(0).integers(0, 256, (3, fmt.block_bytes), dtype=np.uint8)
    for off in fmt.scale_offsets:  # finite scales: NaN bits need not repeat
        raw[:, off:off + 2] = np.array(0.5, np.float16).reshape(1).view(np.uint8)
    if fmt.write_scale is not None:
        fmt.write_scale(raw, np.full(3, 0.5, dtype=np.float16))
    out = torch.full((3 * fmt.block_elems,), 7.0)
    got = dequantize_torch(torch.from_numpy(raw.reshape(-1)), fmt, out=out, compiled=False)
    assert got is out and same_bits(out.numpy(), fmt.dequantize(raw).reshape(-1))


def test_a_wrong_output_is_refused_naming_format_and_shape():
    q = torch.zeros((2, 34), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q8_0: out must be a contiguous torch.float32 tensor of shape \(2, 32\)"):
        dequantize_torch(q, "Q8_0", out=torch.empty(2, 33))
    with pytest.raises(ValueError, match="non-contiguous"):
        dequantize_torch(q, "Q8_0", out=torch.empty(32, 2).T)
    with pytest.raises(ValueError, match="got a torch.bfloat16 tensor"):
        dequantize_torch(q, "Q8_0", out=torch.empty(2, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt", FAST, ids=lambda f: f.name)
def test_rows_at_an_odd_byte_offset(fmt):
    """Blocks one byte into their storage: the fp16 scales cannot be read in place there,
    so the rows are copied first; the values must not change."""
    raw = np.random.default_rng(1).integers(0, 256, (4, fmt.block_bytes), dtype=np.uint8)
    raw[:, :2] = np.array(-0.25, np.float16).reshape(1).view(np.uint8)
    store = torch.zeros(1 + raw.size, dtype=torch.uint8)
    store[1:] = torch.from_numpy(raw.reshape(-1))
    got = dequantize_torch(store[1:], fmt, compiled=False)
    assert same_bits(got.numpy(), fmt.dequantize(raw).reshape(-1))


# --- the compiled loops -------------------------------------------------------------------
# Inductor's compiles cost about a minute on a cold cache (53 s for these, measured on 2 cores),
# 10-15 s warm: too slow for every run of the suite, so these run on request; the bench's
# "same bits" column checks the compiled output on each of its runs too.
compile_tests = pytest.mark.skipif(
    os.environ.get("STRATA_TEST_COMPILE", "0") in ("", "0"),
    reason="compiles with Inductor (about 30 s a case cold): STRATA_TEST_COMPILE=1 python -m pytest "
           "tests/triton_kernels/test_dequant_torch.py; Q4_0 in float32 runs in every suite run")
# one compiled case runs always, so that the compiled path is checked wherever the suite runs
ALWAYS = ("Q4_0", torch.float32)


@pytest.mark.parametrize("name,dtype", [pytest.param(n, d, id=f"{n}-{d}", marks=() if (n, d) == ALWAYS else compile_tests)
                                        for n in FUSED for d in (torch.float32, torch.bfloat16)])
def test_compiled_equals_reference(name, dtype):
    """Any blocks, NaN and Inf scales included: the fused loop keeps the reference's single
    product a weight (no contraction into anything else), so every bit, and bf16 rounds it to
    nearest even as torch does."""
    fmt = quant.get(name)

    @given(blocks(fmt, min_blocks=2, max_blocks=40), st.booleans())
    @settings(max_examples=examples(30))
    def prop(raw, two_d):
        q = torch.from_numpy(raw)
        want = torch.from_numpy(fmt.dequantize(raw)).to(dtype).float().numpy()
        got = dequantize_torch(q if two_d else q.reshape(-1), fmt, dtype, compiled=True)
        assert same_bits(got.float().numpy().reshape(want.shape), want)
    prop()


@compile_tests
def test_the_environment_turns_compiling_on(monkeypatch):
    from triton_kernels.cpu import dequant_compiled
    monkeypatch.setenv("STRATA_DEQUANT_COMPILE", "1")
    raw = np.random.default_rng(2).integers(0, 256, (8, 18), dtype=np.uint8)
    raw[:, :2] = np.array(0.125, np.float16).reshape(1).view(np.uint8)
    dequant_compiled._COMPILED.pop("Q4_0", None)
    got = dequantize_torch(torch.from_numpy(raw), "Q4_0")
    assert "Q4_0" in dequant_compiled._COMPILED and same_bits(got.numpy(), quant.get("Q4_0").dequantize(raw))
