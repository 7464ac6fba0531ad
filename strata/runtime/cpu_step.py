"""A dense model's decode step on the CPU, compiled: one call of Inductor's C++ a layer.

Eager, a SmolLM2 decode step is some 6,800 small torch ops whose dispatch costs more than
its matmuls (measured on 2 cores: about 12 of 25 ms outside any op). torch.compile turns a
layer's step into one Python call of fused C++ loops around the matmuls. The layer's
weights are the compiled function's arguments, so one compile serves every layer of the
same shapes; the cache's capacity is symbolic from the start, and the sequence's length
from the second step (a second compile). The first step costs the compiles: about 10 s on 2
cores with Inductor's disk cache cold, 1-3 s warm.

The step computes what Llama.forward computes for one token, op for op (the same RMSNorm,
RoPE, matmul calls and softmax), so its logits equal eager decode's except where Inductor
fuses an element-wise chain (float32 either way). When it compiles is
triton_kernels.cpu.compiled's choice (by default only in the background, `warm`, and only for
a run whose decode steps are plain); taken only
where every matmul has a compiled form (QuantLinear.pure), the KV cache stores floats and
batch-invariant mode is off. A failing compile (no C++ compiler) warns once and decodes
eagerly from then on (triton_kernels.cpu.compiled).
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from strata.nn.attention import one_token
from strata.nn.rope import rotate
from triton_kernels import invariant
from triton_kernels.cpu import compiled
from triton_kernels.cpu.compiled import Compiled


def _attend(qkv, pos, end, keys, vals, cos, sin, n_heads, n_kv, head_dim, rope_dim):
    """One token's attention: qkv (1, (H + 2 Hkv) D) projected; its K and V written into the
    layer's cache rows `keys`/`vals` (Hkv, capacity, D) at device position `pos`; the
    positions up to `end` attended."""
    H, Hkv, D = n_heads, n_kv, head_dim
    qk, v = qkv.split([(H + Hkv) * D, Hkv * D], dim=-1)
    qk = rotate(qk.reshape(1, H + Hkv, D).transpose(0, 1), cos, sin, rope_dim)   # (H + Hkv, 1, D)
    keys.index_copy_(1, pos, qk[H:].to(keys.dtype))
    vals.index_copy_(1, pos, v.reshape(1, Hkv, D).transpose(0, 1).to(vals.dtype))
    return one_token(qk[:H], keys[:, :end].float(), vals[:, :end].float()).reshape(1, H * D)


def _layer(x, pos, end, keys, vals, cos, sin, attn_norm, ffn_norm, eps, qkv, wo, gate_up, down,
           n_heads, n_kv, head_dim, rope_dim, ffn_dim):
    """A llama block for one token; each matmul is a (function, tensors) pair (QuantLinear.pure)."""
    h = F.rms_norm(x, attn_norm.shape, attn_norm, eps)
    a = _attend(qkv[0](h, *qkv[1]), pos, end, keys, vals, cos, sin, n_heads, n_kv, head_dim, rope_dim)
    x = x + wo[0](a, *wo[1])
    h = F.rms_norm(x, ffn_norm.shape, ffn_norm, eps)
    gate, up = gate_up[0](h, *gate_up[1]).split(ffn_dim, dim=-1)
    return x + down[0](F.silu(gate) * up, *down[1])


# one layer a call: one compile of about 10 s cold on 2 cores (six layers a call took 23 s,
# all 30 took 125 s, for no speed measurable above this machine's noise); the cache's
# capacity (keys, vals: dimension 1) symbolic from the first compile. One for every model:
# Dynamo counts a function's compiles against its limit whichever wrapper made them
_LAYER = Compiled(_layer, "the compiled decode step", symbolic={3: 1, 4: 1}, recompiles=16)


class CpuStep:
    """The compiled decode step of one Llama model (strata.models.llama)."""

    def __init__(self, model):
        self.model = model
        c = model.cfg
        self.shape = (c.n_heads, c.n_kv_heads, c.head_dim, model.blocks[0].attn.rope.dim, c.ffn_dim)
        self.layers = [(b.attn_norm.weight, b.ffn_norm.weight, b.attn_norm.eps, b.attn.qkv.pure(),
                        b.attn.wo.pure(), b.gate_up.pure(), b.down.pure()) for b in model.blocks]
        self.layer_fn = _LAYER

    @staticmethod
    def usable(model, cache) -> bool:
        """Whether this model and cache can take the compiled step."""
        if not compiled.available() or model.device.type != "cpu" or cache.kind == "int8" or invariant.enabled():
            return False
        every = getattr(model, "_cpu_step_pure", None)  # once a model: every matmul has a pure form
        if every is None:
            linears = [model.output] + [m for b in model.blocks for m in (b.attn.qkv, b.attn.wo, b.gate_up, b.down)]
            every = model._cpu_step_pure = all(m.pure() is not None for m in linears)
        return every

    def __call__(self, tok: int, cache) -> torch.Tensor | None:
        """Logits (1, vocab), or None where a compile failed (the cache as it was)."""
        m = self.model
        start = cache.length
        cache.reserve(start + 1)
        pos = torch.tensor([start])
        x = m.embed(torch.tensor([tok]))
        cos, sin = m.blocks[0].attn.rope._rows(pos, x.device)
        for i, (n1, n2, eps, qkv, wo, gate_up, down) in enumerate(self.layers):
            x = self.layer_fn(x, pos, start + 1, cache.k[i], cache.v[i], cos, sin, n1, n2, eps,
                              qkv, wo, gate_up, down, *self.shape)
            if x is None:  # the rows written at `start` are written again by the eager step
                return None
        cache.length = start + 1
        # the head eagerly: compiled with the norm, Inductor recomputed the norm for every row
        return m.output(m.norm(x))


def decode(model, tok: int, cache) -> torch.Tensor | None:
    """Logits (1, vocab) of one token through the model's compiled step, or None where the
    step does not apply or its compile failed (the caller decodes eagerly)."""
    if not CpuStep.usable(model, cache):
        return None
    return _step(model)(tok, cache)


_made = threading.Lock()


def _step(model) -> CpuStep:
    """The model's one CpuStep (its Compiled is what the background compile builds)."""
    with _made:
        if getattr(model, "_cpu_step", None) is None:
            model._cpu_step = CpuStep(model)
        return model._cpu_step


def warm(model) -> bool:
    """Build the compiled step on a scratch cache (triton_kernels.cpu.compiled.background): a few
    tokens, so that the sequence's length is symbolic as a real decode's (the first step
    compiles it fixed, the next ones symbolic, against the cache's capacity), and the head's
    one-row loop with them. The cache is made as generate's is (outside inference mode:
    Dynamo guards on that too), the steps run in inference mode as Llama.forward's do."""
    cache = model.new_cache(64)
    if not CpuStep.usable(model, cache):
        return False
    step = _step(model)
    with torch.inference_mode():  # as Llama.forward's steps: the guards then hold for them
        for _ in range(4):
            if step(0, cache) is None:
                return False
    return True
