"""A hyper-connection's down projection in the launch that writes the streams (or, for a
read that follows no write, reads them): the down GEMV's launch joins the write's.

Each program takes a chunk of BH columns of one (token, stream) row: it writes the chunk
(x + inj * out, or a MoE block's parts summed as hc_write_moe sums them; a read writes
nothing), and multiplies the chunk by the down weight's columns there by dp4a, where
hc_write_norm wrote the normed streams for a GEMV launch of their own. The norm's scale is
a stream's, known once all its chunks are summed; it factors out of the product,

    down(xn)[r] = sum_s inv_s * sum_c W[r, (s, c)] . (w_s * y_s)[c],   inv_s = 1 / sqrt(mean(y_s^2) + eps)

so each program stores its rows' sums over its chunk of w_s * y_s (in int8 per 32, as
int8.quantize_x rounds: the dp4a GEMV's bound) and its chunk's sum of y^2, and hc_mix
(triton_kernels.hyperconn), which reads them, finishes: each stream's scale from its
chunks' sums, the rows' sums in chunk order times the scale, in stream order; the normed
streams themselves made where it reads them (y * inv_s * w_s). A read and a write launch
two kernels where they launched three.

    hc_down(x (T, S*H), w (S, H), eps, q, fmt, N, out=None, inj=None)
        -> (y (T, S*H): the streams written, or x for a read; Down: their partial sums)
        out: the block's output (T, H), or a MoE block's parts (routed, gate, shared) as
        hc_write_moe takes them; inj (T, S) its injection weights

`takes` says where the launch applies: the down weight in a format with int8 units, its
columns' chunks whole K steps of the dp4a GEMV's tiles. `hc_down_torch` is the same
arithmetic in torch (the chunks' sums in float32 from the dequantized weight and int8).
Not bit for bit with hc_write_norm then the GEMV: the norm's scale multiplies the sums, not
the int8's input, and the chunks add in another order (tests/triton_kernels/test_hc_down.py
states the bound).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import quant

from .asm import asm_for
from .backend import use_triton
from .decode import launch_args, unit, unit_table
from .dequant import dequantize_torch
from .int8 import GROUP, gemv_launch, quantize_x_torch, row_sums, store_groups
from .shared_expert import gated_add_torch, gated_sum


@dataclass
class Down:
    """hc_down's partial sums of the streams y (T, S*H): ss (T, S*C) each chunk's sum of
    y^2, part (T, S*C, N) each chunk's rows' sums of W times w * y; with the norm's weight
    w (S, H) and eps, what hc_mix needs to finish the down projection and the norm."""
    y: torch.Tensor
    ss: torch.Tensor
    part: torch.Tensor
    w: torch.Tensor
    eps: float

    @property
    def chunks(self) -> int:
        """C: the chunks a stream's row was cut into."""
        return self.ss.shape[1] // self.w.shape[0]

    def __getitem__(self, rows) -> "Down":
        """The tokens `rows` (a slice) of it, as of the streams x[rows]."""
        return Down(self.y[rows], self.ss[rows], self.part[rows], self.w, self.eps)


@triton.jit
def _hc_down_kernel(x_ptr, o_ptr, gate_ptr, b_ptr, inj_ptr, w_ptr, y_ptr, zq_ptr, zd_ptr, zs_ptr, ss_ptr,
                 part_ptr, q_ptr, tab_ptr, S, H, N, K_MOE, stride_a, stride_k, stride_gate, stride_b,
                 MODE: tl.constexpr, BH: tl.constexpr, UNIT: tl.constexpr, UW: tl.constexpr,
                 UPB: tl.constexpr, BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                 BODY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr, ASM: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # (token, stream) row: r = t * S + s
    c = tl.program_id(1)  # its chunk of BH columns
    t, s = r // S, r % S
    h = c * BH + tl.arange(0, BH)
    y = tl.load(x_ptr + r * H + h)
    if MODE != 0:  # hc_write's (MODE 1) or hc_write_moe's (2) expression
        if MODE == 1:
            o = tl.load(o_ptr + t * H + h).to(tl.float32)
        else:
            o = gated_sum(o_ptr, gate_ptr, b_ptr, t, h, h < H, K_MOE, stride_a, stride_k, stride_gate, stride_b)
        y = y + tl.load(inj_ptr + r) * o
        tl.store(y_ptr + r * H + h, y)
    chunk = r * tl.num_programs(1) + c
    tl.store(ss_ptr + chunk, tl.sum(y * y, axis=0))
    K = S * H
    g = (s * H + c * BH) // 32 + tl.arange(0, BH // 32)
    store_groups(zq_ptr, zd_ptr, zs_ptr, t, g, tl.reshape(y * tl.load(w_ptr + s * H + h), (BH // 32, 32)), K,
                 g < K // 32)
    tl.debug_barrier()  # the chunk's int8 stored by every lane before any lane reads it back
    lo = (s * H + c * BH) // UW
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        p = row_sums(zq_ptr + t * (K // 4), zd_ptr + t * (K // 32), zs_ptr + t * (K // 32), q_ptr, tab_ptr, rows,
                     N, K, lo, lo + BH // UW, UNIT, UW, UPB, BLOCK_HW, ZERO, OFFSET, BODY, BLOCK_N, BLOCK_U, False,
                     ASM)
        tl.store(part_ptr + chunk * N + rows, p, mask=rows < N)


@triton.jit
def stream_scale(ss_ptr, t, s, S, H, eps, CH: tl.constexpr):
    """The norm's scale of token t's stream s, 1 / sqrt(mean(y^2) + eps), from its CH
    chunks' sums of y^2 added in chunk order (hc_mix's, from hc_down's sums)."""
    row = ss_ptr + (t * S + s) * CH
    ss = tl.load(row)
    for c in tl.static_range(1, CH):
        ss += tl.load(row + c)
    return 1.0 / tl.sqrt_rn(ss / H + eps)


@triton.jit
def parts_both(part_ptr, ss_ptr, t, cols, cmask, S, H, N, eps, CH: tl.constexpr):
    """The down projection of token t's normed streams at rows `cols` from hc_down's
    partial sums: each stream's chunks' sums in chunk order times its scale, added in
    stream order."""
    acc = tl.zeros(cols.shape, tl.float32)
    for s in range(0, S):
        base = part_ptr + ((t * S + s) * CH) * N + cols
        p = tl.load(base, mask=cmask, other=0.0)
        for c in tl.static_range(1, CH):
            p += tl.load(base + c * N, mask=cmask, other=0.0)
        acc += p * stream_scale(ss_ptr, t, s, S, H, eps, CH)
    return acc


def chunk(fmt: quant.Format, device, N: int, S: int, H: int) -> tuple[int, int] | None:
    """(BH columns a program, BLOCK_U units a K step) of hc_down's launch for an (N, S*H)
    down weight in fmt on `device`, or None where it takes none: BH whole steps of the dp4a
    GEMV's tiles (gemv_launch: its BLOCK_U, halved until a step divides H), so that each
    chunk's K loop stops at its end with no mask; whole int8 groups."""
    fmt = quant.get(fmt)
    u = unit(fmt)
    if u is None or H % GROUP or S * H % fmt.block_elems:
        return None
    block_u = gemv_launch(fmt, device, N, S * H)[1]
    while block_u >= 1:
        bh = u.weights * block_u
        if bh >= GROUP and H % bh == 0:
            return bh, block_u
        block_u //= 2
    return None


def takes(fmt, device, N: int, S: int, H: int) -> bool:
    """Whether hc_down's launch runs this down projection (see `chunk`)."""
    return chunk(fmt, device, N, S, H) is not None


def _mode(out) -> int:
    return 0 if out is None else (2 if isinstance(out, (tuple, list)) else 1)


def _check(x, w, q, fmt, N, out, inj):
    T, SH = x.shape
    S, H = w.shape
    if x.dtype != torch.float32 or w.dtype != torch.float32 or SH != S * H:
        raise ValueError(f"hc_down: x must be float32 (T, S*H) and w float32 (S, H), got x {x.dtype} "
                         f"{tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}")
    if chunk(fmt, q.device, N, S, H) is None:
        raise ValueError(f"hc_down: a {quant.get(fmt).name} down weight of {N} x {SH} on {q.device} takes no "
                         f"launch here; ask takes() first")
    if out is not None and (inj is None or tuple(inj.shape) != (T, S) or inj.dtype != torch.float32):
        raise ValueError(f"hc_down: a write needs inj float32 ({T}, {S}), got "
                         f"{None if inj is None else (inj.dtype, tuple(inj.shape))}")
    if isinstance(out, torch.Tensor) and tuple(out.shape) != (T, H):
        raise ValueError(f"hc_down: out must be ({T}, {H}), got {tuple(out.shape)}")


def hc_down(x: torch.Tensor, w: torch.Tensor, eps: float, q: torch.Tensor, fmt, N: int,
            out=None, inj: torch.Tensor | None = None) -> tuple[torch.Tensor, Down]:
    """See the module: (the streams, their Down)."""
    fmt = quant.get(fmt)
    _check(x, w, q, fmt, N, out, inj)
    if not use_triton(x):
        return hc_down_torch(x, w, eps, q, fmt, N, out, inj)
    T, SH = x.shape
    S, H = w.shape
    bh, block_u = chunk(fmt, q.device, N, S, H)
    C = H // bh
    x, w = x.contiguous(), w.contiguous()
    mode = _mode(out)
    y = x if mode == 0 else torch.empty_like(x)
    zq = torch.empty((T, SH // 4), dtype=torch.int32, device=x.device)
    zd, zs = (torch.empty((T, SH // GROUP), dtype=torch.float32, device=x.device) for _ in range(2))
    ss = torch.empty((T, S * C), dtype=torch.float32, device=x.device)
    part = torch.empty((T, S * C, N), dtype=torch.float32, device=x.device)
    if mode == 2:
        routed, gate, shared = out
        K, stride_k = (routed.shape[1], routed.stride(1)) if routed.dim() == 3 else (1, 0)
        moe = (routed, gate, shared, K, routed.stride(0), stride_k, gate.stride(0), shared.stride(0))
    else:
        o = x if out is None else out.contiguous()
        moe = (o, x, x, 1, 0, 0, 0, 0)
    block_n, _, _, warps = gemv_launch(fmt, q.device, N, SH)
    if T:
        _hc_down_kernel[(T * S, C)](
            x, moe[0], moe[1], moe[2], x if inj is None else inj.contiguous(), w, y, zq, zd, zs, ss, part,
            q.reshape(-1).view(torch.uint16), unit_table(fmt, q.device), S, H, N, *moe[3:],
            MODE=mode, BH=bh, **launch_args(fmt, unit(fmt)), BLOCK_N=block_n, BLOCK_U=block_u,
            ASM=asm_for(q.device), num_warps=warps)
    return y, Down(y, ss, part, w, eps)


def hc_down_torch(x: torch.Tensor, w: torch.Tensor, eps: float, q: torch.Tensor, fmt, N: int,
                  out=None, inj: torch.Tensor | None = None) -> tuple[torch.Tensor, Down]:
    """hc_down in torch: the write as hc_write's and hc_write_moe's twins compute it, each
    chunk's sums in float32 from the dequantized weight and w * y rounded to int8 per 32."""
    fmt = quant.get(fmt)
    _check(x, w, q, fmt, N, out, inj)
    T, SH = x.shape
    S, H = w.shape
    bh, _ = chunk(fmt, q.device, N, S, H)
    C = H // bh
    if out is None:
        y = x
    else:
        o = gated_add_torch(*out) if _mode(out) == 2 else out.float()
        y = x + (inj[:, :, None] * o[:, None, :]).reshape(T, SH)
    ss = (y.reshape(T, S * C, bh) ** 2).sum(dim=-1)
    z = quantize_x_torch((y.reshape(T, S, H) * w).reshape(T, SH)).dequantize()
    W = dequantize_torch(q.reshape(N, -1), fmt, torch.float32, compiled=False).reshape(N, S * C, bh)
    part = torch.einsum("tcb,ncb->tcn", z.reshape(T, S * C, bh), W)
    return y, Down(y, ss, part, w, eps)


def down_both_torch(d: Down) -> tuple[torch.Tensor, torch.Tensor]:
    """(both (T, N): the down projection of the normed streams, xn (T, S*H): the normed
    streams) from a Down, in hc_mix's order: a stream's chunks' sums added in chunk order,
    the scale 1 / sqrt(sum / H + eps), the streams' scaled sums added in stream order."""
    T, SH = d.y.shape
    S, H = d.w.shape
    C = d.chunks
    ss, part = d.ss.reshape(T, S, C), d.part.reshape(T, S, C, -1)
    both, xn = torch.zeros_like(part[:, 0, 0]), []
    for s in range(S):
        total, p = ss[:, s, 0], part[:, s, 0]
        for c in range(1, C):
            total, p = total + ss[:, s, c], p + part[:, s, c]
        inv = 1.0 / torch.sqrt(total / H + d.eps)
        both = both + p * inv[:, None]
        xn.append(d.y[:, s * H:(s + 1) * H] * inv[:, None] * d.w[s])
    return both, torch.cat(xn, dim=1)
