"""Golden data written by llama.cpp's own tools, for tests/strata/test_perplexity.py,
test_imatrix.py and test_quantize.py.

    scripts/build_llama_cpp.sh --tools /tmp/llama-tools        # about 5 minutes on 2 cores
    python scripts/golden_llama_tools.py /tmp/llama-tools       # about 2 minutes
    python scripts/golden_llama_tools.py /tmp/llama-tools --only quantize   # one part again

The tools are llama-perplexity, llama-imatrix and llama-quantize of the llama.cpp that the
llama-cpp-python 0.3.36 sdist vendors (the llama.cpp Strata compares itself with), built for
this CPU. Each runs on SmolLM2-135M-Instruct Q4_1 (strata.hub) over the first 20,000
characters of strata.perplexity.stdlib_text() (`stdlib.txt`, kept as
tests/data/llama_tools_text.txt), 2 chunks of 128 tokens, 2 threads; what it prints and
the files it writes are read back here and kept, small, in
tests/data/llama_tools_golden.json and tests/data/llama_imatrix.npz:

- perplexity: the "[i]ppl" line and the final "PPL = x +/- y" of a plain run; the file
  `--kl-divergence-base` writes (llama.cpp's log-probs, 16 bits each; 12 MB here) read as
  llama-perplexity reads it: its header, the tokens it evaluated, and per scored position
  the log-prob of the next token and the argmax, decoded as its kl_divergence() decodes
  them; the statistics it prints for that file against the model itself ("Mean PPL(base)"
  is then computed from the decoded log-probs alone) and against the model with its
  ffn_down requantized to Q4_0 by llama-quantize (whose ffn_down bytes are hashed, so that
  the test can check that it evaluates the same weights);
- imatrix: llama-imatrix's GGUF as gguf-py reads it: metadata, every tensor's name, shape
  and type in file order, the header's bytes, every `.counts`, and the `.in_sum2` of blocks
  0, 15 and 29 (the whole file is 600 KB); and its file for flash-tiny (strata.hub, qwen4exp),
  whose routed experts it collects per expert: every `.counts`, and block 0's experts'
  `.in_sum2` (tests/data/llama_imatrix_moe.npz);
- quantize: llama-quantize --dry-run's type for every tensor, for each ftype
  strata.quantize.FTYPES names, without and with that importance matrix, --pure, and
  with a --tensor-type override; on SmolLM2 and on flash-tiny (strata.hub, qwen4exp).
  And the size and sha256 of the whole file llama-quantize writes from SmolLM2 for Q4_K_M,
  Q5_K_M, Q3_K_M, Q6_K and IQ4_XS (FILE_FTYPES), which `strata quantize` repeats byte for
  byte.

The converter's golden data is scripts/golden_convert.py's (same llama.cpp tree:
`python scripts/golden_convert.py /tmp/llama-tools/llama.cpp`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT_JSON = ROOT / "tests" / "data" / "llama_tools_golden.json"
OUT_NPZ = ROOT / "tests" / "data" / "llama_imatrix.npz"
OUT_MOE_NPZ = ROOT / "tests" / "data" / "llama_imatrix_moe.npz"
# the text the tools read, kept: docstrings move between Python versions, the tests' text must not
OUT_TEXT = ROOT / "tests" / "data" / "llama_tools_text.txt"

TEXT_CHARS = 20000
N_CTX, N_CHUNKS, THREADS = 128, 2, 2
TEXT_NAME = "stdlib.txt"
IMATRIX_LAYERS = (0, 15, 29)  # the first, a middle and the last block: activations drift with depth
# the Q model of the KLD run: SmolLM2 through the Q4_1 mix (which keeps every Q4_1 and Q8_0
# tensor as it is) with ffn_down requantized to Q4_0: a fifth of the weights to quantize
KLD_OVERRIDE = "ffn_down=q4_0"


def run(cmd: list, cwd: Path) -> str:
    """stdout and stderr of a tool, together (llama.cpp logs to both)."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{out[-3000:]}")
    return out


# -- llama-perplexity ------------------------------------------------------------------------

def parse_ppl(out: str) -> dict:
    chunks = [float(x) for x in re.findall(r"\[\d+\](\d+\.\d+),", out)]
    m = re.search(r"Final estimate: PPL = (\d+\.\d+) \+/- (\d+\.\d+)", out)
    if not chunks or not m:
        raise SystemExit(f"no perplexity in llama-perplexity's output:\n{out[-2000:]}")
    return {"chunk_ppl": chunks, "ppl": float(m.group(1)), "ppl_err": float(m.group(2))}


_KLD_LINE = re.compile(r"^(Mean PPL\(Q\)|Mean PPL\(base\)|Cor\(ln\(PPL\(Q\)\), ln\(PPL\(base\)\)\)|"
                       r"Mean ln\(PPL\(Q\)/PPL\(base\)\)|Mean PPL\(Q\)/PPL\(base\)|Mean PPL\(Q\)-PPL\(base\)|"
                       r"Mean +KLD|Maximum KLD|Median +KLD|Minimum KLD|[ \d.]+% +KLD|"
                       r"Mean +Δp|Maximum Δp|Median +Δp|Minimum Δp|[ \d.]+% +Δp|RMS Δp +|Same top p)"
                       r"\s*:\s*(-?\d+\.\d+)%?(?: ± +(\d+\.\d+))?", re.M)


def parse_kld(out: str) -> dict:
    """llama-perplexity --kl-divergence's closing statistics, label -> [value] or
    [value, uncertainty], as printed (Δp, Same top p and Cor in percent)."""
    stats = {}
    for m in _KLD_LINE.finditer(out):
        label = re.sub(r"\s+", " ", m.group(1)).strip()
        stats[label] = [float(m.group(2))] + ([float(m.group(3))] if m.group(3) else [])
    if "Mean KLD" not in stats or "Same top p" not in stats:
        raise SystemExit(f"no KLD statistics in llama-perplexity's output:\n{out[-2000:]}")
    return stats


def read_logits_file(path: Path) -> dict:
    """llama-perplexity's --kl-divergence-base file: "_logits_", n_ctx u32, n_vocab i32,
    n_chunk i32, the tokens evaluated (i32, n_chunk * n_ctx, BOS not substituted), then per
    chunk and scored position nv = 2*((n_vocab+1)/2) + 4 uint16: a float32 scale and min
    log-prob, then n_vocab codes; log p_i = scale * code_i + min (perplexity.cpp, log_softmax)."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise SystemExit(f"{path}: not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    per_chunk = n_ctx - 1 - n_ctx // 2
    rows = np.frombuffer(raw, np.uint16, n_chunk * per_chunk * nv, 20 + 4 * tokens.size).reshape(-1, nv)
    head = rows[:, :4].copy().view(np.float32)  # (P, 2): scale, min
    codes = rows[:, 4:4 + n_vocab]
    scale, low = head[:, 0], head[:, 1]
    first = n_ctx // 2
    targets = tokens.reshape(n_chunk, n_ctx)[:, first + 1:].reshape(-1)
    # as kl_divergence() decodes: float32 scale*code + min; the argmax the first of equal maxima
    token_logp = (scale * codes[np.arange(codes.shape[0]), targets].astype(np.float32) + low).astype(np.float32)
    return {"n_ctx": int(n_ctx), "n_vocab": int(n_vocab), "n_chunks": int(n_chunk),
            "tokens": tokens.tolist(), "scale": scale.tolist(), "min_log_prob": low.tolist(),
            "token_logp": token_logp.tolist(), "top": codes.argmax(axis=1).tolist(),
            "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def perplexity_golden(bins: Path, model: Path, q_model: Path, work: Path) -> dict:
    ppl = [bins / "llama-perplexity", "-f", TEXT_NAME, "-c", N_CTX, "-b", N_CTX, "--chunks", N_CHUNKS,
           "-t", THREADS]
    plain = parse_ppl(run([*ppl, "-m", model], work))
    parse_ppl(run([*ppl, "-m", model, "--kl-divergence-base", "base.bin"], work))  # writes the file
    base = read_logits_file(work / "base.bin")
    self_kld = parse_kld(run([*ppl, "-m", model, "--kl-divergence-base", "base.bin", "--kl-divergence"], work))
    q_kld = parse_kld(run([*ppl, "-m", q_model, "--kl-divergence-base", "base.bin", "--kl-divergence"], work))
    return {"plain": plain, "logits_file": base, "kld_self": self_kld, "kld_q": q_kld}


# -- llama-imatrix ---------------------------------------------------------------------------

def _run_imatrix(bins: Path, model: Path, work: Path, out: str):
    """llama-imatrix on `model` over the text's chunks: (the file, its reader, its metadata,
    every tensor's name, shape and type)."""
    from gguf import GGUFReader
    run([bins / "llama-imatrix", "-m", model, "-f", TEXT_NAME, "-c", N_CTX, "-b", N_CTX, "--chunks", N_CHUNKS,
         "-t", THREADS, "-o", out, "--output-frequency", 1000], work)
    path = work / out
    r = GGUFReader(path)
    meta = {k: {"type": f.types[0].name, "value": f.contents()} for k, f in r.fields.items()
            if not k.startswith("GGUF.")}
    tensors = [{"name": t.name, "shape": [int(n) for n in t.shape], "type": t.tensor_type.name} for t in r.tensors]
    return path, r, meta, tensors


def imatrix_golden(bins: Path, model: Path, work: Path) -> tuple[dict, dict[str, np.ndarray]]:
    path, r, meta, tensors = _run_imatrix(bins, model, work, "imatrix.gguf")
    arrays = {}
    for t in r.tensors:
        if t.name.endswith(".counts"):
            arrays[t.name] = np.array(t.data, dtype=np.float32)
        elif t.name.endswith(".in_sum2") and int(t.name.split(".")[1]) in IMATRIX_LAYERS:
            arrays[t.name] = np.array(t.data, dtype=np.float32)
    # the header (metadata, tensor names, shapes, types and offsets) does not depend on the
    # values: a file Strata writes for the same weights must repeat it byte for byte
    arrays["header"] = np.frombuffer(path.read_bytes()[:r.data_offset], np.uint8)
    return ({"metadata": meta, "tensors": tensors, "layers": list(IMATRIX_LAYERS),
             "bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}, arrays)


MOE_LAYERS = (0,)  # flash-tiny's block whose experts' sums are kept


def moe_imatrix_golden(bins: Path, model: Path, work: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """llama-imatrix on flash-tiny (qwen4exp: 64 routed experts a layer, 8 a token), same text
    and chunks: the metadata, every tensor's name, shape and type, the header's bytes, every
    `.counts` (per expert for the merged-experts tensors), and the experts' `.in_sum2` of
    MOE_LAYERS (256 x 64 floats each)."""
    path, r, meta, tensors = _run_imatrix(bins, model, work, "imatrix-moe.gguf")
    arrays = {"header": np.frombuffer(path.read_bytes()[:r.data_offset], np.uint8)}
    for t in r.tensors:
        if t.name.endswith(".counts") or ("_exps." in t.name and int(t.name.split(".")[1]) in MOE_LAYERS):
            arrays[t.name] = np.array(t.data, dtype=np.float32)
    return ({"model": model.name, "metadata": meta, "tensors": tensors, "layers": list(MOE_LAYERS),
             "bytes": path.stat().st_size}, arrays)


# -- llama-quantize --------------------------------------------------------------------------

_DRY_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s+(\w+), size = .*?(?:\((\w+)\))?$", re.M)


def dry_run_types(bins: Path, model: Path, ftype: str, work: Path, *flags) -> dict[str, str]:
    """llama-quantize --dry-run's target type of every tensor (upper case, as Strata names
    formats): the type in parentheses where it converts, else the tensor's own."""
    out = run([bins / "llama-quantize", "--dry-run", "--allow-requantize", *flags, model, ftype, THREADS], work)
    if (n := len(_DRY_LINE.findall(out))) != out.count("type = "):
        raise SystemExit(f"llama-quantize --dry-run: {n} tensor lines parsed of {out.count('type = ')}:\n{out[-2000:]}")
    types = {m.group(1): (m.group(3) or m.group(2)).upper() for m in _DRY_LINE.finditer(out)}
    if not types:
        raise SystemExit(f"no tensor lines in llama-quantize --dry-run's output:\n{out[-2000:]}")
    return types


def quantize_golden(bins: Path, models: dict[str, Path], imatrix: Path, work: Path) -> dict:
    """{"tensors": {model: [names in file order]}, "mixes": [{model, ftype, imatrix, pure,
    tensor_types, types: [type of each tensor, in that order]}]}."""
    from strata.quantize import FTYPES
    mixes = []
    for model_name, path in models.items():
        for ftype in FTYPES:
            mixes.append({"model": model_name, "ftype": ftype, "imatrix": False, "pure": False,
                          "tensor_types": [], "types": dry_run_types(bins, path, ftype, work)})
            if model_name == "smollm2":  # the imatrix is SmolLM2's: only the mixes that change with one
                mixes.append({"model": model_name, "ftype": ftype, "imatrix": True, "pure": False,
                              "tensor_types": [],
                              "types": dry_run_types(bins, path, ftype, work, "--imatrix", imatrix)})
        mixes.append({"model": model_name, "ftype": "IQ3_XXS", "imatrix": False, "pure": True, "tensor_types": [],
                      "types": dry_run_types(bins, path, "IQ3_XXS", work, "--pure")})
        override = r"blk\.(0|1)\.ffn_down=iq3_xxs"
        mixes.append({"model": model_name, "ftype": "IQ3_XXS", "imatrix": False, "pure": False,
                      "tensor_types": [override],
                      "types": dry_run_types(bins, path, "IQ3_XXS", work, "--tensor-type", override)})
    names = {m["model"]: list(m["types"]) for m in mixes}
    for m in mixes:
        if list(m["types"]) != names[m["model"]]:
            raise SystemExit(f"{m['model']} {m['ftype']}: llama-quantize listed other tensors than before")
        m["types"] = list(m["types"].values())
    return {"tensors": names, "mixes": mixes}


# the mixes whose whole file Strata writes as llama-quantize does, byte for byte
FILE_FTYPES = ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q6_K", "IQ4_XS")


def quantized_files(bins: Path, model: Path, work: Path) -> dict:
    """{ftype: {"bytes", "sha256"}} of the file llama-quantize writes from `model` for each
    of FILE_FTYPES (no importance matrix)."""
    out = {}
    for ftype in FILE_FTYPES:
        dst = work / f"q-{ftype}.gguf"
        run([bins / "llama-quantize", "--allow-requantize", model, dst, ftype, THREADS], work)
        out[ftype] = {"bytes": dst.stat().st_size, "sha256": hashlib.sha256(dst.read_bytes()).hexdigest()}
        dst.unlink()
    return out


def tensor_sha256(path: Path, pattern: str) -> dict[str, str]:
    from gguf import GGUFReader
    r = GGUFReader(path)
    return {t.name: hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()
            for t in r.tensors if re.search(pattern, t.name)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tools_dir", type=Path, help="scripts/build_llama_cpp.sh --tools DIR's DIR")
    p.add_argument("--only", choices=("quantize", "imatrix_moe"), action="append",
                   help="recompute this part alone (llama-imatrix and llama-quantize), keeping the rest "
                        "of the golden data as it is (repeatable)")
    args = p.parse_args()
    bins = args.tools_dir.resolve() / "build" / "bin"
    if args.only:
        return only(bins, set(args.only))
    for tool in ("llama-perplexity", "llama-imatrix", "llama-quantize"):
        if not (bins / tool).is_file():
            raise SystemExit(f"{bins / tool}: missing; build it with scripts/build_llama_cpp.sh --tools {args.tools_dir}")
    from strata.hub import pull_smollm2, synth_flash_tiny
    from strata.perplexity import stdlib_text, text_sha256

    smollm2, flash_tiny = pull_smollm2(), synth_flash_tiny()
    text = stdlib_text()[:TEXT_CHARS]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / TEXT_NAME).write_text(text, encoding="utf-8")
        print("llama-imatrix ...", file=sys.stderr)
        imatrix, arrays = imatrix_golden(bins, smollm2, work)
        print("llama-imatrix (flash-tiny) ...", file=sys.stderr)
        moe_imatrix, moe_arrays = moe_imatrix_golden(bins, flash_tiny, work)
        print("llama-quantize --dry-run ...", file=sys.stderr)
        mixes = quantize_golden(bins, {"smollm2": smollm2, "flash-tiny": flash_tiny}, work / "imatrix.gguf", work)
        print("llama-quantize (whole files) ...", file=sys.stderr)
        mixes["files"] = {"model": smollm2.name, **quantized_files(bins, smollm2, work)}
        print("llama-quantize (the KLD run's Q model) ...", file=sys.stderr)
        q_model = work / "smollm2-q4_1-ffn_down-q4_0.gguf"
        run([bins / "llama-quantize", "--allow-requantize", "--tensor-type", KLD_OVERRIDE,
             smollm2, q_model, "Q4_1", THREADS], work)
        print("llama-perplexity ...", file=sys.stderr)
        ppl = perplexity_golden(bins, smollm2, q_model, work)
        ppl["q_model"] = {"source": smollm2.name, "ftype": "Q4_1", "tensor_types": [KLD_OVERRIDE],
                          "ffn_down_sha256": tensor_sha256(q_model, r"ffn_down")}
    golden = {
        "llama_cpp": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp, built by scripts/build_llama_cpp.sh --tools",
        "text": {"source": f"strata.perplexity.stdlib_text()[:{TEXT_CHARS}]", "file": TEXT_NAME,
                 "sha256": text_sha256(text)},
        "n_ctx": N_CTX, "n_chunks": N_CHUNKS, "model": smollm2.name,
        "perplexity": ppl, "imatrix": imatrix, "imatrix_moe": moe_imatrix, "quantize": mixes,
    }
    OUT_JSON.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n")
    np.savez_compressed(OUT_NPZ, **arrays)
    np.savez_compressed(OUT_MOE_NPZ, **moe_arrays)
    OUT_TEXT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT_TEXT}, {OUT_JSON} ({OUT_JSON.stat().st_size} bytes) and {OUT_NPZ} ({OUT_NPZ.stat().st_size} bytes)",
          file=sys.stderr)


def only(bins: Path, parts: set[str]) -> None:
    """Some parts again (the quantize mixes after FTYPES grew, ...), the rest as it was."""
    from strata.hub import pull_smollm2, synth_flash_tiny
    golden = json.loads(OUT_JSON.read_text())
    smollm2, flash_tiny = pull_smollm2(), synth_flash_tiny()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / TEXT_NAME).write_text(OUT_TEXT.read_text(encoding="utf-8"), encoding="utf-8")  # the kept parts
        if "imatrix_moe" in parts:
            print("llama-imatrix (flash-tiny) ...", file=sys.stderr)
            golden["imatrix_moe"], moe_arrays = moe_imatrix_golden(bins, flash_tiny, work)
            np.savez_compressed(OUT_MOE_NPZ, **moe_arrays)
        if "quantize" in parts:
            print("llama-imatrix ...", file=sys.stderr)
            imatrix_golden(bins, smollm2, work)
            print("llama-quantize --dry-run ...", file=sys.stderr)
            golden["quantize"] = quantize_golden(bins, {"smollm2": smollm2, "flash-tiny": flash_tiny},
                                                 work / "imatrix.gguf", work)
            print("llama-quantize (whole files) ...", file=sys.stderr)
            golden["quantize"]["files"] = {"model": smollm2.name, **quantized_files(bins, smollm2, work)}
    OUT_JSON.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {OUT_JSON} ({OUT_JSON.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
