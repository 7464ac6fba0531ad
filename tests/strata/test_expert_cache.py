"""The expert cache's decode on the device (strata.storage.expert_cache), run through the
Triton interpreter: whatever hits and misses, the cache tier's output is the resident
tier's bit for bit; its LFU promotes the experts routed most, between steps; and the
staging copy equals its torch twin on any rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quant
from strata.storage import experts as ex
from strata.tensors import QTensor
from tests.tiers import examples
from triton_kernels import configs
from triton_kernels.stage import stage_rows, stage_rows_torch

NAMES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with configs.interpreter_tiles():  # the interpreter's larger tiles: the same bytes, fewer programs
        yield


@pytest.fixture(scope="module")
def layer(flash_tiny_gguf):
    """flash-tiny's layer 0 experts in Q4_0 (the MoE kernels' dp4a path, as a GPU decodes)."""
    g = flash_tiny_gguf
    f = quant.get("Q4_0")
    out = []
    for n in NAMES:
        t = g.tensor(f"blk.0.{n}.weight")
        out.append(QTensor(t.name, f, t.shape, f.quantize(t.numpy().reshape(-1, t.shape[-1]))))
    return tuple(out)


def test_the_device_cache_equals_the_resident_tier_and_promotes_the_routed_experts(layer):
    E, _, H = layer[0].shape
    ref = ex.ExpertStore(*layer, torch.float32, "cpu", None, "device", kernels="triton")
    store = ex.ExpertStore(*layer, torch.float32, "cpu", None, "cache:4:host", kernels="triton", top_k=2)
    assert store.device_cache is not None and "LFU" in store.describe()
    g = torch.Generator().manual_seed(0)
    popular = [3, 17, 40]
    for step in range(12):
        store.rebalance()
        ids = torch.tensor([[popular[step % 3], int(torch.randint(E, (1,), generator=g))]], dtype=torch.int32)
        x, w = torch.randn(1, H, generator=g), torch.softmax(torch.randn(1, 2, generator=g), -1)
        assert torch.equal(store(x, w, ids), ref(x, w, ids)), step
    s = store.stats()
    assert s["hits"] > 0 and s["misses"] > 0 and s["hits"] + s["misses"] == 24
    store.rebalance()  # the last promotion's copy is published between steps
    assert set(popular) <= set(store.cache_order())
    # a batch of more slots than the staging rows fetches from host memory: equal too
    ids = torch.tensor([[3, 5], [40, 2], [9, 17]], dtype=torch.int32)
    x, w = torch.randn(3, H, generator=g), torch.full((3, 2), 0.5)
    assert torch.equal(store(x, w, ids), ref(x, w, ids))


def test_staging_refuses_a_source_in_pageable_host_memory():
    """The staging kernel reads its source where it lies: host memory must be page-locked
    for a GPU to read it, and a pageable source is refused before any launch, saying what
    to do (on fake CUDA)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    src = torch.zeros(4, 64, dtype=torch.uint8)  # pageable host memory
    with FakeTensorMode(allow_non_fake_inputs=True):
        dst = torch.empty(6, 64, dtype=torch.uint8, device="cuda")
        ids, slots = torch.zeros(2, dtype=torch.int64, device="cuda"), torch.full((2,), -1, device="cuda")
        with pytest.raises(ValueError, match=r"pageable host memory.*tensor\.pin_memory\(\)"):
            stage_rows(src, dst, ids, slots, 0)


def test_publishing_a_slot_makes_the_host_wait_for_nothing():
    """rebalance publishes a finished copy's slot in the device table with a kernel (a
    slice's fill_), not with a copy from pageable host memory, which a GPU's host would
    wait for (traced on fake CUDA, where such a copy raises)."""
    from strata.runtime.trace import fake_cuda, trace
    from strata.storage.expert_cache import DeviceCache
    host = tuple(torch.zeros(8, 2, 32, dtype=torch.uint8) for _ in range(3))
    with fake_cuda():
        cache = DeviceCache(host, slots=2, staging=4, device="cuda", kernels="triton")
        cache._copy(5, 0)  # a promotion's copy, done at once (no stream under fake CUDA)
        t = trace(cache.rebalance)
    assert cache.slot_of == {5: 0} and not cache.transit
    assert t.torch_ops == {"fill_": 1}, t.torch_ops


@settings(max_examples=examples(20), deadline=None)
@given(rows=st.integers(1, 6), cols=st.lists(st.sampled_from([1, 3, 4, 68, 1030]), min_size=1, max_size=3),
       n=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_staging_copies_the_missed_rows_as_its_torch_twin(rows, cols, n, seed):
    """One to three matrices of their own row widths (an expert's gate, up and down),
    staged in one launch; bytes or words as the widths allow."""
    rng = np.random.default_rng(seed)
    src = [torch.from_numpy(rng.integers(0, 256, (rows, c), dtype=np.uint8)) for c in cols]
    ids = torch.from_numpy(rng.integers(0, rows, n))
    slots = torch.from_numpy(rng.integers(-1, 2, n))  # -1: a miss
    dst = [torch.from_numpy(rng.integers(0, 256, (n + 2, c), dtype=np.uint8)) for c in cols]
    first = int(rng.integers(0, 3))
    want = [d.clone() for d in dst]  # the definition: a missed slot's row copied, every other row kept
    for s, w in zip(src, want):
        for j in range(n):
            if slots[j] < 0:
                w[first + j] = s[ids[j]]
    twin = [d.clone() for d in dst]
    stage_rows_torch(src, twin, ids, slots, first)
    stage_rows(src, dst, ids, slots, first)
    assert all(torch.equal(t, w) and torch.equal(d, w) for t, d, w in zip(twin, dst, want))
    if len(cols) == 1:  # a tensor alone, as a list of one
        one = dst[0].clone()
        stage_rows(src[0], one, ids, slots, first)
        assert torch.equal(one, want[0])


@pytest.mark.parametrize("fmt", ["Q4_0", "F32"])  # the MoE's dp4a path (no alignment) and its dot path
def test_a_step_routed_by_route_align_equals_the_resident_tier_and_counts_the_same(flash_tiny_gguf, fmt):
    """The router's launch that also looks up, counts and aligns (route_plan, route_align)
    gives the store's result of the separate launches, on the cache tier and the resident."""
    from triton_kernels.route_align import route_align
    f = quant.get(fmt)
    layer = []
    for n in NAMES:
        t = flash_tiny_gguf.tensor(f"blk.0.{n}.weight")
        layer.append(QTensor(t.name, f, t.shape, f.quantize(t.numpy().reshape(-1, t.shape[-1]))))
    E, _, H = layer[0].shape
    ref = ex.ExpertStore(*layer, torch.float32, "cpu", None, "device", kernels="triton")
    store = ex.ExpertStore(*layer, torch.float32, "cpu", None, "cache:4:host", kernels="triton", top_k=2)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        store.rebalance()
        plan = store.route_plan(1, 2)
        assert plan is not None and plan["block_m"] == (0 if fmt == "Q4_0" else 16), plan
        block_m = plan.pop("block_m")
        logits, x = torch.randn(1, E, generator=g), torch.randn(1, H, generator=g)
        w, ids, local, slot, *aligned, _ = route_align(logits, 2, True, block_m, **plan)
        got = store(x, w, ids, slots=True, plan=(local, slot, (*aligned, block_m) if block_m else None))
        assert torch.equal(got.sum(dim=1), ref(x, w, ids)), step
    s = store.stats()
    assert s["hits"] + s["misses"] == 8 and s["misses"] > 0
    assert ref.route_plan(1, 2) is None  # resident on the CPU: the store counts on the host


def _launches(step):
    """step()'s result and its Triton launches, counted by kernel (the interpreter's)."""
    import collections

    import triton.runtime.interpreter as interpreter
    run = interpreter.InterpretedFunction.run
    counts = collections.Counter()

    def counted(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        return run(self, *args, **kwargs)
    interpreter.InterpretedFunction.run = counted
    try:
        return step(), counts
    finally:
        interpreter.InterpretedFunction.run = run


def _requant(g, name: str, fmt: str) -> QTensor:
    """Layer 0's MoE weight `name` (strata.names.qwen4exp.MOE) of flash-tiny in fmt."""
    from strata.names import qwen4exp as n
    t = g.tensor(n.blk(0, n.MOE[name]))
    f = quant.get(fmt)
    return QTensor(t.name, f, t.shape, f.quantize(t.numpy().reshape(-1, t.shape[-1])))


def _planned_and_apart(g, layer, proj_fmts, down_fmt):
    """The MoE of flash-tiny's layer 0 over a cache:4:host store of `layer`'s experts, its
    projection in proj_fmts and the shared expert's down in down_fmt: (the one-token
    step's parts with the store's plan, its launches; the same without the plan)."""
    from strata.names import qwen4exp as n
    from strata.nn.linear import QuantLinear
    from strata.nn.moe import MoE
    E, shared = layer[0].shape[0], g.tensor(n.blk(0, n.MOE["shexp_gate"])).shape[0]
    store = ex.ExpertStore(*layer, torch.float32, "cpu", None, "cache:4:host", kernels="triton", top_k=2)
    proj = QuantLinear([_requant(g, w, f) for w, f in zip(("router", "shexp_router", "shexp_gate", "shexp_up"),
                                                         proj_fmts)], kernels="triton")
    moe = MoE(proj, store, E, 2, shared, QuantLinear(_requant(g, "shexp_down", down_fmt), kernels="triton"))
    x = torch.randn(1, proj.in_features, generator=torch.Generator().manual_seed(3))
    store.rebalance()
    with_plan = _launches(lambda: moe.parts(x))
    store.route_plan = lambda *a: None  # the separate launches
    return moe, with_plan, _launches(lambda: moe.parts(x))


@pytest.mark.parametrize("proj_fmts", [("Q4_0",) * 4, ("F32",) * 4, ("F32", "F32", "Q4_0", "Q4_0")])
def test_the_routers_launch_takes_its_gemv_and_the_shared_experts_swiglu_with_their_bits(flash_tiny_gguf, layer,
                                                                                         proj_fmts):
    """A one-token step routes in its router GEMV's launch (router_gemv): the projection's
    dp4a GEMV (Q4_0), its float GEMV (F32), or a released file's mix, F32 routers before
    the shared expert's Q4_0 gate and up, whose dp4a GEMV joins the float one's launch
    (router_gemv's pair); with the shared expert's down projection in Q4_0 that launch
    computes its SwiGLU and int8 too, and the routed experts' down launch (Q4_0 experts:
    dp4a) runs the shared expert's down GEMV (moe(pair=)), where the step without a plan
    launches the GEMVs, route, cache_lookup and silu_mul apart: the MoE's parts are the
    same bits, in fewer launches."""
    moe, (with_plan, fused), (without, apart) = _planned_and_apart(flash_tiny_gguf, layer, proj_fmts, "Q4_0")
    assert moe.shared_down.product_apart(1)
    routing = "_router_gemv_kernel" if proj_fmts[0] == "Q4_0" else "_router_gemv_float_kernel"
    assert fused[routing] == 1 and not {"_silu_mul_kernel", "_route_kernel"} & set(fused), fused
    assert apart["_silu_mul_kernel"] == 1 and sum(fused.values()) < sum(apart.values()), (fused, apart)
    # no GEMV beside the router's launch and the experts': the mix's Q4_0 gate and up are in
    # the router's launch, the shared expert's Q4_0 down in the routed experts' down launch
    assert fused["_gemv_dp4a_kernel"] == 0 and fused["_gemv_kernel"] == 0, fused
    assert apart["_gemv_dp4a_kernel"] >= 1, apart
    for a, b in zip(with_plan, without):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["F32", "BF16"])
def test_float_experts_down_launch_takes_the_shared_experts_gated_down_gemv_with_its_bits(flash_tiny_gguf, fmt):
    """Float experts (the MoE's dot path, its per-weight down kernel) with a float shared
    expert, as flash-tiny's BF16 file holds them: the one-token step's routed experts' down
    launch runs the shared expert's gated down GEMV too (moe(pair=): gated_gemv's
    programs), where the step without a plan launches it apart; the same bits."""
    layer = tuple(_requant(flash_tiny_gguf, w, fmt) for w in ("gate_exps", "up_exps", "down_exps"))
    moe, (with_plan, fused), (without, apart) = _planned_and_apart(flash_tiny_gguf, layer, (fmt,) * 4, fmt)
    assert not moe.shared_down.product_apart(1)
    assert fused["_down_kernel"] == 1 and "_gated_gemv_kernel" not in fused, fused
    assert apart["_gated_gemv_kernel"] == 1, apart
    for a, b in zip(with_plan, without):
        assert torch.equal(a, b)
