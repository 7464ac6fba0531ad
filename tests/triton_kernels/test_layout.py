"""The split device layout (triton_kernels/layout): an exact round trip to the GGUF bytes,
and every kernel that reads it gives what it gives on the GGUF bytes, bit for bit.

Bit for bit, not within a bound: the split decode functions (decode/split.py) run the
GGUF ones' arithmetic on the same bytes found at other addresses, so dequantized values,
and every product made from them in the same order, are equal.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from tests.tiers import examples

import quant
from tests.blocks import blocks, same_bits
from triton_kernels import dequantize, dequantize_torch, layout
from triton_kernels.int8 import gemv_dp4a, quantize_x
from triton_kernels.layout.split import HEADS, permutation
from triton_kernels.qmatmul import qmatmul

SPLIT = [quant.get(n) for n in HEADS]


def split(raw: np.ndarray, fmt: quant.Format) -> tuple[torch.Tensor, quant.Format]:
    return torch.from_numpy(layout.pack(raw, fmt)), layout.split_format(fmt)


@pytest.mark.parametrize("fmt", SPLIT, ids=lambda f: f.name)
def test_pack_and_unpack_are_an_exact_round_trip(fmt):
    """numpy and torch alike; the split format's numpy codec reads the packed bytes as the
    GGUF one reads the originals, and writes packed bytes."""
    @given(n=st.integers(1, 6), seed=st.integers(0, 2 ** 32 - 1))
    @settings(max_examples=examples(25))
    def prop(n, seed):
        raw = np.random.default_rng(seed).integers(0, 256, (4 * n, fmt.block_bytes), dtype=np.uint8)
        packed = layout.pack(raw, fmt)
        assert packed.shape == raw.shape and not np.array_equal(packed, raw)
        tile = 4 * fmt.block_bytes  # byte for byte as the layout's definition moves them
        assert np.array_equal(packed.reshape(-1, tile), raw.reshape(-1, tile)[:, permutation(fmt)])
        assert np.array_equal(layout.unpack(packed, fmt), raw)
        assert torch.equal(layout.pack(torch.from_numpy(raw), fmt), torch.from_numpy(packed))
        assert torch.equal(layout.unpack(torch.from_numpy(packed), fmt), torch.from_numpy(raw))
        # every body starts 8-byte aligned within its tile, the heads after the four bodies
        body = layout.body_bytes(fmt)
        assert body % 8 == 0 and tile % 8 == 0
        assert sorted(permutation(fmt)) == list(range(tile))
        sf = layout.split_format(fmt)
        assert same_bits(sf.dequantize(packed.reshape(-1)), fmt.dequantize(raw.reshape(-1)))
    prop()
    x = np.random.default_rng(0).standard_normal((2, 4 * fmt.block_elems)).astype(np.float32)
    sf = layout.split_format(fmt)
    assert np.array_equal(sf.quantize(x), layout.pack(fmt.quantize(x), fmt))


@pytest.mark.parametrize("fmt", SPLIT, ids=lambda f: f.name)
def test_dequantize_reads_the_split_layout_bit_for_bit(fmt):
    """The unit kernel (decode/split.py's unit decode) and the torch path against the GGUF
    bytes' torch dequantization."""
    @given(raw=blocks(fmt, max_blocks=8, min_blocks=4))
    @settings(max_examples=examples(10))
    def prop(raw):
        raw = raw[:len(raw) // 4 * 4]
        want = dequantize_torch(torch.from_numpy(raw), fmt)
        q, sf = split(raw, fmt)
        assert same_bits(dequantize(q, sf).numpy(), want.numpy())
        assert same_bits(dequantize_torch(q, sf).numpy(), want.numpy())
    prop()


@pytest.mark.parametrize("fmt", SPLIT, ids=lambda f: f.name)
def test_matmuls_read_the_split_layout_bit_for_bit(fmt):
    """The dp4a GEMV, the float GEMV and the GEMM (unit decode, at explicit and default
    tiles) give on split bytes exactly what they give on GGUF bytes."""
    rng = np.random.default_rng(1)
    n, K = 6, 2 * fmt.block_elems  # 12 blocks: three tiles, rows straddling them
    raw = quant.get(fmt).quantize(rng.standard_normal((n, K)).astype(np.float32))
    q, sf = split(raw, fmt)
    g = torch.from_numpy(raw)
    x = torch.from_numpy(rng.uniform(-1, 1, (2, K)).astype(np.float32))
    x8 = quantize_x(x)
    assert torch.equal(gemv_dp4a(x8, q, sf, n), gemv_dp4a(x8, g, fmt, n))
    for path, tiles in (("gemv", None), ("gemm", (16, 16, 32)), ("gemm", None)):
        assert torch.equal(qmatmul(x, q, sf, path=path, tiles=tiles), qmatmul(x, g, fmt, path=path, tiles=tiles))


def test_choose_keeps_gguf_where_the_layout_does_not_fit(monkeypatch):
    q8, q4k = quant.get("Q8_0"), quant.get("Q4_K")
    monkeypatch.delenv("STRATA_LAYOUT", raising=False)
    assert layout.choose(q8, "cpu", 8) is q8                       # the CPU reads GGUF
    assert layout.choose(q8, "cuda", 8).layout == "split"          # a GPU the split layout
    assert layout.choose(q8, "cuda", 18) is q8                     # not whole tiles
    assert layout.choose(q8, "cuda", 8, slab_blocks=6) is q8       # an expert's slab is not
    assert layout.choose(q4k, "cuda", 8) is q4k                    # aligned as GGUF stores it
    assert layout.choose(q8, "cuda", 1 << 30) is q8                # past int32 byte offsets
    monkeypatch.setenv("STRATA_LAYOUT", "gguf")
    assert layout.choose(q8, "cuda", 8) is q8
    monkeypatch.setenv("STRATA_LAYOUT", "split")
    raw = torch.arange(2 * 136, dtype=torch.int32).to(torch.uint8).reshape(2, 136)
    sf = layout.choose(q8, "cpu", 8)
    q = layout.place(raw, q8, "cpu", sf)
    assert sf.layout == "split" and torch.equal(q, layout.pack(raw, q8))
    assert torch.equal(raw, torch.arange(2 * 136, dtype=torch.int32).to(torch.uint8).reshape(2, 136))
    monkeypatch.setenv("STRATA_LAYOUT", "tiled")
    with pytest.raises(ValueError, match="STRATA_LAYOUT='tiled': use 'gguf', 'split'"):
        layout.choose(q8, "cuda", 8)


def test_a_split_tensor_must_start_at_a_tile():
    fmt = quant.get("Q8_0")
    q, sf = split(np.zeros((8, 34), np.uint8), fmt)
    with pytest.raises(ValueError, match=r"Q8_0 \(split layout\): the blocks are laid out in fours"):
        dequantize_torch(q[1:5], sf)
    with pytest.raises(ValueError, match="the tensor holds 6 blocks"):
        layout.pack(np.zeros((6, 34), np.uint8), fmt)


def test_the_bench_moe_case_reads_either_layout_alike(monkeypatch):
    """`strata bench kernels`' MoE decode case (a device's command) at a small shape: the
    split layout gives GGUF order's output bit for bit, and the routed bytes are k experts'."""
    from strata.bench.kernels import moe_case
    from triton_kernels import moe
    shape = (8, 2, 256, 64, "IQ3_XXS", "IQ4_NL")
    out = {}
    for mode in ("split", "gguf"):
        monkeypatch.setenv("STRATA_LAYOUT", mode)
        args, routed = moe_case(np.random.default_rng(0), shape, device="cpu")
        assert {f.layout for f in args[4:7]} == {mode} and args[0].dtype == torch.bfloat16
        out[mode] = moe(*args, path="dp4a")
        assert routed == 2 * (2 * 64 * 98 + 256 * 2 * 18)
    assert torch.equal(out["split"], out["gguf"])
