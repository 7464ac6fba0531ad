"""Quantizer searches: numpy only (no torch, no triton), vectorised over all blocks.

`kquants` holds llama.cpp's K-quant searches (make_qkx2/qkx3/qx/q3/qp_quants) and `iq4`
its IQ4_NL / IQ4_XS scale search, both ggml's to the bit; `iq3` the IQ3_XXS / IQ3_S search
(llama.cpp's method plus a refinement), `grid` its lookup tables, `reference` a
block-at-a-time port of llama.cpp's IQ3 loops that the tests hold the vectorised search
against.
"""
from .grid import GridTables, grid_tables
from .iq3 import IQ3Options
from .iq3 import search as iq3_search

__all__ = ["GridTables", "IQ3Options", "grid_tables", "iq3_search"]
