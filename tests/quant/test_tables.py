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
