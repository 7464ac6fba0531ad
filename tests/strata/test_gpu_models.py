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


@pytest.mark.cuda
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
