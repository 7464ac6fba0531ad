"""A hyper-connection's down projection in the launch that writes the streams (or, for a
read that follows no write, reads them): the down GEMV's launch joins the write's.

Each program takes a chunk of BH columns of one (token, stream) row: it writes the chunk
(x + inj * out, or a MoE block's parts summed as hc_write_moe sums them; a read writes
nothing), and multiplies the chunk by the down weight's columns there with the GEMV that
QuantLinear would run (dp4a, or the float GEMV), where hc_write_norm wrote the normed
streams for a GEMV launch of their own. The norm's scale is
a stream's, known once all its chunks are summed; it factors out of the product,

    down(xn)[r] = sum_s inv_s * sum_c W[r, (s, c)] . (w_s * y_s)[c],   inv_s = 1 / sqrt(mean(y_s^2) + eps)

so each program stores its rows' sums over its chunk of w_s * y_s (in int8 per 32, as
int8.quantize_x rounds, for dp4a; rounded to the float GEMV's dtype for it) and its
chunk's sum of y^2, and hc_mix
(triton_kernels.hyperconn), which reads them, finishes: each stream's scale from its
chunks' sums, the rows' sums in chunk order times the scale, in stream order; the normed
streams themselves made where it reads them (y * inv_s * w_s). A read and a write launch
two kernels where they launched three.

    hc_down(x (T, S*H), w (S, H), eps, q, fmt, N, out=None, inj=None, dtype=torch.float32)
        -> (y (T, S*H): the streams written, or x for a read; Down: their partial sums)
        out: the block's output (T, H), or a MoE block's parts (routed, gate, shared) as
        hc_write_moe takes them; inj (T, S) its injection weights

`plan` says where the launch applies and how (`takes`): where QuantLinear runs a GEMV for
the tokens, the chunks whole K steps of its tiles. `hc_down_torch` is the same arithmetic
in torch (the chunks' sums in float32 from the dequantized weight and the rounded input).
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

from . import configs
from .asm import asm_for
from .backend import use_triton
from .decode import decoder, launch_args, table, unit, unit_table
from .dequant import dequantize_torch
from .gated_gemv import ROUNDING, rounded
from .int8 import GROUP, gemv_launch, quantize_x_torch, row_sums, store_groups
from .qmatmul import choose_path, gemv_tiles, gemv_weights
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
                    MODE: tl.constexpr, BH: tl.constexpr, FLOAT: tl.constexpr, DECODE: tl.constexpr,
                    QK: tl.constexpr, ROUND: tl.constexpr, UNIT: tl.constexpr, UW: tl.constexpr,
                    UPB: tl.constexpr, BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                    BODY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
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
    z = y * tl.load(w_ptr + s * H + h)
    k0 = s * H + c * BH  # the chunk's first column of the weight
    if FLOAT:  # the float GEMV's input, rounded to its dtype (zq holds it as float32 here)
        tl.store(zq_ptr + t * K + k0 + tl.arange(0, BH), rounded(z, ROUND))
    else:
        g = k0 // 32 + tl.arange(0, BH // 32)
        store_groups(zq_ptr, zd_ptr, zs_ptr, t, g, tl.reshape(z, (BH // 32, 32)), K, g < K // 32)
    tl.debug_barrier()  # the chunk stored by every lane before any lane reads it back
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        if FLOAT:  # qmatmul's float GEMV over the chunk (gemv_weights: its tiles' decode)
            n = rows.to(tl.int64)
            p = tl.zeros((BLOCK_N,), tl.float32)
            for k in range(k0, k0 + BH, BLOCK_K):
                wt, offs_k, _ = gemv_weights(q_ptr, tab_ptr, n, n < N, k, K, DECODE, QK, BLOCK_K)
                p += tl.sum(wt * tl.load(zq_ptr + t * K + offs_k)[None, :], axis=1)
        else:  # the dp4a GEMV's program over the chunk's units
            lo = k0 // UW
            p = row_sums(zq_ptr + t * (K // 4), zd_ptr + t * (K // 32), zs_ptr + t * (K // 32), q_ptr, tab_ptr,
                         rows, N, K, lo, lo + BH // UW, UNIT, UW, UPB, BLOCK_HW, ZERO, OFFSET, BODY, BLOCK_N,
                         BLOCK_K, False, ASM)
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


@dataclass(frozen=True)
class Plan:
    """hc_down's launch for one down weight: the GEMV it runs (`kind`: "dp4a", or "gemv",
    qmatmul's float GEMV), BH columns a program, BLOCK_N rows and BLOCK_K (units for dp4a,
    weights for gemv) a K step, the warps."""
    kind: str
    bh: int
    block_n: int
    block_k: int
    warps: int


def plan(fmt, device, N: int, S: int, H: int, rows: int) -> Plan | None:
    """hc_down's launch for an (N, S*H) down weight in fmt on `device` read by `rows`
    tokens, or None where it takes none: where QuantLinear would run a GEMV for them
    (qmatmul.choose_path: dp4a, or the float GEMV), with each chunk whole K steps of the
    GEMV's tiles (the dp4a GEMV's BLOCK_U halved until a step divides H; the float one's
    512 columns at most), whole int8 groups, and no K mask."""
    fmt = quant.get(fmt)
    if H % GROUP or S * H % fmt.block_elems:
        return None
    kind = choose_path(fmt, rows)
    if kind == "dp4a":
        block_n, block_u, _, warps = gemv_launch(fmt, device, N, S * H)
        while block_u >= 1:
            bh = unit(fmt).weights * block_u
            if bh >= GROUP and H % bh == 0:
                return Plan(kind, bh, block_n, block_u, warps)
            block_u //= 2
        return None
    if kind == "gemv":
        _, block_n, block_k = gemv_tiles(N, device, fmt)
        bh = min(512, H & -H)  # the largest power of two dividing H, at most 512
        return Plan(kind, bh, block_n, min(block_k, bh), configs.float_gemv_warps(fmt.name, device))
    return None


def takes(fmt, device, N: int, S: int, H: int, rows: int) -> bool:
    """Whether hc_down's launch runs this down projection for `rows` tokens (`plan`)."""
    return plan(fmt, device, N, S, H, rows) is not None


def _mode(out) -> int:
    return 0 if out is None else (2 if isinstance(out, (tuple, list)) else 1)


def _check(x, w, q, fmt, N, out, inj, dtype) -> Plan:
    T, SH = x.shape
    S, H = w.shape
    if x.dtype != torch.float32 or w.dtype != torch.float32 or SH != S * H:
        raise ValueError(f"hc_down: x must be float32 (T, S*H) and w float32 (S, H), got x {x.dtype} "
                         f"{tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}")
    if dtype not in ROUNDING:
        raise ValueError(f"hc_down: dtype must be float32, bfloat16 or float16, got {dtype}")
    p = plan(fmt, q.device, N, S, H, T)
    if p is None:
        raise ValueError(f"hc_down: a {quant.get(fmt).name} down weight of {N} x {SH} on {q.device} takes no "
                         f"launch for {T} tokens; ask takes() first")
    if out is not None and (inj is None or tuple(inj.shape) != (T, S) or inj.dtype != torch.float32):
        raise ValueError(f"hc_down: a write needs inj float32 ({T}, {S}), got "
                         f"{None if inj is None else (inj.dtype, tuple(inj.shape))}")
    if isinstance(out, torch.Tensor) and tuple(out.shape) != (T, H):
        raise ValueError(f"hc_down: out must be ({T}, {H}), got {tuple(out.shape)}")
    if _mode(out) == 2:  # the MoE's parts as hc_write_moe takes them (its kernel's sum is ours)
        from .hc_moe_write import _check as check_parts  # (it imports hyperconn, which imports this)
        check_parts(x, *out, inj, w)
    return p


def hc_down(x: torch.Tensor, w: torch.Tensor, eps: float, q: torch.Tensor, fmt, N: int,
            out=None, inj: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, Down]:
    """See the module: (the streams, their Down). `dtype`: the float GEMV's input dtype
    (QuantLinear's), to which w * y is rounded there (the dp4a GEMV rounds it to int8)."""
    fmt = quant.get(fmt)
    p = _check(x, w, q, fmt, N, out, inj, dtype)
    if not use_triton(x):
        return hc_down_torch(x, w, eps, q, fmt, N, out, inj, dtype)
    T, SH = x.shape
    S, H = w.shape
    C = H // p.bh
    x, w = x.contiguous(), w.contiguous()
    mode = _mode(out)
    y = x if mode == 0 else torch.empty_like(x)
    dev = x.device
    if p.kind == "gemv":  # w * y as the GEMV's input; the weight as qmatmul's float GEMV reads it
        z = (torch.empty((T, SH), dtype=torch.float32, device=dev), x, x)
        qw, cx = q.contiguous(), dict(FLOAT=True, DECODE=decoder(fmt), QK=fmt.block_elems, ROUND=ROUNDING[dtype],
                                      **_NO_UNIT)
    else:  # w * y in int8 (quantize_x's); the weight as gemv_dp4a reads it
        z = (torch.empty((T, SH // 4), dtype=torch.int32, device=dev),
             *(torch.empty((T, SH // GROUP), dtype=torch.float32, device=dev) for _ in range(2)))
        qw, cx = q.reshape(-1).view(torch.uint16), dict(FLOAT=False, DECODE=None, QK=1, ROUND=0,
                                                        **launch_args(fmt, unit(fmt)), ASM=asm_for(dev))
    ss = torch.empty((T, S * C), dtype=torch.float32, device=dev)
    part = torch.empty((T, S * C, N), dtype=torch.float32, device=dev)
    if mode == 2:
        routed, gate, shared = out
        K, stride_k = (routed.shape[1], routed.stride(1)) if routed.dim() == 3 else (1, 0)
        moe = (routed, gate, shared, K, routed.stride(0), stride_k, gate.stride(0), shared.stride(0))
    else:
        moe = (x if out is None else out.contiguous(), x, x, 1, 0, 0, 0, 0)
    if T:
        _hc_down_kernel[(T * S, C)](
            x, *moe[:3], x if inj is None else inj.contiguous(), w, y, *z, ss, part,
            qw, table(fmt, dev) if p.kind == "gemv" else unit_table(fmt, dev), S, H, N, *moe[3:],
            MODE=mode, BH=p.bh, **cx, BLOCK_N=p.block_n, BLOCK_K=p.block_k, num_warps=p.warps)
    return y, Down(y, ss, part, w, eps)


# the dp4a path's constexprs where the float GEMV runs
_NO_UNIT = dict(UNIT=None, UW=32, UPB=1, BLOCK_HW=1, ZERO=0, OFFSET=0, BODY=0, ASM=0)


def hc_down_torch(x: torch.Tensor, w: torch.Tensor, eps: float, q: torch.Tensor, fmt, N: int,
                  out=None, inj: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, Down]:
    """hc_down in torch: the write as hc_write's and hc_write_moe's twins compute it, each
    chunk's sums in float32 from the dequantized weight and w * y rounded as the launch's
    GEMV rounds it (to int8 per 32, or to dtype)."""
    from .hyperconn import hc_write_torch  # (hyperconn imports this module)
    fmt = quant.get(fmt)
    p = _check(x, w, q, fmt, N, out, inj, dtype)
    T, SH = x.shape
    S, H = w.shape
    C = H // p.bh
    y = x if out is None else hc_write_torch(x, gated_add_torch(*out) if _mode(out) == 2 else out, inj)
    ss = (y.reshape(T, S * C, p.bh) ** 2).sum(dim=-1)
    z = (y.reshape(T, S, H) * w).reshape(T, SH)
    z = z.to(dtype).float() if p.kind == "gemv" else quantize_x_torch(z).dequantize()
    W = dequantize_torch(q.reshape(N, -1), fmt, torch.float32, compiled=False).reshape(N, S * C, p.bh)
    part = torch.einsum("tcb,ncb->tcn", z.reshape(T, S * C, p.bh), W)
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
