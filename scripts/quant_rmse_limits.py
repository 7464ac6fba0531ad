"""Relative RMSE limits for every quantizer (tests/data/quant_rmse_limits.json), from
llama.cpp's own quantizers on the same rows, and the table of Strata's error over theirs.

For each format and each row set, llama.cpp's quantizer (ggml's `ggml_quantize_chunk`,
called through ctypes in a libggml-base.so built from llama-cpp-python 0.3.36's
vendor/llama.cpp) quantizes the rows; `quant` decodes them, and

    rel_rmse = ||dequantize(quantize(x)) - x|| / ||x||

over the whole row set is llama.cpp's number. The limit is that number times MARGIN:
Strata's quantizer may err up to 2% more than llama.cpp's on these rows, and no more.
Strata's own number, measured now, is stored next to it. For IQ3_XXS and IQ3_S, where
Strata's search goes further than llama.cpp's, the format's total (the geometric mean
of its ratios over the row sets) is held to at most 1.00.

Row sets (the test builds the same rows and checks their sum of squares against `sumsq`):
  gaussian     8 rows of 1536 standard normal float32, numpy default_rng(0).
  smollm2      rows 0-7 of blk.0.ffn_down.weight and of blk.15.ffn_down.weight of
               SmolLM2-135M-Instruct Q4_1 (strata.hub.pull_smollm2), decoded by quant:
               ffn_down is the model's only weight whose rows (1536) are whole 256-blocks.
               Decoded Q4_1, each 32 weights lie on a 15-step grid.
  student_t    8 rows of 1536 Student-t with 3 degrees of freedom, default_rng(3): heavy
               tails, a few weights far beyond the rest of their block.
  smollm2_576  rows 0-7 of four of SmolLM2's 576-column tensors, columns 0-511 (two
               256-blocks; a 576-column row is 2.25 of them): token_embd.weight (stored
               Q8_0, so nearly continuous), blk.0.attn_q, blk.10.ffn_gate, blk.20.attn_v
               (Q4_1).

Importance: each side gets what Strata's quantizer uses by default. The IQ2 and IQ1
formats take an all-ones importance (Strata's default for them, and ggml refuses IQ2_XXS,
IQ2_XS and IQ1_S without one); every other format none (the legacy formats and the
K-quants then run ggml's reference quantizers, IQ3 and IQ4 weigh errors by x^2).

With --blocks, the script also writes ggml's bytes for a few synthetic rows
(`block_rows`) of every format whose quantizer is ggml's to the bit, with and without
an importance, for tests/quant/test_search.py.

    python scripts/quant_rmse_limits.py --ggml PATH/libggml-base.so [--out tests/data/quant_rmse_limits.json]
        [--blocks tests/data/quant_ggml_blocks.npz]

Without --ggml, the library comes from an installed llama_cpp package (llama_cpp/lib/).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
from pathlib import Path

import numpy as np

import quant

LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FORMATS = LEGACY + KQUANTS + ("IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                              "IQ1_S", "IQ1_M")
ONES_IMPORTANCE = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"}
# quantizers that are ggml's own to the bit (with and without importance, except the
# legacy formats, which take none)
BIT_EXACT = KQUANTS + ("IQ4_NL", "IQ4_XS")
MARGIN = 1.02
TOTAL_LIMITS = {"IQ3_XXS": 1.0, "IQ3_S": 1.0}
SMOLLM2_TENSORS = ("blk.0.ffn_down.weight", "blk.15.ffn_down.weight")
SMOLLM2_576_TENSORS = ("token_embd.weight", "blk.0.attn_q.weight", "blk.10.ffn_gate.weight",
                       "blk.20.attn_v.weight")
ROWS_PER_TENSOR = 8


def gaussian_rows() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((8, 1536)).astype(np.float32)


def student_t_rows() -> np.ndarray:
    return np.random.default_rng(3).standard_t(3, (8, 1536)).astype(np.float32)


def _smollm2(names: tuple[str, ...], cols: int | None) -> np.ndarray:
    from strata.gguf import open_gguf
    from strata.hub import pull_smollm2
    g = open_gguf(pull_smollm2(quiet=True))
    parts = []
    for name in names:
        t = g.tensors[name]
        parts.append(t.fmt.dequantize(np.asarray(t.data[:ROWS_PER_TENSOR]))[:, :cols])
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def smollm2_rows() -> np.ndarray:
    return _smollm2(SMOLLM2_TENSORS, None)


def smollm2_576_rows() -> np.ndarray:
    return _smollm2(SMOLLM2_576_TENSORS, 512)


ROW_SETS = {"gaussian": gaussian_rows, "smollm2": smollm2_rows, "student_t": student_t_rows,
            "smollm2_576": smollm2_576_rows}


def block_rows() -> np.ndarray:
    """(6, 512), two 256-blocks a row: Gaussian; Student-t(3); a Q4_1-like row (each 32
    weights on a 15-step grid); a row of all-zero, tiny and spiky sub-blocks; Gaussian at
    1e-6 (fp16-subnormal scales); all positive."""
    rng = np.random.default_rng(7)
    grid = rng.uniform(0.01, 0.1, (16, 1)) * rng.integers(0, 16, (16, 32)) - rng.uniform(0, 0.8, (16, 1))
    odd = rng.standard_normal(512) * np.repeat(rng.choice([0, 1e-9, 1e-3, 1, 100], 32), 16)
    odd[::37] *= 50
    odd += 0.0  # no -0: ggml's Q4_0/Q5_0 store d = -0 for a block of zeros of either sign, gguf-py's d = 0 for -0s
    return np.stack([rng.standard_normal(512), rng.standard_t(3, 512), grid.reshape(-1), odd,
                     1e-6 * rng.standard_normal(512), rng.uniform(1, 9, 512)]).astype(np.float32)


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


def ratio(ours: float, theirs: float) -> float:
    """Strata's error over llama.cpp's; 1 where both are exact (Q4_1 on rows decoded from
    Q4_1)."""
    return ours / theirs if theirs > 0 else (1.0 if ours == 0 else math.inf)


def table(formats: dict, sets: list[str]) -> str:
    """The markdown table of Strata's rel-RMSE over llama.cpp's, per format and row set."""
    lines = ["| format | " + " | ".join(sets) + " | total |", "|---|" + "---:|" * (len(sets) + 1)]
    for name, e in formats.items():
        cells = [f"{ratio(e[k]['strata'], e[k]['llama_cpp']):.3f}" for k in sets]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {e['total']['ratio']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ggml", type=Path, help="libggml-base.so of llama-cpp-python 0.3.36")
    ap.add_argument("--out", type=Path, default=Path("tests/data/quant_rmse_limits.json"))
    ap.add_argument("--blocks", type=Path, help="write ggml's bytes for block_rows() here (.npz)")
    a = ap.parse_args()
    ggml = Ggml(a.ggml or find_ggml())
    check_binding(ggml)
    rows = {k: f() for k, f in ROW_SETS.items()}
    out = {
        "about": "rel_rmse = ||dequantize(quantize(x)) - x|| / ||x|| over each row set; limit = llama_cpp * margin; "
                 "total = geometric mean over the row sets of strata / llama_cpp, held to total_limit where given. "
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
        logs = []
        for k, x in rows.items():
            imp = importance(name, x)
            theirs = rel_rmse(x, fmt.dequantize(ggml.quantize(name, x, imp)))
            ours = rel_rmse(x, fmt.dequantize(fmt.quantize(x)))  # as the test calls it
            entry[k] = {"llama_cpp": round(theirs, 6), "strata": round(ours, 6),
                        "limit": round(theirs * MARGIN, 6)}
            logs.append(math.log(ratio(ours, theirs)))
            print(f"{name:8s} {k:12s} llama.cpp {theirs:.5f}  strata {ours:.5f}  "
                  f"ratio {ratio(ours, theirs):.4f}  limit {theirs * MARGIN:.5f}")
        entry["total"] = {"ratio": round(math.exp(sum(logs) / len(logs)), 4)}
        if name in TOTAL_LIMITS:
            entry["total"]["limit"] = TOTAL_LIMITS[name]
        out["formats"][name] = entry
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}\n")
    print(table(out["formats"], list(rows)))
    if a.blocks:
        x = block_rows()
        imp = np.random.default_rng(8).uniform(0.05, 3, x.shape[1]).astype(np.float32)
        blocks = {"rows": x, "importance": imp}
        for name in LEGACY + BIT_EXACT:
            blocks[name] = ggml.quantize(name, x, None)
            if name not in LEGACY:
                blocks[name + "+importance"] = ggml.quantize(name, x, imp)
            same = np.array_equal(blocks[name], quant.get(name).quantize(x))
            print(f"{name:8s} strata's blocks {'are' if same else 'are NOT'} ggml's")
        np.savez_compressed(a.blocks, **blocks)
        print(f"wrote {a.blocks}")


if __name__ == "__main__":
    main()
