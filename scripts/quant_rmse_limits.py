"""Relative RMSE limits for the IQ quantizers (tests/data/quant_rmse_limits.json), from
llama.cpp's own quantizers on the same rows.

For each IQ format and each of two row sets, llama.cpp's quantizer (ggml's
`ggml_quantize_chunk`, called through ctypes in the libggml-base.so that llama-cpp-python
0.3.36 ships) quantizes the rows; `quant` decodes them, and

    rel_rmse = ||dequantize(quantize(x)) - x|| / ||x||

over the whole row set is llama.cpp's number. The limit is that number times MARGIN:
Strata's quantizer may err up to 10% more than llama.cpp's on these rows, and no more.
Strata's own number, measured now, is stored next to it for reading, not for testing.

Row sets (the test builds the same rows and checks their sum of squares against `sumsq`):
  gaussian  8 rows of 1536 standard normal float32, numpy default_rng(0).
  smollm2   rows 0-7 of blk.0.ffn_down.weight and of blk.15.ffn_down.weight of
            SmolLM2-135M-Instruct Q4_1 (strata.hub.pull_smollm2), decoded by quant:
            ffn_down is the model's only weight whose rows (1536) are whole 256-blocks.

Importance: each side gets what Strata's quantizer uses by default. IQ3_XXS, IQ3_S and
IQ4_XS take none (both weigh errors by x^2); the IQ2 and IQ1 formats an all-ones
importance (Strata's default for them, and ggml refuses IQ2_XXS, IQ2_XS and IQ1_S
without one).

    python scripts/quant_rmse_limits.py [--ggml PATH/libggml-base.so] [--out tests/data/quant_rmse_limits.json]

Without --ggml, the library comes from an installed llama_cpp package (llama_cpp/lib/).
"""
from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import numpy as np

import quant

FORMATS = ("IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
ONES_IMPORTANCE = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"}
MARGIN = 1.10
SMOLLM2_TENSORS = ("blk.0.ffn_down.weight", "blk.15.ffn_down.weight")
ROWS_PER_TENSOR = 8


def gaussian_rows() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((8, 1536)).astype(np.float32)


def smollm2_rows() -> np.ndarray:
    from strata.gguf import open_gguf
    from strata.hub import pull_smollm2
    g = open_gguf(pull_smollm2(quiet=True))
    parts = []
    for name in SMOLLM2_TENSORS:
        t = g.tensors[name]
        parts.append(t.fmt.dequantize(np.asarray(t.data[:ROWS_PER_TENSOR])))
    return np.concatenate(parts).astype(np.float32)


ROW_SETS = {"gaussian": gaussian_rows, "smollm2": smollm2_rows}


def rel_rmse(x: np.ndarray, y: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    return float(np.linalg.norm(y.astype(np.float64) - x64) / np.linalg.norm(x64))


def importance(name: str, x: np.ndarray) -> np.ndarray | None:
    return np.ones(x.shape[-1], np.float32) if name in ONES_IMPORTANCE else None


class Ggml:
    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        self.lib.ggml_version.restype = self.lib.ggml_commit.restype = ctypes.c_char_p
        self.version = f"ggml {self.lib.ggml_version().decode()} ({self.lib.ggml_commit().decode()})"

    def quantize(self, name: str, x: np.ndarray, imp: np.ndarray | None) -> np.ndarray:
        fmt = quant.get(name)
        x = np.ascontiguousarray(x, np.float32)
        rows, cols = x.shape
        out = np.zeros((rows, fmt.row_bytes(cols)), np.uint8)
        self.lib.ggml_quantize_init(fmt.type_id)  # the IQ2/IQ1/IQ3 grids' search tables
        n = self.lib.ggml_quantize_chunk(fmt.type_id, x.ctypes.data, out.ctypes.data, 0, rows, cols,
                                         None if imp is None else imp.ctypes.data)
        if n != out.nbytes:
            raise RuntimeError(f"ggml_quantize_chunk({name}) wrote {n} bytes, expected {out.nbytes}")
        return out


def find_ggml() -> Path:
    import llama_cpp
    return Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"


def check_binding(ggml: Ggml) -> None:
    """The ctypes call is right where gguf-py can tell: Q4_0, Q5_1 and Q8_0 bytes must be
    gguf.quants' own."""
    import gguf
    x = np.random.default_rng(1).standard_normal((4, 1536)).astype(np.float32)
    for name in ("Q4_0", "Q5_1", "Q8_0"):
        if not np.array_equal(ggml.quantize(name, x, None), gguf.quants.quantize(x, gguf.GGMLQuantizationType[name])):
            raise RuntimeError(f"ggml's {name} bytes differ from gguf-py's: the ctypes binding is wrong")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ggml", type=Path, help="libggml-base.so of llama-cpp-python 0.3.36")
    ap.add_argument("--out", type=Path, default=Path("tests/data/quant_rmse_limits.json"))
    a = ap.parse_args()
    ggml = Ggml(a.ggml or find_ggml())
    check_binding(ggml)
    rows = {k: f() for k, f in ROW_SETS.items()}
    out = {
        "about": "rel_rmse = ||dequantize(quantize(x)) - x|| / ||x|| over each row set; limit = llama_cpp * margin. "
                 "Written by scripts/quant_rmse_limits.py (its docstring says which rows and importance).",
        "llama_cpp": f"ggml_quantize_chunk of {ggml.version}",
        "margin": MARGIN,
        "rows": {k: {"shape": list(x.shape), "sumsq": float((x.astype(np.float64) ** 2).sum())}
                 for k, x in rows.items()},
        "formats": {},
    }
    for name in FORMATS:
        fmt = quant.get(name)
        entry = {"importance": "ones" if name in ONES_IMPORTANCE else "none"}
        for k, x in rows.items():
            imp = importance(name, x)
            theirs = rel_rmse(x, fmt.dequantize(ggml.quantize(name, x, imp)))
            ours = rel_rmse(x, fmt.dequantize(fmt.quantize(x)))  # as the test calls it
            entry[k] = {"llama_cpp": round(theirs, 5), "strata": round(ours, 5),
                        "limit": round(theirs * MARGIN, 4)}
            print(f"{name:8s} {k:9s} llama.cpp {theirs:.4f}  strata {ours:.4f}  "
                  f"ratio {ours / theirs:.3f}  limit {theirs * MARGIN:.4f}")
        out["formats"][name] = entry
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
