"""`strata`: the one command-line parser (the flags several commands share are strata.cli.args')."""
from __future__ import annotations

import argparse

from strata.bench import TABLE_FORMATS
from strata.cli.args import (KV_CHOICES, add_chat_args, add_device_args, add_expert_args, add_kv_args, add_model_args,
                             add_parallel_args, add_ple_args, add_sampling_args, add_spec_args, add_vision_args,
                             formats)
from triton_kernels.analysis import OPS, TARGET_SPECS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description="Strata: quantized GGUF models on Triton kernels")
    sub = p.add_subparsers(dest="command", required=True)

    pull = sub.add_parser("pull", help="fetch a known model into the cache")
    pull.add_argument("name", choices=("smollm2",))

    sy = sub.add_parser("synth", help="build a test model into the cache (flash-tiny: a random "
                                      "Qwen3.8-Flash-Next with the real structure, scaled down; "
                                      "flash-tiny-vision: the same with a tiny vision tower; flash-shape: "
                                      "its real widths and PLE table, random blocks, about 35 GB at 4 layers)")
    sy.add_argument("name", choices=("flash-tiny", "flash-tiny-vision", "flash-shape"))
    sy.add_argument("--force", action="store_true", help="rebuild even when cached")
    sy.add_argument("--layers", type=int, default=None, metavar="L",
                    help="flash-shape: layers (default 4; the MTP block comes after them)")
    sy.add_argument("--rows", type=int, default=None, metavar="N",
                    help="flash-shape: PLE table rows (default the real 320,001,536: 26.8 GiB)")
    sy.add_argument("--out", default=None, metavar="DIR",
                    help="flash-shape: directory for its files (default: flash-shape/ in the Strata cache)")

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as is")
    add_chat_args(gen)
    add_model_args(gen)
    add_vision_args(gen, images=True)
    add_sampling_args(gen)
    add_spec_args(gen)

    chat = sub.add_parser("chat", help="interactive chat (one line a turn; /image PATH shows an image with the "
                                       "next turn; /reset, /exit)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_chat_args(chat)
    add_model_args(chat)
    add_vision_args(chat)
    add_sampling_args(chat)
    add_spec_args(chat)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with slots and a conversation cache")
    add_model_args(srv)
    add_vision_args(srv)
    add_spec_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--slots", "-np", type=int, default=4, help="requests decoded together")
    srv.add_argument("--queue", type=int, default=64, help="requests that may wait for a slot (then 503)")
    srv.add_argument("--conversation-cache-mib", type=float, default=512,
                     help="memory for finished conversations' KV state, reused by prompts that extend them")
    srv.add_argument("--ctx-size", "-c", type=int, default=None, help="tokens per request (default: the model's)")
    srv.add_argument("--max-tokens", type=int, default=512, help="default max_tokens of a request")
    srv.add_argument("--api-key", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                          "$STRATA_API_KEY; none: anyone who reaches the port may use the model)")
    srv.add_argument("--max-request-bytes", type=int, default=8 << 20, metavar="N",
                     help="largest request body accepted, in bytes (413 above it; default 8 MiB)")
    srv.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                     help="longest prompt accepted, in tokens (400 above it; default: the context size)")
    # a repeated question gets the same answer whatever else the server is doing: batch-invariant
    # numerics cost the server little (bench serve --batch-invariant), prefill elsewhere more
    srv.set_defaults(batch_invariant=True)

    bench = sub.add_parser("bench", help="measure kernels and paths against their peers")
    bsub = bench.add_subparsers(dest="what", required=True)
    dq = bsub.add_parser("dequant", help="dequantization throughput: torch path, Triton kernel, gguf-py")
    dq.add_argument("--formats", type=formats, default=None,
                    help="comma-separated formats (default: all), e.g. IQ3_XXS,IQ3_S")
    dq.add_argument("--mib", type=float, default=64.0,
                    help="MiB of quantized blocks per format (default 64; at least 1024 on CUDA)")
    dq.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: torch path and gguf-py; cuda: also the Triton kernel, checked and timed")
    dq.add_argument("--repeats", type=int, default=3, help="timed runs per path (median reported)")
    dq.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    dq.add_argument("--no-peer", action="store_true", help="skip the peer (gguf-py is slow on large sizes)")
    dq.add_argument("--peer", choices=("gguf-py", "ggml"), default="gguf-py",
                    help="gguf-py's numpy dequantize, or ggml's C to_float through llama-cpp-python's "
                         "libggml-base (with --threads 1: the single-core comparison)")
    dq.add_argument("--compile", action="store_true",
                    help="also time torch.compile's one-pass loops (Q8_0, Q4_0, IQ4_NL; the first "
                         "compile takes 10-45 s)")
    dq.add_argument("--json", action="store_true", help="print JSON instead of the table")

    bk = bsub.add_parser("kernels", help="instructions per weight, registers and spills of every "
                         "kernel from its machine code (--static, no GPU); GB/s on a GPU")
    bk.add_argument("--static", action="store_true",
                    help="compile for --target with no GPU and read the machine code")
    bk.add_argument("--target", default="sm_90",
                    help=f"comma-separated targets for --static: {', '.join(TARGET_SPECS)}")
    bk.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    bk.add_argument("--formats", default=None,
                    help=f"comma-separated formats (default: {','.join(TABLE_FORMATS)}; 'all' for every one)")
    bk.add_argument("--tune", action="store_true",
                    help="CUDA: time GEMV tiles per format and weight height, and the MoE decode's, "
                         "write the fastest to the device's config table")
    bk.add_argument("--ncu", action="store_true",
                    help="CUDA: the kernels' DRAM GB/s and sectors per load request from Nsight Compute's "
                         "counters (ncu on PATH)")
    bk.add_argument("--json", action="store_true", help="print JSON instead of tables")

    bm = bsub.add_parser("model", help="llama-bench's pp/tg tests, optionally against llama.cpp")
    bm.add_argument("--model", "-m", default="smollm2",
                    help="a known model, a .gguf path, or flash-shape[:LAYERS]: Qwen3.8-Flash-Next's real widths "
                         "in random blocks, built in memory (no file; 48 layers by default)")
    bm.add_argument("--rows", type=int, default=None, metavar="N",
                    help="flash-shape: PLE table rows (default the real 320,001,536: 26.8 GiB; e.g. 65536)")
    bm.add_argument("--gpu-mem", type=float, default=None, metavar="GIB",
                    help="--device cuda: place the model for a GPU of this many GiB (a larger card held to a "
                         "smaller one's budget; default: the device's free memory)")
    bm.add_argument("--ram", type=float, default=None, metavar="GIB",
                    help="--device cuda: place the model for this much free host RAM (default: MemAvailable)")
    bm.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    bm.add_argument("--threads", "-t", type=int, default=2)
    add_device_args(bm)
    add_parallel_args(bm)
    bm.add_argument("--n-prompt", "-p", type=int, default=512)
    bm.add_argument("--n-gen", "-n", type=int, default=128)
    bm.add_argument("--repeats", "-r", type=int, default=3)
    bm.add_argument("--spec", type=int, default=0, metavar="N",
                    help="also time the speculative verify of N+1 tokens (and N MTP drafts) against a "
                         "one-token step, and count the distinct experts each reads (qwen4exp)")
    bm.add_argument("--peer", choices=("llama.cpp", "transformers"), default=None,
                    help="also run the same model through llama-cpp-python, or transformers' eager "
                         "forward on the checkpoint it came from, in the same run")
    bm.add_argument("--hf-dir", default=None, help="--peer transformers: the Hugging Face checkpoint")
    bm.add_argument("--profile", action="store_true",
                    help="also profile decode steps (torch.profiler): the top ops a step, time per "
                         "module class, and the time outside ops")
    bm.add_argument("--profile-steps", type=int, default=8, metavar="N", help="--profile: steps profiled")
    bm.add_argument("--depth", "-d", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated context depths (llama-bench -d): pp and tg after a context of "
                         "that many tokens, e.g. 1000,32000,131072")
    bm.add_argument("--ubatch", type=int, default=512, help="--depth: tokens a chunk when filling the context")
    bm.add_argument("--json", action="store_true")

    bs = bsub.add_parser("serve", help="aggregate tok/s of the serving engine per slot count")
    bs.add_argument("--model", "-m", default="smollm2")
    bs.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    bs.add_argument("--threads", "-t", type=int, default=2)
    bs.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                    help="slot counts to compare, e.g. 1,4")
    bs.add_argument("--requests", type=int, default=16)
    bs.add_argument("--n-gen", "-n", type=int, default=64)
    bs.add_argument("--batch-invariant", action="store_true",
                    help="also run each slot count batch-invariant (serve's default), to measure its cost")
    bs.add_argument("--json", action="store_true")

    bp = bsub.add_parser("ple", help="PLE rows/s per I/O mode, cold and warm, against fio's random-read roof")
    bp.add_argument("--rows", type=int, default=None, help="table rows (default: 4 GiB of rows; real: 320001536)")
    bp.add_argument("--format", default="IQ4_NL", help="IQ4_NL, Q8_0, Q4_0, F16, BF16, F32 or FP8_E4M3")
    bp.add_argument("--file", default=None, help="table file (default: written once into the Strata cache)")
    bp.add_argument("--tokens", type=int, default=1024, help="tokens a run (16 rows each)")
    bp.add_argument("--ubatch", type=int, default=512, help="tokens a prefill step")
    bp.add_argument("--depth", type=int, default=16, help="direct reads in flight, and fio's jobs")
    bp.add_argument("--compute-us", type=float, default=0.0,
                    help="model work a step stands for (a sleep), during which announced reads proceed")
    bp.add_argument("--modes", type=lambda s: [m.strip() for m in s.split(",") if m.strip()], default=None,
                    help="comma-separated: ram,mmap,mmap-nohint,direct (default: all)")
    bp.add_argument("--json", action="store_true")

    pp = sub.add_parser("perplexity", help="llama-perplexity: PPL over a text, KL divergence from a base")
    pp.add_argument("model", nargs="?", default="smollm2", help="a known model (smollm2) or a .gguf path")
    pp.add_argument("--text", "-f", default=None, help="text file to score (see --make-text)")
    pp.add_argument("--ctx", "-c", type=int, default=None, help="tokens per chunk (default 512)")
    pp.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    pp.add_argument("--kl-divergence-base", default=None, metavar="BASE",
                    help="a base model (.gguf or known name), run side by side; or a log-probs file: "
                         "read with --kl-divergence, else written (as llama.cpp does)")
    pp.add_argument("--kl-divergence", action="store_true", help="compare against --kl-divergence-base")
    pp.add_argument("--save-all-logits", default=None, metavar="FILE",
                    help="save this model's log-probs (.npz) for a later --kl-divergence run")
    pp.add_argument("--save-top-k", type=int, default=None,
                    help="log-probs kept per token in a saved file (default 1024; 0: all)")
    pp.add_argument("--base-dtype", choices=("bf16", "f32"), default="f32",
                    help="compute dtype of a base model run side by side")
    pp.add_argument("--base-kv", choices=KV_CHOICES, default=None,
                    help="KV cache of a base model run side by side (default f32: exact), e.g. "
                         "--kv int8 --base-kv bf16 for what int8 costs against a bf16 cache")
    pp.add_argument("--make-text", default=None, metavar="OUT",
                    help="write the standard-library docstring text to OUT and exit")
    pp.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    pp.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    pp.add_argument("--threads", "-t", type=int, default=None)
    add_device_args(pp)
    add_kv_args(pp)
    add_parallel_args(pp)

    im = sub.add_parser("imatrix", help="llama-imatrix: importance matrix (GGUF) for llama-quantize --imatrix")
    im.add_argument("model", nargs="?", default="smollm2", help="a known model (smollm2) or a .gguf path")
    im.add_argument("--text", "-f", required=True, help="text file to evaluate")
    im.add_argument("--output", "-o", required=True, help="imatrix GGUF to write")
    im.add_argument("--ctx", "-c", type=int, default=512, help="tokens per chunk")
    im.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: all)")
    im.add_argument("--process-output", action="store_true", help="also collect output.weight")
    im.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    im.add_argument("--threads", "-t", type=int, default=None)
    add_device_args(im)

    add_quantize(sub)

    cv = sub.add_parser("convert", help="Hugging Face Qwen3.8-Flash-Next checkpoint -> GGUF, as llama.cpp writes it")
    cv.add_argument("hf_dir", help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    cv.add_argument("output", help=".gguf to write; an mtp.* block goes to mtp-<name> beside it")
    cv.add_argument("--outtype", default="f16", help="f32, f16 (default), bf16 or q8_0")
    cv.add_argument("--mmproj", action="store_true",
                    help="also write the vision tower to mmproj-<name> beside the output, as llama.cpp's "
                         "converter does with --mmproj (a Qwen4ExpForConditionalGeneration checkpoint)")

    pk = sub.add_parser("pack", help="write experts.bin and its index for the packed expert tier")
    pk.add_argument("model", help="a .gguf path (or a known model); the other shards of its set come along")
    pk.add_argument("--out", default=None, metavar="DIR",
                    help="directory for experts.bin and experts.txt (default: packs/<model> in the Strata cache)")

    pl = sub.add_parser("plan", help="what sits where, what a prompt reads from the drive, the drive's speed")
    pl.add_argument("model", help="a known model, a .gguf path, flash-next[:EXPERT_TYPE] (the real "
                                   "shapes, no file: with --gpu-mem, --gpus and --ram), or flash-shape[:LAYERS] "
                                   "(bench model's, made in memory)")
    pl.add_argument("--device", default=None,
                    help="cpu or cuda[:N]: where the model would compute (default: cuda when torch sees one)")
    pl.add_argument("--gpu-mem", type=float, default=None, metavar="GIB",
                    help="plan for a GPU of this many GiB (each, with --gpus) instead of this machine's")
    pl.add_argument("--gpus", type=int, default=1, help="GPUs the layers are split over (with --gpu-mem)")
    pl.add_argument("--ram", type=float, default=None, metavar="GIB",
                    help="plan for this much free host RAM instead of this machine's MemAvailable")
    pl.add_argument("--vram-reserve-mib", type=int, default=1024,
                    help="VRAM kept free a GPU (activations, KV, the CUDA context; default 1024)")
    pl.add_argument("--tokens", type=int, default=32768,
                    help="prompt length the drive reads are counted for (the context the KV cache holds, with a GPU)")
    pl.add_argument("--remeasure", action="store_true", help="measure the drive again (else its cached speed)")
    pl.add_argument("--ep", type=int, default=1, metavar="E", help="plan E expert shares a stage (see --pp)")
    pl.add_argument("--pp", type=int, default=1, metavar="P",
                    help="plan P pipeline stages: with --ep, each rank's memory and the bytes sent a token")
    pl.add_argument("--layer-split", default=None, metavar="L1,L2,...", help="--pp: each later stage's first layer")
    pl.add_argument("--chunk", type=int, default=512, help="--ep/--pp: prefill chunk the bytes sent are counted for")
    pl.add_argument("--mem-bw", type=float, default=4800.0, metavar="GB/S",
                    help="--ep/--pp: a rank's memory bandwidth for the break-even link (default 4800: an H200's HBM)")
    pl.add_argument("--json", action="store_true")
    add_ple_args(pl)
    add_expert_args(pl)

    pr = sub.add_parser("probe", help="drive speed by depth, page cache, mlock limit, and the I/O modes picked")
    pr.add_argument("model", nargs="?", default=None,
                    help="a known model or a .gguf path (default: the largest GGUF in the Strata cache)")
    pr.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the model would compute")
    pr.add_argument("--seconds", type=float, default=0.2, help="seconds a drive reading (8 readings)")
    pr.add_argument("--json", action="store_true")
    return p


def add_quantize(sub) -> None:
    qz = sub.add_parser("quantize", help="llama-quantize: requantize a GGUF (Q4_K_M, IQ4_XS, IQ3_XXS, ...)")
    qz.add_argument("input", help="source .gguf (a quantized source is dequantized first)")
    qz.add_argument("output", help=".gguf to write")
    qz.add_argument("type", help="Q4_K_M, Q5_K_M, Q3_K_M, Q6_K, IQ4_XS, IQ4_NL, IQ3_XXS, IQ3_S, Q4_0, Q4_1 or Q8_0 "
                    "(llama.cpp's mix for it)")
    qz.add_argument("--imatrix", default=None, help="importance matrix, llama.cpp's GGUF imatrix format")
    qz.add_argument("--tensor-type", action="append", metavar="REGEX=TYPE",
                    help="type of the tensors whose name matches REGEX (repeatable; first match wins)")
    qz.add_argument("--pure", action="store_true", help="TYPE for every tensor: no mix (fallback still applies)")
    qz.add_argument("--threads", "-t", type=int, default=2, help="tensors quantized at once")


def quantize_parser() -> argparse.ArgumentParser:
    """The parser of `strata quantize` alone: the full one imports torch (the bench and KV
    flags' choices), which quantize, numpy alone, does without."""
    p = argparse.ArgumentParser(prog="strata", description="Strata: quantized GGUF models on Triton kernels")
    add_quantize(p.add_subparsers(dest="command", required=True))
    return p
