"""FP8_E4M3 (not a GGUF type): the numpy codec == torch's float8_e4m3fn, bit for bit; the
registry knows it by name only."""
import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import quant
from quant.fp8 import FP8_E4M3, encode
from tests.blocks import same_bits

CODES = np.arange(256, dtype=np.uint8)


def torch_decode(codes: np.ndarray) -> np.ndarray:
    return torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()


def torch_encode(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_every_code_decodes_as_torch():
    ours = FP8_E4M3.dequantize(CODES)
    assert same_bits(ours, torch_decode(CODES))
    assert np.isnan(ours[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(ours, [0x7F, 0xFF])).all()
    assert np.nanmax(ours) == 448.0 and ours[1] == 2.0 ** -9
    assert np.signbit(ours[0x80]) and ours[0x80] == 0


@given(st.lists(st.floats(width=32), min_size=1, max_size=64))
@example([2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6 - 2.0 ** -10, 464.0, 465.0, 1e30, -0.0, 17.0, 18.0])
@example([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45])
def test_encode_equals_torch_cast(values):
    """Nearest, ties to even, as torch's cast; what rounds past +-448 (464 and beyond, Inf
    included) saturates to +-448, as torch 2.13's CPU cast does (2.11's gives NaN there, so
    those values are held to the saturated codes themselves)."""
    x = np.array(values, dtype=np.float32)
    got = encode(x)
    assert np.array_equal(got & 0x7F == 0x7F, np.isnan(x))
    beyond = np.abs(x) >= 464  # NaN compares False
    assert np.array_equal(got[beyond], np.where(x[beyond] > 0, 0x7E, 0xFE).astype(np.uint8))
    within = ~np.isnan(x) & ~beyond  # torch's NaN code may carry either sign
    assert np.array_equal(got[within], torch_encode(x)[within])


def test_every_finite_code_round_trips():
    finite = CODES[(CODES & 0x7F) != 0x7F]
    assert np.array_equal(FP8_E4M3.quantize(FP8_E4M3.dequantize(finite)), finite)


def test_registry_by_name_only():
    assert quant.get("FP8_E4M3") is quant.get("fp8_e4m3") is FP8_E4M3
    assert FP8_E4M3.type_id is None
    assert "FP8_E4M3" not in quant.FORMATS  # FORMATS holds the GGUF types, each with a type id
    assert quant.OTHER_FORMATS["FP8_E4M3"] is FP8_E4M3
    with pytest.raises(ValueError, match=r"unknown quantization format 'FP9'.*FP8_E4M3 \(by name; not a GGUF type\)"):
        quant.get("FP9")
