"""A decode step on fake CUDA tensors (strata.runtime.trace): what a GPU step would launch,
counted on the CPU, and no read of device data on the host anywhere in it.

On a GPU each host read waits for the device's queue to drain, and none can be captured
in a CUDA graph; a launch costs a few microseconds from Python and about one in a graph.
"""
from __future__ import annotations

import json

import pytest
import torch

from strata.load import load_model
from strata.runtime.trace import HostRead, HostWait, fake_cuda, trace
from triton_kernels import deltanet_fla
from triton_kernels.backend import to_device
from triton_kernels.deltanet_fla import fla_installed

# flash-tiny's decode step at bf16 with Triton kernels when these bounds were set (its 8
# layers): 92 launches with the experts resident, 100 in a cache over host RAM (the
# routing, its lookup and counters and the alignment in the router GEMV's last program,
# the staging one launch: triton_kernels.router_gemv, route_align, stage; the shared
# expert's gated down GEMV in the routed experts' down launch: moe(pair=); a
# hyper-connection read's down GEMV in the launch that writes the streams: hc_down); a DeltaNet
# layer's mixing one (its conv, inputs, recurrence and gated norm:
# triton_kernels.deltanet_decode); the embedding one, gathered into every stream
# (Qwen4Exp.embed); an attention layer's q and k norms and its rows' stores one, RoPE's
# rows read at the positions (triton_kernels.attention_rows); they only come down (104 and
# 112 before deltanet_decode, 112 and 120 before attention_rows, 129 and 137 before
# hc_down, 137 and 145 before the shared expert's down joined, 145 and 153 before the
# routing joined the GEMV)
LAUNCHES_A_LAYER = {"device": 92 / 8, "cache:16:host": 100 / 8}


def test_a_host_read_of_device_data_raises_naming_the_line():
    with fake_cuda():
        x = to_device(torch.arange(4.0), "cuda")
        with pytest.raises(HostRead, match=r"test_trace\.py:\d+ .*x\.sum\(\)"):
            trace(lambda: int(x.sum()))
        with pytest.raises(HostRead, match=r"cpu\(\) of a device tensor"):
            trace(lambda: x.cpu())
        with pytest.raises(HostRead, match="copy from the device to the host"):
            trace(lambda: torch.empty(4).copy_(x))
        with pytest.raises(HostRead, match="boolean mask"):
            trace(lambda: x[x > 1])


def test_a_copy_from_pageable_host_memory_raises():
    """On CUDA a copy to the device from pageable host memory makes the host wait for the
    queue (and raises under torch.cuda.set_sync_debug_mode("error")): copy_ of a host
    tensor, and one element set to a Python number, which torch makes a host tensor first.
    A slice's fill_ launches a kernel; to_device copies a step's few values from pinned
    memory, asynchronously."""
    with fake_cuda():
        x = to_device(torch.zeros(4, dtype=torch.int64), "cuda")
        with pytest.raises(HostWait, match=r"one element .* Python number .*test_trace\.py:\d+"):
            trace(lambda: x.__setitem__(1, 5))
        with pytest.raises(HostWait, match=r"pageable host memory at .*test_trace\.py:\d+"):
            trace(lambda: x.copy_(torch.arange(4)))
        t = trace(lambda: (x[1:2].fill_(5), x.copy_(to_device(torch.arange(4), "cuda"))))
    assert t.torch_ops == {"fill_": 1, "copy_": 1} and t.host_to_device == 1, t.torch_ops


def test_host_values_stay_real_and_device_launches_are_counted():
    with fake_cuda():
        x = to_device(torch.ones(4, 3), "cuda")

        def step():
            n = torch.arange(5)                     # the host's own tensors keep their values
            assert int(n.sum()) == 10
            y = x.T.contiguous()[1:, None] * 2      # Python indexing on fake CUDA tensors
            y[0] = 0
            return y

        t = trace(step)
    # contiguous (a copy), mul, and the write of 0 (the scalar made on the device, copied in):
    # the views launch nothing
    assert t.torch_ops == {"clone": 1, "mul": 1, "scalar_tensor": 1, "copy_": 1}, t.torch_ops
    assert sum(t.triton.values()) == 0


def test_triton_launches_are_counted_not_run():
    from triton_kernels.ops import impl
    with fake_cuda():
        q = to_device(torch.zeros(64, 68, dtype=torch.uint8), "cuda")  # 64 rows of 64 Q8_0 weights
        x = to_device(torch.zeros(1, 64, dtype=torch.bfloat16), "cuda")
        t = trace(lambda: impl("qmatmul", "triton")(x, q, "Q8_0"))
    assert sum(t.triton.values()) >= 1 and all(k.startswith("_") for k in t.triton), t.triton


@pytest.mark.parametrize("experts, ple_io, where", [
    ("device", None, "PLE table in memory (6 MiB F32 on cuda)"),
    ("cache:16:host", "ram", "read by the GPU over PCIe"),
])
def test_a_flash_tiny_decode_step_on_the_gpu_reads_nothing_on_the_host(flash_tiny_gguf, experts, ple_io, where,
                                                                      monkeypatch):
    """Experts resident with the PLE table in VRAM, and experts in a cache of 16 slots a
    layer over host RAM with the table in RAM: two steps from an empty state (a step of
    more routed slots than a cache's staging rows fetches on the host: prefill). The eager
    step: with graphs on, a one-token step on CUDA replays the state's decode graph, whose
    step tests/strata/test_graphs_qwen4exp.py traces."""
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")
    with fake_cuda():
        model = load_model(flash_tiny_gguf, dtype=torch.bfloat16, device="cuda", kernels="triton",
                           experts=experts, ple_io=ple_io)
        assert "on cuda" in model.plan_line() and where in model.plan_line(), model.plan_line()
        kernels = "fla-core" if fla_installed() else "strata"  # triton_kernels.deltanet_fla.deltanet_path
        assert f"6 DeltaNet ({kernels} chunks, a token one launch)" in model.plan_line(), model.plan_line()
        state = model.new_cache()
        first = trace(lambda: model(torch.tensor([1]), state))
        second = trace(lambda: model(torch.tensor([4]), state))
    n = model.cfg.n_layers
    print(f"\nflash-tiny on fake CUDA (bf16, Triton, experts {experts}, PLE {ple_io or 'in VRAM'}): "
          f"decode: {second.line(n)}")
    assert state.length == 2 and first.launches >= second.launches  # the first makes constants once
    assert second.launches <= LAUNCHES_A_LAYER[experts] * n, second.line(n)


def test_flash_next_shapes_decode_step_quantizes_each_input_once(monkeypatch):
    """One layer at Flash-Next's real shape (strata.convert.flash_shape_memory: quantized
    weights, so the dp4a GEMVs and their int8 activations) on fake CUDA, experts resident:
    21 launches, 2 of them quantize_x, the PLE block's (48 layers: 516, 10.8 a layer). A
    hyper-connection read's launch quantizes the block's input as it writes it, a write's
    launch (or the first read's norm) the streams' norm for the next read, a gate's launch
    its product (the shared expert's: the router's, route_align), DeltaNet's gated norm its
    rows (triton_kernels.hyperconn: hc_mix, hc_norm, hc_write_norm, hc_write_moe;
    shared_expert: silu_mul, sigmoid_mul;
    deltanet_decode; int8.attach), for the projections and the routed
    experts alike, and the routed experts' gate/up programs their intermediate
    (triton_kernels.moe): before, 43 launches, 12 quantize_x (48 layers: 1,257, 26.2 a
    layer), then 35 and 4 (921, 19.2), then 32 (870: the embedding then took three launches
    and the token check four), then 29 (867: the shared expert's SwiGLU then took its own
    launch), then 28 (819: the routing then took a launch after the router's GEMV), then
    27 (771), and 28 again once the file's routers were F32 as a released file's are: a
    matmul for them, with the routing in its launch, and one for the shared expert's gate
    and up (the graph step of 48 layers: 1,083 launches with a matmul a weight and a
    join, then 843), and 27 once the float GEMV's launch ran the quantized rows beside it
    too (triton_kernels.gemv_pair: the routers' with the shared expert's gate and up, the
    attention's F32 indexer rows with its Q, K and V; graph step 783), and 26 once the
    routed experts' down launch ran the shared expert's down GEMV (moe(pair=); graph step
    735), and 23 once each hyper-connection read's down GEMV ran in the launch that writes
    (or, after the PLE block, reads) the streams, its norm finished by hc_mix
    (triton_kernels.hc_down; graph step 638); and at 48 layers 588 once an attention
    layer's q and k norms, its rows' stores (and in a graph the block keys' pooling and the
    indexer queries' norm) took one launch (triton_kernels.attention_rows; graph step 602);
    and at 48 layers 516 once a DeltaNet layer's conv, inputs, recurrence and gated norm
    took one launch (triton_kernels.deltanet_decode; graph step 530). They only come down
    for the same file."""
    from strata.convert import flash_shape_memory as fsm
    from strata.load import Options, build, decide
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")  # the eager step (a graph replays its launches)
    g = fsm.flash_shape_memory(1, 65536)
    with fake_cuda():
        plan = decide(g, Options(device="cuda", kernels="triton", dtype=torch.bfloat16, gpu_mem_gib=140.0,
                                 ram_gib=64, vram_reserve_mib=0))
        assert plan.experts.tier == "device", plan.lines(False)
        model = build(plan)
        state = model.new_cache(8)
        trace(lambda: model(torch.tensor([1]), state))
        t = trace(lambda: model(torch.tensor([4]), state))
    print(f"\nflash-shape:1 on fake CUDA (bf16, Triton, experts device): decode: {t.line(1)}")
    assert t.launches <= 21 and t.triton["_quantize_x_kernel"] <= 2, (t.line(1), t.triton)
    assert t.triton["_hc_down_kernel"] == 3 and "_norm_kernel" not in t.triton, t.triton


@pytest.fixture
def strata_chunks(monkeypatch):
    """DeltaNet's prompts through Strata's chunks, as where fla-core is absent: fla's
    kernels run on a real GPU only (a fake one has no device to enter)."""
    monkeypatch.setattr(deltanet_fla, "fla_installed", lambda: False)
    deltanet_fla._path.cache_clear()
    yield
    deltanet_fla._path.cache_clear()  # (before monkeypatch puts fla_installed back)


@pytest.mark.slow
def test_flash_next_shapes_prompt_and_graph_step_compile_for_the_gpus(strata_chunks):
    """pp512 and the step a GPU then replays at Flash-Next's real widths (flash-shape:4:
    DeltaNet layers, the PLE block, a QSA attention layer, the MoE over 512 experts: the
    prompt's GEMMs, the decode's int8 kernels), traced on fake CUDA with their launches
    recorded, then every kernel compiled for sm_89 (the RTX 4090), sm_90, gfx942 and
    gfx1100 (RDNA3) as those launches ask: none fails, none spills, none asks for more
    shared memory than a program gets. (hc_mix's whole tile spilled 8 bytes a thread at 4
    warps here, which flash-tiny's widths never showed; qsa_select's row of a 513-token
    context, 257 blocks all kept, at 4 warps spilled 8 bytes on sm_89 and sm_90, which a
    one-token state's never showed; the MoE prefill, handed float32 x by the expert store,
    multiplied float32 rows, TF32 on NVIDIA and float32 FMAs on RDNA3, whose WMMA takes
    none, where IQ3_XXS's gate/up spilled 524 bytes: its dots now take the model's bf16.)
    DeltaNet's prompt runs Strata's chunks, as where fla-core is absent."""
    from strata.convert import flash_shape_memory as fsm
    results = _graph_step_compiled(fsm.flash_shape_memory(4, 65536), {"ple_mix", "qsa_attention", "moe", "hc_mix"},
                                   prompt=512, targets=("sm_89", "sm_90", "gfx942", "gfx1100"))
    assert {"_gemm_units_kernel", "_gate_up_units_kernel", "_select_kernel"} <= {r.kernel for r in results}
    # the MoE prefill's rows (x into gate/up, h into down) and its dots in the model's bf16
    dots = [r for r in results if r.kernel in ("_gate_up_units_kernel", "_down_units_kernel")]
    for r in dots:
        sig = json.loads(r.signature)
        assert sig["h_ptr"] == "*bf16" and sig.get("x_ptr", "*bf16") == "*bf16", (r.kernel, sig)
        assert "'DOT_DTYPE': triton.language.bfloat16" in r.constexprs, (r.kernel, r.constexprs)
    assert {r.kernel for r in dots} == {"_gate_up_units_kernel", "_down_units_kernel"}
    print(f"\nflash-shape:4 pp512 and graph step: {len(results)} kernels compiled, max registers "
          f"{max(r.regs for r in results if r.target == 'sm_90')} and shared memory "
          f"{max(r.shared_bytes for r in results if r.target == 'sm_90')} B on sm_90")


@pytest.mark.slow
def test_flash_next_shapes_graph_step_over_an_expert_cache_compiles_for_the_gpus():
    """The same step with the experts in a cache of VRAM slots over host RAM (a 3 GiB
    budget: gpu_check.sh's --gpu-mem 24 at 4 layers): the router's launch then looks the
    experts up in the slot table and counts hits and misses (LOOKUP), and the MoE reads a
    miss where it lies. Compiled for sm_89, sm_90 and gfx942: none fails, spills or asks
    for more shared memory than a program gets. (On gfx942 the router's noinline routing
    takes a 12-byte call frame there, arguments past the calling convention's VGPRs, which
    is not a spill: static._gcn_resources.)"""
    from strata.convert import flash_shape_memory as fsm
    results = _graph_step_compiled(fsm.flash_shape_memory(4, 65536), {"router_gemv", "moe"}, gpu_mem_gib=3.0,
                                   targets=("sm_89", "sm_90", "gfx942"), plan="experts: cache:")
    lookup = [r for r in results if r.kernel.startswith("_router_gemv") and "'LOOKUP': True" in r.constexprs]
    assert {r.target for r in lookup} == {"sm_89", "sm_90", "gfx942"}, [(r.kernel, r.target) for r in results]


@pytest.mark.slow
def test_flash_tinys_graph_step_compiles_for_the_gpus_without_spills(flash_tiny_gguf):
    """flash-tiny's graph step (its float weights: the float GEMVs, the MoE's per-weight
    kernels with the shared expert's gated down GEMV in the down launch, hc_down's float
    GEMV) compiled for sm_90 and gfx942 as its launches ask: none fails, none spills."""
    results = _graph_step_compiled(flash_tiny_gguf, {"moe", "hc_down", "hc_mix"})
    assert {"_hc_down_kernel", "_down_kernel"} <= {r.kernel for r in results}


def _graph_step_compiled(g, ops: set, prompt: int = 1, targets=("sm_90", "gfx942"), gpu_mem_gib: float = 140.0,
                         plan: str = "") -> list:
    """A prompt of `prompt` tokens, then the graph step, of the model in `g` on fake CUDA
    (_recorded), their launches (the step's at least `ops`) compiled for `targets`: every
    kernel compiled, none spilling, each within the target's shared memory
    (Compiled.problems)."""
    from triton_kernels.analysis.launches import compile_calls
    step, before = _recorded(g, prompt, gpu_mem_gib, plan)
    assert ops <= {c["op"] for c in step}, {c["op"] for c in step}
    # (a one-token prompt is the same step's warm-up: the same kernels)
    results = compile_calls(step + before if prompt > 1 else step, targets)
    bad = [f"{r.kernel} on {r.target}: {r.problems}" for r in results if r.problems]
    assert results and not bad, bad
    return results


def _recorded(g, prompt: int = 1, gpu_mem_gib: float = 140.0, plan: str = "") -> tuple[list, list]:
    """(the graph step's launches, the prompt's) of the model in `g` on fake CUDA (bf16,
    Triton; a GPU of `gpu_mem_gib`, whose plan line says `plan`): a prompt of `prompt`
    tokens, then one token's step, which replays the state's decode graph."""
    from strata.load import Options, build, decide
    from triton_kernels.analysis.launches import record
    with fake_cuda():
        model = build(decide(g, Options(device="cuda", kernels="triton", dtype=torch.bfloat16, gpu_mem_gib=gpu_mem_gib,
                                        ram_gib=64, vram_reserve_mib=0)))
        assert plan in model.plan_line(), model.plan_line()
        state = model.new_cache(prompt + 8)
        with record() as before:
            trace(lambda: model(torch.arange(prompt) % 1000 + 1, state))
        with record() as step:
            trace(lambda: model(torch.tensor([4]), state))
    assert state.graphs, "the one-token step ran eagerly"
    return step, before


@pytest.mark.slow
def test_flash_tinys_prompt_and_step_compile_for_an_rdna3_card(flash_tiny_gguf, strata_chunks):
    """A 64-token prompt (the GEMMs, the MoE's tl.dot prefill) and the graph step of
    flash-tiny compile for gfx1100 (Radeon PRO W7900, RX 7900: 32-lane waves, WMMA) as
    their launches ask, with no spill and within its shared memory. Before
    qmatmul.dot_types every tl.dot kernel failed there (its 16-bit dots asked for TF32,
    which Triton's AMD backend takes on gfx942 alone), and the QSA scores spilled 68 bytes
    at CDNA's 4 warps (configs' "rdna" family takes 8). Flash-Next's widths are held there by the test
    above; RDNA3's prompt kernels' spills are left in other formats (test_static.RDNA_PROMPT_OPS)."""
    results = _graph_step_compiled(flash_tiny_gguf, {"moe", "qsa_scores"}, prompt=64, targets=("gfx1100",))
    assert {"_gemm_kernel", "_gate_up_kernel", "_down_kernel", "_qsa_scores_kernel"} <= {r.kernel for r in results}
    # its float experts take the dot path in decode too: a prompt's rows rounded to bf16
    # before the launch, a decode's in the kernel; the SwiGLU product and the dots bf16
    dots = [r for r in results if r.kernel in ("_gate_up_kernel", "_down_kernel")]
    assert {json.loads(r.signature).get("x_ptr") for r in dots} == {"*bf16", "*fp32", None}, dots
    assert all(json.loads(r.signature)["h_ptr"] == "*bf16" and "'DOT_DTYPE': triton.language.bfloat16"
               in r.constexprs for r in dots), dots
    print(f"\nflash-tiny on gfx1100: {len(results)} kernels compiled, max registers {max(r.regs for r in results)}")
