"""A Flash-Next layer's decode on the CPU, compiled: two calls of Inductor's C++ a layer.

Eager, a flash-tiny decode step is some 3,800 small torch ops, about half its time in
dispatch and Python (strata.runtime.cpu_step gives the same reasons for llama). Here each
layer runs as two compiled calls for one token:

    DeltaNet layers: the mixer half (streams read, input projection, the DeltaNet step,
        strata.nn.deltanet._decode, its recurrent state updated in place, output
        projection, streams written), then the MoE half (streams read, the MoE's fused
        projection, routing, the dense experts' one pass, strata.storage.experts._few_tokens,
        the gated shared expert, streams written);
    attention layers: the input half (streams read, projection, per-head norms and RoPE,
        strata.nn.gated_attention.project), then, after the eager append to the cache and
        the attention itself (QSA picks blocks past its budget), the output half (gate,
        output projection, streams written) with the MoE half in the same call;
    the PLE layer's block first: the table's rows gathered eagerly (a storage tier's read),
        the rest compiled (strata.nn.ple.mix).

The weights are the compiled functions' arguments, so one compile serves every layer of
the same shapes and forms (QuantLinear.pure). The calls compute what the modules compute,
the same functions on the same values, so they equal the eager step within float32's
element-wise rounding (Inductor fuses the element-wise chains, and a dense one-row product
is its fused sum: strata.nn.linear._dense_mm); tests/strata/test_cpu_compile.py holds
logits and states within 1e-5. Taken where: one token on the CPU, compiles on,
batch-invariant mode off, every matmul of the call with a pure form; a DeltaNet state
outside a verify; experts held dense and not shared out under --ep. Elsewhere the modules
run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.nn import deltanet, gated_attention, hyperconn, ple
from strata.nn.hyperconn import HyperConnection
from strata.storage.experts import _few_tokens
from triton_kernels import invariant
from triton_kernels.cpu import compiled
from triton_kernels.cpu.compiled import Compiled
from triton_kernels.moe import route_torch


def _call(pure):
    """A QuantLinear's pure form (f, tensors) as a function of x."""
    f, held = pure
    return lambda t: f(t, *held)


def _mixer_half(x, hc_norm, hc_down, hc_up, proj, out, window, rec, conv, dt_bias, a_coef, norm,
                streams, rank, eps, splits, heads, ssm_eps):
    """A DeltaNet layer's first half for one token: (the streams after it, the conv's window)."""
    a, w = hyperconn.read(x, hc_norm, _call(hc_down), _call(hc_up), streams, rank, eps, True)
    qkv, z, b, g = _call(proj)(a).float().split(splits, dim=-1)
    o, window = deltanet._decode(qkv, z, b, g, window, rec, conv, dt_bias, a_coef, norm, heads, ssm_eps)
    return hyperconn.write(x, _call(out)(o), w), window


def _ffn_half(x, hc_norm, hc_down, hc_up, proj, shared_down, w13, w2, streams, rank, eps, splits,
              top_k, norm_topk):
    """A layer's MoE half for one token: (the streams after it, the routed ids (1, k))."""
    m, w = hyperconn.read(x, hc_norm, _call(hc_down), _call(hc_up), streams, rank, eps, True)
    logits, gate, g, u = _call(proj)(m).float().split(splits, dim=-1)  # MoE's order
    weights, ids = route_torch(logits, top_k, norm_topk)
    shared = _call(shared_down)(F.silu(g) * u).float()
    y = _few_tokens(m.float(), weights, ids, w13, w2) + torch.sigmoid(gate) * shared
    return hyperconn.write(x, y, w), ids


def _attn_in(x, hc_norm, hc_down, hc_up, proj, cos, sin, streams, rank, eps, project_args):
    """An attention layer's input for one token: (q, k, v, the indexer's query and key, the
    gate: gated_attention.project's), and the streams' injection weights."""
    a, w = hyperconn.read(x, hc_norm, _call(hc_down), _call(hc_up), streams, rank, eps, True)
    return *gated_attention.project(_call(proj)(a).float(), *project_args, cos, sin), w


def _attn_out(x, out, gate, w, o, *ffn):
    """An attention layer's output projection and streams written, then its MoE half:
    (the streams after the layer, the routed ids)."""
    x = hyperconn.write(x, _call(o)(gated_attention.finish(out, gate)), w)
    return _ffn_half(x, *ffn)


def _ple(x, e, key, value, *args):
    """The PLE block for one token (strata.nn.ple.mix): (x, the conv's new window)."""
    return ple.mix(x, e, _call(key), _call(value), *args)


_MIXER = Compiled(_mixer_half, "the DeltaNet layer's decode step", recompiles=16, dynamic=False)
_FFN = Compiled(_ffn_half, "the MoE layer's decode step", recompiles=16, dynamic=False)
_ATTN_IN = Compiled(_attn_in, "the attention layer's decode input", recompiles=16, dynamic=False)
_ATTN_OUT = Compiled(_attn_out, "the attention layer's decode output", recompiles=16, dynamic=False)
_PLE = Compiled(_ple, "the PLE block's decode step", recompiles=16, dynamic=False)


def _hc(hc: HyperConnection):
    """A hyper-connection's arguments, or None where a matmul has no pure form."""
    down, up = hc.down.pure(), hc.up.pure()
    if down is None or up is None:
        return None
    return hc.norm, down, up


class LayerStep:
    """What one layer's compiled halves take, gathered once (None: that half runs eagerly)."""

    def __init__(self, layer):
        self.mixer = self.ffn = self.attn = self.ple = None
        p = layer.ple
        if p is not None and p.key.pure() is not None and p.value.pure() is not None:
            self.ple = (p.key.pure(), p.value.pure(), *p.mix_args())
        # what is swapped at run time: a new expert store or --ep share rebuilds this
        self.store, self.share = layer.moe.experts, layer.moe.share
        hc = _hc(layer.attn_hc)
        m = layer.mixer
        if layer.recurrent and hc is not None and m.proj.pure() is not None and m.out.pure() is not None:
            Hk, Hv, dk, dv = m.k_heads, m.v_heads, m.dk, m.dv
            self.mixer = (*hc, m.proj.pure(), m.out.pure(), m.conv, m.dt_bias, m.a_coef, m.norm,
                          layer.attn_hc.streams, layer.attn_hc.rank, layer.attn_hc.eps,
                          [2 * Hk * dk + Hv * dv, Hv * dv, Hv, Hv], (Hk, Hv, dk, dv), m.eps)
        if not layer.recurrent and hc is not None and m.proj.pure() is not None and m.o.pure() is not None:
            f = layer.attn_hc
            self.attn = ((*hc, m.proj.pure()), (f.streams, f.rank, f.eps, m.project_args()), m.o.pure())
        hc, moe = _hc(layer.ffn_hc), layer.moe
        store = moe.experts
        if (hc is not None and moe.share is None and getattr(getattr(store, "spec", None), "kind", None) == "dense"
                and moe.proj.pure() is not None and moe.shared_down.pure() is not None):
            f = layer.ffn_hc
            self.ffn = (*hc, moe.proj.pure(), moe.shared_down.pure(), store.w13, store.w2, f.streams,
                        f.rank, f.eps, [moe.n_experts, 1, moe.shared_dim, moe.shared_dim], moe.top_k, moe.norm_topk)


def _step(layer, x: torch.Tensor) -> LayerStep | None:
    """The layer's LayerStep where a compiled call may run now (one token on the CPU), else None."""
    if x.shape[0] != 1 or x.device.type != "cpu" or not compiled.available() or invariant.enabled():
        return None
    step = getattr(layer, "_cpu_step", None)
    if step is None or step.store is not layer.moe.experts or step.share is not layer.moe.share:
        step = layer._cpu_step = LayerStep(layer)
    return step


def mixer_half(layer, x: torch.Tensor, st) -> torch.Tensor | None:
    """The streams after a DeltaNet layer's mixer for one token, compiled; None where the
    eager modules run (the state untouched)."""
    if not layer.recurrent or st.trail is not None:
        return None
    step = _step(layer, x)
    if step is None or step.mixer is None:
        return None
    a = step.mixer
    r = _MIXER(x, *a[:5], st.conv, st.rec, *a[5:])
    if r is None:
        return None
    x, st.conv = r
    return x


def ffn_half(layer, x: torch.Tensor) -> torch.Tensor | None:
    """The streams after a layer's MoE for one token, compiled; None where the eager modules
    run. The experts' counters count the call as the store's own forward does."""
    step = _step(layer, x)
    if step is None or step.ffn is None:
        return None
    r = _FFN(x, *step.ffn)
    if r is None:
        return None
    x, ids = r
    layer.moe.experts.count(ids)
    return x


def attention_layer(layer, x: torch.Tensor, st, start: int, positions) -> torch.Tensor | None:
    """The streams after an attention layer (its mixer and MoE) for one token: the input and
    the output halves compiled, the cache's append and the attention itself eager; None
    where the eager modules run (the state untouched)."""
    if layer.recurrent:
        return None
    step = _step(layer, x)
    if step is None or step.attn is None or step.ffn is None:
        return None
    m = layer.mixer
    pos = m.positions(start, 1, positions)
    cos, sin = m.rope._rows(pos, x.device)
    head, rest, o = step.attn
    r = _ATTN_IN(x, *head, cos, sin, *rest)
    if r is None:
        return None
    *qkv, gate, w = r
    out = m.attend(*qkv, st, start, pos, positions)
    r = _ATTN_OUT(x, out, gate, w, o, *step.ffn)
    if r is None:  # the rows were appended: finish this token eagerly
        y = hyperconn.write(x, m.o(gated_attention.finish(out, gate)), w)
        m_in, w = layer.ffn_hc.read(y)
        return hyperconn.write(y, layer.moe(m_in), w)
    x, ids = r
    layer.moe.experts.count(ids)
    return x


def ple_block(layer, x: torch.Tensor, tokens: torch.Tensor, st, ids) -> torch.Tensor | None:
    """The residual after the layer's PLE block for one token: the table's rows gathered
    eagerly (the storage tier's read), the rest compiled; None where the module runs."""
    if layer.ple is None:
        return None
    step = _step(layer, x)
    if step is None or step.ple is None:
        return None
    p = layer.ple
    e = p.table.gather(p.ids(tokens, st) if ids is None else ids)
    r = _PLE(x, e, *step.ple, st.conv)
    if r is None:  # the history moved on and the rows are here: the eager math on them
        r = ple.mix(x, e, p.key, p.value, *p.mix_args(), st.conv)
    x, st.conv = r
    return x


def warm(model) -> bool:
    """Build the compiled halves on a scratch state (triton_kernels.cpu.compiled.background):
    one token through the model compiles every kind of layer, the PLE block and the head.
    Only where the scratch step shares nothing with the caller's steps but weights: one
    process, every layer's experts held dense (a cache tier's slots would move), the PLE
    table in memory (the page cache's hints and direct mode's reads ahead keep the caller's
    state)."""
    tables = [layer.ple.table for layer in model.layers if layer.ple is not None]
    if (model.pipe is not None or any(layer.moe.share is not None for layer in model.layers)
            or any(getattr(getattr(layer.moe.experts, "spec", None), "kind", None) != "dense"
                   for layer in model.layers)
            or any(getattr(getattr(t, "table", None), "mode", "ram") != "ram" for t in tables)):
        return False
    model([0], model.new_cache(8), last_only=True)
    return bool(getattr(model.layers[0], "_cpu_step", None))  # a layer took its compiled halves
