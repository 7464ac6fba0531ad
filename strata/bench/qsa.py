"""`strata bench kernels`' QSA choice rows: a decode graph's choice of blocks at
Qwen3.8-Flash-Next's budget (the indexer's 2,048 tokens in blocks of 4: keep 512) over a
row of 4,096 blocks (16K tokens of context) and of 8,192 (32K) for one query, and of 8,192
for a verify's 4, graph-timed two ways: qsa_select's one launch (the engine's) and
select_sorted's stable sort, which it replaced (on a GPU aten's small sort of three
launches up to 4,096 blocks, a segmented radix sort past it). Scores are relu'd normals
(ties at 0) with the last quarter of each row unseen (-inf); they are a few hundred KB
that the step has just written, so they are read from the L2 here as in the step. "= sort"
says whether the launch kept the sort's blocks in its order on this device.
"""
from __future__ import annotations

import numpy as np
import torch

from strata.bench import cold

CASES = ((1, 4096, 512), (1, 8192, 512), (4, 8192, 512))  # (queries, blocks a row, keep)


def rows(rng: np.random.Generator, device="cuda", cases=CASES) -> list[dict]:
    from triton_kernels.qsa import select_sorted
    from triton_kernels.qsa_select import qsa_select
    out = []
    for T, nb, keep in cases:
        s = torch.from_numpy(np.maximum(rng.standard_normal((T, nb)), 0).astype(np.float32)).to(device)
        s[:, 3 * nb // 4:] = float("-inf")
        ways = [("one launch (qsa_select)", lambda x, keep=keep: qsa_select(x, keep)),
                ("stable sort (select_sorted)", lambda x, keep=keep: select_sorted(x, keep)[1])]
        same = torch.equal(ways[0][1](s), ways[1][1](s))
        for how, fn in ways:
            out.append({"op": f"QSA choice, {how}", "format": "F32", "layout": f"{T} x {nb} blocks, keep {keep}",
                        "us": cold.graph_ms(fn, [(s,)]) * 1e3})
        out[-2]["bits_as_sort"] = same
    return out
