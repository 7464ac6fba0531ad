"""Gated DeltaNet (linear attention) with its causal conv, as Qwen3.5/Flash-Next use it.

Per token, for each value head with state S (dk, dv):

    S = S * exp(g);  S = S + k (beta * (v - S^T k))^T;  o = S^T q

with q, k L2-normalised (q also scaled by dk^-1/2), g = a_coef * softplus(a + dt_bias)
(the GGUF's ssm_a holds a_coef = -exp(A_log)) and beta = sigmoid(b). The recurrence's
op (GatedDeltaNet.recurrence) runs it token by token (decode); `chunked` runs the same recurrence 64 tokens at a time with the
WY/UT transform (prefill), as transformers' torch_chunk_gated_delta_rule. On CUDA,
`fla-core`'s chunked Triton kernels take a prompt's over when installed; with the Triton
kernels the tokens taken one by one (a decode's, a verify's rows and their replay) are one
launch (triton_kernels.deltanet_decode).

Head order: llama.cpp's converter stores the value heads "tiled" (value head j*Hk + k
belongs to key head k), so the key heads are repeated with `repeat`, not
`repeat_interleave`, and everything else follows the file's order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from triton_kernels import invariant
from triton_kernels.cpu.compiled import Compiled
from triton_kernels.conv import causal_conv_torch
from triton_kernels.deltanet_decode import deltanet_decode_torch
from triton_kernels.deltanet_fla import deltanet_chunk_fla, deltanet_path
from triton_kernels.ops import impl

from .linear import QuantLinear


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The recurrence over chunks of `chunk` tokens: q, k (T, Hv, dk); v (T, Hv, dv); g, beta
    (T, Hv); state (Hv, dk, dv), updated in place. Returns o (T, Hv, dv)."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # (H, T', d)
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))      # (H, T')
    n = (T + pad) // chunk
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    q, k, kb, vb = (x.reshape(H, n, chunk, -1) for x in (q, k, kb, vb))
    g = g.reshape(H, n, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (kb @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    # (I + strictly-lower(system)) is unit lower triangular: solve rather than invert
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    qd = q * g.exp().unsqueeze(-1)
    kd = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    last = g[..., -1].exp()[..., None, None]
    out = torch.empty(H, n, chunk, dv, dtype=q.dtype, device=q.device)
    s = state
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = qd[:, i] @ s + intra[:, i] @ v_new
        s = s * last[:, i] + kd[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(H, -1, dv)[:, :T].transpose(0, 1)


class _Trail:
    """What a verify forward leaves for `DeltaNetState.keep`: the state before it, the
    inputs of its rows (the conv's input qkv (T, C) first) and `replay(rows, n, window,
    rec)`, which runs the first n of them again on the state `rec` from the window before
    with the op that ran them (GatedDeltaNet.replay_of)."""

    def __init__(self, conv: torch.Tensor, rec: torch.Tensor):
        self.conv, self.rec = conv, rec
        self.rows = None
        self.replay = None


class DeltaNetState:
    """One sequence's conv window (conv_dim, K-1) and recurrent state (Hv, dk, dv).

    A speculative verify runs between `begin_all` and `keep(n)`: it may feed several drafted
    tokens, and `keep(n)` cuts the state back to its first n. The conv window is a slice of
    the window before and the rows' inputs (free); the recurrent state is the one before,
    with the recurrence replayed over the n kept rows on their recorded inputs (the same
    function on the same inputs as the verify: the state it passed through, bit for bit).
    Costs: one copy of the recurrent state per verify (the one before is kept), and on a
    rejection a replay of n token steps of the recurrence (no weights read)."""

    def __init__(self, conv_dim: int, kernel: int, heads: int, dk: int, dv: int, device="cpu"):
        self.conv = torch.zeros(conv_dim, kernel - 1, device=device)
        self.rec = torch.zeros(heads, dk, dv, device=device)
        self.trail: _Trail | None = None

    def copy(self) -> "DeltaNetState":
        c = DeltaNetState.__new__(DeltaNetState)
        c.conv, c.rec, c.trail = self.conv.clone(), self.rec.clone(), None
        return c

    @torch.inference_mode()
    def keep(self, n: int) -> None:
        """Keep the first n tokens of the verify since `begin`, as if only they had been fed."""
        t, self.trail = self.trail, None
        if t is None or t.rows is None:
            raise RuntimeError("DeltaNetState.keep: no verify forward since begin_all()")
        x = t.rows[0]
        if n == x.shape[0]:
            return
        span = t.conv.shape[1]
        self.conv.copy_(torch.cat([t.conv, x.T], dim=1)[:, n:n + span])
        self.rec.copy_(t.rec)
        t.replay(t.rows, n, t.conv, self.rec)


def begin_all(states: list[DeltaNetState]) -> None:
    """The next forward is a verify: each state keeps what its `keep` needs to cut it back,
    copies of its tensors (which stay where they are, as a decode graph reads them), all
    written by one foreach copy (on a GPU a launch or two, where each clone was one)."""
    held = [t for s in states for t in (s.conv, s.rec)]
    copies = [torch.empty_like(t) for t in held]
    if held:
        torch._foreach_copy_(copies, held)
    for s, conv, rec in zip(states, copies[0::2], copies[1::2]):
        s.trail = _Trail(conv, rec)


def causal_conv(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dilation: int = 1, step=None,
                in_place: bool = False):
    """Depthwise causal conv of x (T, C) with taps w (C, K), continuing `window` (C, (K-1)*d)
    of earlier inputs; returns (output (T, C), the new window). `step`: the GPU path's op
    (triton_kernels.conv: one launch, the same sums bit for bit), which with `in_place`
    writes the new window over `window` (a decode graph's buffer)."""
    if step is not None:
        return step(window, x, w, dilation, in_place=in_place)
    return causal_conv_torch(window, x, w, dilation)


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, proj: QuantLinear, out: QuantLinear, conv: torch.Tensor, dt_bias: torch.Tensor,
                 a_coef: torch.Tensor, norm: torch.Tensor, k_heads: int, v_heads: int, dk: int, dv: int,
                 eps: float):
        """`proj` is the fused input projection: rows of qkv (2*Hk*dk + Hv*dv), the output
        gate z (Hv*dv), beta's b (Hv) and the decay's a (Hv), in that order."""
        super().__init__()
        self.proj, self.out = proj, out
        self.conv = torch.nn.Parameter(conv.float(), requires_grad=False)    # (conv_dim, K)
        self.dt_bias = torch.nn.Parameter(dt_bias.float(), requires_grad=False)
        self.a_coef = torch.nn.Parameter(a_coef.float(), requires_grad=False)
        self.norm = torch.nn.Parameter(norm.float(), requires_grad=False)
        self.k_heads, self.v_heads, self.dk, self.dv, self.eps = k_heads, v_heads, dk, dv, eps

    def new_state(self, device="cpu") -> DeltaNetState:
        return DeltaNetState(self.conv.shape[0], self.conv.shape[1], self.v_heads, self.dk, self.dv, device)

    def forward(self, x: torch.Tensor, st: DeltaNetState) -> torch.Tensor:
        T = x.shape[0]
        Hk, Hv, dk, dv = heads = self.k_heads, self.v_heads, self.dk, self.dv
        qkv, z, b, a = self.proj(x).float().split([2 * Hk * dk + Hv * dv, Hv * dv, Hv, Hv], dim=-1)
        weights = (self.conv, self.dt_bias, self.a_coef, self.norm)
        if T == 1 and x.device.type == "cpu" and st.trail is None and not invariant.enabled():
            # a CPU decode: one compiled call (strata.runtime.cpu_step's reasons)
            r = _STEP(qkv, z, b, a, st.conv, st.rec, *weights, heads, self.eps)
            if r is not None:
                o, st.conv = r
                return self.out(o)
        # batch-invariant mode: token by token for any T, as decode runs (the chunked WY
        # form sums in another order, so a prompt's chunking would change its state)
        by_token = T == 1 or st.trail is not None or invariant.enabled()
        if by_token and self.one_launch():
            if st.trail is not None:  # a verify: its rows as decode steps, and `keep`'s replay the same
                st.trail.rows, st.trail.replay = (qkv, z, b, a), self.replay_of(x.device)
            y, st.conv = self.tokens(qkv, z, b, a, st)
            return self.out(y)
        q, k, v, g, beta, st.conv = _inputs(qkv, b, a, st.conv, *weights[:3], heads, self.proj.kernels)
        fla, step = self.recurrence(x.device)
        if st.trail is not None:  # a verify: token by token, as decode and `keep`'s replay run
            st.trail.rows, st.trail.replay = (qkv, q, k, v, g, beta), self.replay_of(x.device)
        if by_token:
            o = step(q, k, v, g, beta, st.rec)
        else:
            o = (deltanet_chunk_fla if fla else chunked)(q, k, v, g, beta, st.rec)
        return self.out(self.gated_norm(o, z))

    def one_launch(self) -> bool:
        """Whether tokens taken one by one (a decode's, a verify's rows, any in batch-invariant
        mode) run in one launch (triton_kernels.deltanet_decode): the Triton kernels."""
        return self.proj.kernels == "triton"

    def tokens(self, qkv, z, b, a, st: DeltaNetState, in_place: bool = False):
        """The projections' rows (T of them) token after token in one launch: (the output
        projection's input rows, the conv's new window, with `in_place` st.conv itself);
        st.rec updated in place. On a GPU the rows' int8 form too, for a dp4a GEMV."""
        return impl("deltanet_decode", "triton")(st.conv, qkv, self.conv, b, a, self.dt_bias, self.a_coef,
                                                 self.k_heads, self.dk, st.rec, z, self.norm, self.eps,
                                                 quantize=qkv.is_cuda, in_place=in_place)

    def replay_of(self, device):
        """`_Trail.replay` for a verify's rows as this layer ran them: (qkv, z, b, a) through
        the one launch, or (qkv, q, k, v, g, beta) through the recurrence's op."""
        if self.one_launch():
            def replay(rows, n, window, rec):
                qkv, z, b, a = (r[:n] for r in rows)
                impl("deltanet_decode", "triton")(window, qkv, self.conv, b, a, self.dt_bias, self.a_coef,
                                                  self.k_heads, self.dk, rec, z, self.norm, self.eps)
            return replay
        step = self.recurrence(device)[1]

        def replay(rows, n, window, rec):
            step(*(r[:n] for r in rows[1:]), rec)
        return replay

    def recurrence(self, device) -> tuple[bool, object]:
        """(fla-core's chunked kernels for a prompt?, the token-by-token op where the tokens
        take no one launch, the torch kernels', which runs T tokens one after another in one
        call): fla-core's on CUDA where it is installed (triton_kernels.deltanet_fla.
        deltanet_path says why)."""
        return deltanet_path(device, self.proj.kernels)[0] == "fla-core", impl("deltanet_step", self.proj.kernels)

    def gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm per head of the recurrence's output o (T, Hv, dv): rows (T, Hv * dv)."""
        # on a GPU the launch also quantizes the rows for the output projection's dp4a GEMV
        return impl("deltanet_gated_norm", self.proj.kernels)(o, z, self.norm, self.eps, quantize=o.is_cuda)


def _inputs(qkv, b, a, window, conv, dt_bias, a_coef, heads, kernels: str = "torch"):
    """The recurrence's inputs from the projections: (q, k, v, g, beta, the conv's new
    window). With Triton kernels
    (a prompt's rows: tokens taken one by one take GatedDeltaNet.tokens' one launch), the
    conv and everything between it and the recurrence one kernel each
    (triton_kernels.conv, triton_kernels.deltanet_inputs)."""
    Hk, _, dk, _ = heads
    mixed, window = causal_conv(window, qkv, conv, step=impl("conv_step", "triton") if kernels == "triton" else None)
    q, k, v, g, beta = impl("deltanet_inputs", kernels)(mixed, b, a, dt_bias, a_coef, Hk, dk)
    return q, k, v, g, beta, window


def _decode(qkv, z, b, a, window, rec, conv, dt_bias, a_coef, norm, heads, eps):
    """One token's mixing, `rec` updated in place: (output rows (1, Hv * dv), new window).
    The eager path's functions (deltanet_decode's torch twin), traced: Inductor fuses them
    into a few loops (measured 0.3 ms against 1.8 ms a layer eagerly for flash-tiny on 2
    cores); float32 throughout, the element-wise rounding Inductor's (vector exp and the
    like), so within a few ulps of the eager step, not bit-equal: batch-invariant mode and
    a verify's replay keep the eager path."""
    Hk, _, dk, _ = heads
    return deltanet_decode_torch(window, qkv, conv, b, a, dt_bias, a_coef, Hk, dk, rec, z, norm, eps)


_STEP = Compiled(_decode, "the DeltaNet decode step", dynamic=False)
