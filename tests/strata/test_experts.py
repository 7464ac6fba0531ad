"""Expert tiers: for any batch and routing, every tier's output equals the resident tier's
bit for bit (the same bytes meet the same matmul); the cache evicts the least recently
used expert and counts hits and misses; a pack is read back as written."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiers import examples

import quant
from strata.cli.args import add_expert_args, load_options
from strata.gguf import open_gguf, write_gguf
from strata.storage import experts as ex
from strata.storage.expert_sources import tensor_file
from strata.storage.expert_tier import ExpertTier, parse_tier
from strata.storage.pack import PACK_ALIGN, PACK_BIN, pack
from strata.tensors import QTensor

NAMES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(autouse=True)
def torch_moe(monkeypatch):
    # the storage tiers are the subject here, not the kernel (tests/triton_kernels checks
    # moe against moe_torch): the CPU path keeps each call in milliseconds
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _layer(g, i=0):
    return tuple(g.tensor(f"blk.{i}.{n}.weight") for n in NAMES)


@pytest.fixture(scope="module")
def tiny(flash_tiny_gguf):
    return flash_tiny_gguf


@pytest.fixture(scope="module")
def tiny_pack(flash_tiny_pack):
    return flash_tiny_pack


def _batches(n_experts, k, hidden, seed=0):
    """Random tokens and routing; sizes chosen so that small caches must evict and, at 24
    tokens, run in groups (more distinct experts than slots)."""
    rng = torch.Generator().manual_seed(seed)
    for T in (1, 3, 12, 1, 24, 1):
        x = torch.randn(T, hidden, generator=rng)
        ids = torch.stack([torch.randperm(n_experts, generator=rng)[:k] for _ in range(T)]).int()
        w = torch.softmax(torch.randn(T, k, generator=rng), -1)
        yield x, w, ids


@pytest.mark.parametrize("tier,io_mode", [
    ("host", "direct"), ("file", "direct"), ("file", "mmap"), ("packed", "direct"),
    ("cache:64", "direct"), ("cache:12:file", "direct"), ("cache:5:packed", "mmap"),
])
def test_tier_equals_resident_on_flash_tiny(tiny, tiny_pack, tier, io_mode):
    ts = _layer(tiny)
    ref = ex.ExpertStore(*ts, torch.float32, "cpu", None, "device")
    store = ex.ExpertStore(*ts, torch.float32, "cpu", None, tier, experts_dir=tiny_pack, io_mode=io_mode, depth=4)
    E, _, H = ts[0].shape
    for x, w, ids in _batches(E, 8, H):
        assert torch.equal(store(x, w, ids), ref(x, w, ids)), (tier, io_mode, tuple(ids.shape))
    s = store.stats()
    assert s["calls"] == 6 and s["hits"] + s["misses"] >= s["experts"] > 0
    if tier != "host":  # every tier but the resident ones fetched what it ran
        assert s["misses"] > 0 and s["bytes"] == s["misses"] * store.expert_bytes


def test_dropped_experts_stay_dropped(tiny):
    # -1 marks an expert another rank holds: it contributes nothing in every tier
    ts = _layer(tiny)
    ref = ex.ExpertStore(*ts, torch.float32, "cpu", None, "device")
    store = ex.ExpertStore(*ts, torch.float32, "cpu", None, "cache:4:file", depth=2)
    x, w = torch.randn(2, ts[0].shape[2]), torch.rand(2, 3)
    ids = torch.tensor([[5, -1, 9], [-1, 5, 63]], dtype=torch.int32)
    assert torch.equal(store(x, w, ids), ref(x, w, ids))
    assert store.cache_order() == [5, 9, 63]


def test_lru_order_and_counts(tiny):
    ts = _layer(tiny)
    store = ex.ExpertStore(*ts, torch.float32, "cpu", None, "cache:3:host")
    x, w = torch.randn(1, ts[0].shape[2]), torch.ones(1, 2)
    steps = [([0, 1], [0, 1], (0, 2, 0)),     # both miss; one slot stays free
             ([2, 0], [1, 0, 2], (1, 3, 0)),  # 0 hits and becomes the most recent; 2 takes the free slot
             ([3, 0], [2, 0, 3], (2, 4, 1)),  # 0 hits; 3 evicts 1, the least recently used
             ([1, 2], [3, 2, 1], (3, 5, 2))]  # 2 hits; 1 evicts 0, the least recent not asked for
    for ids, order, (hits, misses, evictions) in steps:
        store(x, w, torch.tensor([ids], dtype=torch.int32))
        s = store.stats()
        assert store.cache_order() == order
        assert (s["hits"], s["misses"], s["evictions"]) == (hits, misses, evictions)
    assert s["hit_rate"] == pytest.approx(3 / 8)


def _small_gguf(path, layers=2, E=6, H=64, inter=32, seed=0):
    """Quantized experts of mixed formats (Q8_0 gate/up, Q4_0 down), as real files mix them."""
    rng = np.random.default_rng(seed)
    q8, q4 = quant.get("Q8_0"), quant.get("Q4_0")
    tensors = []
    for i in range(layers):
        for name, fmt, shape in ((NAMES[2], q4, (E, H, inter)), (NAMES[0], q8, (E, inter, H)),
                                 (NAMES[1], q8, (E, inter, H))):
            blocks = fmt.quantize(rng.standard_normal((E * shape[1], shape[2])).astype(np.float32))
            tensors.append(QTensor(f"blk.{i}.{name}.weight", fmt, shape, blocks))
        tensors.append(QTensor(f"blk.{i}.attn_norm.weight", quant.get("F32"), (H,),
                               np.ones((1, H), np.float32).view(np.uint8)))
    return write_gguf(path, "qwen4exp", {"qwen4exp.block_count": layers, "qwen4exp.expert_count": E,
                                         "qwen4exp.expert_used_count": 2}, tensors)


@settings(max_examples=examples(40), deadline=None)
@given(chosen=st.sets(st.integers(0, 11), max_size=12), seed=st.integers(0, 2 ** 32 - 1))
def test_host_experts_copied_from_where_they_lie_are_the_gathered_ones(chosen, seed):
    """HostSource.fetch_to (a GPU's copies from pinned host memory, a run of consecutive
    experts one copy) gives fetch's blocks for any sorted set of experts; here to the CPU."""
    from strata.storage.expert_sources import HostSource
    g = torch.Generator().manual_seed(seed)
    src = HostSource(tuple(torch.randint(0, 256, (12, r, 18), dtype=torch.uint8, generator=g) for r in (3, 3, 2)))
    experts = sorted(chosen)
    for a, b in zip(src.fetch_to(experts, "cpu"), src.fetch(experts)):
        assert a.shape == b.shape and torch.equal(a, b)


def test_pack_round_trip_and_index(tmp_path):
    g = open_gguf(_small_gguf(tmp_path / "small.gguf"))
    index = pack(g.path, tmp_path / "pack", say=lambda _msg: None)
    text = index.read_text()
    # human-readable: comments say the layout, then a header row and a row per tensor
    assert text.startswith("# Strata expert pack") and "\nlayer\ttensor\tname\t" in text
    rows = [line.split("\t") for line in text.splitlines() if line and not line.startswith(("#", "layer\t"))]
    assert [(r[0], r[1]) for r in rows] == [(str(i), k) for i in range(2) for k in ("gate", "up", "down")]
    data = (tmp_path / "pack" / PACK_BIN).read_bytes()
    for r in rows:
        t = g.tensor(r[2])
        path, offset = tensor_file(t)
        assert (int(r[5]), r[10]) == (offset, str(path.resolve()))
        per, at, stride = int(r[6]), int(r[7]), int(r[8])
        assert stride % PACK_ALIGN == 0
        for e in range(t.shape[0]):  # expert e of the tensor is where the index says
            assert data[at + e * stride:at + e * stride + per] == t.data.reshape(t.shape[0], -1)[e].tobytes()
    ts = _layer(g, 1)
    ref = ex.ExpertStore(*ts, torch.float32, "cpu", None, "device")
    for tier in ("packed", "cache:2:packed", "file"):
        store = ex.ExpertStore(*ts, torch.float32, "cpu", None, tier, experts_dir=tmp_path / "pack", depth=2)
        for x, w, ids in _batches(6, 2, 64, seed=1):
            assert torch.equal(store(x, w, ids), ref(x, w, ids)), tier


def test_stale_or_missing_pack_says_what_to_do(tmp_path):
    a = open_gguf(_small_gguf(tmp_path / "a.gguf", seed=0))
    b = open_gguf(_small_gguf(tmp_path / "b.gguf", E=4, seed=1))
    pack(a.path, tmp_path / "pa", say=lambda _msg: None)
    with pytest.raises(ValueError, match="stale; run `strata pack"):
        ex.ExpertStore(*_layer(b), torch.float32, "cpu", None, "packed", experts_dir=tmp_path / "pa")
    with pytest.raises(ValueError, match="no expert pack.*strata pack"):
        ex.ExpertStore(*_layer(b), torch.float32, "cpu", None, "packed", experts_dir=tmp_path / "none")


def test_tier_specs():
    assert parse_tier("cache:64:file") == ExpertTier("cache", 64, "file")
    assert parse_tier("cache:8") == ExpertTier("cache", 8, "host")
    assert parse_tier("blocks") == parse_tier("device") == ExpertTier("device")
    assert [str(parse_tier(s)) for s in ("host", "packed", "file", "CACHE:3:Packed")] == \
        ["host", "packed", "file", "cache:3:packed"]
    for bad in ("cache", "cache:0", "cache:x:file", "cache:4:disk", "ssd"):
        with pytest.raises(ValueError, match="--experts"):
            parse_tier(bad)
    p = argparse.ArgumentParser()
    add_expert_args(p)
    args = p.parse_args(["--experts", "cache:16:packed", "--experts-dir", "/d", "--experts-io", "mmap"])
    o = load_options(args)
    assert {"tier": o.experts, "experts_dir": o.experts_dir, "io_mode": o.experts_io, "depth": o.experts_io_depth} \
        == {"tier": "cache:16:packed", "experts_dir": "/d", "io_mode": "mmap", "depth": 16}
    with pytest.raises(SystemExit):
        p.parse_args(["--experts", "cache:-1"])


def test_stats_line_adds_up_the_layers(tiny):
    stores = [ex.ExpertStore(*_layer(tiny, i), torch.float32, "cpu", None, "cache:4:file", depth=2)
              for i in (0, 1)]
    x, w = torch.randn(1, 256), torch.ones(1, 2)
    for s in stores:
        s(x, w, torch.tensor([[1, 2]], dtype=torch.int32))
        s(x, w, torch.tensor([[1, 3]], dtype=torch.int32))
    total = ex.summarize(stores)
    assert (total["hits"], total["misses"], total["bytes"]) == (2, 6, 6 * stores[0].expert_bytes)
    line = ex.stats_line(stores)
    assert line.startswith("experts [cache:4:file x2]: 2 hits, 6 misses (hit rate 25.0%), 0 evictions, ")
    assert f"{6 * stores[0].expert_bytes / 1e9:.3f} GB fetched" in line


def test_file_tier_needs_a_file():
    q8 = quant.get("Q8_0")
    t = QTensor("blk.0.ffn_gate_exps.weight", q8, (2, 32, 32), q8.quantize(np.ones((64, 32), np.float32)))
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_exps.weight' is not a view of a file"):
        ex.ExpertStore(t, t, t, torch.float32, "cpu", None, "file")


def test_kernel_path_equals_resident(tmp_path, monkeypatch):
    # the Triton kernel itself (the interpreter here, compiled on CUDA): a compact set and
    # a group of k = 1 choices run with the resident call's tiles, so they agree exactly
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ts = _layer(open_gguf(_small_gguf(tmp_path / "s.gguf")))
    ref = ex.ExpertStore(*ts, torch.float32, "cpu", None, "device")
    for tier in ("file", "cache:2:file"):
        store = ex.ExpertStore(*ts, torch.float32, "cpu", None, tier, depth=2)
        rng = torch.Generator().manual_seed(2)
        for T in (1, 5, 9):
            x, w = torch.randn(T, 64, generator=rng), torch.rand(T, 2, generator=rng)
            ids = torch.stack([torch.randperm(6, generator=rng)[:2] for _ in range(T)]).int()
            assert torch.equal(store(x, w, ids), ref(x, w, ids)), (tier, T)


@pytest.mark.parametrize("tier", ["dense", "device", "file", "packed", "cache:5:packed"])
def test_a_share_of_the_experts_answers_for_them(tiny, tiny_pack, tier):
    """--ep: a store of experts 24..48 (ids local to the share, -1 for the rest) gives what
    the whole layer gives for the slots routed to them, in every tier (the packed tiers
    read the pack at the share's offset)."""
    ts = _layer(tiny)
    E, _, H = ts[0].shape
    mine = range(24, 48)
    ref = ex.ExpertStore(*ts, torch.float32, "cpu", None, "device")
    share = ex.ExpertStore(*ts, torch.float32, "cpu", None, tier, experts_dir=tiny_pack, experts=mine)
    assert share.n_experts == len(mine)
    for x, w, ids in _batches(E, 8, H, seed=3):
        held = (ids >= mine.start) & (ids < mine.stop)
        local = torch.where(held, ids - mine.start, -1)
        only = torch.where(held, ids, -1)  # the whole layer, the other slots dropped
        if tier == "dense":  # its own loop over experts: another order of the same sums
            torch.testing.assert_close(share(x, w, local), ref(x, w, only), rtol=0, atol=1e-6)
        else:  # the same bytes through the same kernel
            assert torch.equal(share(x, w, local), ref(x, w, only)), tier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_tier_few_tokens_in_one_pass_equal_its_loop(tiny, dtype, monkeypatch):
    """Up to FEW_TOKENS tokens the dense tier runs one compiled pass over the routed experts
    (experts._few_tokens); it equals the expert loop: float32 weights, to summation order
    (1e-5 of the output's scale); bfloat16, to the loop's own rounding of x and of the
    SwiGLU product to bfloat16 (2^-7 relative, a little more through silu: 2^-6)."""
    import triton_kernels.cpu.compiled as compiled
    monkeypatch.setattr(compiled, "broken", [])
    ts = _layer(tiny)
    E, _, H = ts[0].shape
    store = ex.ExpertStore(*ts, dtype, "cpu", None, "dense")
    for x, w, ids in _batches(E, 8, H, seed=4):
        if x.shape[0] > ex.FEW_TOKENS:
            continue
        ids[0, 0] = -1  # a slot held by another rank weighs nothing
        monkeypatch.setenv("STRATA_CPU_COMPILE", "1")
        got = store(x, w, ids)
        monkeypatch.setenv("STRATA_CPU_COMPILE", "0")
        want = store(x, w, ids)
        tol = 1e-5 if dtype == torch.float32 else 2.0 ** -6
        assert float((got - want).abs().max()) <= tol * float(want.abs().max())
    assert compiled.broken == []
