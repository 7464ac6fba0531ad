"""A prompt's gated delta rule through fla-core's chunked Triton kernels
(flash-linear-attention, the optional extra `strata-engine[cuda]`), in Strata's layouts:

    deltanet_chunk_fla(q, k, v, g, beta, state) -> o
        q, k (T, Hv, dk) (q already L2-normed and scaled by dk^-1/2, k L2-normed),
        v (T, Hv, dv), g (T, Hv) the log of the decay, beta (T, Hv) after its sigmoid;
        state (Hv, dk, dv) float32, updated to the last token's; o (T, Hv, dv)

fla's layouts are Strata's with a batch of one in front: q, k [B, T, H, K], v [B, T, HV,
V], g and beta [B, T, HV], states [N, HV, K, V] float32. The arguments are given as
Strata's own recurrence takes them: q and k normed and repeated to the value heads by
triton_kernels.deltanet_inputs (fla's grouped heads pair value head h with key head
h // (HV / H), llama.cpp's files with h % H: see strata.nn.deltanet), the scale 1 (q
holds it), the gate and beta's sigmoid applied. So fla's kernels do only the recurrence,
the same math as strata.nn.deltanet.chunked.

Tokens taken one by one (a decode's, a verify's rows and their replay) run Strata's kernel
whether fla-core is installed or not: one launch for the conv, the inputs, the recurrence
and the gated norm (triton_kernels.deltanet_decode), where fla's fused-recurrent kernel
is the recurrence alone.

`deltanet_path(device, kernels)` is the one place that chooses fla-core or Strata's own
kernels for a prompt, and says why (the load's plan prints it).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from .deltanet import check_inputs

FLA_VERSION = "0.6.0"


@functools.cache
def fla_installed() -> bool:
    """fla-core installed (its import is slow: it is not imported to answer this)."""
    return importlib.util.find_spec("fla") is not None


@functools.cache
def fla_import_error() -> str | None:
    """Why fla-core's gated delta rule kernels, installed, do not import (a dependency
    missing: wheels installed with --no-deps; a Triton it does not take), or None. Asked
    only where a load would run them, which imports them anyway."""
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:  # noqa: BLE001 - any failure of a third party's import falls back, saying why
        return f"{type(e).__name__}: {str(e)[:160]}"
    return None


def deltanet_path(device, kernels: str) -> tuple[str, str]:
    """("fla-core" or "strata", why): the DeltaNet recurrence's kernels for a load's prompts."""
    return _path(device.type if isinstance(device, torch.device) else torch.device(device).type, kernels)


@functools.cache  # asked by every DeltaNet layer's forward
def _path(device_type: str, kernels: str) -> tuple[str, str]:
    if device_type != "cuda" or kernels != "triton":
        return "strata", f"{kernels} kernels on {device_type}"
    if not fla_installed():
        return "strata", ("one launch a token, torch chunks for prefill: fla-core not installed "
                          "(pip install strata-engine[cuda])")
    broken = fla_import_error()
    if broken is not None:
        return "strata", (f"one launch a token, torch chunks for prefill: fla-core is installed but does not "
                          f"import ({broken})")
    return "fla-core", f"fla-core {FLA_VERSION} chunked for prefill, Strata's one launch a token"


def chunk_arguments(q, k, v, g, beta, state: torch.Tensor) -> dict:
    """fla's chunk_gated_delta_rule's arguments for Strata's (T, Hv, ...) tensors: a batch
    of one, the state as its one sequence's initial state, scale 1 (q holds it)."""
    check_inputs(q, k, v, g, beta, state, "deltanet_chunk_fla")
    q, k, v, g, beta = (x.unsqueeze(0).contiguous() for x in (q, k, v, g, beta))
    return dict(q=q, k=k, v=v, g=g, beta=beta, scale=1.0, initial_state=state.unsqueeze(0),
                output_final_state=True, use_qk_l2norm_in_kernel=False)


def deltanet_chunk_fla(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """T tokens through fla's chunked kernels (prefill); `state` updated to the last's."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    o, final = chunk_gated_delta_rule(**chunk_arguments(q, k, v, g, beta, state))
    state.copy_(final[0])
    return o[0]
