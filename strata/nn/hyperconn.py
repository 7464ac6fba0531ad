"""Hyper-connections: S residual streams of width H in place of the pre-norms.

The residual is x (T, S*H). Before a block, `read` normalises each stream (one RMSNorm
with a weight per stream; the GGUF holds 1 + w), mixes them into the block's input

    m = sigmoid(up(silu(down(xn) / S)))            (T, S*H)
    input = mean over streams of m * xn             (T, H)

and returns the injection weights 2*sigmoid(inject(xn) / S), one per stream; `write`
adds the block's output to each stream times its weight. The final mixer is a `read`
without injection.

With Triton kernels (a GPU) a read is its norm, the down GEMV and one kernel for the rest
(triton_kernels.hyperconn.hc_mix: the gates, the small up projection and the streams'
mix), the norm left out where a write and the next block's norm share one launch
(`write_and_norm`); the torch form below is the CPU's and the compiled step's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from triton_kernels.dequant import dequantize_torch
from triton_kernels.hc_down import Down, takes as hc_down_takes
from triton_kernels.hyperconn import hc_norm_torch, hc_write_torch
from triton_kernels.ops import impl

from .linear import QuantLinear


class HyperConnection(torch.nn.Module):
    def __init__(self, norm: torch.Tensor, down: QuantLinear, up: QuantLinear, rank: int,
                 streams: int, eps: float):
        """`down` holds the mixer's down projection (rank rows), followed, except in the
        final mixer, by the injection weights (S rows): both read the normed streams."""
        super().__init__()
        self.streams, self.eps, self.rank = streams, eps, rank
        self.width = norm.numel() // streams
        self.norm = torch.nn.Parameter(norm.float().reshape(streams, self.width), requires_grad=False)
        self.down, self.up = down, up
        self.injects = down.out_features > rank
        # with the Triton kernels hc_mix multiplies by the up weight inside its launch,
        # decoding its blocks where they lie (a whole number a row: rank 64 holds two
        # 32-weight blocks), else from a float32 copy (S*H x rank values, small)
        self.up_w, self.up_fmt = None, None
        if up.kernels == "triton" and up.mode == "triton":
            if rank % up.fmt.block_elems == 0:
                self.up_w, self.up_fmt = up.blocks, up.fmt
            else:
                self.up_w = torch.nn.Parameter(
                    dequantize_torch(up.blocks, up.fmt, torch.float32, compiled=False).reshape(up.out_features, rank),
                    requires_grad=False)

    def read(self, x: torch.Tensor, xn: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's input (T, H) and the streams' injection weights (T, S) (None for the
        final mixer). `xn`: x's streams already normed by this connection's weight (what
        `write_and_norm` gives the next block), with the Triton kernels."""
        if self.down.kernels == "triton":
            return self._read_kernels(x, xn)
        return read(x, self.norm, self.down, self.up, self.streams, self.rank, self.eps, self.injects)

    def _read_kernels(self, x: torch.Tensor, xn) -> tuple[torch.Tensor, torch.Tensor | None]:
        S, rank = self.streams, self.rank
        if xn is None and self.joins_down(x.shape[0]):  # the norm and the down GEMV in one launch
            d = self.down
            _, xn = impl("hc_down", "triton")(x.float(), self.norm, self.eps, d.blocks, d.fmt, d.out_features,
                                              dtype=d.dtype)
        elif xn is None:  # on a GPU quantized too, for the down projection (as write_and_norm's)
            xn = impl("hc_norm", "triton")(x.float(), self.norm, self.eps, quantize=x.is_cuda)
        if isinstance(xn, Down):  # hc_down's sums: the mix finishes the norm and the projection
            inp, inj = impl("hc_mix", "triton")(xn, self.up_w, None, rank, S, quantize=x.is_cuda, fmt=self.up_fmt)
            return inp, (inj if self.injects else None)
        if self.up_w is not None:  # gates, up and combine in one launch
            # on a GPU the launch also quantizes the input for the block's dp4a projections
            inp, inj = impl("hc_mix", "triton")(self.down(xn), self.up_w, xn, rank, S, quantize=xn.is_cuda,
                                                fmt=self.up_fmt)
            return inp, (inj if self.injects else None)
        a, inj = impl("hc_gates", "triton")(self.down(xn), rank, S)
        inp = impl("hc_combine", "triton")(self.up(a), xn, S)
        return inp, (inj if self.injects else None)

    def joins_down(self, rows: int) -> bool:
        """Whether a read of `rows` tokens takes its norm and down GEMV in the launch that
        writes the streams, or reads them (triton_kernels.hc_down: where the down weight
        runs a GEMV, dp4a or float, and the mix's launch its up weight; not while
        torch.compile traces, whose ops are the registered ones)."""
        d = self.down
        return (d.kernels == "triton" and d.mode == "triton" and self.up_w is not None
                and not torch.compiler.is_compiling()
                and hc_down_takes(d.fmt, d.blocks.device, d.out_features, self.streams, self.width, rows))

    def write(self, x: torch.Tensor, out, weights: torch.Tensor) -> torch.Tensor:
        """x + out injected into every stream by its weight. `out` may be a MoE block's
        parts (MoE.parts), summed here (with the Triton kernels in the write's launch)."""
        if self.down.kernels == "triton":
            if isinstance(out, tuple):
                return impl("hc_write_moe", "triton")(x.float(), *out, weights)[0]
            return impl("hc_write", "triton")(x.float(), out, weights)
        return write(x, _summed(out, self.down.kernels), weights)

    def write_and_norm(self, x: torch.Tensor, out, weights: torch.Tensor,
                       then: "HyperConnection") -> tuple[torch.Tensor, torch.Tensor | None]:
        """`write`, and with the Triton kernels the result's streams normed for `then`, the
        next block's connection (its `read(x, xn)`), in the same launch; (x, None) in torch.
        `out` as `write`'s."""
        if self.down.kernels == "triton":
            if then.joins_down(x.shape[0]):  # then's down GEMV in the write's launch (hc_down)
                d = then.down
                return impl("hc_down", "triton")(x.float(), then.norm, then.eps, d.blocks, d.fmt, d.out_features, out,
                                                 weights, dtype=d.dtype)
            # on a GPU the launch also quantizes the norm for then's dp4a down projection
            q = x.is_cuda
            if isinstance(out, tuple):
                return impl("hc_write_moe", "triton")(x.float(), *out, weights, then.norm, then.eps, quantize=q)
            return impl("hc_write_norm", "triton")(x.float(), out, weights, then.norm, then.eps, quantize=q)
        return write(x, _summed(out, self.down.kernels), weights), None


def _summed(out, kernels: str) -> torch.Tensor:
    """A block's output: `out`, or a MoE block's parts (MoE.parts) summed."""
    return impl("gated_add", kernels)(*out) if isinstance(out, tuple) else out


def write(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """HyperConnection.write in torch: x + out injected into every stream by its weight."""
    return hc_write_torch(x, out, weights)


def read(x: torch.Tensor, norm: torch.Tensor, down, up, streams: int, rank: int, eps: float,
         injects: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HyperConnection.read as a function of its weights: `norm` (S, H); `down` and `up`
    callables giving float32 rows (the QuantLinear modules, or a compiled step's pure
    matmuls, strata.models.qwen4exp_step)."""
    xn = stream_norm(x.float(), norm, streams, eps)                     # (T, S, H)
    flat = xn.reshape(xn.shape[0], -1)
    both = down(flat).float() / streams
    mix = torch.sigmoid(up(F.silu(both[:, :rank])))
    inp = (mix.reshape_as(xn) * xn).mean(dim=1)
    return inp, (2 * torch.sigmoid(both[:, rank:]) if injects else None)


def stream_norm(x: torch.Tensor, w: torch.Tensor, streams: int, eps: float) -> torch.Tensor:
    """Each of the S streams of x (T, S*H) RMS-normalised with its own weight (w: S*H
    values): (T, S, H)."""
    width = w.numel() // streams
    return hc_norm_torch(x, w.reshape(streams, width), eps).reshape(x.shape[0], streams, width)


def next_norm(layers, i: int, last=None):
    """The hyper-connection that reads layer i's result next, whose norm layer i's last
    write can give in its launch (Layer.run): the next layer's attn_hc (not where a PLE
    block changes the streams first), or after the last layer `last`."""
    if i + 1 == len(layers):
        return last
    return layers[i + 1].attn_hc if layers[i + 1].ple is None else None
