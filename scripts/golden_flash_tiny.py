"""Golden data for flash-tiny from llama.cpp: its top-16 logits at every position of a
60-token prompt (within the QSA budget of 64, where llama.cpp and the reference agree),
and of a 200-token prompt on llama.cpp's own conversion of the checkpoint (no QSA ratios:
llama.cpp attends densely, which Strata's `--qsa off` matches at any length).

    python scripts/golden_flash_tiny.py [--llama-cpp-src DIR] [--out tests/data/flash_tiny_golden.json]

flash-tiny is built deterministically (the same GGUF, byte for byte, on every machine), so
the stored numbers hold wherever the tests run. llama-cpp-python 0.3.36 and its sdist's
converter are used here only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

TOP_K = 16


def prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 49152, (300,), generator=g)
    ids[0] = ids[150] = ids[151] = ids[290] = 2
    return ids[:n].tolist()


def scores(path: Path, ids: list[int]) -> dict:
    import llama_cpp
    ll = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    ll.eval(ids)
    s = np.array(ll.scores[:len(ids)], dtype=np.float32)
    top = np.argsort(-s, axis=1)[:, :TOP_K]
    return {"ids": ids, "top_ids": top.tolist(), "top_logits": np.take_along_axis(s, top, 1).tolist(),
            "max_abs_logit": float(np.abs(s).max())}


def main() -> None:
    from strata.hub import flash_tiny_checkpoint, synth_flash_tiny
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-src", default="/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
    ap.add_argument("--out", default="tests/data/flash_tiny_golden.json")
    a = ap.parse_args()
    tiny = synth_flash_tiny()
    src = Path(a.llama_cpp_src)
    with tempfile.TemporaryDirectory() as tmp:
        theirs = Path(tmp) / "tiny-llama-cpp.gguf"
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(flash_tiny_checkpoint()),
                        "--outfile", str(theirs), "--outtype", "f32"], check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(src / "gguf-py")})
        out = {"engine": "llama-cpp-python 0.3.36", "top_k": TOP_K,
               "strata_file_60": scores(tiny, prompt(60)),
               "llama_cpp_file_200": scores(theirs, prompt(200))}
    Path(a.out).write_text(json.dumps(out) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
