"""The n-gram PLE block (Flash-Next, one layer): hashed bigram/trigram rows into the residual.

For each token: the ids of its 16 n-gram rows (8 bigram heads, 8 trigram heads; hashed
from the token and the previous one or two, see triton_kernels.ple.ngram_ids), the rows
gathered and concatenated head-major (E = 16 x row_dim), then

    key   = norm_key(key_proj(e))          per stream     (T, S, H)
    value = value_proj(e)                                  (T, H)
    query = norm_query(x)                  per stream     (T, S, H)
    gate  = signed_sqrt(sum(key * query) / sqrt(H))        (T, S, 1)
    gv    = sigmoid(gate) * value                          (T, S, H)
    out   = gv + silu(conv(norm_conv(gv)))                 conv: depthwise, kernel 4,
                                                           dilation 3, causal
added to the residual x (T, S*H). The norms are RMSNorms per stream (weights hold 1 + w).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from triton_kernels import invariant
from triton_kernels.backend import to_device
from triton_kernels.ops import impl

from .deltanet import causal_conv
from .hyperconn import stream_norm
from .linear import QuantLinear


class PLEState:
    """One sequence's n-gram history (the last ngram-1 tokens, EOS at the start) and the
    dilated conv's window (S*H, (kernel-1)*dilation)."""

    def __init__(self, history: list[int], channels: int, window: int, device="cpu"):
        self.history = torch.tensor(history, dtype=torch.long, device=device)
        self.conv = torch.zeros(channels, window, device=device)

    def copy(self) -> "PLEState":
        c = PLEState.__new__(PLEState)
        c.history, c.conv = self.history.clone(), self.conv.clone()
        return c


class NgramPLE(torch.nn.Module):
    def __init__(self, table, hash_args: dict, key: QuantLinear, value: QuantLinear,
                 norm_key, norm_query, norm_conv, conv: torch.Tensor, streams: int, eps: float,
                 dilation: int):
        """`table` gathers rows: table.gather(ids (T, heads)) -> (T, heads*row_dim) float32;
        `hash_args` are the keyword arguments of triton_kernels.ple.ngram_ids."""
        super().__init__()
        from triton_kernels.ops import impl
        self.table, self.hash_args = table, hash_args
        self.hash = impl("ngram_ids", key.kernels)
        self.key, self.value = key, value
        p = (lambda t: torch.nn.Parameter(t.float(), requires_grad=False))
        self.norm_key, self.norm_query, self.norm_conv = p(norm_key), p(norm_query), p(norm_conv)
        self.conv = p(conv)                              # (S*H, kernel)
        self.streams, self.eps, self.dilation = streams, eps, dilation
        self.width = self.norm_key.numel() // streams
        self.ngram = len(hash_args["multipliers"])
        # the hash's ids lie below this (each head's offset and size): the gather checks the
        # table's rows against it once, not the ids each step
        self.id_bound = max(int(o) + int(n) for o, n in zip(hash_args["head_offsets"], hash_args["head_vocab_sizes"]))

    def new_state(self, device="cpu") -> PLEState:
        window = (self.conv.shape[1] - 1) * self.dilation
        return PLEState([self.hash_args["eos_id"]] * (self.ngram - 1), self.conv.shape[0], window, device)

    def ids(self, tokens: torch.Tensor, st: PLEState, in_place: bool = False) -> torch.Tensor:
        """The block's row ids of `tokens`, the state's n-gram history moved on: replaced,
        or with `in_place` written into the tensor it holds (a decode graph's buffer)."""
        dev = self.conv.device
        if self._consts is None or self._consts["multipliers"].device != dev:
            # the hash's constants held where it runs: no copy from the host a step
            self._consts = {k: to_device(torch.as_tensor(self.hash_args[k], dtype=torch.int64), dev)
                            for k in ("multipliers", "head_vocab_sizes", "head_offsets")}
        ids, st.history = self.hash(to_device(tokens, dev), to_device(st.history, dev),
                                    **{**self.hash_args, **self._consts}, in_place=in_place)
        return ids

    _consts = None

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, st: PLEState, ids=None) -> torch.Tensor:
        """The residual x (T, S*H) with the PLE block's output added; `ids`: this block's
        `ids(tokens, st)` made ahead (to announce the rows), or None."""
        e = self.table.gather(self.ids(tokens, st) if ids is None else ids, bound=self.id_bound)
        x, st.conv = mix(x, e, self.key, self.value, *self.mix_args(), st.conv, **self.kernels())
        return x

    def kernels(self) -> dict:
        """`mix`'s keyword arguments for this block's kernels: with Triton, the whole block
        after its projections as one launch (triton_kernels.ple_mix), and for a long
        prompt's rows the per-stream norms and the conv one launch each (hc_norm, conv)."""
        if self.key.kernels != "triton":
            return {}
        return dict(one=impl("ple_mix", "triton"), norm=_triton_stream_norm, conv_step=impl("conv_step", "triton"))

    def mix_args(self) -> tuple:
        """`mix`'s arguments between the projections and the conv's window."""
        return (self.norm_key, self.norm_query, self.norm_conv, self.conv, self.streams, self.width,
                self.eps, self.dilation)


def _triton_stream_norm(x: torch.Tensor, w: torch.Tensor, streams: int, eps: float) -> torch.Tensor:
    """hyperconn.stream_norm as one launch of the hc_norm kernel: (T, S, H)."""
    width = w.numel() // streams
    return impl("hc_norm", "triton")(x, w.reshape(streams, width), eps).reshape(x.shape[0], streams, width)


# tokens up to which the Triton path runs the block in its one launch, every token as a
# decode step's (a verify's rows, a short chunk; any number in batch-invariant mode): the
# launch's S programs walk the tokens one after another, so a long prompt's rows run
# torch's ops instead, the tokens side by side
ONE_LAUNCH_TOKENS = 16


def mix(x, e, key, value, norm_key, norm_query, norm_conv, conv, streams: int, width: int, eps: float,
        dilation: int, window, conv_step=None, norm=stream_norm, one=None, in_place: bool = False):
    """The block's output added to the residual x (T, S*H), from the gathered rows e: (x, the
    conv's new window). `key` and `value` are callables giving float32 rows (the modules, or
    a compiled step's pure matmuls, strata.models.qwen4exp_step); `one`: the rest in one
    launch, token after token (NgramPLE.kernels, the Triton ones; see ONE_LAUNCH_TOKENS),
    which with `in_place` writes the new window over `window` (a decode graph's buffer);
    else torch's ops, with `norm` stream_norm's form and `conv_step` the conv's op
    (causal_conv's `step`)."""
    T = x.shape[0]
    kr, v = key(e).float(), value(e).float()
    if one is not None and (T <= ONE_LAUNCH_TOKENS or invariant.enabled()):
        return one(x.float(), kr, v, norm_key, norm_query, norm_conv, conv, window, streams, eps, dilation,
                   in_place=in_place)
    k = norm(kr, norm_key, streams, eps)
    query = norm(x.float(), norm_query, streams, eps)
    gate = (k * query).sum(dim=-1, keepdim=True) / width ** 0.5
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gv = invariant.pointwise(torch.sigmoid, gate) * v.unsqueeze(1)  # (T, S, H)
    normed = norm(gv.reshape(T, -1), norm_conv, streams, eps).reshape(T, -1)
    out, window = causal_conv(window, normed, conv, dilation, step=conv_step, in_place=in_place)
    return x + gv.reshape(T, -1) + F.silu(out), window
