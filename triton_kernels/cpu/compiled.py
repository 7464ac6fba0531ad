"""torch.compile on the CPU path: when it runs, and one way to fail.

    f = Compiled(fn, "the int8-code matmul")
    y = f(*args)          # None: not compiled now (the caller runs its eager code)

When (triton_kernels.backend.cpu_compile_mode, STRATA_CPU_COMPILE):
- `on`: every Compiled compiles at its first call, in the caller's thread;
- `auto` (the default): nothing compiles in the caller's thread. A command that decodes
  long enough with plain decode steps (strata.runtime.background; batch-invariant steps,
  by default those of a model with a draft head, are never compiled) calls
  `background(warm)`: a daemon thread runs `warm` (the model's step on a scratch state,
  strata.runtime.cpu_step.warm and strata.models.qwen4exp_step.warm), which compiles every
  piece while the caller decodes eagerly, and the caller's calls take the compiled pieces
  once all are built. Dynamo and Inductor cost seconds to import and tens of
  seconds to compile on 2 cores (the Inductor cache makes a later process's compile
  cheaper, not free), which a short command never earns back: it stays eager;
- `off`: never.

A compile that fails (no C++ compiler) warns once and the callers' eager code runs from
then on.
"""
from __future__ import annotations

import threading
import time
import warnings
from typing import Callable

import torch

from ..backend import cpu_compile_mode

# why a compile failed, once for all: a missing compiler fails every function alike
broken: list[str] = []

# auto mode: the background compile's state
_ready = threading.Event()
_local = threading.local()
_lock = threading.Lock()
_started: list[float] = []       # when the background compile started (perf_counter)
_took: list[float] = []          # and its seconds, once done


def available() -> bool:
    """Whether a Compiled runs compiled now (in this thread): asked for, not failed, and in
    auto mode built by the background compile (or on that compile's own thread)."""
    if broken:
        return False
    mode = cpu_compile_mode()
    if mode == "on":
        return True
    if mode == "off":
        return False
    return _ready.is_set() or warming()


def warming() -> bool:
    """Whether this thread is the background compile's (its scratch steps count nothing)."""
    return getattr(_local, "warming", False)


def background(warm: Callable[[], bool], what: str) -> threading.Thread | None:
    """Auto mode: run `warm` on a daemon thread with compiles on in that thread only; once it
    returns True (it built the step), `available()` is true everywhere. None where nothing
    starts: compiles on (they happen at the first call), off, failed, or already started."""
    if cpu_compile_mode() != "auto" or broken:
        return None
    with _lock:
        if _started:
            return None
        _started.append(time.perf_counter())

    def run():
        _local.warming = True
        try:
            built = warm()
        except Exception as e:  # noqa: BLE001 - a compile's failure: eager from now on, as Compiled does
            _fail(what, e, stacklevel=2)
            return
        if built and not broken:  # else nothing was built, and the caller stays eager
            _took.append(time.perf_counter() - _started[0])
            _ready.set()

    t = threading.Thread(target=run, name="strata-compile", daemon=True)
    t.start()
    return t


def ready_line() -> str | None:
    """The one-time cost of the background compile, once it is done (None before)."""
    if not _took:
        return None
    return f"compiled CPU decode ready {_took[0]:.1f} s after it started in the background; the steps after it ran compiled"


def reset() -> None:
    """Forget a background compile (tests: each starts from eager)."""
    _ready.clear()
    _started.clear()
    _took.clear()


def _fail(what: str, e: Exception, stacklevel: int) -> None:
    broken.append(f"{type(e).__name__}: {e}")
    warnings.warn(f"torch.compile failed for {what} ({broken[0][:200]}); running the CPU path "
                  "eagerly from now on (slower, the same results within the stated bounds; "
                  "STRATA_CPU_COMPILE=0 skips the attempt)", RuntimeWarning, stacklevel=stacklevel + 1)


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
            with _lock:  # the background compile and the caller may come here at once
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
            if warming():
                raise  # background(): one warning, from there
            _fail(self.what, e, stacklevel=2)
            return None
