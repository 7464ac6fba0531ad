"""strata.bench.cold without a GPU: graph-timed calls take their operands in turn from copies
(or disjoint expert sets) that hold three times the L2 between them, so that no replayed call
reads a weight the L2 kept from the call before; and `bench kernels` times through it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import quant
from strata.bench import cold
from strata.bench import kernels as bench


@pytest.mark.parametrize("nbytes, l2, want", [
    (33_030_144, 50 << 20, 5),     # a Q4_0 4096 x 14336 weight on an H200's 50 MiB L2
    (62_390_272, 50 << 20, 3),     # Q8_0's: larger than the L2, still cycled
    (1_392_640, 50 << 20, 113),    # the 512 x 2560 Q8_0 GEMV
    (10 << 30, 50 << 20, 2),       # never fewer than two
])
def test_copies_hold_three_l2s_between_them(nbytes, l2, want):
    n = cold.copies(nbytes, l2)
    assert n == want and n * nbytes >= cold.COLD_L2 * l2 and (n == 2 or (n - 1) * nbytes < cold.COLD_L2 * l2)


def test_cycled_copies_are_apart_and_equal():
    t = torch.arange(300, dtype=torch.int16).to(torch.uint8)
    got = cold.cycled(t, 1000)
    assert len(got) == cold.copies(300, 1000) == 10 and got[0] is t
    assert len({c.data_ptr() for c in got}) == len(got) and all(torch.equal(c, t) for c in got)


def test_expert_sets_are_disjoint_routings():
    rng = np.random.default_rng(0)
    sets = cold.expert_sets(512, 10, 21_800_000, 50 << 20, rng, device="cpu")
    assert len(sets) == cold.copies(21_800_000, 50 << 20) == 8
    ids = torch.cat(sets, dim=1).flatten().tolist()
    assert all(s.shape == (1, 10) and s.dtype == torch.int32 for s in sets)
    assert len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < 512
    few = cold.expert_sets(16, 8, 1000, 50 << 20, rng, device="cpu")  # every disjoint set there is
    assert len(few) == 2 and sorted(torch.cat(few, 1).flatten().tolist()) == list(range(16))


def test_graph_ms_hands_the_variants_out_in_turn():
    seen = []

    def timer(f):  # as do_bench_cudagraph: a warm-up call, five to size the graph, then the captured ones
        for _ in range(1 + 5 + 7):
            f()
        return 0.5
    assert cold.graph_ms(lambda a, b: seen.append((a, b)), [(1, "x"), (2, "y"), (3, "z")], timer) == 0.5
    assert seen == [(1, "x"), (2, "y"), (3, "z")] * 4 + [(1, "x")]


def test_bench_kernels_graph_times_the_gemv_from_copies(monkeypatch):
    """time_gemv(graph=True), which the table's GEMV rows and --tune use, hands the graph
    copies of the weight past the (here tiny) L2, and the kernel reads each."""
    rng = np.random.default_rng(0)
    fmt = quant.get("Q8_0")
    q = torch.from_numpy(rng.integers(0, 256, (4, 34), dtype=np.uint8))
    calls = []
    monkeypatch.setattr(cold, "l2_bytes", lambda device="cuda": 1000)
    monkeypatch.setattr(cold, "graph_ms", lambda fn, variants, timer=None: calls.append(variants) or 1.0)
    assert bench.time_gemv(fmt, q, torch.zeros(1, 32), graph=True) == 1.0
    (variants,) = calls
    assert len(variants) == cold.copies(q.numel(), 1000) == 23
    assert variants[0][0] is q and all(torch.equal(v[0], q) for v in variants)
    assert len({v[0].data_ptr() for v in variants}) == len(variants)


@pytest.mark.parametrize("fla", [False, True], ids=["strata", "fla"])
def test_bench_kernels_deltanet_rows_time_each_way_from_copies_of_the_state(monkeypatch, fla):
    """strata.bench.deltanet at small heads through the interpreter: the one launch gives
    the three launches' bits (the row says so), and each way is graph-timed from copies of
    the state past the (here tiny) L2. With fla-core's row (as on a GPU where it is
    installed): its rows within 1e-4 of the one launch's, relative to the largest (each
    recurrence lies within gamma(2 dk + 6) = 2.3e-6 of float64 at dk = 16,
    tests/triton_kernels/test_deltanet.py, and the gated norm keeps a relative error)."""
    from strata.bench import deltanet
    from triton_kernels import deltanet_fla
    if fla:
        if not deltanet_fla.fla_installed():
            pytest.skip("fla-core not installed (pip install strata-engine[cuda])")
        monkeypatch.setattr(deltanet_fla, "deltanet_path", lambda device, kernels: ("fla-core", "forced"))
    calls = []

    def graph_ms(fn, variants, timer=None):
        calls.append(variants)
        for v in variants:
            fn(*v)
        return 0.5
    monkeypatch.setattr(cold, "l2_bytes", lambda device="cuda": 1000)
    monkeypatch.setattr(cold, "graph_ms", graph_ms)
    rows = deltanet.rows(np.random.default_rng(0), 100.0, device="cpu", heads=(2, 2, 16, 32, 4))
    assert [r["op"] for r in rows] == ["deltanet token, one launch (deltanet_decode)",
                                       "deltanet token, three launches, Strata's recurrence"] + \
        (["deltanet token, three launches, fla-core's fused recurrent"] if fla else [])
    assert rows[0]["bits_as_three"] is True and rows[1]["max_rel_err"] == 0.0
    assert all(r["us"] == 500.0 for r in rows) and all(r["max_rel_err"] < 1e-4 for r in rows)
    state_bytes = 2 * 4 * 16 * 32 * 4  # read and written: 4 value heads of 16 x 32 float32
    assert rows[0]["gb_per_s"] == state_bytes / 0.5e-3 / 1e9
    assert all(len(v) == cold.copies(state_bytes // 2, 1000) and len({s.data_ptr() for (s,) in v}) == len(v)
               for v in calls)


def test_bench_kernels_qsa_rows_time_both_ways_and_compare_their_choices(monkeypatch):
    """strata.bench.qsa at small rows through the interpreter: a row for each way and case,
    each graph-timed once over the case's scores, and the launch's choice the sort's."""
    from strata.bench import qsa
    calls = []

    def graph_ms(fn, variants, timer=None):
        calls.append([tuple(fn(*v).shape) for v in variants])
        return 0.25
    monkeypatch.setattr(cold, "graph_ms", graph_ms)
    rows = qsa.rows(np.random.default_rng(0), device="cpu", cases=((1, 40, 8), (3, 100, 16)))
    assert [(r["op"], r["layout"]) for r in rows] == [
        ("QSA choice, one launch (qsa_select)", "1 x 40 blocks, keep 8"),
        ("QSA choice, stable sort (select_sorted)", "1 x 40 blocks, keep 8"),
        ("QSA choice, one launch (qsa_select)", "3 x 100 blocks, keep 16"),
        ("QSA choice, stable sort (select_sorted)", "3 x 100 blocks, keep 16")]
    assert calls == [[(1, 8)], [(1, 8)], [(3, 16)], [(3, 16)]]
    assert rows[0]["bits_as_sort"] is True and rows[2]["bits_as_sort"] is True and all(r["us"] == 250.0 for r in rows)
