"""Lookup tables for searching an IQ3 grid: which 3-bit points lie on it, and the grid
entries near each point that does not.

A point is four 3-bit level indices l0..l3 packed as u = l0 | l1 << 3 | l2 << 6 | l3 << 9
(4096 points). `index[u]` is the grid entry of that point, or -1. For a point off the
grid, `neighbours[u]` lists the grid entries within its `nwant` nearest squared distances
(distance between the odd values 2l+1), as llama.cpp's `iq3xs_init_impl` builds them:
nwant 2 for the 256-entry grid, 3 for the 512-entry one. Lists differ in length (1 to
~38); they are stored padded with their first entry (a repeat never wins an argmin), and
sorted into a few width classes so that a search gathers little padding.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

# List widths a search gathers at. The points weights land on are not the typical point:
# on SmolLM2's ffn_down 13% of the off-grid groups have more than 16 neighbours (the
# widest list has 38), so the classes go up in small steps.
WIDTHS = (3, 5, 8, 12, 18, 26, 38)


@dataclass(frozen=True)
class GridTables:
    levels: np.ndarray        # (G, 4) float32: the magnitudes the search fits, in units of db
    level_index: np.ndarray   # (G, 4) int: the 3-bit index of each magnitude
    index: np.ndarray         # (4096,) int32: grid entry of point u, -1 when off the grid
    neighbours: np.ndarray    # (4096, WIDTHS[-1]) int32, padded with the first entry
    width_class: np.ndarray   # (4096,) int8: smallest i with len(list) <= WIDTHS[i]; -1 on grid
    n_neighbours: np.ndarray  # (4096,) int32: length of each list, 0 on grid
    # per width class i: (4096, 4, WIDTHS[i]) float32, the neighbours' magnitudes as level
    # coordinates (v - 1) / 2, so 0..7 (7.25 for IQ3_XXS's top), gathered in one step;
    # coordinate-major so that the error sums over four contiguous (k, W) slices
    neighbour_coords: tuple[np.ndarray, ...] = ()


def pack_points(l: np.ndarray) -> np.ndarray:
    """(..., 4) level indices 0..7 -> (...,) point ids u."""
    l = l.astype(np.int32)
    return l[..., 0] | (l[..., 1] << 3) | (l[..., 2] << 6) | (l[..., 3] << 9)


@functools.cache
def _build(level_index_bytes: bytes, g: int, nwant: int, top: float) -> GridTables:
    li = np.frombuffer(level_index_bytes, dtype=np.int64).reshape(g, 4)
    index = np.full(4096, -1, dtype=np.int32)
    index[pack_points(li)] = np.arange(g, dtype=np.int32)
    pts = np.stack(np.meshgrid(*[np.arange(8)] * 4, indexing="ij"), -1).reshape(-1, 4)[:, ::-1]
    u = pack_points(pts)
    # integer squared distances between odd values, (4096, G); stable argsort keeps equal
    # distances in grid order, as llama.cpp's qsort on (distance, index) pairs does
    d2 = (((2 * pts[:, None, :] + 1) - (2 * li[None] + 1)) ** 2).sum(-1)
    order = np.argsort(d2, axis=1, kind="stable")
    neighbours = np.zeros((4096, WIDTHS[-1]), dtype=np.int32)
    width_class = np.full(4096, -1, dtype=np.int8)
    n_neighbours = np.zeros(4096, dtype=np.int32)
    for row, ui in enumerate(u):
        if index[ui] >= 0:
            continue
        ds = d2[row, order[row]]
        cut = np.unique(ds)[nwant - 1]          # the nwant-th smallest distance
        lst = order[row][ds <= cut]
        neighbours[ui] = lst[0]
        neighbours[ui, :len(lst)] = lst
        width_class[ui] = int(np.searchsorted(WIDTHS, len(lst)))
        n_neighbours[ui] = len(lst)
    levels = (2 * li + 1).astype(np.float32)
    levels[li == 7] = np.float32(top)
    coords = (levels - 1) / 2
    by_class = tuple(np.ascontiguousarray(coords[neighbours[:, :w]].transpose(0, 2, 1)) for w in WIDTHS)
    return GridTables(levels, li, index, neighbours, width_class, n_neighbours, by_class)


def grid_tables(level_index: np.ndarray, top: float = 15.0) -> GridTables:
    """Tables of a grid given as (G, 4) level indices. `top` is the value of level 7 in
    units of db: 15 for IQ3_S; 15.5 for IQ3_XXS, whose top byte is 62 = 4 * 15.5, not 60."""
    li = np.ascontiguousarray(level_index, dtype=np.int64)
    nwant = 2 if li.shape[0] == 256 else 3
    return _build(li.tobytes(), li.shape[0], nwant, float(top))
