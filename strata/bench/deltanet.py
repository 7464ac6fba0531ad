"""`strata bench kernels`' DeltaNet rows: a decode's token of one DeltaNet layer at
Qwen3.8-Flash-Next's heads (16 key heads, 48 value heads of 128, a conv of 4 taps),
graph-timed with the recurrent state read from copies past the L2 (strata.bench.cold: at
the real shape 36 layers hold 113 MB of states, read and written each token from device
memory), three ways: Strata's one launch (triton_kernels.deltanet_decode, the engine's),
the three launches it replaced with Strata's recurrence, and, where fla-core is installed,
with fla's fused recurrent kernel in the middle (the recurrence alone). GB/s are the
state's bytes read and written over the call's time, against the device copy; "= three
launches" says whether the one launch gave the three's bits on this device, "max rel err"
each way's rows against the one launch's (fla's recurrence sums in its own order).
"""
from __future__ import annotations

import numpy as np
import torch

from strata.bench import cold

HEADS = (16, 3, 128, 128, 4)  # key heads, value heads a key head, dk, dv, conv taps


def layer(rng: np.random.Generator, device="cuda", heads=HEADS) -> dict:
    """A token's projections and a layer's weights and state, as the engine holds them."""
    Hk, rep, dk, dv, K = heads
    Hv = Hk * rep
    C = 2 * Hk * dk + Hv * dv

    def f(*shape, s=1.0):
        return torch.from_numpy((rng.standard_normal(shape) * s).astype(np.float32)).to(device)
    qkv, z, b, a = f(1, C + Hv * dv + 2 * Hv).split([C, Hv * dv, Hv, Hv], dim=-1)
    a_coef = -torch.from_numpy(rng.uniform(1, 16, Hv).astype(np.float32)).to(device)
    return dict(window=f(C, K - 1), qkv=qkv, taps=f(C, K, s=0.5), b=b, a=a, dt_bias=torch.ones(Hv, device=device),
                a_coef=a_coef, k_heads=Hk, dk=dk, state=f(Hv, dk, dv, s=0.1), z=z, norm=f(dv), eps=1e-6)


def ways(p: dict) -> list[tuple[str, object]]:
    """(name, fn(state) -> the output projection's rows) for each way a token runs."""
    from triton_kernels.deltanet import deltanet_step
    from triton_kernels.deltanet_decode import deltanet_decode
    from triton_kernels.deltanet_fla import deltanet_path
    from triton_kernels.deltanet_inputs import deltanet_conv_inputs, deltanet_gated_norm
    w, Hk, dk = p["window"], p["k_heads"], p["dk"]
    inputs = (p["qkv"], p["taps"], p["b"], p["a"], p["dt_bias"], p["a_coef"], Hk, dk)

    def one(s):
        return deltanet_decode(w, *inputs, s, p["z"], p["norm"], p["eps"], quantize=True, in_place=True)[0]

    def three(step):
        def run(s):
            q, k, v, g, beta, _ = deltanet_conv_inputs(w, *inputs, in_place=True)
            return deltanet_gated_norm(step(q, k, v, g, beta, s), p["z"], p["norm"], p["eps"], quantize=True)
        return run

    out = [("one launch (deltanet_decode)", one), ("three launches, Strata's recurrence", three(deltanet_step))]
    if deltanet_path(w.device, "triton")[0] == "fla-core":
        out.append(("three launches, fla-core's fused recurrent", three(_fla_in_place)))
    return out


def _fla_in_place(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token through fla-core's fused-recurrent kernel with the state as both its
    initial and its final state, updated in place as the engine ran it for decode before
    deltanet_decode (fla's wrapper writes a new final state: one more copy a token)."""
    import triton
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel
    Hv, dk, dv = state.shape
    o = torch.empty_like(v)
    bv = min(8, triton.next_power_of_2(dv))  # fla's own choice (fused_recurrent_gated_delta_rule_fwd)
    fused_recurrent_gated_delta_rule_fwd_kernel[(triton.cdiv(dv, bv) * Hv,)](
        q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=None, dt_bias=None, o=o, h0=state, ht=state,
        cu_seqlens=None, scale=1.0, T=1, H=Hv, HV=Hv, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=bv,
        IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=False, APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False,
        STATE_V_FIRST=False, num_warps=1, num_stages=3)
    return o


def rows(rng: np.random.Generator, copy: float, device="cuda", heads=HEADS) -> list[dict]:
    """The table's rows (see the module); `copy` the device copy's GB/s."""
    p = layer(rng, device, heads)
    state, window = p["state"], p["window"]
    Hv, dk, dv = state.shape
    runs = ways(p)
    w0, outs = window.clone(), []
    for _, fn in runs:  # each way once from the same state and window
        window.copy_(w0)
        s = state.clone()
        outs.append((fn(s), s, window.clone()))
    same = all(torch.equal(x, y) for x, y in zip(outs[0], outs[1]))
    one = outs[0][0]
    states = [(s,) for s in cold.cycled(state, cold.l2_bytes(device))]
    out = []
    for (how, fn), (rows_, _, _) in zip(runs, outs):
        ms = cold.graph_ms(fn, states)
        gbps = 2 * state.numel() * state.element_size() / (ms * 1e-3) / 1e9
        rel = float((rows_ - one).abs().max() / one.abs().max().clamp_min(1e-30))
        out.append({"op": f"deltanet token, {how}", "format": "F32", "layout": f"{Hv} heads {dk}x{dv}",
                    "us": ms * 1e3, "gb_per_s": gbps, "pct_copy": 100 * gbps / copy, "max_rel_err": rel})
    out[0]["bits_as_three"] = same
    return out
