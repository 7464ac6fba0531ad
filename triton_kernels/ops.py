"""Each op's two implementations, Triton and torch, and the one lookup that the model's
modules make: `impl(op, kernels)`, with `kernels` from backend.choose_kernels.

While `triton_kernels.analysis.launches.record()` is open, every call of a Triton op is recorded
(its arguments' shapes, dtypes and strides), so that the launches a model makes can be
compiled for a GPU afterwards.
"""
from __future__ import annotations

import torch

from .attention_rows import attention_rows, attention_rows_torch
from .conv import conv_step, conv_step_torch
from .deltanet import deltanet_step, deltanet_step_torch
from .deltanet_decode import deltanet_decode, deltanet_decode_torch
from .deltanet_inputs import (deltanet_conv_inputs, deltanet_conv_inputs_torch, deltanet_gated_norm,
                              deltanet_gated_norm_torch, deltanet_inputs, deltanet_inputs_torch)
from .dequant import dequantize, dequantize_torch
from .gemv_pair import gemv_pair, gemv_pair_torch
from .hyperconn import (hc_combine, hc_combine_torch, hc_gates, hc_gates_torch, hc_mix, hc_mix_torch, hc_norm,
                        hc_norm_torch, hc_write, hc_write_norm, hc_write_norm_torch, hc_write_torch)
from .moe import moe, moe_torch, route, route_torch
from .ple import ngram_ids, ngram_ids_torch, ple_gather, ple_gather_torch
from .ple_mix import ple_mix, ple_mix_torch
from .qmatmul import qmatmul, qmatmul_torch
from .qsa import qsa_attention, qsa_attention_torch, qsa_pool, qsa_pool_torch, qsa_scores, qsa_scores_torch
from .qsa_select import qsa_select, qsa_select_torch
from .rope import norm_rope, norm_rope2, norm_rope2_torch, norm_rope_torch
from .shared_expert import gated_add, gated_add_torch, sigmoid_mul, sigmoid_mul_torch, silu_mul, silu_mul_torch
from .gated_gemv import gated_qmatmul, gated_qmatmul_torch
from .hc_down import hc_down, hc_down_torch
from .hc_moe_write import hc_write_moe, hc_write_moe_torch
from .route_align import route_align, route_align_torch
from .router_gemv import router_gemv, router_gemv_torch
from .stage import cache_lookup, cache_lookup_torch, stage_rows, stage_rows_torch

OPS = {
    "qmatmul": (qmatmul, qmatmul_torch),
    "gated_qmatmul": (gated_qmatmul, gated_qmatmul_torch),
    "gemv_pair": (gemv_pair, gemv_pair_torch),
    "dequantize": (dequantize, dequantize_torch),
    "route": (route, route_torch),
    "route_align": (route_align, route_align_torch),
    "router_gemv": (router_gemv, router_gemv_torch),
    "moe": (moe, moe_torch),
    "ngram_ids": (ngram_ids, ngram_ids_torch),
    "ple_gather": (ple_gather, ple_gather_torch),
    "ple_mix": (ple_mix, ple_mix_torch),
    "qsa_scores": (qsa_scores, qsa_scores_torch),
    "qsa_select": (qsa_select, qsa_select_torch),
    "qsa_attention": (qsa_attention, qsa_attention_torch),
    "qsa_pool": (qsa_pool, qsa_pool_torch),
    "attention_rows": (attention_rows, attention_rows_torch),
    "stage_rows": (stage_rows, stage_rows_torch),
    "cache_lookup": (cache_lookup, cache_lookup_torch),
    "deltanet_step": (deltanet_step, deltanet_step_torch),
    "deltanet_inputs": (deltanet_inputs, deltanet_inputs_torch),
    "deltanet_conv_inputs": (deltanet_conv_inputs, deltanet_conv_inputs_torch),
    "deltanet_gated_norm": (deltanet_gated_norm, deltanet_gated_norm_torch),
    "deltanet_decode": (deltanet_decode, deltanet_decode_torch),
    "conv_step": (conv_step, conv_step_torch),
    "hc_norm": (hc_norm, hc_norm_torch),
    "hc_gates": (hc_gates, hc_gates_torch),
    "hc_combine": (hc_combine, hc_combine_torch),
    "hc_mix": (hc_mix, hc_mix_torch),
    "hc_write": (hc_write, hc_write_torch),
    "hc_write_norm": (hc_write_norm, hc_write_norm_torch),
    "hc_write_moe": (hc_write_moe, hc_write_moe_torch),
    "hc_down": (hc_down, hc_down_torch),
    "norm_rope": (norm_rope, norm_rope_torch),
    "norm_rope2": (norm_rope2, norm_rope2_torch),
    "silu_mul": (silu_mul, silu_mul_torch),
    "sigmoid_mul": (sigmoid_mul, sigmoid_mul_torch),
    "gated_add": (gated_add, gated_add_torch),
}

recorder: list | None = None  # set by launches.record(): the calls made while it is open
calls = 0  # Triton op calls so far (STRATA_DECODE_TIMING reports them a step)


class _Triton:
    """An op's Triton launcher, noting each call while a recorder is open."""

    def __init__(self, op: str):
        self.op, self.fn = op, OPS[op][0]

    def __call__(self, *args, **kwargs):
        global calls
        if torch.compiler.is_compiling():  # torch.compile traces the registered op
            from .library import call
            return call(self.op, *args, **kwargs)
        calls += 1
        if recorder is not None:
            from .analysis.launches import describe
            recorder.append(describe(self.op, args, kwargs))
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<triton {self.op}>"


_TRITON = {op: _Triton(op) for op in OPS}


def impl(op: str, kernels: str):
    """The implementation of `op` that `kernels` ("triton" or "torch") names."""
    if op not in OPS:
        raise KeyError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    return _TRITON[op] if kernels == "triton" else OPS[op][1]
