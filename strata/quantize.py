"""`strata quantize IN.gguf OUT.gguf TYPE`: llama-quantize's per-tensor type choice, with
Strata's numpy quantizers.

The type of each tensor follows llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp)
for the mixes Strata names here; its main rules:
  - only tensors of 2+ dimensions whose name ends in "weight" (not norms, not MoE gates)
    are quantized; the rest are copied as they are (1-D tensors stay F32);
  - output.weight, and token_embd.weight when the output is tied to it: Q8_0 when its rows
    do not fit the type's blocks, Q5_K for IQ3_XXS, else Q6_K (Q8_0 stays Q8_0);
  - token_embd.weight (untied): IQ3_S for IQ3_XXS;
  - attn_v: Q4_K (IQ3_XXS/IQ3_S) or Q5_K (IQ4_NL) with grouped-query factor >= 4, and for
    IQ3_XXS without an imatrix IQ3_S;
  - attn_q, attn_k: IQ2_S for IQ3_XXS; attn_output: IQ3_S for IQ3_XXS;
  - attn_v, the i-th of n: Q5_K (Q3_K_M, i < 2, else Q4_K); Q6_K (Q4_K_M, Q5_K_M) where
    "more bits" (i < n/8, i >= 7n/8, or every third between);
  - ffn_down, layer i of n: for IQ3_XXS without an imatrix Q4_K (i < n/8) else Q3_K; for
    IQ4_NL and IQ4_XS without an imatrix Q5_K (i < n/8); for Q4_0 with an imatrix Q4_1 (i < n/8);
    Q5_K (Q3_K_M, i < n/16, else Q4_K); Q6_K (Q4_K_M, Q5_K_M) where "more bits";
  - attn_output: Q4_K for Q3_K_M;
  - --pure skips all of the above, --tensor-type REGEX=TYPE overrides them (first match);
  - then the fallback: rows not divisible by the type's block take IQ4_NL (IQ and 256-block
    IQ types), Q4_0 (Q2_K, Q3_K), Q5_0 (Q4_K), Q5_1 (Q5_K), Q8_0 (Q6_K), F16 if even that
    does not fit.
A quantized source is dequantized to float32 first. One progress line per tensor, as
llama-quantize prints it, and the size summary at the end. The file is laid out as
llama-quantize's: its tensor order (by block, then name) and its header's keys (the source's,
then general.quantization_version and general.file_type), so that where the quantizers give
ggml's bytes the whole file is llama-quantize's, byte for byte.

The quantizers are the `quant` codecs: IQ3_XXS and IQ3_S search as llama.cpp does, then
refine (quant/search/iq3.py); the K-quants, IQ4_NL and IQ4_XS run llama.cpp's searches
(quant/search/kquants.py, iq4.py), block for block ggml's bytes.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

import quant
from strata.gguf import open_gguf
from strata.gguf.writer import write_streamed
from strata.names import OUTPUT, TOKEN_EMBD
from strata.tensors import QTensor

# llama_ftype ids written to general.file_type (include/llama.h)
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,
          "IQ3_XXS": 23, "IQ4_NL": 25, "IQ3_S": 26, "IQ4_XS": 30}
# an ftype's base format (llama_ftype_get_default_type), where it is not the ftype's own name
BASE_TYPE = {"Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
FALLBACK = {"IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL",
            "IQ2_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL",
            "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# llama-quant.cpp's tensor_allows_quantization: kept as they are (the indexer's projections
# are small, and llama-quantize leaves them in their own type for every architecture)
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight",
                  "token_types.weight", "ssm_conv1d", "attn_rel_b.weight",
                  "indexer.k_proj.weight", "indexer.q_proj.weight", "per_layer_model_proj")


class QuantizeError(ValueError):
    """Bad input to `strata quantize`; the message names the flag, file or tensor."""


# --- the importance matrix ----------------------------------------------------------------

def read_imatrix(path: str | Path) -> dict[str, np.ndarray]:
    """llama.cpp's GGUF imatrix -> {weight name: float32 mean squared activation per input
    column}, read by strata.imatrix (the writer of the same format)."""
    from strata.imatrix_file import load_imatrix
    try:
        out = load_imatrix(path)
    except (ValueError, OSError) as e:
        raise QuantizeError(f"--imatrix {path}: {e}") from None
    for name, v in out.items():
        if not np.isfinite(v).all():
            raise QuantizeError(f"--imatrix {path}: {name} holds NaN or Inf; compute it again")
    return out


# --- the type of each tensor --------------------------------------------------------------

@dataclass
class Plan:
    """What `choose_type` needs to know of the whole model."""
    ftype: str
    n_layer: int
    n_gqa: int = 1
    tied_output: bool = False
    has_imatrix: bool = False
    pure: bool = False
    overrides: list[tuple[re.Pattern, str]] = field(default_factory=list)
    # a dense model's ffn_down "layer" as llama-quantize counts it: the ffn_down tensors its
    # mix rules have seen before this one (one given a type by --tensor-type is not counted,
    # so an override on the first layers moves the "first eighth" on); absent: the block number
    ffn_down_index: dict[str, int] = field(default_factory=dict)
    # attn_v (and attn_qkv, attn_kv_b) likewise: the index among those the mix rules see, and
    # how many the model has (overridden ones included, as llama-quantize counts them)
    attn_v_index: dict[str, int] = field(default_factory=dict)
    n_attn_v: int = 0


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    dims = sum(1 for n in shape if n > 1) if len(shape) > 1 else 1
    return dims >= 2 and name.endswith("weight") and not any(s in name for s in _NOT_QUANTIZED)


def _layer(name: str) -> int | None:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _is_attn_v(name: str) -> bool:
    return "attn_v.weight" in name or "attn_qkv.weight" in name or "attn_kv_b.weight" in name


def _mix_type(plan: Plan, name: str, shape: tuple[int, ...], t: str) -> str:
    """llama_tensor_get_type_impl for the ftypes in FTYPES."""
    f = plan.ftype
    is_output = name == OUTPUT or (plan.tied_output and name == TOKEN_EMBD)
    if is_output:
        if shape[-1] % quant.get(t).block_elems:
            return "Q8_0"
        if f == "IQ3_XXS":
            return "Q5_K"
        return t if t == "Q8_0" else "Q6_K"
    if name == TOKEN_EMBD:
        return "IQ3_S" if f == "IQ3_XXS" else t
    i, n = plan.ffn_down_index.get(name, _layer(name)), plan.n_layer
    if _is_attn_v(name):
        iv = plan.attn_v_index.get(name, _layer(name) or 0)
        if f == "IQ3_XXS":
            return "Q4_K" if plan.n_gqa >= 4 else ("IQ3_XXS" if plan.has_imatrix else "IQ3_S")
        if f == "IQ3_S" and plan.n_gqa >= 4:
            return "Q4_K"
        if f == "Q3_K_M":
            return "Q5_K" if iv < 2 else "Q4_K"
        if f in ("IQ4_NL", "IQ4_XS") and plan.n_gqa >= 4:
            return "Q5_K"
        if f in ("Q4_K_M", "Q5_K_M") and _more_bits(iv, plan.n_attn_v):
            return "Q6_K"
        return t
    if "attn_k.weight" in name or "attn_q.weight" in name:
        return "IQ2_S" if f == "IQ3_XXS" else t
    if "attn_output.weight" in name:
        return {"IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K"}.get(f, t)
    if "ffn_down" in name and i is not None:
        if f == "IQ3_XXS" and not plan.has_imatrix:
            return "Q4_K" if i < n // 8 else "Q3_K"
        if f == "Q3_K_M":  # Q3_K only where the architecture is Falcon
            return "Q5_K" if i < n // 16 else "Q4_K"
        if f == "Q4_K_M":
            return "Q6_K" if _more_bits(i, n) else t
        if f in ("IQ4_NL", "IQ4_XS") and not plan.has_imatrix and i < n // 8:
            return "Q5_K"
        if f == "Q5_K_M" and _more_bits(i, n):
            return "Q6_K"
        if f == "Q4_0" and plan.has_imatrix and i < n // 8:
            return "Q4_1"
    return t


def choose_type(plan: Plan, name: str, shape: tuple[int, ...]) -> tuple[str | None, str | None]:
    """(target format name or None to copy, fallback note or None) for one tensor."""
    if not quantizable(name, shape):
        return None, None
    t = BASE_TYPE.get(plan.ftype, plan.ftype)
    manual = next((ty for rx, ty in plan.overrides if rx.search(name)), None)
    if manual is not None:
        t = manual
    elif not plan.pure:
        t = _mix_type(plan, name, shape, t)
    cols, blk = shape[-1], quant.get(t).block_elems
    if cols % blk == 0:
        return t, None
    fb = FALLBACK.get(t, t if blk <= 32 else None)
    if fb is None:
        raise QuantizeError(f"tensor {name!r}: rows of {cols} do not fit {t}'s {blk}-weight blocks "
                            f"and {t} has no fallback type; choose another type with --tensor-type")
    if cols % quant.get(fb).block_elems:
        fb = "F16"
    return fb, (f"ncols {cols:6d} not divisible by {blk:3d} (required for type {_ggml_name(t):>7s}) "
                f"-> falling back to {_ggml_name(fb):>7s}")


# --- quantizing a model -------------------------------------------------------------------

def _ggml_name(name: str) -> str:
    """ggml_type_name: lower case, but the K of the k-quants (q4_K)."""
    low = name.lower()
    return low[:-2] + "_K" if low.endswith("_k") else low


def _shape_text(shape: tuple[int, ...]) -> str:
    ne = list(reversed(shape)) + [1] * (4 - len(shape))
    return ", ".join(f"{n:6d}" for n in ne)


def _parse_override(text: str) -> tuple[re.Pattern, str]:
    if "=" not in text:
        raise QuantizeError(f"--tensor-type {text!r}: expected REGEX=TYPE, e.g. ffn_down=Q8_0")
    rx, ty = text.rsplit("=", 1)
    try:
        fmt = quant.get(ty.strip())
    except ValueError as e:
        raise QuantizeError(f"--tensor-type {text!r}: {e}") from None
    try:
        return re.compile(rx), fmt.name
    except re.error as e:
        raise QuantizeError(f"--tensor-type {text!r}: bad regex: {e}") from None


def _first(v) -> int:
    """A per-layer hparam array (some archs store head counts per layer) -> its first entry."""
    if isinstance(v, (list, tuple, np.ndarray)):
        v = v[0] if len(v) else 1
    return max(1, int(v or 1))


def _ftype(name: str) -> str:
    """The ftype's name in upper case, or a QuantizeError that lists the ones there are."""
    ftype = name.upper()
    if ftype not in FTYPES:
        raise QuantizeError(f"quantization type {ftype!r} is not supported; choose one of "
                            f"{', '.join(FTYPES)} (or any format per tensor with --tensor-type)")
    return ftype


def make_plan(g, ftype: str, *, has_imatrix: bool = False, tensor_types: list[str] = (),
              pure: bool = False) -> Plan:
    """The Plan of quantizing the opened GGUF `g` to `ftype`, as llama-quantize makes it from
    the model's hparams (block_count, head counts) and tensors (a tied output)."""
    ftype = _ftype(ftype)
    arch = g.arch
    n_head = _first(g.get(f"{arch}.attention.head_count", 1))
    n_head_kv = _first(g.get(f"{arch}.attention.head_count_kv", n_head))
    layers = [i for i in (_layer(n) for n in g.tensors) if i is not None]
    plan = Plan(ftype=ftype, n_layer=int(g.get(f"{arch}.block_count", max(layers, default=-1) + 1)),
                n_gqa=max(1, n_head // max(1, n_head_kv)),
                tied_output=OUTPUT not in g.tensors, has_imatrix=has_imatrix,
                pure=pure, overrides=[_parse_override(t) for t in tensor_types])
    if _first(g.get(f"{arch}.expert_count", 1)) <= 1:  # with experts it reads the block number
        downs = sorted((n for n, t in g.tensors.items() if "ffn_down" in n and quantizable(n, t.shape)
                        and not any(rx.search(n) for rx, _ in plan.overrides)),
                       key=lambda n: _layer(n) if _layer(n) is not None else -1)
        plan.ffn_down_index = {n: i for i, n in enumerate(downs)}
    vs = sorted((n for n, t in g.tensors.items() if _is_attn_v(n) and quantizable(n, t.shape)),
                key=lambda n: _layer(n) if _layer(n) is not None else -1)
    plan.n_attn_v = len(vs)
    plan.attn_v_index = {n: i for i, n in enumerate(n for n in vs if not any(rx.search(n) for rx, _ in plan.overrides))}
    return plan


def target_types(g, plan: Plan) -> dict[str, str]:
    """Tensor name -> the format it has after quantizing (its own where it is copied), in
    file order: what llama-quantize --dry-run lists."""
    return {name: choose_type(plan, name, t.shape)[0] or t.fmt.name for name, t in g.tensors.items()}


def _file_order(name: str) -> tuple[int, str]:
    """llama-quantize's tensor order (llama_model_loader's weight_name_comparer): by block,
    the tensors of no block first, then by name."""
    i = _layer(name)
    return (-1 if i is None else i, name)


def _importance(imat: dict[str, np.ndarray] | None, imatrix, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """One row of importance per matrix: a merged-experts tensor (E, rows, in) has one per
    expert, and each expert's rows are quantized with its own (llama-quantize's
    imatrix_for_row)."""
    if imat is None or name not in imat:
        return None
    n_mat = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    imp = imat[name].reshape(-1, shape[-1]) if imat[name].size % shape[-1] == 0 else None
    if imp is None or imp.shape[0] != n_mat:
        raise QuantizeError(f"--imatrix {imatrix}: {name} has {imat[name].size} values for {n_mat} "
                            f"matrices of rows of {shape[-1]}; was it computed for another model?")
    return imp


def _quantize_tensor(t: QTensor, fmt: quant.Format, imp: np.ndarray | None) -> np.ndarray:
    """t's blocks in `fmt`, (rows, row bytes); a quantized source is dequantized first."""
    if imp is None:
        return fmt.requantize(t.data, t.fmt).reshape(t.data.shape[0], -1)
    x = t.fmt.dequantize(t.data).reshape(-1, t.shape[-1]).astype(np.float32, copy=False)
    if imp.shape[0] == 1:
        data = fmt.quantize(x, imp[0])
    else:
        per = x.reshape(imp.shape[0], -1, x.shape[-1])
        data = np.concatenate([fmt.quantize(per[e], imp[e]).reshape(per.shape[1], -1)
                               for e in range(imp.shape[0])])
    return data.reshape(x.shape[0], -1)


def _header(g, ftype: str) -> list[tuple[str, object, GGUFValueType]]:
    """llama-quantize's header: the source's keys, less the split ones, then these two last;
    arrays copied as the source's bytes."""
    meta = g.typed_metadata(packed=True)
    for key in ("general.quantization_version", "general.file_type", "split.no", "split.count",
                "split.tensors.count"):
        meta.pop(key, None)
    meta["general.quantization_version"] = (2, GGUFValueType.UINT32)
    meta["general.file_type"] = (FTYPES[ftype], GGUFValueType.UINT32)
    return [(k, v, t) for k, (v, t) in meta.items()]


def _progress_line(k: int, n: int, t: QTensor, target: str | None, out_bytes: int) -> str:
    """llama-quantize's line for the k-th of n tensors."""
    head = f"[{k:4d}/{n:4d}] {t.name:<36s} - [{_shape_text(t.shape)}], type = {_ggml_name(t.fmt.name):>6s}, "
    if target is None:
        return head + f"size = {t.nbytes / 2**20:8.3f} MiB"
    return head + (f"converting to {_ggml_name(target)} .. size = {t.nbytes / 2**20:8.2f} MiB -> "
                   f"{out_bytes / 2**20:8.2f} MiB")


def quantize_model(src: str | Path, dst: str | Path, ftype: str, *, imatrix: str | Path | None = None,
                   tensor_types: list[str] = (), pure: bool = False, threads: int = 1,
                   log: Callable[[str], None] = print) -> dict:
    """Quantize the GGUF `src` into `dst`; returns sizes and timing. `threads` tensors are
    quantized at once, and each is written as soon as it and those before it are done."""
    t0 = time.perf_counter()
    ftype = _ftype(ftype)
    g = open_gguf(src)
    imat = read_imatrix(imatrix) if imatrix else None
    plan = make_plan(g, ftype, has_imatrix=imat is not None, tensor_types=tensor_types, pure=pure)

    jobs = []  # (tensor, target format or None to copy, fallback note), in file order
    for name, t in sorted(g.tensors.items(), key=lambda kv: _file_order(kv[0])):
        target, note = choose_type(plan, name, t.shape)
        jobs.append((t, None if target == t.fmt.name else target, note))

    def work(job) -> np.ndarray:
        t, target, _ = job
        if target is None:
            return t.data
        return _quantize_tensor(t, quant.get(target), _importance(imat, imatrix, t.name, t.shape))

    sizes = {"size_in": 0, "size_out": 0, "n_fallback": 0}
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        results = pool.map(work, jobs)  # started now: the header is written meanwhile

        def data(i: int):
            t, target, note = jobs[i]
            q = next(results)
            if note:
                sizes["n_fallback"] += 1
                log(f"warning: {t.name:<36s} - {note}")
            log(_progress_line(i + 1, len(jobs), t, target, q.nbytes))
            sizes["size_in"] += t.nbytes
            sizes["size_out"] += q.nbytes
            yield q

        infos = [(t.name, t.shape, quant.get(target) if target else t.fmt) for t, target, _ in jobs]
        write_streamed(dst, g.arch, _header(g, ftype), infos, data)
    n_elem = sum(int(np.prod(t.shape)) for t in g.tensors.values())
    log(f"model size  = {sizes['size_in'] / 2**20:8.2f} MiB ({sizes['size_in'] * 8 / n_elem:.2f} BPW)")
    log(f"quant size  = {sizes['size_out'] / 2**20:8.2f} MiB ({sizes['size_out'] * 8 / n_elem:.2f} BPW)")
    if sizes["n_fallback"]:
        log(f"WARNING: {sizes['n_fallback']} of {len(jobs)} tensor(s) required fallback quantization")
    dt = time.perf_counter() - t0
    log(f"quantize time = {dt:8.2f} s")
    return {**sizes, "seconds": dt}
