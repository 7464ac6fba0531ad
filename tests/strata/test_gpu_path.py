"""The GPU path, checked on the CPU: with `kernels="triton"` every module runs the Triton
kernels (here through the interpreter), and the models' logits agree with the torch path;
every launch they make compiles for sm_90 and gfx942.

Bound: max |logit difference| / max |logit| <= 3e-2, with the same greedy token. Both
paths decode the same weights bit for bit; they differ in the activations. Where a format
has int8 units (Q8_0, Q4_0, ...), a decode step's matmuls quantize x to int8 in blocks
of 32, as llama.cpp's GPU kernels do (Q8_1): each x carries an error of up to 1/254 of its
block's largest |x|, about 0.3% of a dot product of 256 to 1536 terms (measured 2% of
the largest output on one 49152 x 256 Q8_0 GEMV of random x, whose outputs are all of a
size). Two layers of SmolLM2 or four of flash-tiny add those up; the torch path keeps
float32 throughout. A wrong decode, layout or routing gives differences of the logits'
own size (ratio near 1), and most likely another token.

The interpreter runs a vocabulary-sized GEMV in about a second with its own larger tiles
(triton_kernels.configs.interpreter_tiles) and in minutes with a GPU's, so SmolLM2 runs
two of its 30 layers. The launches are compiled with the GPU's tiles (see
triton_kernels.analysis.launches).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import quant
from strata.gguf import open_gguf, write_gguf
from strata.hub import synth_flash_tiny
from strata.load import load_model
from strata.storage import experts as ex
from strata.storage.pack import pack as write_pack
from strata.tensors import QTensor
from triton_kernels import configs
from triton_kernels.backend import interpreter_on
from triton_kernels.analysis.launches import compile_calls, distinct, record

REL = 3e-2


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    """The interpreter, and the weights in the layout a GPU holds them in (the split
    layout where a format has one: triton_kernels.layout)."""
    if not interpreter_on():
        pytest.skip("the GPU path runs on the CPU only under TRITON_INTERPRET=1 (the suite sets it)")
    with configs.interpreter_tiles(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRATA_LAYOUT", "split")
        yield


def _requant(t: QTensor, fmt: str) -> QTensor:
    f = quant.get(fmt)
    return QTensor(t.name, f, t.shape, f.quantize(t.numpy().reshape(-1, t.shape[-1])))


@pytest.fixture(scope="module")
def tiny_mixed(tmp_path_factory):
    """flash-tiny's first 4 layers (DeltaNet, DeltaNet with the PLE block, DeltaNet, gated
    attention with QSA: every kind of layer, at half the interpreter's time) with unit
    formats where the decode step's int8 kernels take them: the routed experts of layer 1
    in Q8_0 and of layer 2 in Q4_0 (the MoE dp4a kernels; the prompt's, the unit dot
    kernels: triton_kernels.moe_units), layer 1's shared expert down
    and layer 3's attention output in Q8_0 (their gates' products written apart, as int8,
    for the dp4a GEMV; layer 1's down GEMV in the routed experts' down launch), layer 1's
    shared expert gate and up in Q8_0 beside the F32 routers and layer 3's Q, K and V in
    Q8_0 beside the F32 indexer rows (a released file's mix: a float and a dp4a GEMV in
    one launch, gemv_pair), layer 1's hyper-connection up weights in Q4_0 (decoded inside
    hc_mix), its and layer 2's attention connection's down and inject weights in Q8_0 (the read after
    the PLE block, a write and a MoE block's write each with the next read's down GEMV in
    its launch: triton_kernels.hc_down), the output in Q8_0 (the dp4a GEMV); the rest F32
    (the float kernels)."""
    src = open_gguf(synth_flash_tiny(quiet=True))
    n = 4
    meta = src.typed_metadata()
    for key in ("block_count", "attention.recurrent_layers", "attention.compress_ratios"):
        v, kind = meta[f"{src.arch}.{key}"]
        meta[f"{src.arch}.{key}"] = (n if key == "block_count" else v[:n], kind)
    assert max(meta[f"{src.arch}.ple.layers"][0]) < n and not all(meta[f"{src.arch}.attention.recurrent_layers"][0])
    to = {"output.weight": "Q8_0", "blk.1.ffn_down_shexp.weight": "Q8_0", "blk.3.attn_output.weight": "Q8_0",
          "blk.1.hc_attn_up.weight": "Q4_0", "blk.1.hc_ffn_up.weight": "Q4_0",
          **{f"blk.{i}.hc_{b}_{w}.weight": "Q8_0" for i, b in ((1, "attn"), (1, "ffn"), (2, "attn"))
             for w in ("down", "inject")},
          **{f"blk.1.ffn_{w}_shexp.weight": "Q8_0" for w in ("gate", "up")},
          **{f"blk.3.attn_{w}.weight": "Q8_0" for w in ("q", "k", "v")}}
    for i, fmt in ((1, "Q8_0"), (2, "Q4_0")):
        for w in ("gate", "up", "down"):
            to[f"blk.{i}.ffn_{w}_exps.weight"] = fmt
    tensors = {name: _requant(t, to[name]) if name in to else t for name, t in src.tensors.items()
               if not name.startswith("blk.") or int(name.split(".")[1]) < n}
    dst = tmp_path_factory.mktemp("mixed") / "flash-tiny-mixed.gguf"
    write_gguf(dst, src.arch, meta, tensors)
    return dst


@pytest.fixture(scope="module")
def smol_two_layers(smollm2_gguf, tmp_path_factory):
    """SmolLM2's first two blocks, its norm and (tied) output: Q4_1 and Q8_0 as shipped."""
    g = smollm2_gguf
    meta = g.typed_metadata()
    meta["llama.block_count"] = (2, meta["llama.block_count"][1])
    keep = {n: t for n, t in g.tensors.items() if not n.startswith("blk.") or int(n.split(".")[1]) < 2}
    dst = tmp_path_factory.mktemp("smol") / "smollm2-2-layers.gguf"
    write_gguf(dst, g.arch, meta, keep)
    return dst


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _agree(path, prompt: list[int], steps: int, **opts) -> list[float]:
    """Prefill `prompt`, then `steps` greedy decode steps, on both paths (the torch path's
    tokens fed to both); returns each forward's bound ratio."""
    ref = load_model(path, dtype=torch.float32, kernels="torch", **opts)
    got = load_model(path, dtype=torch.float32, kernels="triton", **opts)
    assert got.kernels == "triton" and "triton kernels" in got.plan_line()
    held = {m.fmt.layout for m in got.modules() if getattr(m, "mode", None) == "triton"}
    assert "split" in held, held  # the Q8_0 weights are held as a GPU holds them
    cr, cg = ref.new_cache(), got.new_cache()
    rels, toks = [], list(prompt)
    with record() as calls:
        for _ in range(steps + 1):
            a = ref(toks, cr, last_only=True)[-1]
            b = got(toks, cg, last_only=True)[-1]
            rels.append(_rel(b, a))
            assert int(b.argmax()) == int(a.argmax()), rels
            toks = [int(a.argmax())]
    return rels, calls


def _compiles(calls: list[dict], kernels: tuple[str, ...]) -> None:
    """Every kernel the recorded calls launch compiles for sm_89 (the RTX 4090), sm_90 and
    gfx942, as the engine would launch it there (the GPU's tiles and instruction family),
    without spilling and within the target's shared memory."""
    import time
    t = time.perf_counter()
    results = compile_calls(distinct(calls), ("sm_89", "sm_90", "gfx942"))
    print(f"{len(distinct(calls))} calls, {len(results)} kernels compiled in {time.perf_counter() - t:.1f} s")
    failed = [f"{r.kernel} on {r.target}: {r.problems}" for r in results if r.problems]
    assert not failed, "\n".join(failed)
    got = {(r.kernel, r.target) for r in results}
    for k in kernels:
        assert {(k, "sm_89"), (k, "sm_90"), (k, "gfx942")} <= got, (k, sorted(got))


@pytest.mark.slow
def test_flash_tiny_with_triton_kernels_gives_the_torch_logits(tiny_mixed):
    # 18 prompt tokens: the GEMM and the MoE's tl.dot kernels; decode: the int8 ones
    prompt = [1, 5, 77, 2, 900, 31, 4000, 12, 7, 2, 88, 1500, 3, 19, 600, 42, 9, 250]
    rels, calls = _agree(tiny_mixed, prompt, steps=1)
    print("flash-tiny bound ratios", rels)
    assert max(rels) <= REL, rels
    ops = {c["op"] for c in calls}
    assert {"qmatmul", "route", "moe", "ngram_ids", "ple_gather", "hc_down"} <= ops, ops
    modes = {c["kwargs"].get("out") is None and len(c["args"]) < 7 for c in calls if c["op"] == "hc_down"}
    assert modes == {True, False}, modes  # a read (after the PLE block) and writes
    _compiles(calls, ("_gemv_dp4a_kernel", "_gate_up_dp4a_kernel", "_down_dp4a_kernel", "_gate_up_kernel",
                      "_down_kernel", "_gate_up_units_kernel", "_down_units_kernel", "_route_kernel",
                      "_ngram_ids_kernel", "_gemv_kernel", "_gemm_kernel", "_hc_down_kernel"))


@pytest.mark.slow
def test_smollm2_with_triton_kernels_gives_the_torch_logits(smol_two_layers):
    rels, calls = _agree(smol_two_layers, [1, 504, 3458, 314], steps=1)
    print("SmolLM2 bound ratios", rels)
    assert max(rels) <= REL, rels
    # its Q4_1 weights decode as int8 units (decode.legacy.unit_q4_1): every GEMV of the
    # decode step the dp4a one, where Q4_1 took the float GEMV's byte loads before
    _compiles(calls, ("_gemv_dp4a_kernel",))


def _layer1(path):
    g = open_gguf(path)
    return tuple(g.tensor(f"blk.1.ffn_{w}_exps.weight") for w in ("gate", "up", "down"))


@pytest.fixture(scope="module")
def moe_batches(tiny_mixed):
    """Layer 1's experts (Q8_0) on a decode batch (dp4a) and a prefill batch (tl.dot): the
    inputs, the resident store's output with the MoE kernels, and the torch path's."""
    ts = _layer1(tiny_mixed)
    resident = ex.ExpertStore(*ts, torch.float32, "cpu", None, "device", kernels="triton")
    torch_ = ex.ExpertStore(*ts, torch.float32, "cpu", None, "device", kernels="torch")
    E, _, H = ts[0].shape
    rng = torch.Generator().manual_seed(0)
    out = []
    for T in (3, 6):  # 3 tokens route to 24 experts: more than a 16-slot cache holds
        x = torch.randn(T, H, generator=rng)
        ids = torch.stack([torch.randperm(E, generator=rng)[:8] for _ in range(T)]).int()
        w = torch.softmax(torch.randn(T, 8, generator=rng), -1)
        want = resident(x, w, ids)
        assert _rel(want, torch_(x, w, ids)) <= REL, T
        out.append((x, w, ids, want))
    return out


@pytest.mark.slow  # the quick tier reaches the GPU path through the PLE gather below and the kernels' properties
@pytest.mark.parametrize("tier", ["host", "cache:16:host", "cache:5:file", "file", "packed"])
def test_every_expert_tier_runs_the_moe_kernels(tiny_mixed, moe_batches, tmp_path_factory, tier):
    """Per tier, the store with the MoE kernels equals the resident store bit for bit (the
    same bytes meet the same kernel blocks, also when a cache runs a batch in groups),
    which is within the bound of the torch path (moe_batches)."""
    pack = tmp_path_factory.getbasetemp() / "mixed-pack"
    if tier == "packed" and not pack.exists():
        write_pack(tiny_mixed, pack, say=lambda _msg: None)
    store = ex.ExpertStore(*_layer1(tiny_mixed), torch.float32, "cpu", None, tier, experts_dir=pack, depth=4,
                           kernels="triton")
    assert {f.layout for f in store.fmts} == {"split"}  # the Q8_0 experts, as a GPU holds them
    for x, w, ids, want in moe_batches:
        assert torch.equal(store(x, w, ids), want), (tier, x.shape[0])
    if tier != "host":
        assert store.stats()["misses"] > 0


@pytest.mark.parametrize("mode", ["ram"] + [pytest.param(m, marks=pytest.mark.slow) for m in ("mmap", "direct")])
def test_every_ple_mode_gathers_with_the_kernel(mode):
    from strata.storage.ple_gather import InMemoryTable, StoredTable
    from strata.storage.ple import PleTable
    path = synth_flash_tiny(quiet=True)
    g = open_gguf(path)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, g.tensor("per_layer_token_embd.weight").shape[0],
                                                             (5, 16)))
    want = InMemoryTable(g.tensor("per_layer_token_embd.weight"), "cpu", "torch").gather(ids)
    with PleTable.open(path, mode, depth=4) as table:
        got = StoredTable(table, "cpu", "triton").gather(ids)
    assert torch.equal(got, want), mode  # a gather is a dequantization: bit for bit


@pytest.fixture(scope="module")
def tiny_mixed_short_budget(tiny_mixed, tmp_path_factory):
    """tiny_mixed with its QSA budget cut to 8 tokens (2 blocks of 4), so that a decode
    step chooses among blocks after a prompt of 10 tokens, not 66."""
    g = open_gguf(tiny_mixed)
    meta = g.typed_metadata()
    key = f"{g.arch}.attention.indexer.top_k"
    meta[key] = (8, meta[key][1])
    dst = tmp_path_factory.mktemp("budget") / "flash-tiny-mixed-budget8.gguf"
    write_gguf(dst, g.arch, meta, g.tensors)
    return dst


@pytest.mark.slow
def test_the_graph_step_with_the_triton_kernels_equals_their_eager_step(tiny_mixed_short_budget):
    """The step a GPU replays (strata.runtime.graphs_qwen4exp, run as is here), with the
    Triton kernels: its QSA layer scores and attends with the QSA kernels, which read the
    position from the device and count the blocks a query cannot see yet as none; within
    the budget and past it, the eager step's logits within 1e-5 of the largest (the two
    attend in other orders: dense and chosen rows). Where a tie of exactly equal scores
    straddles the cut the two may keep different blocks (the module says why); these
    positions have none."""
    from strata.runtime.graphs_qwen4exp import Qwen4ExpGraph
    model = load_model(tiny_mixed_short_budget, dtype=torch.float32, kernels="triton")
    qsa = model.layers[3].mixer
    assert qsa.qsa and qsa.budget == 8 and qsa.ratio == 4
    a = model.new_cache()
    model([1, 5, 77, 2, 900, 31, 4000, 12, 7, 2], a, last_only=True)
    b = a.copy()
    graph = Qwen4ExpGraph(model, b, capacity=16)
    tok, rels = 3, []
    for _ in range(2):  # positions 10 (2 blocks seen: both kept) and 11 (3 seen: 2 chosen)
        want = model([tok], a, last_only=True)
        with record() as calls:
            got = graph(tok)
        rels.append(_rel(got, want))
        tok = int(want.argmax())
    print("flash-tiny graph step with the Triton kernels against the eager step:", rels)
    assert max(rels) <= 1e-5 and a.layers[3].n_blocks == 3, rels
    # the graph's own launches (the attention's rows normed, roped and stored, and the block
    # keys pooled, in one; the scores and attention at a device position, RoPE's rows read
    # there, the embedding gathered into every stream) compile for sm_90 and gfx942 as a
    # GPU would launch them
    graph_ops = {"attention_rows", "qsa_scores", "qsa_attention", "ple_gather", "gemv_pair"}
    assert graph_ops <= {c["op"] for c in calls}
    assert not {"qsa_pool", "norm_rope", "norm_rope2"} & {c["op"] for c in calls}
    # the attention's launch gates the Q8_0 output projection's input (no sigmoid_mul);
    # layer 3's Q8_0 Q, K, V and F32 indexer rows take one launch (gemv_pair), and so do
    # layer 1's F32 routers and Q8_0 shared gate and up (the store counts on the host here,
    # so the routing takes no launch of its own: test_expert_cache.py has the router's)
    assert "sigmoid_mul" not in {c["op"] for c in calls}
    assert sum(c["op"] == "gemv_pair" for c in calls) == 2
    _compiles([c for c in calls if c["op"] in graph_ops],
              ("_attention_rows_kernel", "_qsa_scores_kernel", "_qsa_attention_kernel", "_gemv_pair_kernel"))


@pytest.mark.slow
def test_past_the_budget_the_triton_kernels_give_the_torch_logits(tiny_mixed_short_budget):
    """The eager step past the QSA budget (positions 11 and 12 choose 2 of 3 blocks): the
    indexer's queries normed and roped by the launch that stores the rows
    (triton_kernels.attention_rows), the blocks scored and attended by the QSA kernels;
    the torch path's logits within REL, the same tokens."""
    rels, calls = _agree(tiny_mixed_short_budget, [1, 5, 77, 2, 900, 31, 4000, 12, 7, 2], steps=3)
    print("flash-tiny past the QSA budget, bound ratios", rels)
    assert max(rels) <= REL, rels
    assert {"attention_rows", "qsa_scores", "qsa_attention"} <= {c["op"] for c in calls}


@pytest.mark.slow
def test_text_after_an_image_keeps_its_rows_at_its_index_with_the_triton_kernels(flash_tiny_gguf):
    """Text after an image takes M-RoPE positions behind its indices (here 4, 5, 6 for
    tokens 6, 7, 8): the Triton path's launch ropes at the positions and stores the rows
    at the indices (attention_rows' slots), and the logits are the torch path's (float
    weights: 6e-7 measured; 0.5 while the rows went to the RoPE positions)."""
    logits = {}
    for kernels in ("torch", "triton"):
        model = load_model(flash_tiny_gguf, dtype=torch.float32, kernels=kernels)
        state = model.new_cache()
        state.positions.plan([(2, None), (4, (2, 2)), (3, None)])  # text, a 2 x 2 image's run, text
        rows = [model([1, 5, 77, 2, 900, 31], state), model([4000, 12, 7], state), model([9], state)]
        assert state.positions.of(6, 3).tolist() == [4, 5, 6] and state.layers[3].n == 10
        logits[kernels] = torch.cat(rows)
    assert _rel(logits["triton"], logits["torch"]) < 1e-5


@pytest.mark.slow
def test_batch_invariant_a_verify_through_the_graph_is_one_token_steps_with_the_triton_kernels(
        tiny_mixed, monkeypatch):
    """The promise greedy `--spec` rests on (triton_kernels.invariant), on the GPU path's
    kernels: a verify of 2 rows through its graph gives the one-token graph steps' logits
    bit for bit, every kind of layer (DeltaNet, the PLE block, QSA attention) and the int8
    MoE among them. Each op that takes T rows runs them as its one-token launch does (the
    conv, the recurrence and the PLE block's mix token after token inside one launch)."""
    from strata.runtime import graphs_qwen4exp
    from triton_kernels import invariant
    monkeypatch.setattr(graphs_qwen4exp, "usable", graphs_qwen4exp.holds)  # the graphs, run as is
    with configs.interpreter_tiles():
        model = load_model(tiny_mixed, dtype=torch.float32, kernels="triton")
        base = model.new_cache()
        model([1, 504, 3458], base)
        one, v = base.copy(), base.copy()
        with invariant.batch_invariant(True):
            steps = torch.cat([model([t], one) for t in (1234, 2345)])
            verify = model.verify([1234, 2345], v)
    assert list(one.graphs) == [1] and list(v.graphs) == [2]
    assert torch.equal(steps, verify), _rel(verify, steps)
