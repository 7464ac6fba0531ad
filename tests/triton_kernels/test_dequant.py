"""Triton dequant kernel (interpreter) == torch implementation == numpy reference, bit for bit."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings, strategies as st
from tests.tiers import examples

import quant
from tests.blocks import blocks, exhaustive_blocks, has_scales, same_bits, special_f16, with_first_scale, with_scale
from triton_kernels import dequantize, dequantize_torch
from triton_kernels.backend import interpreter_on
from triton_kernels.dequant import store_packed, store_units

FORMATS = list(quant.FORMATS.values())
# A property's cost is one interpreted launch an example, whatever its size: 50 examples of
# up to 12 blocks check as many random blocks (about 325) as 200 examples of up to 3 did,
# in a quarter of the launches
settings_blocks = settings(max_examples=examples(50))
# output dtypes and 2-D layouts reuse the decode path checked above
settings_small = settings(max_examples=examples(25))


def test_the_interpreter_is_on():
    assert interpreter_on()  # else dequantize() on CPU tensors would test the torch path


def both(raw: np.ndarray, fmt, dtype=torch.float32):
    q = torch.from_numpy(raw)
    return dequantize(q, fmt, dtype), dequantize_torch(q, fmt, dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kernel_and_torch_equal_reference(fmt):
    @given(blocks(fmt, max_blocks=12))
    @settings_blocks
    @example(with_scale(fmt, 0x00, 0.0))
    @example(with_scale(fmt, 0xFF, 65504.0))
    @example(with_scale(fmt, 0x81, -(2.0 ** -24)))
    @example(with_first_scale(fmt, 0x5A, -0.0))
    def prop(raw):
        ref = fmt.dequantize(raw)
        kernel, torch_ = both(raw, fmt)
        assert same_bits(kernel.numpy(), ref)
        assert same_bits(torch_.numpy(), ref)
    prop()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_code(fmt):
    raw = exhaustive_blocks(fmt)
    ref = fmt.dequantize(raw)
    kernel, torch_ = both(raw, fmt)
    assert same_bits(kernel.numpy(), ref)
    assert same_bits(torch_.numpy(), ref)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if has_scales(f)], ids=lambda f: f.name)
def test_nan_and_inf_scales(fmt):
    @given(blocks(fmt, max_blocks=8, scales=special_f16))
    @settings_blocks
    def prop(raw):
        ref = fmt.dequantize(raw)
        kernel, torch_ = both(raw, fmt)
        assert same_bits(kernel.numpy(), ref) and same_bits(torch_.numpy(), ref)
    prop()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_half_outputs_round_the_reference_to_nearest_even(fmt, dtype):
    @given(blocks(fmt, max_blocks=2))
    @settings_small
    def prop(raw):
        want = torch.from_numpy(fmt.dequantize(raw)).to(dtype)
        kernel, torch_ = both(raw, fmt, dtype)
        assert kernel.dtype == torch_.dtype == dtype and kernel.shape == want.shape
        # widening to float32 is exact, so equal float32 bits mean equal 16-bit patterns
        assert same_bits(kernel.float().numpy(), want.float().numpy())
        assert same_bits(torch_.float().numpy(), want.float().numpy())
    prop()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_two_dimensional_rows(fmt):
    @given(st.integers(1, 3), st.integers(1, 3), st.data())
    @settings_small
    def prop(rows, per_row, data):
        flat = data.draw(blocks(fmt, min_blocks=rows * per_row, max_blocks=rows * per_row))
        q = flat.reshape(rows, per_row * fmt.block_bytes)
        ref = fmt.dequantize(q)
        kernel, torch_ = both(q, fmt)
        assert kernel.shape == (rows, per_row * fmt.block_elems)
        assert same_bits(kernel.numpy(), ref) and same_bits(torch_.numpy(), ref)
    prop()


def test_many_programs_and_a_ragged_tail():
    # more weights than one program's BLOCK, not a multiple of it
    fmt = quant.get("IQ3_S")
    raw = exhaustive_blocks(fmt)[:9]
    q = torch.from_numpy(raw)
    assert same_bits(dequantize(q, fmt, block=512).numpy(), fmt.dequantize(raw))


def test_empty_input():
    out = dequantize(torch.zeros((0, 98), dtype=torch.uint8), "IQ3_XXS")
    assert out.shape == (0, 256)


@pytest.mark.parametrize("fn", [dequantize, dequantize_torch])
def test_bad_input_raises_value_error_naming_the_format(fn):
    q = torch.zeros(99, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"IQ3_XXS: 99 bytes per row .* multiple of 98 bytes \(256 weights a block\)"):
        fn(q, "IQ3_XXS")
    with pytest.raises(ValueError, match="Q4_0: quantized data must be a uint8 tensor, got torch.float32"):
        fn(torch.zeros(18), "Q4_0")
    with pytest.raises(ValueError, match="unknown quantization format 'IQ3_XL'"):
        fn(torch.zeros(98, dtype=torch.uint8), "IQ3_XL")
    with pytest.raises(ValueError, match="Q8_0: dequantize writes float32, float16 or bfloat16, not torch.int32"):
        fn(torch.zeros(34, dtype=torch.uint8), "Q8_0", torch.int32)


@triton.jit
def _store_both(w_ptr, a_ptr, b_ptr, tile_ptr, packed_ptr, n, scale, ZERO: tl.constexpr,
                OFFSET: tl.constexpr, HAS_SCALE: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
    """One 32-value unit a lane, written by the interpreter's tile path and by the device's
    packed one (with the conversion as plain Triton, which the interpreter runs)."""
    v = tl.arange(0, BLOCK)
    live = v < n
    p = w_ptr + v * 8
    words = (tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3),
             tl.load(p + 4), tl.load(p + 5), tl.load(p + 6), tl.load(p + 7))
    a, b = (tl.load(a_ptr + v),), (tl.load(b_ptr + v),)
    store_units(tile_ptr + v * 32, words, a, b, live, scale, 32, ZERO, OFFSET, HAS_SCALE, OUT, "")
    store_packed(packed_ptr + v * 32, words, a, b, live, scale, 32, ZERO, OFFSET, HAS_SCALE, OUT, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 16), offset=st.booleans(), scaled=st.booleans())
@settings_small
def test_the_devices_packed_stores_write_the_tiles_values(dtype, seed, n, offset, scaled):
    """store_packed (NVIDIA: a word's four values in one 8-byte store) writes the values
    the tile path writes, bit for bit, in the same places, and nothing past a dead lane."""
    g = np.random.default_rng(seed)
    words = torch.from_numpy(g.integers(-2**31, 2**31, (16, 8), dtype=np.int64).astype(np.int32))
    a = torch.from_numpy((g.standard_normal(16) * 10.0 ** g.integers(-6, 4, 16)).astype(np.float32))
    b = torch.from_numpy(g.standard_normal(16).astype(np.float32))
    store = torch.int16 if dtype == torch.bfloat16 else dtype
    tile = torch.full((16 * 32,), 7, dtype=torch.int8).view(torch.uint8).repeat(store.itemsize).view(store)
    packed = tile.clone()
    _store_both[(1,)](words, a, b, tile, packed, n, 0.75, ZERO=8, OFFSET=offset, HAS_SCALE=scaled,
                      OUT="bf16" if dtype == torch.bfloat16 else "", BLOCK=16)
    assert torch.equal(tile.view(torch.uint8), packed.view(torch.uint8))
    assert torch.equal(packed[n * 32:].view(torch.uint8), torch.full(((16 - n) * 32 * store.itemsize,), 7, dtype=torch.uint8))
