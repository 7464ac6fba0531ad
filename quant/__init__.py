"""GGUF quantization formats: block layouts, tables and numpy reference codecs.

The numpy codecs here are the oracle for every kernel: each one is bit-exact with
`gguf.quants.dequantize`. numpy only: no torch, no triton.

    >>> import quant
    >>> fmt = quant.get("IQ3_XXS")      # or quant.get(18), the ggml type id
    >>> x = fmt.dequantize(raw_bytes)   # (..., k*98) uint8 -> (..., k*256) float32
"""
from __future__ import annotations

from .floats import BF16, F16, F32
from .format import Format
from .fp8 import FP8_E4M3
from .iq1 import IQ1_M, IQ1_S
from .iq2 import IQ2_S, IQ2_XS, IQ2_XXS
from .iq3 import IQ3_S, IQ3_XXS
from .iq4 import IQ4_NL, IQ4_XS
from .kquants import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from .legacy import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

FORMATS: dict[str, Format] = {f.name: f for f in (F32, F16, BF16, Q8_0, Q4_0, Q4_1, IQ4_NL, IQ3_XXS, IQ3_S, IQ4_XS,
                                                 IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M)}
FORMATS.update({f.name: f for f in (Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)})
_BY_ID: dict[int, Format] = {f.type_id: f for f in FORMATS.values()}
# Formats outside GGUF, known by name only (type_id None): kept out of FORMATS, whose every
# entry has a ggml type id that GGUF files, gguf-py and the GGUF writer understand.
OTHER_FORMATS: dict[str, Format] = {f.name: f for f in (FP8_E4M3,)}


def get(key: str | int | Format) -> Format:
    """A format by name ("IQ3_S", case-insensitive) or ggml type id (21); formats outside
    GGUF ("FP8_E4M3") by name only."""
    if isinstance(key, Format):
        return key
    if isinstance(key, str):
        fmt = FORMATS.get(key.upper()) or OTHER_FORMATS.get(key.upper())
    elif isinstance(key, int):
        fmt = _BY_ID.get(key)
    else:
        fmt = None
    if fmt is None:
        known = ", ".join([f"{f.name} ({f.type_id})" for f in FORMATS.values()]
                          + [f"{f.name} (by name; not a GGUF type)" for f in OTHER_FORMATS.values()])
        raise ValueError(f"unknown quantization format {key!r}; known formats: {known}")
    return fmt


__all__ = ["Format", "FORMATS", "OTHER_FORMATS", "get"] + list(FORMATS) + list(OTHER_FORMATS)
