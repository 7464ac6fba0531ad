"""Quantizer searches: numpy only (no torch, no triton), vectorised over all blocks.

`iq3` holds the IQ3_XXS / IQ3_S search (llama.cpp's method plus a refinement), `grid` its
lookup tables, `reference` a block-at-a-time port of llama.cpp's loops that the tests hold
the vectorised search against.
"""
from .grid import GridTables, grid_tables
from .iq3 import IQ3Options
from .iq3 import search as iq3_search

__all__ = ["GridTables", "IQ3Options", "grid_tables", "iq3_search"]
