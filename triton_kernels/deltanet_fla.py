"""The gated delta rule through fla-core's Triton kernels (flash-linear-attention, the
optional extra `strata-engine[cuda]`), in Strata's layouts:

    deltanet_step_fla(q, k, v, g, beta, state) -> o      as triton_kernels.deltanet's
        q, k (Hv, dk) (q already L2-normed and scaled by dk^-1/2, k L2-normed), v (Hv, dv),
        g (Hv,) the log of the decay, beta (Hv,) after its sigmoid; state (Hv, dk, dv)
        float32, updated in place; o (Hv, dv); or T tokens with a leading token axis
    deltanet_chunk_fla(q, k, v, g, beta, state) -> o     the same over T tokens:
        q, k (T, Hv, dk), v (T, Hv, dv), g, beta (T, Hv); o (T, Hv, dv)

fla's layouts are Strata's with a batch of one in front: q, k [B, T, H, K], v [B, T, HV,
V], g and beta [B, T, HV], states [N, HV, K, V] float32 (state_v_first=False). The
arguments are given as Strata's own recurrence takes them: q and k normed and repeated to
the value heads by triton_kernels.deltanet_inputs (fla's grouped heads pair value head h
with key head h // (HV / H), llama.cpp's files with h % H: see strata.nn.deltanet), the
scale 1 (q holds it), the gate and beta's sigmoid applied. So fla's kernels do only the
recurrence, the same math as strata.nn.deltanet.recurrent and .chunked.

The decode step calls fla's fused-recurrent kernel itself with the state as both its
initial and its final state: each program loads its own (dk, BV) tile before the loop and
stores it after, so the state is updated in place (a CUDA graph replays reads of the same
tensor) without fla's wrapper allocating a final state and a copy back. That reaches into
fla-core's module, so the extra pins its version (pyproject.toml).

`deltanet_path(device, kernels)` is the one place that chooses fla-core or Strata's own
kernels, and says why (the load's plan prints it).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util

import torch
import triton

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
        importlib.import_module("fla.ops.gated_delta_rule.fused_recurrent")
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as e:  # noqa: BLE001 - any failure of a third party's import falls back, saying why
        return f"{type(e).__name__}: {str(e)[:160]}"
    return None


def deltanet_path(device, kernels: str) -> tuple[str, str]:
    """("fla-core" or "strata", why): the DeltaNet recurrence's kernels for a load."""
    return _path(device.type if isinstance(device, torch.device) else torch.device(device).type, kernels)


@functools.cache  # asked by every DeltaNet layer's forward
def _path(device_type: str, kernels: str) -> tuple[str, str]:
    if device_type != "cuda" or kernels != "triton":
        return "strata", f"{kernels} kernels on {device_type}"
    if not fla_installed():
        return "strata", "Triton step, torch chunks for prefill: fla-core not installed (pip install strata-engine[cuda])"
    broken = fla_import_error()
    if broken is not None:
        return "strata", f"Triton step, torch chunks for prefill: fla-core is installed but does not import ({broken})"
    return "fla-core", f"fla-core {FLA_VERSION}: fused recurrent for decode, chunked for prefill"


def _fused_recurrent():
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel
    return fused_recurrent_gated_delta_rule_fwd_kernel


def deltanet_step_fla(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token through fla's fused-recurrent kernel, or T with a leading token axis in the
    same launch (its loop runs them one after another, the state in registers between:
    each token's arithmetic the one-token call's) (see the module); `state` in place."""
    check_inputs(q, k, v, g, beta, state, "deltanet_step_fla")
    Hv, dk, dv = state.shape
    T = q.shape[0] if q.dim() == 3 else 1
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    if not T:
        return o
    bv = min(8, triton.next_power_of_2(dv))  # fla's own choice (fused_recurrent_gated_delta_rule_fwd)
    _fused_recurrent()[(triton.cdiv(dv, bv) * Hv,)](
        q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=None, dt_bias=None, o=o, h0=state, ht=state,
        cu_seqlens=None, scale=1.0, T=T, H=Hv, HV=Hv, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=bv,
        IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=False, APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False,
        STATE_V_FIRST=False, num_warps=1, num_stages=3)
    return o


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
