"""Golden digests of llama.cpp's GGUF conversion of the tiny Qwen4Exp checkpoint, for
tests/strata/test_convert.py.

    python scripts/golden_convert.py LLAMA_CPP_DIR            # writes tests/data/convert_golden.json
    python scripts/golden_convert.py LLAMA_CPP_DIR --mmproj   # writes tests/data/mmproj_golden.json

LLAMA_CPP_DIR is a llama.cpp source tree with convert_hf_to_gguf.py, conversion/ and
gguf-py/ (the llama-cpp-python 0.3.36 sdist vendors one under vendor/llama.cpp). Its
converter needs only torch, numpy, transformers and safetensors, all in Strata's test
environment. The checkpoint is strata.convert.synth's, seed 0, built in a folder named
`flash-tiny` (the folder's name becomes general.name).

llama.cpp's converter reads config.json through transformers' AutoConfig when transformers
knows the model; transformers 5.23 knows qwen4_exp and renames the layer type
`full_attention` to `indexed_attention`, after which the converter writes compress ratio 0
for every layer (QSA off). Where transformers does not know the model, the converter reads
config.json itself and writes the ratio for the full-attention layers, which is what the
model means. The digests are taken that way (AutoConfig made to fail), so that they hold
what llama.cpp intends; `--autoconfig` keeps transformers in the loop instead.

Each output is read by gguf-py (llama.cpp's own GGUF reader, the `gguf` package). For each
--outtype the golden data holds the sha256 of the whole file and its size, and a digest that
says where two files differ: every metadata key (type, sha256 of its value as JSON, and the
value itself when short) and every tensor (type, shape, offset, sha256 of its bytes) in
file order; plus the sha256 of each checkpoint tensor, so that a test can tell a changed
checkpoint from a changed conversion. The bytes of the `.ssm_a` tensors (-exp(A_log), whose
last bit torch's exp sets differently on CPUs with and without AVX-512) are kept as well,
so that a test on another machine can put llama.cpp's in place and still compare whole files.

`--mmproj` (for tests/strata/test_mmproj.py) takes the vision tower instead, and leaves
convert_golden.json alone: the checkpoint is synth's Qwen4ExpForConditionalGeneration
(strata.hub.FLASH_TINY with `vision={}`, float32, seed 0) built in a folder named
`flash-tiny-vision`, converted by llama.cpp's converter with `--mmproj` for each --outtype,
and the digests, with those of the checkpoint's `model.visual.*` tensors, go to
tests/data/mmproj_golden.json. (Given --outfile, that converter writes the mmproj to that
very path; only without one does it prefix the name with `mmproj-`.) The mmproj reads no
layer types, and llama.cpp's output is the same with and without AutoConfig.

`assert_matches` compares a file with such a digest, for the tests.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "convert_golden.json"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
CHECKPOINT_NAME = "flash-tiny"
SEED = 0
MMPROJ_OUT = ROOT / "tests" / "data" / "mmproj_golden.json"
MMPROJ_CHECKPOINT_NAME = "flash-tiny-vision"
VISUAL_PREFIX = "model.visual."
# tensors whose bytes depend on the CPU torch runs on (see the docstring)
MACHINE_DEPENDENT = (".ssm_a",)

# run llama.cpp's converter with AutoConfig unavailable: it then reads config.json as written
_RAW_CONFIG = """
import runpy, sys, transformers
def _refuse(*a, **k):
    raise ValueError("strata golden: read config.json directly")
transformers.AutoConfig.from_pretrained = _refuse
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _json_sha(value) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False).encode()).hexdigest()


def _type_name(field) -> str:
    return "/".join(t.name for t in field.types)  # ARRAY/UINT64 for an array


def digest_gguf(path: Path) -> dict:
    """The file as gguf-py reads it: whole-file sha256 and size, metadata and tensors in
    file order, and the bytes of the machine-dependent tensors (MACHINE_DEPENDENT)."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    meta = []
    for key, field in r.fields.items():
        if key.startswith("GGUF."):  # the header's own fields (version, counts)
            continue
        value = field.contents()
        entry = {"key": key, "type": _type_name(field), "sha256": _json_sha(value)}
        if len(json.dumps(value, ensure_ascii=False)) <= 200:
            entry["value"] = value
        meta.append(entry)
    tensors, machine = [], {}
    for t in r.tensors:
        raw = np.ascontiguousarray(t.data).tobytes()
        tensors.append({"name": t.name, "type": t.tensor_type.name, "shape": [int(n) for n in t.shape],
                        "offset": int(t.data_offset), "sha256": hashlib.sha256(raw).hexdigest()})
        if t.name.endswith(MACHINE_DEPENDENT):
            machine[t.name] = raw.hex()
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size, "metadata": meta, "tensors": tensors,
            "machine_dependent": machine}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def digest_checkpoint(hf_dir: Path, prefix: str = "") -> dict[str, str]:
    """The sha256 of each checkpoint tensor whose name starts with `prefix`."""
    import torch
    from safetensors import safe_open

    out = {}
    for part in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(part, framework="pt") as f:
            for name in sorted(k for k in f.keys() if k.startswith(prefix)):
                raw = f.get_tensor(name).contiguous().reshape(-1).view(torch.uint8)
                out[name] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return out


def _first_difference(got: list, want: list) -> str:
    i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    at = lambda xs: repr(xs[i]) if i < len(xs) else "(end)"
    return f"{len(got)} here, {len(want)} in llama.cpp's; first difference at #{i}: {at(got)} here, {at(want)} there"


def assert_matches(path: Path, want: dict, label: str) -> None:
    """The file at `path` equals the one `want` digests (digest_gguf of llama.cpp's output),
    byte for byte; the AssertionError names the first metadata key or tensor that differs.

    One exception, and it is bounded: the tensors of want's machine_dependent (`.ssm_a`,
    -exp(A_log): torch's float32 exp, which llama.cpp's converter and Strata both call, sets
    the last bit differently on CPUs with and without AVX-512) may differ by 1 ulp from the
    golden machine's, and llama.cpp's bytes are put in their place before the whole file is
    hashed."""
    path = Path(path)
    got = digest_gguf(path)
    # first the digest, for a message that names the key or tensor that differs
    keys = [[m["key"] for m in d["metadata"]] for d in (got, want)]
    assert keys[0] == keys[1], f"{label}: metadata keys: {_first_difference(*keys)}"
    for g, w in zip(got["metadata"], want["metadata"]):
        assert (g["type"], g["sha256"]) == (w["type"], w["sha256"]), (
            f"{label}: metadata {g['key']!r}: {g['type']} {g.get('value', '(long value)')!r} here, "
            f"{w['type']} {w.get('value', '(long value)')!r} in llama.cpp's")
    names = [[t["name"] for t in d["tensors"]] for d in (got, want)]
    assert names[0] == names[1], f"{label}: tensors: {_first_difference(*names)}"
    data = bytearray(path.read_bytes())
    for g, w in zip(got["tensors"], want["tensors"]):
        if g["name"] in want["machine_dependent"]:
            ours = np.frombuffer(bytes.fromhex(got["machine_dependent"][g["name"]]), np.float32)
            theirs = np.frombuffer(bytes.fromhex(want["machine_dependent"][g["name"]]), np.float32)
            assert np.all(np.abs(ours.view(np.int32) - theirs.view(np.int32)) <= 1), (
                f"{label}: tensor {g['name']!r} differs from llama.cpp's by more than 1 ulp")
            data[g["offset"]:g["offset"] + theirs.nbytes] = theirs.tobytes()
            g, w = ({k: v for k, v in t.items() if k != "sha256"} for t in (g, w))
        assert g == w, f"{label}: tensor {g['name']!r}: {g} here, {w} in llama.cpp's"
    assert len(data) == want["bytes"], f"{label}: {len(data)} bytes here, {want['bytes']} in llama.cpp's"
    assert hashlib.sha256(data).hexdigest() == want["sha256"], f"{label}: the files differ outside the tensors"


def run_llama_cpp(llama_dir: Path, hf_dir: Path, out: Path, outtype: str, autoconfig: bool = False,
                  mmproj: bool = False) -> None:
    env = {**os.environ, "PYTHONPATH": str(llama_dir / "gguf-py")}
    script = str(llama_dir / "convert_hf_to_gguf.py")
    args = [str(hf_dir), "--outfile", str(out), "--outtype", outtype] + (["--mmproj"] if mmproj else [])
    cmd = [sys.executable, script, *args] if autoconfig else [sys.executable, "-c", _RAW_CONFIG, script, *args]
    subprocess.run(cmd, env=env, check=True, cwd=llama_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def golden_mmproj(llama_dir: Path, autoconfig: bool = False) -> dict:
    """llama.cpp's --mmproj output for the vision checkpoint, digested per --outtype."""
    from strata.convert.synth import build_qwen4exp_checkpoint
    from strata.hub import FLASH_TINY, pull_smollm2

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_qwen4exp_checkpoint(Path(tmp) / MMPROJ_CHECKPOINT_NAME, FLASH_TINY, seed=SEED,
                                           dtype="float32", tokenizer_gguf=pull_smollm2(), vision={})
        golden = {"seed": SEED, "checkpoint_name": MMPROJ_CHECKPOINT_NAME,
                  "checkpoint": digest_checkpoint(hf_dir, VISUAL_PREFIX), "outtypes": {}}
        for outtype in OUTTYPES:
            out = Path(tmp) / f"mmproj-ref-{outtype}.gguf"
            run_llama_cpp(llama_dir, hf_dir, out, outtype, autoconfig, mmproj=True)
            golden["outtypes"][outtype] = d = digest_gguf(out)
            print(f"mmproj {outtype}: {len(d['tensors'])} tensors, {d['bytes']} bytes, sha256 {d['sha256']}",
                  file=sys.stderr)
    return golden


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("llama_cpp_dir", type=Path)
    p.add_argument("--autoconfig", action="store_true", help="let the converter read the config via transformers")
    p.add_argument("--mmproj", action="store_true",
                   help=f"the vision tower's mmproj instead: write {MMPROJ_OUT.relative_to(ROOT)} "
                        f"(and leave {OUT.relative_to(ROOT)} as it is)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.mmproj:
        golden = golden_mmproj(args.llama_cpp_dir.resolve(), args.autoconfig)
        MMPROJ_OUT.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {MMPROJ_OUT}", file=sys.stderr)
        return
    from strata.convert.synth import build_qwen4exp_checkpoint
    from strata.hub import pull_smollm2

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_qwen4exp_checkpoint(Path(tmp) / CHECKPOINT_NAME, seed=SEED, tokenizer_gguf=pull_smollm2())
        golden = {"seed": SEED, "checkpoint_name": CHECKPOINT_NAME, "checkpoint": digest_checkpoint(hf_dir),
                  "outtypes": {}}
        for outtype in OUTTYPES:
            out = Path(tmp) / f"ref-{outtype}.gguf"
            run_llama_cpp(args.llama_cpp_dir.resolve(), hf_dir, out, outtype, args.autoconfig)
            golden["outtypes"][outtype] = digest_gguf(out)
            d = golden["outtypes"][outtype]
            print(f"{outtype}: {len(d['tensors'])} tensors, {d['bytes']} bytes, sha256 {d['sha256']}", file=sys.stderr)
    OUT.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
