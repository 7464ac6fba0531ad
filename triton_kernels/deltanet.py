"""The gated delta rule (Gated DeltaNet's recurrence) over T tokens, the state updated in
place, in one kernel:

    deltanet_step(q, k, v, g, beta, state) -> o
    q, k (Hv, dk); v (Hv, dv); g, beta (Hv,); state (Hv, dk, dv) float32, in place; o (Hv, dv)
    or with a leading token axis on q, k, v, g, beta and o: T tokens, one after another
    for each value head h and token:
        S     = exp(g_h) S                 the decay
        kv    = k_h^T S                    (dv)
        delta = beta_h (v_h - kv)
        S     = S + k_h delta^T            the delta rule's write
        o_h   = q_h^T S

deltanet_step_torch runs the same math as torch ops, some ten launches a token a
layer; here one program holds a (dk, BLOCK_V) tile of a head's state in registers from the
first token's decay to the last one's read-out. A token's arithmetic is the same whatever
T (the state stays float32 between tokens, in registers or in memory): T tokens at once
give T one-token calls' bits (a verify's rows are decode steps'). `deltanet_step_torch` is
that torch form, token by token. triton_kernels.deltanet_decode runs the same token
(`delta_token`, the same tile) inside the engine's one launch for its tokens, neither
fusing a multiply-add: this launch is its reference (tests) and a peer in its bench
(strata.bench.deltanet).
Float32 throughout; the kernel's sums over dk run in another order than torch's, so the
two agree within float32's summation bound (tests/triton_kernels/test_deltanet.py), not
bit for bit: a model takes one form (with the Triton kernels deltanet_decode's) for every
token of a sequence (decode and a verify's replay alike), never two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton

BLOCK_V = 32


@triton.jit
def _step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, T, H, DK: tl.constexpr, DV: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    tile = s_ptr + h * DK * DV + rk[:, None] * DV + rv[None, :]
    live = mk[:, None] & mv[None, :]
    s = tl.load(tile, mask=live, other=0.0)
    for t in range(T):
        th = t * H + h  # token t's head h
        s, o = delta_token(s, tl.load(q_ptr + th * DK + rk, mask=mk, other=0.0),
                           tl.load(k_ptr + th * DK + rk, mask=mk, other=0.0),
                           tl.load(v_ptr + th * DV + rv, mask=mv, other=0.0), tl.load(g_ptr + th),
                           tl.load(beta_ptr + th))
        tl.store(o_ptr + th * DV + rv, o, mask=mv)
    tl.store(tile, s, mask=live)


@triton.jit
def delta_token(s, q, k, v, g, beta):
    """One token of a head's recurrence on its state tile s [BK, BV]: (s after, o [BV])."""
    s = s * tl.exp(g)
    kv = tl.sum(s * k[:, None], axis=0)
    delta = (v - kv) * beta
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], axis=0)


def check_inputs(q, k, v, g, beta, state, op: str = "deltanet_step") -> None:
    """q, k (Hv, dk), v (Hv, dv), g, beta (Hv,) float32 for a contiguous float32 state
    (Hv, dk, dv); a leading token axis on all five where q has one (a chunk)."""
    Hv, dk, dv = state.shape
    lead = (q.shape[0],) if q.dim() == 3 else ()
    want = {"q": (q, (*lead, Hv, dk)), "k": (k, (*lead, Hv, dk)), "v": (v, (*lead, Hv, dv)),
            "g": (g, (*lead, Hv)), "beta": (beta, (*lead, Hv))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be float32 {shape} for a state of {tuple(state.shape)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"{op}: the state must be contiguous float32, got {state.dtype}")


def deltanet_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token of the recurrence, or T with a leading token axis, in one launch (see the
    module); `state` updated in place."""
    check_inputs(q, k, v, g, beta, state)
    if not use_triton(state):
        return deltanet_step_torch(q, k, v, g, beta, state)
    Hv, dk, dv = state.shape
    T = q.shape[0] if q.dim() == 3 else 1
    o = torch.empty(v.shape, dtype=torch.float32, device=state.device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if T:
        _step_kernel[(Hv, triton.cdiv(dv, BLOCK_V))](q, k, v, g.contiguous(), beta.contiguous(), state, o, T, Hv,
                                                     DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=BLOCK_V,
                                                     enable_fp_fusion=False)  # as deltanet_decode's
    return o


def deltanet_step_torch(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    check_inputs(q, k, v, g, beta, state)
    if q.dim() == 2:
        return delta_rule_token(q, k, v, g, beta, state)
    if q.shape[0] == 1:  # (no copy into `out`)
        return delta_rule_token(q[0], k[0], v[0], g[0], beta[0], state).unsqueeze(0)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        out[t] = delta_rule_token(q[t], k[t], v[t], g[t], beta[t], state)
    return out


def delta_rule_token(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """The torch form of one token, unchecked: deltanet_step_torch's step, which the torch
    kernels run for every token of every DeltaNet layer (the checks stay out of that loop;
    the model's shapes were checked at load)."""
    state.mul_(g.exp()[:, None, None])
    kv = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (state * q.unsqueeze(-1)).sum(dim=-2)
