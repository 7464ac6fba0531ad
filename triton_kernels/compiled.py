"""torch.compile on the CPU path, with one way to fail: a missing C++ compiler (or any
compile error) warns once and the callers' eager code runs from then on.

    f = Compiled(fn, "the int8-code matmul")
    y = f(*args)          # None: not compiled (STRATA_CPU_COMPILE=0, or a compile failed)
"""
from __future__ import annotations

import warnings

import torch

from .backend import cpu_compile

# why a compile failed, once for all: a missing compiler fails every function alike
broken: list[str] = []


def available() -> bool:
    """Whether the CPU path compiles now: asked for (STRATA_CPU_COMPILE) and not failed."""
    return cpu_compile() and not broken


class Compiled:
    def __init__(self, fn, what: str, symbolic: dict[int, int] | None = None, recompiles: int = 8, **options):
        """`fn` compiled lazily, on its first call (importing Dynamo and Inductor takes
        seconds); `what` names it in the warning; `symbolic`: {argument index: dimension}
        sizes kept symbolic from the first compile; `recompiles`: the compiles dynamo may
        keep for fn's code (its default is 8); `options`: torch.compile's."""
        self.fn, self.what, self.symbolic, self.recompiles, self.options = fn, what, symbolic or {}, recompiles, options
        self.compiled = None

    def __call__(self, *args):
        if not available():
            return None
        if self.compiled is None:
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, self.recompiles)
            self.compiled = torch.compile(self.fn, fullgraph=True, **self.options)
        for i, dim in self.symbolic.items():
            if args[i] is not None:
                torch._dynamo.maybe_mark_dynamic(args[i], dim)
        try:
            return self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - no C++ compiler and the like: the eager path is the same math
            broken.append(f"{type(e).__name__}: {e}")
            warnings.warn(f"torch.compile failed for {self.what} ({broken[0][:200]}); running the CPU path "
                          "eagerly from now on (slower, the same results within the stated bounds; "
                          "STRATA_CPU_COMPILE=0 skips the attempt)", RuntimeWarning, stacklevel=3)
            return None
