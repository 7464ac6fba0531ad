"""numpy codecs == gguf-py, bit for bit, for any blocks; the registry; bad input."""
import gguf
import numpy as np
import pytest
from hypothesis import example, given, strategies as st

import quant
from tests.blocks import (blocks, exhaustive_blocks, first_scale, has_scales, same_bits,
                          special_f16, with_scale)

FORMATS = list(quant.FORMATS.values())


def gguf_dequant(raw: np.ndarray, fmt: quant.Format) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(fmt.type_id))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantize_equals_gguf_py(fmt):
    @given(blocks(fmt, max_blocks=4))
    @example(with_scale(fmt, 0x00, 0.0))
    @example(with_scale(fmt, 0xFF, -65504.0))
    @example(with_scale(fmt, 0xA5, 2.0 ** -24))       # smallest subnormal
    @example(with_scale(fmt, 0x5A, -(2.0 ** -14)))    # smallest normal, negative
    def prop(raw):
        assert same_bits(fmt.dequantize(raw), gguf_dequant(raw, fmt))
    prop()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantize_every_code_equals_gguf_py(fmt):
    raw = exhaustive_blocks(fmt)
    assert same_bits(fmt.dequantize(raw), gguf_dequant(raw, fmt))


@pytest.mark.parametrize("fmt", [f for f in FORMATS if has_scales(f)], ids=lambda f: f.name)
def test_nan_and_inf_scales_propagate_as_ieee(fmt):
    """Defined behaviour: the block formula is evaluated in IEEE arithmetic, as gguf-py and
    llama.cpp do. A NaN scale makes the whole block NaN; an infinite one gives +-Inf, or NaN
    where the code's factor is zero."""
    @given(blocks(fmt, max_blocks=2, scales=special_f16))
    def prop(raw):
        ours = fmt.dequantize(raw)
        assert same_bits(ours, gguf_dequant(raw, fmt))
        d = first_scale(fmt, raw)
        assert np.isnan(ours[np.isnan(d)]).all()
        assert not np.isfinite(ours[np.isinf(d)]).any()
    prop()


# gguf-py quantizes these formats; ours follow the same reference algorithms.
@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantize_equals_gguf_py(name):
    fmt = quant.get(name)
    elems = st.floats(-1e4, 1e4, width=32, allow_subnormal=True)

    @given(st.integers(1, 3).flatmap(lambda n: st.lists(elems, min_size=n * 32, max_size=n * 32)))
    @example([0.0] * 32)
    @example([0.5, -0.5] * 16)
    @example([0.0] * 5 + [1e-40] + [0.0] * 26)  # a subnormal scale: 1/d overflows
    def prop(values):
        x = np.array(values, dtype=np.float32).reshape(-1, 32)
        theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType(fmt.type_id))
        assert np.array_equal(fmt.quantize(x), theirs.view(np.uint8).reshape(x.shape[0], -1))
    prop()


def test_registry_by_name_and_type_id():
    for fmt in FORMATS:
        assert quant.get(fmt.name) is fmt
        assert quant.get(fmt.name.lower()) is fmt
        assert quant.get(fmt.type_id) is fmt
    with pytest.raises(ValueError, match="unknown quantization format 'Q3_Z'.*IQ3_XXS \\(18\\)"):
        quant.get("Q3_Z")
    with pytest.raises(ValueError, match="unknown quantization format 99"):
        quant.get(99)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_bad_input_names_the_format_and_the_expected_size(fmt):
    with pytest.raises(ValueError, match=f"{fmt.name}: {fmt.block_bytes + 1} bytes per row .* "
                                         f"multiple of {fmt.block_bytes} bytes"):
        fmt.dequantize(np.zeros(fmt.block_bytes + 1, dtype=np.uint8))
    with pytest.raises(ValueError, match=f"{fmt.name}: quantized data must be uint8 bytes, got dtype float32"):
        fmt.dequantize(np.zeros(fmt.block_bytes, dtype=np.float32))
    if fmt.block_elems > 1:
        with pytest.raises(ValueError, match=f"{fmt.name}: rows of {fmt.block_elems + 1} weights .* "
                                             f"multiple of {fmt.block_elems} weights"):
            fmt.quantize(np.zeros(fmt.block_elems + 1, dtype=np.float32))
    with pytest.raises(ValueError, match=f"{fmt.name}: the weights hold NaN or Inf"):
        fmt.quantize(np.full(fmt.block_elems, np.inf, dtype=np.float32))


def test_leading_axes_are_kept():
    fmt = quant.get("Q4_0")
    raw = exhaustive_blocks(fmt)[:12].reshape(3, 4 * 18)
    out = fmt.dequantize(raw)
    assert out.shape == (3, 128)
    assert same_bits(out.reshape(-1, 32), fmt.dequantize(raw.reshape(12, 18)))


@pytest.mark.parametrize("src, dst", [("Q4_1", "Q8_0"), ("Q8_0", "Q5_0"), ("Q5_1", "Q4_1"),
                                      ("Q4_1", "Q2_K"), ("Q4_0", "Q3_K"), ("Q4_1", "Q4_K"),
                                      ("Q5_1", "Q5_K"), ("Q8_0", "Q6_K")])
def test_requantize_is_quantize_of_dequantize_across_its_steps(src, dst):
    """Format.requantize goes by columns of 32 weights in steps of REQUANTIZE_BLOCKS
    blocks, which the K-quants take as sub-blocks (Q4_K, Q5_K) or halves of two (Q2_K,
    Q3_K, Q6_K): a tensor of two and a half steps gives quantize(dequantize(...))'s bytes."""
    from quant.format import REQUANTIZE_BLOCKS
    s, d = quant.get(src), quant.get(dst)
    cols = max(4 * 32, d.block_elems)
    rows = 5 * REQUANTIZE_BLOCKS // 2 // (cols // 32)
    x = np.random.default_rng(0).standard_t(3, (rows, cols)).astype(np.float32)
    x[0, :64] = 0                                     # an all-zero block
    q = s.quantize(x)
    assert np.array_equal(d.requantize(q, s), d.quantize(s.dequantize(q)))


def test_requantize_names_the_format_for_rows_its_blocks_do_not_fit():
    q = quant.get("Q4_1").quantize(np.ones((2, 128), np.float32))
    with pytest.raises(ValueError, match="Q4_K: rows of 128 weights cannot be quantized; expected a multiple of 256"):
        quant.get("Q4_K").requantize(q, quant.get("Q4_1"))


@given(k=st.integers(1, 40), n=st.integers(0, 70), seed=st.integers(0, 2**32 - 1))
def test_byte_rows_is_the_transpose(k, n, seed):
    from quant.format import byte_rows
    c = np.random.default_rng(seed).integers(0, 256, (k, n), dtype=np.uint8)
    out = byte_rows(c)
    assert out.flags.c_contiguous and np.array_equal(out, c.T)


def test_q8_0s_rounding_is_roundf_near_every_half_and_anywhere():
    """Q8_0's codes round by adding the float32 below one half (with v's sign) and
    truncating: C's roundf
    (round_away) for every float32 within 64 ulps of each half and whole number of
    [-128, 128], and for a million others there."""
    from quant.legacy import _roundf_int8, round_away
    marks = np.arange(-256, 257, dtype=np.float32) / np.float32(2)
    bits = marks.view(np.int32)[:, None] + np.arange(-64, 65, dtype=np.int32)[None, :]
    v = np.concatenate([bits.view(np.float32).ravel(),
                        np.random.default_rng(0).uniform(-128, 128, 10 ** 6).astype(np.float32)])
    v = v[np.abs(v) <= 128]
    assert np.array_equal(_roundf_int8(v.copy()), round_away(v).astype(np.int8))
