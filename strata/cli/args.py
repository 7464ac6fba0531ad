"""The flags that several commands share, and what they become: model flags to
strata.load.Options, sampling flags to SamplingParams."""
from __future__ import annotations

import argparse

DTYPE_NAMES = ("bf16", "f32")  # --dtype's spellings; DTYPES maps them to torch dtypes


def _dtypes() -> dict:
    import torch
    return {"bf16": torch.bfloat16, "f32": torch.float32}


def __getattr__(name: str):
    # DTYPES at its first use: torch takes seconds to import, and `import strata.cli` (for
    # --help, or a command that loads no model) does without it
    if name == "DTYPES":
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def formats(text: str) -> list[str]:
    """`--formats A,B`: format names as quant spells them."""
    import quant
    try:
        return [quant.get(t.strip()).name for t in text.split(",") if t.strip()]
    except ValueError as e:  # argparse prints an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(e)) from None


def tier(text: str) -> str:
    """`--experts TIER`, checked as the flag is read."""
    from strata.storage.expert_tier import parse_tier
    try:
        parse_tier(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, metavar="cuda|cpu",
                   help="where the model computes: cuda[:N] or cpu (default: cuda when torch sees one)")
    p.add_argument("--kernels", choices=("triton", "torch"), default=None,
                   help="the ops' implementation (default: triton on a GPU, torch on the CPU; triton on "
                        "the CPU runs the Triton interpreter: slow, for checking the GPU path)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="a token's result does not depend on the prompt's chunking or the requests "
                        "batched beside it (fixed-shape matmuls; costs prefill speed: docs/serving.md). "
                        "Default: on in serve; elsewhere on in decode steps alone, so that greedy --spec "
                        "gives --spec 0's tokens (--no-batch-invariant: nowhere)")
    p.add_argument("--vram-reserve-mib", type=int, default=1024,
                   help="VRAM a GPU keeps free (activations, KV growth, the CUDA context) when the "
                        "placement sizes the expert cache (default 1024)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Several processes under torchrun (strata.dist)."""
    g = p.add_argument_group("several processes (torchrun --nproc-per-node E*P -m strata ...)")
    g.add_argument("--ep", type=int, default=1, metavar="E",
                   help="expert parallelism: each of E ranks holds 1/E of every layer's experts (default 1)")
    g.add_argument("--pp", type=int, default=1, metavar="P",
                   help="layer pipeline: P stages of consecutive layers (default 1)")
    g.add_argument("--layer-split", default=None, metavar="L1,L2,...",
                   help="--pp: the first layer of each stage after the first (default: even)")
    g.add_argument("--plan-all-ranks", action="store_true",
                   help="every rank prints its plan lines, prefixed by its rank (default: rank 0 alone)")
    g.add_argument("--dist-timeout", type=float, default=300.0, metavar="S",
                   help="seconds a collective may wait for the other ranks before the run ends, naming "
                        "the rank that is gone (default 300)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="smollm2",
                   help="a known model (smollm2: pulled on first use) or a .gguf path")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16",
                   help="compute dtype (bf16: fast; f32: exact weights)")
    add_device_args(p)
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--qsa", choices=("on", "off"), default="on",
                   help="qwen4exp: QSA sparse attention past the indexer's budget (on, as transformers) "
                        "or dense attention at every length (off, as llama.cpp)")
    add_context_args(p)
    add_ple_args(p)
    add_expert_args(p)
    add_parallel_args(p)


def add_context_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="tokens a sequence may hold (default: the model's trained context, times --rope-scale)")
    p.add_argument("--rope-scaling", choices=("none", "linear", "yarn"), default=None,
                   help="stretch RoPE past the trained context (default: the file's rope.scaling, else none)")
    p.add_argument("--rope-scale", type=float, default=None, metavar="S",
                   help="the stretch factor: the context becomes S x the trained one")
    p.add_argument("--yarn-orig-ctx", type=int, default=None, metavar="N",
                   help="the context the model was trained on (default: the file's)")
    add_kv_args(p)


# strata.nn.kv.KV_TYPES, spelt here so that building the parser imports no torch (seconds,
# which `strata quantize` never needs)
KV_CHOICES = ("f32", "bf16", "f16", "int8")


def add_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv", choices=KV_CHOICES, default=None,
                   help="how the attention cache stores keys and values: f32 (default, exact), bf16, f16, "
                        "or int8 (codes and a float16 scale per head and token: about half of bf16)")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="models whose chat template has a thinking switch (Qwen3 and on): --think asks "
                        "for reasoning first, --no-think for the answer alone (default: the template's)")


def add_vision_args(p: argparse.ArgumentParser, images: bool = False) -> None:
    p.add_argument("--mmproj", default=None, metavar="PATH",
                   help="the vision tower's GGUF (default: mmproj-<model file> beside the model, where there "
                        "is one; `strata convert HF_DIR OUT.gguf --mmproj` writes it)")
    if images:
        p.add_argument("--image", action="append", default=None, metavar="PATH",
                       help="an image to show the model, before the prompt's text (several allowed)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-predict", "-n", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", "--temp", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="0: off")
    p.add_argument("--top-p", type=float, default=0.95, help="1.0: off")
    p.add_argument("--min-p", type=float, default=0.05, help="0.0: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding's flags (generate, chat, serve)."""
    p.add_argument("--spec", type=int, default=0, metavar="N",
                   help="speculative decoding: up to N tokens a step drafted by the model's MTP head "
                        "(qwen4exp), verified in one forward of N+1; greedy, the output is --spec 0's "
                        "(default 0: off)")
    p.add_argument("--spec-min-p", type=float, default=0.0, metavar="P",
                   help="--spec: stop drafting when the draft's top probability falls below P (default 0)")


def add_ple_args(p: argparse.ArgumentParser) -> None:
    """The PLE table's flags, for every command that loads a model with one."""
    p.add_argument("--ple-io", choices=("auto", "ram", "mmap", "direct"), default="auto",
                   help="how PLE rows are read: ram (read whole, mlock), mmap (page cache, hinted), "
                        "direct (O_DIRECT, thread pool), auto (measure, keep the faster; default)")
    p.add_argument("--ple-gguf", default=None, metavar="PATH",
                   help="the file holding the PLE table (GGUF or safetensors FP8; default: the model's GGUF)")
    p.add_argument("--no-ple-prefetch", action="store_true",
                   help="announce no step's rows ahead: no MADV_WILLNEED hints (mmap), no read-ahead (direct)")
    p.add_argument("--ple-io-depth", type=int, default=16, metavar="N",
                   help="direct reads in flight (threads) for --ple-io direct (default 16)")


def add_expert_args(p: argparse.ArgumentParser) -> None:
    """The expert tier's flags, for every command that loads a MoE model."""
    p.add_argument("--experts", type=tier, default=None, metavar="TIER",
                   help="where routed experts live: device (resident), host (RAM; pinned on CUDA), "
                        "cache:N[:host|packed|file] (N slots on the device, LRU), packed (experts.bin "
                        "of `strata pack`), file (read in place from the GGUF). Default: dense on the "
                        "CPU while memory lasts, else device; on a GPU, what the placement fits")
    p.add_argument("--experts-dir", default=None, metavar="DIR",
                   help="the directory `strata pack --out` wrote experts.bin and experts.txt to "
                        "(default: packs/<model> in the Strata cache)")
    p.add_argument("--experts-io", choices=("direct", "mmap"), default="direct",
                   help="how packed and file tiers read: direct (O_DIRECT, thread pool; default) or "
                        "mmap (page cache, one batched MADV_WILLNEED a fetch)")
    p.add_argument("--experts-io-depth", type=int, default=16, metavar="N",
                   help="direct reads in flight (threads) for --experts-io direct (default 16)")


def load_options(args, **override):
    """strata.load.Options from a command's flags; a command without some of them (perplexity,
    imatrix, bench) takes their defaults, except that a command-line load reads the PLE table
    through the storage tier (--ple-io auto), where a library load keeps it in the mapping."""
    from strata.load import Options
    get = (lambda k, d=None: override.get(k, getattr(args, k, d)))
    dtype = get("dtype", "bf16")
    return Options(
        dtype=_dtypes().get(dtype, dtype), device=get("device"), kernels=get("kernels"), threads=get("threads"),
        qsa=get("qsa", "on") != "off", experts=get("experts"), experts_dir=get("experts_dir"),
        experts_io=get("experts_io", "direct"), experts_io_depth=get("experts_io_depth", 16),
        ple_io=get("ple_io", "auto"), ple_file=get("ple_gguf"), ple_prefetch=not get("no_ple_prefetch", False),
        ple_io_depth=get("ple_io_depth", 16), vram_reserve_mib=get("vram_reserve_mib", 1024),
        tokens=get("tokens", None) or 32768, rope_scaling=get("rope_scaling"), rope_scale=get("rope_scale"),
        yarn_orig_ctx=get("yarn_orig_ctx"), max_context=get("max_context"), kv=get("kv"),
        batch_invariant=get("batch_invariant"))
