"""The format tables are data: their invariants, and agreement with gguf-py's copies."""
import numpy as np
from gguf.quants import IQ2_XXS, IQ3_S as GG_IQ3_S, IQ3_XXS as GG_IQ3_XXS, IQ4_NL as GG_IQ4_NL

import quant
from quant import iq3, iq4


def test_iq3_xxs_grid_values_are_4_times_odd_with_62_on_top():
    levels = np.unique(iq3.XXS_GRID)
    assert levels.tolist() == [4, 12, 20, 28, 36, 44, 52, 62]  # 4(2l+1), but 62 not 60
    assert iq3.XXS_GRID.shape == (256, 4)
    assert len({tuple(r) for r in iq3.XXS_GRID}) == 256  # no entry twice


def test_iq3_s_grid_values_are_exactly_the_odd_numbers_to_15():
    assert np.unique(iq3.S_GRID).tolist() == [1, 3, 5, 7, 9, 11, 13, 15]
    assert iq3.S_GRID.shape == (512, 4)
    assert len({tuple(r) for r in iq3.S_GRID}) == 512


def test_iq3_grids_equal_gguf_py():
    for ours, theirs in ((iq3.XXS_GRID, GG_IQ3_XXS), (iq3.S_GRID, GG_IQ3_S)):
        theirs.init_grid()
        assert np.array_equal(ours.astype(np.float32), theirs.grid.reshape(-1, 4))


def test_ksigns_low_bits_are_the_index_and_bit_7_the_parity():
    k = iq3.KSIGNS.astype(int)
    assert np.array_equal(k & 0x7F, np.arange(128))
    popcount = np.array([bin(v).count("1") for v in k])
    assert (popcount % 2 == 0).all()  # every group of 8 has an even number of minus signs
    assert bytes(iq3.KSIGNS) == IQ2_XXS.ksigns


def test_iq4_nl_values():
    assert iq4.KVALUES.tolist() == [-127, -104, -83, -65, -49, -35, -22, -10,
                                    1, 13, 25, 38, 53, 69, 89, 113]
    assert iq4.KVALUES.tolist() == list(GG_IQ4_NL.kvalues)
    assert (np.diff(iq4.KVALUES.astype(int)) > 0).all()


def test_block_geometry_matches_gguf():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    for fmt in quant.FORMATS.values():
        assert GGML_QUANT_SIZES[GGMLQuantizationType(fmt.type_id)] == (fmt.block_elems, fmt.block_bytes)
        assert GGMLQuantizationType(fmt.type_id).name == fmt.name


def test_iq2_grids_are_eight_magnitudes_of_three_levels_and_equal_gguf_py():
    from gguf.quants import IQ2_S as GG_IQ2_S, IQ2_XS as GG_IQ2_XS
    from quant import iq2
    for ours, theirs, size in ((iq2.XXS_GRID, IQ2_XXS, 256), (iq2.XS_GRID, GG_IQ2_XS, 512),
                               (iq2.S_GRID, GG_IQ2_S, 1024)):
        assert ours.shape == (size, 8) and ours.dtype == np.uint8
        assert np.unique(ours).tolist() == [8, 25, 43]
        assert len({tuple(r) for r in ours}) == size
        theirs.init_grid()
        assert np.array_equal(ours.astype(np.float32), theirs.grid.reshape(-1, 8))
    assert iq2.IQ2_XXS.tables["ksigns"] is iq3.KSIGNS


def test_iq1_grid_is_2048_ternary_entries_and_equals_gguf_py():
    from gguf.quants import IQ1_M as GG_IQ1_M, IQ1_S as GG_IQ1_S
    from quant import iq1
    assert iq1.GRID.shape == (2048, 8) and iq1.GRID.dtype == np.int8
    assert np.unique(iq1.GRID).tolist() == [-1, 0, 1]
    assert len({tuple(r) for r in iq1.GRID}) == 2048
    for theirs in (GG_IQ1_S, GG_IQ1_M):
        theirs.init_grid()
        assert np.array_equal(iq1.GRID.astype(np.float32), theirs.grid.reshape(-1, 8))
        assert theirs.delta == iq1.DELTA == 0.125


def test_iq4_xs_uses_the_iq4_nl_values():
    assert quant.get("IQ4_XS").tables["kvalues"] is iq4.KVALUES


def test_iq1_m_scale_bits_round_trip():
    from quant import iq1
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, (64, 56), dtype=np.uint8)
    d = rng.integers(0, 65536, 64, dtype=np.uint16).view(np.float16)
    low = np.ascontiguousarray(b[:, 48:56]).view("<u2") & 0x0FFF
    iq1.set_m_scale(b, d)
    assert np.array_equal(iq1.m_scale_bits(b), d.view(np.uint16))
    assert np.array_equal(np.ascontiguousarray(b[:, 48:56]).view("<u2") & 0x0FFF, low)
