"""Strata's IQ3 quantizers against llama.cpp's, tensor by tensor.

For each format, llama.cpp (through llama-cpp-python's `llama_model_quantize`, pure, so
that every tensor with rows divisible by 256 gets the format) quantizes the model, and
Strata quantizes the same tensors from the same float32 input (the source dequantized),
with the same importance. Both are decoded with `quant` and compared by

    weighted RMSE = sqrt(sum imp (x - x')^2 / sum imp)

imp: the importance matrix (one value per column), all ones without one. The objective
column weighs by what both quantizers minimise (x^2 without an importance matrix,
imp * sqrt(sigma2 + x^2) with one).

llama.cpp refuses IQ3_XXS without an importance matrix; without --imatrix, IQ3_XXS runs
with an all-ones matrix on both sides (noted in the table).

    python scripts/quant_quality.py [--model GGUF] [--formats IQ3_XXS,IQ3_S] [--imatrix FILE]
    python scripts/quant_quality.py --speed [--formats IQ3_XXS]

--speed times the whole model instead, in one run: llama.cpp's pure quantization, then
`strata quantize IN OUT TYPE --pure` with the same importance matrix (all ones when
none is given and llama.cpp needs one) and the same thread count.
"""
from __future__ import annotations

import argparse
import ctypes
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import quant
from quant.search.iq3 import weights
from strata.gguf import open_gguf
from strata.quantize import read_imatrix

DEFAULT_MODEL = Path.home() / ".cache/strata/models/SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDS_IMATRIX = {"IQ3_XXS"}  # llama.cpp's tensor_requires_imatrix


def llama_quantize(src: Path, dst: Path, fmt: str, imatrix: dict[str, np.ndarray] | None,
                   threads: int) -> float:
    """Pure `fmt` quantization by llama.cpp; returns its wall time in seconds."""
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt}")
    p.allow_requantize = True
    p.pure = True
    p.nthread = threads
    keep = []
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for e, (name, v) in zip(entries, imatrix.items()):
            v = np.ascontiguousarray(v, dtype=np.float32).reshape(-1)
            keep.append(v)
            e.name, e.data, e.size = name.encode(), v.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), v.size
        p.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(entries)
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {fmt}) failed with code {rc}; see its log above")
    return dt


def wrmse(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    w = np.broadcast_to(w, x.shape)
    return float(np.sqrt((w * (x - y) ** 2).sum(dtype=np.float64) / w.sum(dtype=np.float64)))


def compare(model: Path, fmt_name: str, imatrix: dict[str, np.ndarray] | None, pattern: str,
            threads: int, out_dir: Path) -> dict:
    fmt = quant.get(fmt_name)
    src = open_gguf(model)
    # matrices and stacks of expert matrices (E, rows, cols), quantized row by row
    quantizable = [n for n, t in src.tensors.items()
                   if len(t.shape) in (2, 3) and t.shape[-1] % fmt.block_elems == 0]
    names = [n for n in quantizable if re.search(pattern, n)]
    note = ""
    imp_all = imatrix
    if imp_all is None and fmt_name in NEEDS_IMATRIX:
        # llama.cpp wants one for every tensor it quantizes: a row of ones per matrix (per expert)
        imp_all = {n: np.ones(int(np.prod(src.tensors[n].shape[:-2])) * src.tensors[n].shape[-1], np.float32)
                   for n in quantizable}
        note = " (llama.cpp needs an imatrix: all ones on both sides)"
    dst = out_dir / f"llama_{fmt_name}.gguf"
    t_llama = llama_quantize(model, dst, fmt_name, imp_all, threads)
    theirs = open_gguf(dst)
    rows, t_strata = [], 0.0
    for n in names:
        t = src.tensors[n]
        x = t.fmt.dequantize(t.data).astype(np.float32).reshape(-1, t.shape[-1])
        imp = None
        if imp_all is not None:  # per matrix (per expert for a stack): broadcast over its rows
            per = imp_all[n].astype(np.float32).reshape(-1, 1, t.shape[-1])
            imp = np.broadcast_to(per, (per.shape[0], x.shape[0] // per.shape[0], t.shape[-1])).reshape(x.shape)
        t0 = time.perf_counter()
        ours = fmt.dequantize(fmt.quantize(x, imp))
        t_strata += time.perf_counter() - t0
        tq = theirs.tensors[n]
        if tq.fmt.name != fmt_name:
            raise RuntimeError(f"{dst}: llama.cpp wrote {n} as {tq.fmt.name}, not {fmt_name}")
        ref = tq.fmt.dequantize(tq.data).reshape(x.shape)
        wi = np.ones_like(x) if imp is None else np.broadcast_to(imp, x.shape)
        wo = weights(x.reshape(-1, 256), None if imp is None else wi.reshape(-1, 256)).reshape(x.shape)
        rows.append((n, wrmse(x, ours, wi), wrmse(x, ref, wi), wrmse(x, ours, wo), wrmse(x, ref, wo),
                     (wi * (x - ours) ** 2).sum(dtype=np.float64), (wi * (x - ref) ** 2).sum(dtype=np.float64),
                     wi.sum(dtype=np.float64)))
    return {"fmt": fmt_name, "note": note, "rows": rows, "t_llama": t_llama, "t_strata": t_strata}


def report(res: dict) -> None:
    rows = res["rows"]
    print(f"\n{res['fmt']}{res['note']}: weighted RMSE (x 1e-3), Strata vs llama.cpp")
    print(f"{'tensor':<28} {'strata':>9} {'llama':>9} {'ratio':>7} | {'obj strata':>10} {'obj llama':>10} {'ratio':>7}")
    for n, s, l, so, lo, *_ in rows:
        print(f"{n:<28} {s * 1e3:9.4f} {l * 1e3:9.4f} {s / l:7.4f} | {so * 1e3:10.4f} {lo * 1e3:10.4f} {so / lo:7.4f}")
    tot_s = np.sqrt(sum(r[5] for r in rows) / sum(r[7] for r in rows))
    tot_l = np.sqrt(sum(r[6] for r in rows) / sum(r[7] for r in rows))
    wins = sum(r[1] <= r[2] for r in rows)
    wins_o = sum(r[3] <= r[4] for r in rows)
    print(f"{'total':<28} {tot_s * 1e3:9.4f} {tot_l * 1e3:9.4f} {tot_s / tot_l:7.4f}")
    print(f"Strata <= llama.cpp on {wins}/{len(rows)} tensors (objective: {wins_o}/{len(rows)}); "
          f"time on these tensors: Strata {res['t_strata']:.1f} s, llama.cpp whole model {res['t_llama']:.1f} s")


def speed(model: Path, fmt_name: str, imatrix_path: Path | None, threads: int, out_dir: Path) -> None:
    from strata.imatrix import IMatrix, write_imatrix
    from strata.quantize import quantize_model
    src = open_gguf(model)
    if imatrix_path is None and fmt_name in NEEDS_IMATRIX:
        im = IMatrix(sums={n: np.ones((1, t.shape[-1]), np.float32) for n, t in src.tensors.items()
                           if n.startswith("blk.") and len(t.shape) == 2},
                     counts={n: np.ones(1, np.int64) for n, t in src.tensors.items()
                             if n.startswith("blk.") and len(t.shape) == 2})
        imatrix_path = write_imatrix(out_dir / "ones.imatrix.gguf", im)
    imat = read_imatrix(imatrix_path) if imatrix_path else None
    t_llama = llama_quantize(model, out_dir / "llama.gguf", fmt_name, imat, threads)
    res = quantize_model(model, out_dir / "strata.gguf", fmt_name, imatrix=imatrix_path, pure=True,
                         threads=threads, log=lambda line: None)
    print(f"{fmt_name} pure, {threads} threads, imatrix {imatrix_path.name if imatrix_path else 'none'}: "
          f"llama.cpp {t_llama:.1f} s, strata quantize {res['seconds']:.1f} s, "
          f"ratio {res['seconds'] / t_llama:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--formats", default="IQ3_XXS,IQ3_S")
    ap.add_argument("--imatrix", type=Path, default=None, help="llama.cpp GGUF imatrix, used by both")
    ap.add_argument("--tensors", default=r"ffn_down", help="regex of tensors to compare")
    ap.add_argument("--threads", type=int, default=2, help="threads of both quantizers")
    ap.add_argument("--speed", action="store_true", help="time whole-model quantization instead")
    args = ap.parse_args(argv)
    imatrix = read_imatrix(args.imatrix) if args.imatrix else None
    with tempfile.TemporaryDirectory() as tmp:
        if args.speed:
            for f in args.formats.split(","):
                speed(args.model, f.strip().upper(), args.imatrix, args.threads, Path(tmp))
            return 0
        for f in args.formats.split(","):
            report(compare(args.model, f.strip().upper(), imatrix, args.tensors, args.threads, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
