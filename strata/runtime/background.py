"""Which runs build the CPU's compiled decode, in the background (triton_kernels.cpu.compiled).

On 2 cores the compiles cost seconds with Inductor's cache warm and tens of seconds cold,
and a compiled step saves some 10 ms a token (SmolLM2: 48.9 against 32.8 tok/s): it earns
its compile back only past several hundred tokens, which a short `generate` or a chat turn
does not reach. So by default (STRATA_CPU_COMPILE=auto) a run compiles on a thread beside
its eager decode only where the process will decode long with plain steps: a chat session
(it compiles while the first line is typed), a server, a `generate` of LONG_RUN tokens or
more, each of a model whose decode steps are not batch-invariant (by default those of a
model with an MTP head are, so that greedy --spec keeps --spec 0's tokens, and those run
eagerly; --no-batch-invariant turns that off).
"""
from __future__ import annotations

from strata.runtime.spec import can_draft
from triton_kernels import invariant
from triton_kernels.cpu import compiled

# a generate's token budget from which its compile may pay (about a minute of eager decode
# on 2 cores, against 10-45 s of compiles; their thread slows the eager steps beside it)
LONG_RUN = 1024


def compile_in_background(model, tokens: int | None = None):
    """Start `model`'s compiled CPU decode on a thread, where it can pay: on the CPU, in one
    process, decode steps not batch-invariant (the compiled steps are plain: a model without
    a draft head, or STRATA_BATCH_INVARIANT=0 / --no-batch-invariant), and `tokens` (a run's
    budget; None: open-ended, a chat or a server) of at least LONG_RUN. Returns the thread,
    or None."""
    from strata import dist
    warm = getattr(model, "warm_compile", None)
    invariant_steps = invariant.setting() is True or (invariant.decode_steps() and can_draft(model))
    if (warm is None or model.device.type != "cpu" or dist.comm() is not None or invariant_steps
            or (tokens is not None and tokens < LONG_RUN)):
        return None
    return compiled.background(warm, f"the compiled decode of {type(model).__name__}")
