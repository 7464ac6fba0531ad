"""Strata's Triton ops as torch ops, `torch.ops.strata.<op>`, so that torch.compile,
torch.export and fake tensors trace through a model like any torch code.

Each op is registered with `torch.library.custom_op`: its real implementation is the
launcher (triton_kernels.ops.OPS), its fake one the same launcher with the Triton
launches stubbed out (`stubbed_launches`), so the output's shape, dtype and device come
from the launcher's own code and cannot drift from it. Arguments the schema cannot hold
are given as it can: a format by its name, a scale as a tensor or a float, tiles as a
list.

The engine's eager calls go straight to the launchers: a registered op costs 15-30 us of
dispatch a call on this CPU (measured), some 2 ms a flash-tiny decode step. While
torch.compile traces (`torch.compiler.is_compiling()`), `ops.impl`'s launchers call the
registered ops instead (triton_kernels.ops._Triton).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

import quant

from .attention_rows import attention_rows
from .conv import conv_step
from .deltanet import deltanet_step
from .deltanet_decode import deltanet_decode
from .deltanet_inputs import deltanet_conv_inputs, deltanet_gated_norm, deltanet_inputs
from .dequant import dequantize
from .gated_gemv import gated_qmatmul
from .gemv_pair import gemv_pair
from .hc_down import Down, hc_down
from .hc_moe_write import hc_write_moe
from .hyperconn import hc_combine, hc_gates, hc_mix, hc_norm, hc_write, hc_write_norm
from .moe import moe, route
from .ple import PLE_BLOCK_ROWS, ngram_ids, ple_gather
from .ple_mix import ple_mix
from .qmatmul import qmatmul
from .qsa import ATTN_BLOCK_S, SCORES_BLOCK_N, qsa_attention, qsa_pool, qsa_scores
from .qsa_select import SELECT_HELD, SELECT_SPAN, SELECT_TILE, qsa_select
from .rope import norm_rope, norm_rope2
from .route_align import route_align
from .router_gemv import router_gemv
from .shared_expert import gated_add, sigmoid_mul, silu_mul
from .stage import cache_lookup, stage_rows

Tensor = torch.Tensor


@contextlib.contextmanager
def stubbed_launches(on_launch=None, on_args=None):
    """Triton kernel launches skipped for the block's duration (`on_launch(name)` told of
    each; `on_args(name, grid, scalars)` too, with the launch's grid and its number
    arguments): launchers then run only their torch ops, on fake tensors where they are fake."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    def run(self, *args, grid, warmup, **kwargs):
        name = getattr(self, "__name__", None) or self.fn.__name__
        if not warmup and on_launch is not None:
            on_launch(name)
        if not warmup and on_args is not None:
            on_args(name, grid if isinstance(grid, tuple) else None,
                    tuple(a for a in [*args, *kwargs.values()] if isinstance(a, (int, float))))

    saved = jit.JITFunction.run, interpreter.InterpretedFunction.run
    jit.JITFunction.run = interpreter.InterpretedFunction.run = run
    try:
        yield
    finally:
        jit.JITFunction.run, interpreter.InterpretedFunction.run = saved


def _register(name: str, real, mutates: tuple = ()):
    """`real` as `strata::name`, its fake implementation the same code with no launches."""
    op = torch.library.custom_op(f"strata::{name}", mutates_args=mutates)(real)

    @op.register_fake
    def _fake(*args, **kwargs):
        with stubbed_launches():
            return real(*args, **kwargs)
    return op


def _tiles(tiles) -> Optional[tuple]:
    return tuple(tiles) if tiles else None


def _qmatmul(x: Tensor, q: Tensor, fmt: str, n: Optional[int], path: Optional[str],
             tiles: Optional[list[int]]) -> Tensor:
    return qmatmul(x, q, fmt, n=n, path=path, tiles=_tiles(tiles))


def _gated_qmatmul(g: Tensor, u: Tensor, q: Tensor, fmt: str, silu: bool, dtype: torch.dtype) -> Tensor:
    return gated_qmatmul(g, u, q, fmt, silu, dtype)


def _gemv_pair(x: Tensor, q: Tensor, fmt: str, N: int, q2: Tensor, fmt2: str, N2: int, dtype: torch.dtype) -> Tensor:
    return gemv_pair(x, [(q, fmt, N), (q2, fmt2, N2)], dtype)


def _dequantize(q: Tensor, fmt: str, dtype: torch.dtype, block: int) -> Tensor:
    return dequantize(q, fmt, dtype, block)


def _route(logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    return route(logits, top_k, norm_topk_prob)


def _moe(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, fmt_gate: str, fmt_up: str,
         fmt_down: str, weights: Tensor, ids: Tensor, tiles: Optional[list[int]], path: Optional[str],
         tile_slots: Optional[int], dtype: Optional[torch.dtype]) -> Tensor:
    return moe(x, w_gate, w_up, w_down, fmt_gate, fmt_up, fmt_down, weights, ids,
                   tiles=_tiles(tiles), path=path, tile_slots=tile_slots, dtype=dtype)


def _ngram_ids(tokens: Tensor, history: Optional[Tensor], multipliers: Tensor, head_vocab_sizes: Tensor,
               head_offsets: Tensor, eos_id: int, heads_per_ngram: int, block: int,
               in_place: bool) -> tuple[Tensor, Tensor]:
    ids, nxt = ngram_ids(tokens, history, multipliers, head_vocab_sizes, head_offsets, eos_id,
                         heads_per_ngram, block=block, in_place=in_place)
    # an op's output may not alias its input: in place, the next history is `history` itself
    # (declared mutated), handed back by the caller's wrapper; the op returns none
    return ids, (nxt.new_empty(0) if in_place else nxt)


def _ple_gather(table: Tensor, ids: Tensor, fmt: str, scale: Optional[Tensor], scale_value: Optional[float],
                out_dtype: torch.dtype, block_rows: int, bound: Optional[int]) -> Tensor:
    return ple_gather(table, ids, fmt, scale=scale if scale is not None else scale_value,
                          out_dtype=out_dtype, block_rows=block_rows, bound=bound)


def _qsa_scores(q: Tensor, blocks: Tensor, start: int, ratio: int, block_n: int) -> Tensor:
    return qsa_scores(q, blocks, start, ratio, block_n=block_n)


def _qsa_select(scores: Tensor, keep: int, held: int, tile: int, span: int) -> Tensor:
    return qsa_select(scores, keep, held=held, tile=tile, span=span)


def _qsa_attention(q: Tensor, k: Tensor, v: Tensor, sel: Tensor, start: int, ratio: int,
                   k_scale: Optional[Tensor], v_scale: Optional[Tensor], block_s: int,
                   gate: Optional[Tensor] = None) -> Tensor:
    return qsa_attention(q, k, v, sel, start, ratio, k_scale, v_scale, block_s=block_s, gate=gate)


def _stage_rows(src: list[Tensor], dst: list[Tensor], ids: Tensor, slots: Tensor, first: int) -> None:
    stage_rows(src, dst, ids, slots, first)


def _qsa_pool(idx: Tensor, idx_scale: Optional[Tensor], pos: Tensor, ratio: int, w: Tensor, eps: float,
              cos: Tensor, sin: Tensor, blocks: Tensor) -> None:
    qsa_pool(idx, idx_scale, pos, ratio, w, eps, cos, sin, blocks)


OPS = {name: _register(name, f) for name, f in (
    ("qmatmul", _qmatmul), ("gated_qmatmul", _gated_qmatmul), ("gemv_pair", _gemv_pair),
    ("dequantize", _dequantize), ("route", _route),
    ("moe", _moe),
    ("ple_gather", _ple_gather), ("qsa_scores", _qsa_scores), ("qsa_select", _qsa_select),
    ("qsa_attention", _qsa_attention))}
OPS["ngram_ids"] = _register("ngram_ids", _ngram_ids, mutates=("history",))
OPS["stage_rows"] = _register("stage_rows", _stage_rows, mutates=("dst",))
OPS["qsa_pool"] = _register("qsa_pool", _qsa_pool, mutates=("blocks",))


def _attention_rows(q: Tensor, wq: Tensor, k: Tensor, wk: Tensor, v: Tensor, eps: float, cos: Tensor, sin: Tensor,
                    pos: Tensor, k_cache: Tensor, v_cache: Tensor, idx_q: Optional[Tensor], w_iq: Optional[Tensor],
                    idx_k: Optional[Tensor], idx_cache: Optional[Tensor], ratio: int, w_ik: Optional[Tensor],
                    blocks: Optional[Tensor], slots: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    qo, qi = attention_rows(q, wq, k, wk, v, eps, cos, sin, pos, k_cache, v_cache,
                            None if idx_k is None else (idx_q, w_iq, idx_k, idx_cache),
                            None if blocks is None else (ratio, w_ik, blocks), slots)
    return qo, (qo.new_empty(0) if qi is None else qi)  # (an op returns tensors, not None)


OPS["attention_rows"] = _register("attention_rows", _attention_rows,
                                  mutates=("k_cache", "v_cache", "idx_cache", "blocks"))


def _route_align(logits: Tensor, top_k: int, norm_topk_prob: bool, block_m: int, rows: int,
                 hits: Optional[Tensor], lut: Optional[Tensor], routed: Optional[Tensor], missed: Optional[Tensor],
                 first: int, g: Optional[Tensor] = None, u: Optional[Tensor] = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return route_align(logits, top_k, norm_topk_prob, block_m, rows, hits, lut, routed, missed, first,
                       None if g is None else (g, u))


OPS["route_align"] = _register("route_align", _route_align, mutates=("hits", "routed", "missed"))


def _router_gemv(x: Tensor, q: Tensor, fmt: str, N: int, top_k: int, norm_topk_prob: bool, block_m: int, rows: int,
                 E: int, shared: int, hits: Optional[Tensor], lut: Optional[Tensor], routed: Optional[Tensor],
                 missed: Optional[Tensor], first: int, g: Optional[Tensor] = None, u: Optional[Tensor] = None,
                 dtype: torch.dtype = torch.float32, q2: Optional[Tensor] = None, fmt2: Optional[str] = None,
                 N2: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return router_gemv(x, q, fmt, N, top_k, norm_topk_prob, block_m, rows, E, shared, hits, lut, routed, missed,
                       first, None if g is None else (g, u), dtype, None if q2 is None else (q2, fmt2, N2))


OPS["router_gemv"] = _register("router_gemv", _router_gemv, mutates=("hits", "routed", "missed"))


def _cache_lookup(ids: Tensor, lut: Tensor, routed: Tensor, missed: Tensor, first: int) -> tuple[Tensor, Tensor]:
    return cache_lookup(ids, lut, routed, missed, first)


OPS["cache_lookup"] = _register("cache_lookup", _cache_lookup, mutates=("routed", "missed"))


def _deltanet_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    return deltanet_step(q, k, v, g, beta, state)


OPS["deltanet_step"] = _register("deltanet_step", _deltanet_step, mutates=("state",))


def _deltanet_inputs(mixed: Tensor, b: Tensor, a: Tensor, dt_bias: Tensor, a_coef: Tensor, k_heads: int,
                     dk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return deltanet_inputs(mixed, b, a, dt_bias, a_coef, k_heads, dk)


def _deltanet_conv_inputs(window: Tensor, qkv: Tensor, taps: Tensor, b: Tensor, a: Tensor, dt_bias: Tensor,
                          a_coef: Tensor, k_heads: int, dk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return deltanet_conv_inputs(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk)


def _deltanet_gated_norm(o: Tensor, z: Tensor, w: Tensor, eps: float) -> Tensor:
    return deltanet_gated_norm(o, z, w, eps)


OPS["deltanet_inputs"] = _register("deltanet_inputs", _deltanet_inputs)
OPS["deltanet_conv_inputs"] = _register("deltanet_conv_inputs", _deltanet_conv_inputs)
OPS["deltanet_gated_norm"] = _register("deltanet_gated_norm", _deltanet_gated_norm)


def _deltanet_decode(window: Tensor, qkv: Tensor, taps: Tensor, b: Tensor, a: Tensor, dt_bias: Tensor,
                     a_coef: Tensor, k_heads: int, dk: int, state: Tensor, z: Tensor, norm: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
    return deltanet_decode(window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm, eps)


OPS["deltanet_decode"] = _register("deltanet_decode", _deltanet_decode, mutates=("state",))


def _conv_step(window: Tensor, x: Tensor, w: Tensor, dilation: int) -> tuple[Tensor, Tensor]:
    return conv_step(window, x, w, dilation)


OPS["conv_step"] = _register("conv_step", _conv_step)




def _hc_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return hc_norm(x, w, eps)


def _hc_gates(both: Tensor, rank: int, streams: int) -> tuple[Tensor, Tensor]:
    return hc_gates(both, rank, streams)


def _hc_combine(up: Tensor, xn: Tensor, streams: int) -> Tensor:
    return hc_combine(up, xn, streams)


def _hc_mix(both: Tensor, w_up: Tensor, xn: Tensor, rank: int, streams: int,
            fmt: Optional[str] = None) -> tuple[Tensor, Tensor]:
    return hc_mix(both, w_up, xn, rank, streams, fmt=fmt)


def _hc_write(x: Tensor, out: Tensor, inj: Tensor) -> Tensor:
    return hc_write(x, out, inj)


def _hc_write_norm(x: Tensor, out: Tensor, inj: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return hc_write_norm(x, out, inj, w, eps)


def _hc_write_moe(x: Tensor, routed: Tensor, gate: Tensor, shared: Tensor, inj: Tensor, w: Optional[Tensor],
                  eps: float) -> tuple[Tensor, Tensor]:
    return hc_write_moe(x, routed, gate, shared, inj, w, eps)


def _hc_down(x: Tensor, w: Tensor, eps: float, q: Tensor, fmt: str, N: int, out: Optional[Tensor],
             routed: Optional[Tensor], gate: Optional[Tensor], shared: Optional[Tensor],
             inj: Optional[Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    y, d = hc_down(x, w, eps, q, fmt, N, (routed, gate, shared) if routed is not None else out, inj, dtype)
    return (y.clone() if y is x else y), d.ss, d.part  # (an op's output may not alias its input)


def _ple_mix(x: Tensor, k: Tensor, v: Tensor, norm_key: Tensor, norm_query: Tensor, norm_conv: Tensor,
             taps: Tensor, window: Tensor, streams: int, eps: float, dilation: int) -> tuple[Tensor, Tensor]:
    return ple_mix(x, k, v, norm_key, norm_query, norm_conv, taps, window, streams, eps, dilation)


def _norm_rope(x: Tensor, w: Tensor, eps: float, cos: Tensor, sin: Tensor, pos: Optional[Tensor] = None) -> Tensor:
    return norm_rope(x, w, eps, cos, sin, pos)


def _norm_rope2(q: Tensor, wq: Tensor, k: Tensor, wk: Tensor, eps: float, cos: Tensor,
                sin: Tensor, pos: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return norm_rope2(q, wq, k, wk, eps, cos, sin, pos)


def _silu_mul(g: Tensor, u: Tensor) -> Tensor:
    return silu_mul(g, u)


def _sigmoid_mul(g: Tensor, u: Tensor) -> Tensor:
    return sigmoid_mul(g, u)


def _gated_add(a: Tensor, gate: Tensor, b: Tensor) -> Tensor:
    return gated_add(a, gate, b)


for _name, _f in (("hc_norm", _hc_norm), ("hc_gates", _hc_gates), ("hc_combine", _hc_combine), ("hc_mix", _hc_mix),
                  ("hc_write", _hc_write), ("hc_write_norm", _hc_write_norm), ("hc_write_moe", _hc_write_moe), ("hc_down", _hc_down), ("ple_mix", _ple_mix), ("norm_rope", _norm_rope), ("norm_rope2", _norm_rope2), ("silu_mul", _silu_mul), ("sigmoid_mul", _sigmoid_mul),
                  ("gated_add", _gated_add)):
    OPS[_name] = _register(_name, _f)


def _down_out(r, w, eps):
    y, ss, part = r
    return y, Down(y, ss, part, w, eps)


def _rows_out(out: tuple[Tensor, Tensor], idx) -> tuple:
    """attention_rows's returns from the op's: no indexer queries asked, None."""
    return out[0], (out[1] if idx is not None and idx[0] is not None else None)


def _fmt(f) -> str:
    return quant.get(f).name


def _ints(v, device) -> Tensor:
    return v if isinstance(v, Tensor) else torch.as_tensor(v, dtype=torch.int64, device=device)


def _window_out(out: tuple, window: Tensor, in_place: bool) -> tuple:
    """The returns of an op that moves a conv's window on (conv_step, ple_mix,
    deltanet_conv_inputs, deltanet_decode: the new window last), from the registered op's, which may not
    write its input: in place, the new window copied over `window`."""
    return (*out[:-1], window.copy_(out[-1])) if in_place else out


def _ngram_ids_out(out: tuple[Tensor, Tensor], history: Optional[Tensor], in_place: bool) -> tuple[Tensor, Tensor]:
    """ngram_ids's returns from the op's: in place, the next history is `history` itself."""
    return (out[0], history) if in_place else out


# each launcher's Python signature -> the registered op's arguments
def call(op: str, *args, **kwargs):
    """`op` (a launcher's name) through `torch.ops.strata`, taking the launcher's arguments."""
    return _CALLS[op](*args, **kwargs)


_CALLS = {
    "qmatmul": lambda x, q, fmt, *, n=None, path=None, tiles=None:
        OPS["qmatmul"](x, q, _fmt(fmt), n, path, list(tiles) if tiles else None),
    # a product written by another launch (route_align's) is an eager step's: it calls the launcher
    "gated_qmatmul": lambda g, u, q, fmt, silu=True, dtype=torch.float32, product=None:
        OPS["gated_qmatmul"](g, u, q, _fmt(fmt), silu, dtype) if product is None
        else gated_qmatmul(g, u, q, fmt, silu, dtype, product),
    "gemv_pair": lambda x, parts, dtype=torch.float32:
        OPS["gemv_pair"](x, *(v for q, f, n in parts for v in (q, _fmt(f), n)), dtype),
    "dequantize": lambda q, fmt, dtype=torch.float32, block=1024:
        OPS["dequantize"](q, _fmt(fmt), dtype, block),
    "route": lambda logits, top_k, norm_topk_prob=True: OPS["route"](logits, top_k, norm_topk_prob),
    "moe": lambda x, wg, wu, wd, fg, fu, fd, weights, ids, *, tiles=None, path=None, tile_slots=None, dtype=None:
        OPS["moe"](x, wg, wu, wd, _fmt(fg), _fmt(fu), _fmt(fd), weights, ids,
                   list(tiles) if tiles else None, path, tile_slots, dtype),
    "ngram_ids": lambda tokens, history, multipliers, head_vocab_sizes, head_offsets, eos_id,
                        heads_per_ngram=8, *, block=64, in_place=False: _ngram_ids_out(
        OPS["ngram_ids"](tokens, history, _ints(multipliers, tokens.device), _ints(head_vocab_sizes, tokens.device),
                         _ints(head_offsets, tokens.device), eos_id, heads_per_ngram, block, in_place),
        history, in_place),
    "ple_gather": lambda table, ids, fmt, *, scale=None, out_dtype=torch.float32, block_rows=PLE_BLOCK_ROWS,
                         bound=None:
        OPS["ple_gather"](table, ids, _fmt(fmt), scale if isinstance(scale, Tensor) else None,
                          None if scale is None or isinstance(scale, Tensor) else float(scale), out_dtype, block_rows,
                          bound),
    "qsa_scores": lambda q, blocks, start, ratio, *, block_n=SCORES_BLOCK_N:
        OPS["qsa_scores"](q, blocks, start, ratio, block_n),
    "qsa_select": lambda scores, keep, *, held=SELECT_HELD, tile=SELECT_TILE, span=SELECT_SPAN:
        OPS["qsa_select"](scores, keep, held, tile, span),
    "qsa_attention": lambda q, k, v, sel, start, ratio, k_scale=None, v_scale=None, *, block_s=ATTN_BLOCK_S,
                            gate=None: OPS["qsa_attention"](q, k, v, sel, start, ratio, k_scale, v_scale, block_s, gate),
    "attention_rows": lambda q, wq, k, wk, v, eps, cos, sin, pos, k_cache, v_cache, idx=None, pool=None,
                             slots=None: _rows_out(
        OPS["attention_rows"](q, wq, k, wk, v, eps, cos, sin, pos, k_cache, v_cache, *(idx or (None,) * 4),
                              *(pool or (0, None, None)), slots), idx),
    "qsa_pool": lambda idx, idx_scale, pos, ratio, w, eps, cos, sin, blocks:
        OPS["qsa_pool"](idx, idx_scale, pos, ratio, w, eps, cos, sin, blocks),
    "stage_rows": lambda src, dst, ids, slots, first: OPS["stage_rows"](
        [src] if isinstance(src, Tensor) else list(src), [dst] if isinstance(dst, Tensor) else list(dst),
        ids, slots, first),
    "route_align": lambda logits, top_k, norm_topk_prob, block_m, rows, hits=None, lut=None, routed=None,
                          missed=None, first=0, swiglu=None:
        OPS["route_align"](logits, top_k, norm_topk_prob, block_m, rows, hits, lut, routed, missed, first,
                           *(swiglu or (None, None))),
    "cache_lookup": lambda ids, lut, routed, missed, first: OPS["cache_lookup"](ids, lut, routed, missed, first),
    "router_gemv": lambda x, q, fmt, N, top_k, norm_topk_prob, block_m, rows, E, shared=0, hits=None, lut=None,
                          routed=None, missed=None, first=0, swiglu=None, dtype=torch.float32, pair=None:
        OPS["router_gemv"](x, q, _fmt(fmt), N, top_k, norm_topk_prob, block_m, rows, E, shared, hits, lut, routed,
                           missed, first, *(swiglu or (None, None)), dtype,
                           *((pair[0], _fmt(pair[1]), pair[2]) if pair is not None else (None, None, 0))),
    "deltanet_step": lambda q, k, v, g, beta, state: OPS["deltanet_step"](q, k, v, g, beta, state),
    "deltanet_inputs": lambda mixed, b, a, dt_bias, a_coef, k_heads, dk:
        OPS["deltanet_inputs"](mixed, b, a, dt_bias, a_coef, k_heads, dk),
    "deltanet_conv_inputs": lambda window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, in_place=False: _window_out(
        OPS["deltanet_conv_inputs"](window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk), window, in_place),
    "deltanet_gated_norm": lambda o, z, w, eps, quantize=False: OPS["deltanet_gated_norm"](o, z, w, eps),
    "deltanet_decode": lambda window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm, eps,
                              quantize=False, in_place=False: _window_out(
        OPS["deltanet_decode"](window, qkv, taps, b, a, dt_bias, a_coef, k_heads, dk, state, z, norm, eps), window,
        in_place),
    "conv_step": lambda window, x, w, dilation=1, in_place=False: _window_out(
        OPS["conv_step"](window, x, w, dilation), window, in_place),
    "hc_norm": lambda x, w, eps, quantize=False: OPS["hc_norm"](x, w, eps),
    "hc_gates": lambda both, rank, streams: OPS["hc_gates"](both, rank, streams),
    # a compiled step's ops return new tensors, to which nothing can stay attached: no quantize
    "hc_mix": lambda both, w_up, xn, rank, streams, quantize=False, fmt=None:
        OPS["hc_mix"](both, w_up, xn, rank, streams, None if fmt is None else _fmt(fmt)),
    "hc_write_moe": lambda x, routed, gate, shared, inj, w=None, eps=0.0, quantize=False:
        OPS["hc_write_moe"](x, routed, gate, shared, inj, w, eps),
    "hc_down": lambda x, w, eps, q, fmt, N, out=None, inj=None, dtype=torch.float32: _down_out(
        OPS["hc_down"](x, w, eps, q, _fmt(fmt), N, out if isinstance(out, Tensor) else None,
                       *(out if isinstance(out, (tuple, list)) else (None, None, None)), inj, dtype), w, eps),
    "ple_mix": lambda x, k, v, norm_key, norm_query, norm_conv, taps, window, streams, eps, dilation,
                      in_place=False: _window_out(
        OPS["ple_mix"](x, k, v, norm_key, norm_query, norm_conv, taps, window, streams, eps, dilation), window,
        in_place),
    "hc_combine": lambda up, xn, streams: OPS["hc_combine"](up, xn, streams),
    "hc_write": lambda x, out, inj: OPS["hc_write"](x, out, inj),
    "hc_write_norm": lambda x, out, inj, w, eps, quantize=False: OPS["hc_write_norm"](x, out, inj, w, eps),
    "norm_rope": lambda x, w, eps, cos, sin, pos=None: OPS["norm_rope"](x, w, eps, cos, sin, pos),
    "norm_rope2": lambda q, wq, k, wk, eps, cos, sin, pos=None: OPS["norm_rope2"](q, wq, k, wk, eps, cos, sin, pos),
    "silu_mul": lambda g, u: OPS["silu_mul"](g, u),
    "sigmoid_mul": lambda g, u: OPS["sigmoid_mul"](g, u),
    "gated_add": lambda a, gate, b: OPS["gated_add"](a, gate, b),
}
