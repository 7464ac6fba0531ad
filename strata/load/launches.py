"""A model's decode step as a GPU would run it, counted once: the plan's model loaded again
on fake CUDA tensors (strata.runtime.trace), its Triton launches stubbed and counted with
the torch ops that launch a kernel, on any machine. What `strata bench model` and the
`STRATA_DECODE_TIMING` lines print as the launches a step.

The traced load is the plan's: the same file (or model built in memory: its blocks are
never made, a fake device reads none), dtype and options, on device "cuda" with the
Triton kernels. The tiers are the plan's where it is a GPU's; a CPU plan's (dense or
blocks in the mapping) have no GPU twin, so the trace holds the experts and the PLE
table in VRAM (`device`, as the placement does when they fit). The second step from an
empty state is counted: the first also makes the launchers' constant tables (and a
Flash-Next state's decode graph, whose step is the one a GPU replays and is counted, run
as is on fake CUDA; with STRATA_CUDA_GRAPHS=0, or where the graph is not taken, the eager
step). A step of a llama model is counted eagerly (its CUDA graph replays the same
launches)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch


@dataclass
class StepLaunches:
    """What a traced decode step launches (`trace`: strata.runtime.trace.Trace), with the
    tiers it was traced with; or why it could not be traced (`error`)."""
    layers: int
    how: str
    trace: object = None
    error: str | None = None

    @property
    def launches(self) -> int | None:
        return self.trace.launches if self.trace is not None else None

    def line(self) -> str:
        if self.trace is None:
            return f"launches a decode step on a GPU: not traced ({self.error})"
        return f"a decode step on a GPU ({self.how}, traced on fake CUDA): {self.trace.line(self.layers)}"

    def short(self) -> str:
        """For a line a step: `790 launches a step (98.8 a layer)`."""
        if self.trace is None:
            return "launches a step: not traced"
        return f"{self.launches} launches a step on a GPU ({self.launches / max(self.layers, 1):.1f} a layer, traced)"


@contextlib.contextmanager
def _eager_step():
    saved = os.environ.get("STRATA_CUDA_GRAPHS")
    os.environ["STRATA_CUDA_GRAPHS"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["STRATA_CUDA_GRAPHS"]
        else:
            os.environ["STRATA_CUDA_GRAPHS"] = saved


def count_launches(plan) -> StepLaunches:
    """The launches of a decode step of the model `plan` (a strata.load.LoadPlan) describes,
    traced as above; a step that reads the device on the host (a drive tier's host step)
    or a model the trace cannot load says why instead of a count."""
    from strata.runtime.trace import HostRead, fake_cuda, trace

    from . import build, decide
    o, gpu = plan.options, torch.device(plan.device).type == "cuda"
    experts = (plan.experts.tier if gpu else "device") if plan.experts is not None else None
    ple_io = (plan.ple.mode if gpu else None) if plan.ple is not None else None
    traced = dataclasses.replace(o, device="cuda", kernels="triton", experts=experts, ple_io=ple_io,
                                 threads=None, batch_invariant=None)
    how = ", ".join(filter(None, [str(plan.dtype).replace("torch.", ""), "Triton kernels",
                                  experts and f"experts {experts}",
                                  plan.ple is not None and f"PLE {ple_io or 'in memory'}"
                                  + (" on the host" if gpu and plan.ple is not None and plan.ple.host else "")]))
    layers = int(plan.gguf.get(f"{plan.arch}.block_count", 0) or 0)
    if plan.layout is not None:  # a traced step's collectives would wait for ranks that trace nothing
        return StepLaunches(layers, how, error="several processes (--ep/--pp): a step is traced in one")
    threads = torch.get_num_threads()
    try:
        # Flash-Next's step as the GPU takes it (its graph's where it holds one); llama's eager
        with fake_cuda(), (contextlib.nullcontext() if plan.arch == "qwen4exp" else _eager_step()):
            p = decide(plan.gguf, traced)
            if gpu and plan.ple is not None and p.ple is not None:  # a table the placement left on the host
                p.ple = dataclasses.replace(p.ple, host=plan.ple.host)
            model = build(p)
            state = model.new_cache(8)
            trace(lambda: model(torch.tensor([1]), state))
            t = trace(lambda: model(torch.tensor([4]), state))
        if getattr(state, "graphs", None):
            how += ", its CUDA graph's step"
        return StepLaunches(layers, how, t)
    except HostRead as e:
        return StepLaunches(layers, how, error=f"the step reads the host: {e}")
    except Exception as e:  # the trace measures; it never stops the command that asked
        return StepLaunches(layers, how, error=f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        torch.set_num_threads(threads)
