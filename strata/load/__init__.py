"""Loading a model: `decide` makes the LoadPlan (strata.load.plan), `build` makes the
model from it with the architecture's loader, `load_model` does both."""
from __future__ import annotations

import torch

from strata.gguf import GGUFError, GGUFFile, open_gguf
from triton_kernels import backend, invariant

from .plan import ExpertChoice, LoadPlan, Options, PleChoice, decide

LOADERS = ("llama", "qwen4exp")


def build(plan: LoadPlan):
    """The model `plan` describes, built by its architecture's loader."""
    if plan.arch not in LOADERS:
        raise GGUFError(f"{plan.gguf.path}: architecture {plan.arch!r} is not supported "
                        f"(supported: {', '.join(LOADERS)})")
    backend.check_current(plan.device)
    if plan.options.threads:
        torch.set_num_threads(plan.options.threads)
    if plan.options.batch_invariant is not None:  # process-wide, as the thread count
        invariant.set_enabled(plan.options.batch_invariant)
    if plan.arch == "llama":
        from .llama import build as build_arch
    else:
        from .qwen4exp import build as build_arch
    model = build_arch(plan)
    model.max_context = plan.context  # what a sequence may hold: the server's bound
    bad = plan.check(model)
    if bad:  # what the engine says it chose is what it did, or it stops here
        raise RuntimeError(f"{plan.gguf.path}: the loaded model differs from its plan: {'; '.join(bad)}")
    return model


def load_model(path_or_file, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
               kernels: str | None = None, **options):
    """The model of a GGUF file (a path or an opened GGUFFile) on `device`, its ops run by
    `kernels` ("triton" or "torch"; None: the device's default); `options`: the rest of
    strata.load.Options (qsa, experts, ple_io, ...)."""
    g = path_or_file if isinstance(path_or_file, GGUFFile) else open_gguf(path_or_file)
    return build(decide(g, Options(dtype=dtype, device=device, kernels=kernels, **options)))


__all__ = ["ExpertChoice", "LoadPlan", "Options", "PleChoice", "build", "decide", "load_model"]
