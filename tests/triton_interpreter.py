"""The Triton interpreter without its repeated patching: a third of the suite's kernel time.

A launch under TRITON_INTERPRET=1 patches triton.language (its builtins, tensor methods,
range, reduce, ...) with the interpreter's versions, runs every program, and restores them.
Every call of a @triton.jit *device* function (a format's decode, dot_units, dp4a, ...)
patches again, from scratch (`inspect.getmembers` over the module), although the launch
has already patched the same modules and the second patch changes nothing: the builtins
are wrapped already, and the rest is set to equal closures. The MoE dp4a kernels make
about 1,500 such calls a program; their patching was 30-35% of the interpreter's time.

`install()` skips a device function's patch while a launch that patched the same modules
runs; a launch itself, or a device function whose module holds another language module,
patches as before. It also remembers the numpy dtype of each Triton dtype: the interpreter
builds a 16-entry dict to look one up on every tensor it makes (about 60,000 times a MoE
launch; 6-10% of the MoE dp4a kernels' time). What the kernels compute does not change (the
same wrapped functions run, the same dtypes are found); a Triton release without these
internals is left alone (the suite is then slower).
"""
from __future__ import annotations

import functools
import inspect
import threading


def install() -> bool:
    """Patch the interpreter in this process; False where its internals differ."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as ti
    except ImportError:
        return False
    executor = getattr(ti, "GridExecutor", None)
    if getattr(ti, "_strata_once", False):
        return True
    if not callable(getattr(ti, "_patch_lang", None)) or executor is None or not hasattr(ti, "InterpretedFunction"):
        return False
    patch_lang, run_grid = ti._patch_lang, executor.__call__
    state = threading.local()
    langs_of: dict = {}

    class _Unpatched:
        def restore(self):
            pass

    def langs(fn) -> frozenset:
        got = langs_of.get(fn)
        if got is None:
            got = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                           if inspect.ismodule(v) and v in (tl, tl.core))
        return got

    def once_per_launch(fn):
        launch = getattr(state, "launch", None)
        if launch is not None:
            if launch[0] is None:  # the launch's own patch, restored when it ends
                launch[0] = langs(fn)
            elif langs(fn) <= launch[0]:
                return _Unpatched()
        return patch_lang(fn)

    def launch(self, *args, **kwargs):
        held, state.launch = getattr(state, "launch", None), [None]
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            state.launch = held

    ti._patch_lang = once_per_launch
    executor.__call__ = launch
    np_dtype = getattr(ti, "_get_np_dtype", None)
    if callable(np_dtype):
        ti._get_np_dtype = _remembered(np_dtype)
    ti._strata_once = True
    return True


def _remembered(np_dtype):
    """np_dtype with its answers kept (Triton's dtypes are hashable values; one that is not
    is looked up as before)."""
    kept = functools.lru_cache(maxsize=None)(np_dtype)

    def lookup(tt_dtype):
        try:
            return kept(tt_dtype)
        except TypeError:
            return np_dtype(tt_dtype)
    return lookup
