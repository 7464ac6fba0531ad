"""The MoE block's last sum and the hyper-connection's write after it in one launch:

    hc_write_moe(x (T, S*H), routed (T, K, H) or (T, H), gate (T, 1), shared (T, H), inj (T, S),
                 w=None, eps=0.0) -> (y (T, S*H), xn (T, S*H), or (0,) without w)
        out = gated_add(routed, gate, shared)          routed's K slots summed in order,
                                                       plus sigmoid(gate) * shared
        y   = hc_write(x, out, inj)                    x + inj * out in every stream
        xn  = hc_norm(y, w, eps)                       with w (S, H): hc_write_norm's norm

Each program takes one (token, stream) row: it sums the token's MoE output as
gated_add's kernel does (triton_kernels.shared_expert), the same expression in the same
order, and then writes and norms as hc_write_norm's kernel does (triton_kernels.hyperconn):
the bits of the two launches it replaces (gated_add, then hc_write or hc_write_norm), each
of the S programs of a token summing its MoE row again (K + 2 loads a column, beside the
write's two). All float32. `hc_write_moe_torch` is gated_add_torch, then hc_write_torch
and hc_norm_torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import use_triton
from .hyperconn import _f32, hc_norm_torch, hc_write_torch, store_norm
from .int8 import Q8X, attach, int8_buffers
from .shared_expert import _rows, gated_add_torch, gated_sum


@triton.jit
def _write_moe_kernel(x_ptr, a_ptr, gate_ptr, b_ptr, inj_ptr, w_ptr, out_ptr, xn_ptr, q_ptr, d_ptr, s_ptr,
                      S, H, K, stride_a, stride_k, stride_gate, stride_b, eps, BH: tl.constexpr,
                      NORM: tl.constexpr, QUANT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # (token, stream) row
    t, s = r // S, r % S
    c = tl.arange(0, BH)
    live = c < H
    o = gated_sum(a_ptr, gate_ptr, b_ptr, t, c, live, K, stride_a, stride_k, stride_gate, stride_b)
    # hc_write's and hc_write_norm's (triton_kernels.hyperconn._write_norm_kernel)
    x = tl.load(x_ptr + r * H + c, mask=live, other=0.0)
    y = x + tl.load(inj_ptr + r) * o
    tl.store(out_ptr + r * H + c, y, mask=live)
    if NORM:
        store_norm(y, w_ptr, xn_ptr, q_ptr, d_ptr, s_ptr, t, s, c, live, S, H, eps, BH, QUANT)


def _check(x, routed, gate, shared, inj, w):
    _f32("hc_write_moe", x, inj, *(() if w is None else (w,)))
    if routed.dtype != torch.float32 or routed.dim() not in (2, 3) or (routed.shape[-1] > 1 and routed.stride(-1) != 1):
        raise ValueError(f"hc_write_moe: routed must be float32 (T, H) or (T, K, H) with unit column stride, got "
                         f"{routed.dtype} {tuple(routed.shape)} strides {routed.stride()}")
    _rows("hc_write_moe", gate, shared)
    T, S = inj.shape
    H = shared.shape[-1]
    if (routed.shape[0], routed.shape[-1]) != (T, H) or tuple(gate.shape) != (T, 1) or tuple(shared.shape) != (T, H) \
            or tuple(x.shape) != (T, S * H) or (routed.dim() == 3 and routed.shape[1] < 1):
        raise ValueError(f"hc_write_moe: x {tuple(x.shape)}, routed {tuple(routed.shape)}, gate {tuple(gate.shape)}, "
                         f"shared {tuple(shared.shape)} and inj {tuple(inj.shape)} must be (T, S*H), (T[, K], H), "
                         f"(T, 1), (T, H) and (T, S)")
    if w is not None and tuple(w.shape) != (S, H):
        raise ValueError(f"hc_write_moe: the norm's weight must be (streams {S}, width {H}), got {tuple(w.shape)}")


def hc_write_moe(x: torch.Tensor, routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor,
                 inj: torch.Tensor, w: torch.Tensor | None = None, eps: float = 0.0, quantize: bool = False):
    """(y, xn) of the module: the MoE's output summed and written into the streams, and
    with w their norm for the next read (an empty xn without); with `quantize` as well
    hc_write_norm's (xn quantized in the launch, attached)."""
    _check(x, routed, gate, shared, inj, w)
    if not use_triton(x):
        return hc_write_moe_torch(x, routed, gate, shared, inj, w, eps)
    T, S = inj.shape
    H = shared.shape[-1]
    K, stride_k = (routed.shape[1], routed.stride(1)) if routed.dim() == 3 else (1, 0)
    x, inj = x.contiguous(), inj.contiguous()
    y = torch.empty_like(x)
    xn = torch.empty_like(x) if w is not None else x.new_empty(0)
    quantize, x8 = int8_buffers(quantize and w is not None, T, S * H, H, y)
    if T and H:
        _write_moe_kernel[(T * S,)](x, routed, gate, shared, inj, x if w is None else w.contiguous(), y,
                                    y if w is None else xn, *x8, S, H, K, routed.stride(0), stride_k,
                                    gate.stride(0), shared.stride(0), eps, BH=triton.next_power_of_2(H),
                                    NORM=w is not None, QUANT=quantize)
    return y, (attach(xn, Q8X(*x8)) if quantize else xn)


def hc_write_moe_torch(x: torch.Tensor, routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor,
                       inj: torch.Tensor, w: torch.Tensor | None = None, eps: float = 0.0, quantize: bool = False):
    _check(x, routed, gate, shared, inj, w)
    y = hc_write_torch(x, gated_add_torch(routed, gate, shared), inj)
    return y, (hc_norm_torch(y, w, eps) if w is not None else x.new_empty(0))
