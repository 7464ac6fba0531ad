"""Per-format `@triton.jit` decode functions, of two kinds.

Int8 units (`UNITS`, decode/common.py; every quantized GGUF format, FP8 aside): a whole
unit of 32, 64 or 128 weights as int8 words plus a scale per 32 or 16 weights, decoded
once a thread; the dp4a GEMV and MoE kernels, dequant, the unit GEMM and the PLE gather
run on them.

Per weight (`DECODERS`, every format; the GEMM, the float GEMV and the other formats'
dequant): a decode function turns weights of quantized blocks into float32 values:

    decode(q_ptr, tab_ptr, blk, j, mask) -> float32 tensor shaped like `blk`

`q_ptr` points at the uint8 blocks, `blk` holds block indices (int64), `j` the weight's
position inside its block (int32), `mask` which lanes are live; `tab_ptr` points at the
format's lookup table (uint8, from `table()`), unused by formats without one. Any tile
shape works, so the dequant, qmatmul, MoE and PLE-gather kernels share these functions.
Each function repeats the numpy codec's float operations in the same order, so that the
results are bit-exact with quant/ (on a GPU, when launched with enable_fp_fusion=False).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import quant

from ..backend import constant
from ..layout.split import body_bytes
from .floats import decode_bf16, decode_f16, decode_f32
from .fp8 import decode_fp8_e4m3
from .iq1 import decode_iq1_m, decode_iq1_s, unit_iq1_m, unit_iq1_s
from .iq2 import decode_iq2_s, decode_iq2_xs, decode_iq2_xxs, unit_iq2_s, unit_iq2_xs, unit_iq2_xxs
from .iq3 import decode_iq3_s, decode_iq3_xxs, unit_iq3_s, unit_iq3_xxs
from .iq4 import decode_iq4_nl, decode_iq4_xs, unit_iq4_nl, unit_iq4_xs
from .kquants import (decode_q2_k, decode_q3_k, decode_q4_k, decode_q5_k, decode_q6_k, unit_q2_k, unit_q3_k,
                      unit_q4_k, unit_q5_k, unit_q6_k)
from .legacy import (decode_q4_0, decode_q4_1, decode_q5_0, decode_q5_1, decode_q8_0, unit_q4_0, unit_q4_1,
                     unit_q5_0, unit_q5_1, unit_q8_0)
from .split import (decode_iq3_s_split, decode_iq3_xxs_split, decode_iq4_nl_split, decode_q3_k_split,
                    decode_q4_0_split, decode_q5_0_split, decode_q6_k_split, decode_q8_0_split,
                    unit_iq3_s_split, unit_iq3_xxs_split, unit_iq4_nl_split, unit_q3_k_split,
                    unit_q4_0_split, unit_q5_0_split, unit_q6_k_split, unit_q8_0_split)

DECODERS = {
    "F32": decode_f32, "F16": decode_f16, "BF16": decode_bf16,
    "Q8_0": decode_q8_0, "Q4_0": decode_q4_0, "Q4_1": decode_q4_1,
    "Q5_0": decode_q5_0, "Q5_1": decode_q5_1, "Q2_K": decode_q2_k, "Q3_K": decode_q3_k,
    "Q4_K": decode_q4_k, "Q5_K": decode_q5_k, "Q6_K": decode_q6_k,
    "IQ4_NL": decode_iq4_nl, "IQ4_XS": decode_iq4_xs, "IQ3_XXS": decode_iq3_xxs, "IQ3_S": decode_iq3_s,
    "IQ2_XXS": decode_iq2_xxs, "IQ2_XS": decode_iq2_xs, "IQ2_S": decode_iq2_s,
    "IQ1_S": decode_iq1_s, "IQ1_M": decode_iq1_m,
    "FP8_E4M3": decode_fp8_e4m3,
}
# the same formats in the split device layout (triton_kernels.layout)
SPLIT_DECODERS = {
    "Q8_0": decode_q8_0_split, "Q4_0": decode_q4_0_split, "Q5_0": decode_q5_0_split,
    "IQ4_NL": decode_iq4_nl_split, "IQ3_XXS": decode_iq3_xxs_split, "IQ3_S": decode_iq3_s_split,
    "Q3_K": decode_q3_k_split, "Q6_K": decode_q6_k_split,
}


def _table_bytes(fmt: quant.Format) -> np.ndarray:
    """The format's tables as one uint8 array, laid out as its decode function expects."""
    if fmt.name == "IQ3_XXS":  # grid bytes (256 x 4), then ksigns (128)
        return np.concatenate([fmt.tables["grid"].reshape(-1), fmt.tables["ksigns"]])
    if fmt.name in ("IQ2_XXS", "IQ2_XS"):  # grid bytes (256 or 512 x 8), then ksigns (128)
        return np.concatenate([fmt.tables["grid"].reshape(-1), fmt.tables["ksigns"]])
    if fmt.name in ("IQ1_S", "IQ1_M"):  # grid values (2048 x 8 int8)
        return fmt.tables["grid"].reshape(-1).view(np.uint8)
    if fmt.name == "IQ2_S":    # grid bytes (1024 x 8)
        return fmt.tables["grid"].reshape(-1)
    if fmt.name == "IQ3_S":    # grid bytes (512 x 4)
        return fmt.tables["grid"].reshape(-1)
    if fmt.name in ("IQ4_NL", "IQ4_XS"):  # the 16 int8 values
        return fmt.tables["kvalues"].view(np.uint8)
    return np.zeros(1, dtype=np.uint8)


_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def table(fmt: quant.Format, device: torch.device) -> torch.Tensor:
    key = (fmt.name, str(device))
    return constant(_TABLES, key, lambda: torch.from_numpy(_table_bytes(fmt).copy()), device)


def decoder(fmt: quant.Format):
    try:
        return (SPLIT_DECODERS if fmt.layout == "split" else DECODERS)[fmt.name]
    except KeyError:
        raise ValueError(f"{fmt.name} ({fmt.layout} layout): no Triton decode function for this "
                         f"format yet") from None


# --- int8 units: the decode of the dp4a GEMV, the MoE decode kernels and dequant ----------

@dataclass(frozen=True)
class Unit:
    """A format's int8 unit decode (decode/common.py): `fn(p, u, tab_ptr, ASM)` returns
    the int8 words, scales a and offsets b of unit u of each block; weight = a * (code -
    zero), minus b when `offset`."""
    fn: object
    weights: int          # weights a unit: 32, 64 or 128 (groups of 32)
    zero: int = 0         # subtracted from each code before scaling (Q4_0: 8)
    offset: bool = False  # weight = a * code - b (the K-quants' minimum)


UNITS = {
    "Q8_0": Unit(unit_q8_0, 32),
    "Q4_0": Unit(unit_q4_0, 32, zero=8),
    "Q4_1": Unit(unit_q4_1, 32, offset=True),
    "Q5_0": Unit(unit_q5_0, 32, zero=16),
    "Q5_1": Unit(unit_q5_1, 32, offset=True),
    "IQ4_NL": Unit(unit_iq4_nl, 32),
    "IQ4_XS": Unit(unit_iq4_xs, 32),
    "Q2_K": Unit(unit_q2_k, 128, offset=True),    # scales and offsets per 16 weights
    "Q3_K": Unit(unit_q3_k, 128),                 # scales per 16 weights
    "Q4_K": Unit(unit_q4_k, 64, offset=True),
    "Q5_K": Unit(unit_q5_k, 64, offset=True),
    "Q6_K": Unit(unit_q6_k, 128, zero=32),        # scales per 16 weights
    "IQ3_XXS": Unit(unit_iq3_xxs, 32),
    "IQ3_S": Unit(unit_iq3_s, 32),
    "IQ2_XXS": Unit(unit_iq2_xxs, 32),
    "IQ2_XS": Unit(unit_iq2_xs, 32),       # scales per 16 weights
    "IQ2_S": Unit(unit_iq2_s, 32),         # scales per 16 weights
    "IQ1_S": Unit(unit_iq1_s, 32),
    "IQ1_M": Unit(unit_iq1_m, 32),         # scales per 16 weights
}
SPLIT_UNITS = {
    "Q8_0": Unit(unit_q8_0_split, 32),
    "Q4_0": Unit(unit_q4_0_split, 32, zero=8),
    "Q5_0": Unit(unit_q5_0_split, 32, zero=16),
    "IQ4_NL": Unit(unit_iq4_nl_split, 32),
    "IQ3_XXS": Unit(unit_iq3_xxs_split, 32),
    "IQ3_S": Unit(unit_iq3_s_split, 32),
    "Q3_K": Unit(unit_q3_k_split, 128),
    "Q6_K": Unit(unit_q6_k_split, 128, zero=32),
}


def unit(fmt: quant.Format) -> Unit | None:
    """The format's unit decode, or None where only the per-weight decode exists."""
    return (SPLIT_UNITS if fmt.layout == "split" else UNITS).get(fmt.name)


def launch_args(fmt: quant.Format, u: Unit) -> dict:
    """A format's unit constexprs, as every unit kernel takes them: the decode, weights a
    unit, units a block, halfwords a block, ZERO, OFFSET, and BODY: a block's body bytes in
    the split layout, 0 in GGUF order (decode/split.py: block_ptr)."""
    return dict(UNIT=u.fn, UW=u.weights, UPB=fmt.block_elems // u.weights,
                BLOCK_HW=fmt.block_bytes // 2, ZERO=u.zero, OFFSET=u.offset,
                BODY=body_bytes(fmt) if fmt.layout == "split" else 0)


def _sign_words(patterns: np.ndarray) -> np.ndarray:
    """(n,) sign bytes (bit i set: weight i negative) -> (n, 2) int32 of 0x00/0x01 bytes."""
    bits = (patterns[:, None].astype(np.uint32) >> np.arange(8, dtype=np.uint32)) & 1
    return bits.astype(np.uint8).reshape(-1, 2, 4).copy().view("<i4").reshape(-1, 2)


def _unit_table_words(fmt: quant.Format) -> np.ndarray:
    """The unit decode's table as int32 words (layouts in decode/iq3.py and iq4.py)."""
    if fmt.name == "IQ3_XXS":
        grid = fmt.tables["grid"].astype(np.uint8).reshape(-1, 4).copy().view("<i4").reshape(-1)
        return np.concatenate([grid, _sign_words(fmt.tables["ksigns"]).reshape(-1)])
    if fmt.name == "IQ3_S":
        grid = fmt.tables["grid"].astype(np.uint8).reshape(-1, 4).copy().view("<i4").reshape(-1)
        return np.concatenate([grid, _sign_words(np.arange(256)).reshape(-1)])
    if fmt.name in ("IQ1_S", "IQ1_M"):  # codes 8g + 1 of each grid entry, then 8g - 1 (decode/iq1.py)
        grid = fmt.tables["grid"].astype(np.int8).reshape(-1, 8) * 8
        return np.concatenate([grid + 1, grid - 1]).astype(np.int8).copy().view("<i4").reshape(-1)
    if fmt.name in ("IQ2_XXS", "IQ2_XS", "IQ2_S"):  # grid entries (8 bytes: 2 words), then sign words
        grid = fmt.tables["grid"].astype(np.uint8).reshape(-1, 8).copy().view("<i4").reshape(-1)
        signs = fmt.tables["ksigns"] if fmt.name != "IQ2_S" else np.arange(256)
        return np.concatenate([grid, _sign_words(signs).reshape(-1)])
    if fmt.name in ("IQ4_NL", "IQ4_XS"):
        kv = fmt.tables["kvalues"].astype(np.int8)
        return np.concatenate([kv.copy().view("<i4"), kv.astype(np.int32)])
    return np.zeros(1, dtype=np.int32)


_UNIT_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def unit_table(fmt: quant.Format, device: torch.device) -> torch.Tensor:
    key = (fmt.name, str(device))
    return constant(_UNIT_TABLES, key, lambda: torch.from_numpy(_unit_table_words(fmt).astype(np.int32)), device)
