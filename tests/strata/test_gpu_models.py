"""SmolLM2 on a GPU with the Triton kernels against the torch path on the CPU (run by
scripts/gpu_check.sh; skipped without a GPU). Float32 on both sides; the bound and its
reason are test_gpu_path's: the decode kernels' int8 activations, here over all 30 layers,
prefill through the GEMV paths and decode through the captured graph."""
from __future__ import annotations

import pytest
import torch

from strata.load import load_model

REL = 3e-2


def _rel(a, b) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


@pytest.mark.cuda(ci="CI runs SmolLM2 with the Triton kernels through the interpreter against the torch "
                     "path (tests/strata/test_gpu_path.py) and its decode graph (tests/strata/test_graphs.py)")
def test_smollm2_on_the_gpu_gives_the_torch_logits(smollm2_gguf):
    ref = load_model(smollm2_gguf, dtype=torch.float32, kernels="torch")
    got = load_model(smollm2_gguf, dtype=torch.float32, device="cuda")
    assert got.kernels == "triton"
    cr, cg = ref.new_cache(32), got.new_cache(32)
    toks, rels = [1, 504, 3458, 314, 2113, 28], []
    for _ in range(5):  # the prompt, then four decode steps (replayed from the graph)
        a = ref(toks, cr, last_only=True)[-1]
        b = got(toks, cg, last_only=True)[-1]
        rels.append(_rel(b, a))
        assert int(b.argmax()) == int(a.argmax()), rels
        toks = [int(a.argmax())]
    print("SmolLM2, CUDA against the CPU's torch path:", rels)
    assert getattr(cg, "graph", None) is not None  # decode went through the graph
    assert max(rels) <= REL, rels


@pytest.mark.cuda(ci="CI traces these decode steps on fake CUDA, where any host read raises "
                     "(tests/strata/test_trace.py, test_graphs_qwen4exp.py), and runs flash-tiny's Triton "
                     "kernels through the interpreter against the torch path (test_gpu_path.py)")
@pytest.mark.parametrize("experts, ple_io", [("device", None), ("cache:16:host", "ram")])
@pytest.mark.parametrize("graphs", ["1", "0"])
def test_flash_tiny_decodes_on_the_gpu_without_waiting_for_it(flash_tiny_gguf, experts, ple_io, graphs, monkeypatch):
    """Decode steps (the captured graph's replays, and the eager step) under
    torch.cuda.set_sync_debug_mode("error"): a host read of device data or a copy that
    waits for the GPU raises inside a step. The first two steps (the graph's capture, the
    cache's first fills) run before the mode is set. The tokens are the CPU torch path's,
    greedy; the bound on the logits is test_gpu_path's."""
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", graphs)
    ref = load_model(flash_tiny_gguf, dtype=torch.float32, kernels="torch")
    got = load_model(flash_tiny_gguf, dtype=torch.float32, device="cuda", experts=experts, ple_io=ple_io)
    cr, cg = ref.new_cache(), got.new_cache()
    toks, rels = [1, 504, 3458, 314], []
    for step in range(6):
        a = ref(torch.tensor(toks), cr)[-1]
        x = torch.tensor(toks)  # on the host, as the engine passes them
        torch.cuda.synchronize()
        if step >= 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            b = got(x, cg)[-1]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        rels.append(_rel(b, a))
        assert int(b.argmax()) == int(a.argmax()), rels
        toks = [int(a.argmax())]
    print(f"flash-tiny on the GPU ({experts}, graphs {graphs}), CUDA against the CPU's torch path:", rels)
    assert max(rels) <= REL, rels
    caches = [dc for layer in got.layers if (dc := getattr(layer.moe.experts, "device_cache", None)) is not None]
    if experts.startswith("cache"):  # the promotions' side-stream copies, published between steps
        torch.cuda.synchronize()
        assert caches and sum(dc.promotions for dc in caches) > 0
        for dc in caches:  # every expert the device table maps: its slot holds its host bytes
            lut = dc.lut.cpu()
            for e in torch.nonzero(lut >= 0).flatten().tolist():
                assert all(torch.equal(w[int(lut[e])].cpu(), h[e]) for w, h in zip(dc.w, dc.host)), e
