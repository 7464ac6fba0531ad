"""`strata`: the one command-line parser."""
from __future__ import annotations

import argparse
import sys

import torch


def _formats(text: str) -> list[str]:
    import quant
    try:
        return [quant.get(t.strip()).name for t in text.split(",") if t.strip()]
    except ValueError as e:  # argparse prints an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(e)) from None


def _device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, metavar="cuda|cpu",
                   help="where the model computes: cuda[:N] or cpu (default: cuda when torch sees one)")
    p.add_argument("--kernels", choices=("triton", "torch"), default=None,
                   help="the ops' implementation (default: triton on a GPU, torch on the CPU; triton on "
                        "the CPU runs the Triton interpreter: slow, for checking the GPU path)")
    p.add_argument("--vram-reserve-mib", type=int, default=1024,
                   help="VRAM a GPU keeps free (activations, KV growth, the CUDA context) when the "
                        "placement sizes the expert cache (default 1024)")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="smollm2",
                   help="a known model (smollm2: pulled on first use) or a .gguf path")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16",
                   help="compute dtype (bf16: fast; f32: exact weights)")
    _device_args(p)
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--qsa", choices=("on", "off"), default="on",
                   help="qwen4exp: QSA sparse attention past the indexer's budget (on, as transformers) "
                        "or dense attention at every length (off, as llama.cpp)")
    add_ple_args(p)
    from strata.storage.experts import add_expert_args
    add_expert_args(p)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-predict", "-n", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", "--temp", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="0: off")
    p.add_argument("--top-p", type=float, default=0.95, help="1.0: off")
    p.add_argument("--min-p", type=float, default=0.05, help="0.0: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def add_ple_args(p: argparse.ArgumentParser) -> None:
    """The PLE table's flags, for every command that loads a model with one
    (strata.storage.ple.open_from_args reads them)."""
    p.add_argument("--ple-io", choices=("auto", "ram", "mmap", "direct"), default="auto",
                   help="how PLE rows are read: ram (read whole, mlock), mmap (page cache, hinted), "
                        "direct (O_DIRECT, thread pool), auto (measure, keep the faster; default)")
    p.add_argument("--ple-gguf", default=None, metavar="PATH",
                   help="the file holding the PLE table (GGUF or safetensors FP8; default: the model's GGUF)")
    p.add_argument("--no-ple-prefetch", action="store_true",
                   help="announce no step's rows ahead: no MADV_WILLNEED hints (mmap), no read-ahead (direct)")
    p.add_argument("--ple-io-depth", type=int, default=16, metavar="N",
                   help="direct reads in flight (threads) for --ple-io direct (default 16)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    pull = sub.add_parser("pull", help="fetch a known model into the cache")
    pull.add_argument("name", choices=("smollm2",))

    sy = sub.add_parser("synth", help="build a test model into the cache (flash-tiny: a random "
                                      "Qwen3.8-Flash-Next with the real structure, scaled down)")
    sy.add_argument("name", choices=("flash-tiny",))
    sy.add_argument("--force", action="store_true", help="rebuild even when cached")

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as is")
    _model_args(gen)
    _sampling_args(gen)

    chat = sub.add_parser("chat", help="interactive chat (one line a turn; /reset, /exit)")
    chat.add_argument("--system", default=None, help="system prompt")
    _model_args(chat)
    _sampling_args(chat)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with slots and a conversation cache")
    _model_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--slots", "-np", type=int, default=4, help="requests decoded together")
    srv.add_argument("--queue", type=int, default=64, help="requests that may wait for a slot (then 503)")
    srv.add_argument("--conversation-cache-mib", type=float, default=512,
                     help="memory for finished conversations' KV state, reused by prompts that extend them")
    srv.add_argument("--ctx-size", "-c", type=int, default=None, help="tokens per request (default: the model's)")
    srv.add_argument("--max-tokens", type=int, default=512, help="default max_tokens of a request")

    bench = sub.add_parser("bench", help="measure kernels and paths against their peers")
    bsub = bench.add_subparsers(dest="what", required=True)
    dq = bsub.add_parser("dequant", help="dequantization throughput: torch path, Triton kernel, gguf-py")
    dq.add_argument("--formats", type=_formats, default=None,
                    help="comma-separated formats (default: all), e.g. IQ3_XXS,IQ3_S")
    dq.add_argument("--mib", type=float, default=64.0,
                    help="MiB of quantized blocks per format (default 64; at least 1024 on CUDA)")
    dq.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: torch path and gguf-py; cuda: also the Triton kernel, checked and timed")
    dq.add_argument("--repeats", type=int, default=3, help="timed runs per path (median reported)")
    dq.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    dq.add_argument("--no-peer", action="store_true", help="skip gguf-py (it is slow on large sizes)")
    dq.add_argument("--json", action="store_true", help="print JSON instead of the table")

    from strata.bench import kernels as bench_kernels
    bench_kernels.add_args(bsub)

    bm = bsub.add_parser("model", help="llama-bench's pp/tg tests, optionally against llama.cpp")
    bm.add_argument("--model", "-m", default="smollm2")
    bm.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    bm.add_argument("--threads", "-t", type=int, default=2)
    _device_args(bm)
    bm.add_argument("--n-prompt", "-p", type=int, default=512)
    bm.add_argument("--n-gen", "-n", type=int, default=128)
    bm.add_argument("--repeats", "-r", type=int, default=3)
    bm.add_argument("--peer", choices=("llama.cpp", "transformers"), default=None,
                    help="also run the same model through llama-cpp-python, or transformers' eager "
                         "forward on the checkpoint it came from, in the same run")
    bm.add_argument("--hf-dir", default=None, help="--peer transformers: the Hugging Face checkpoint")
    bm.add_argument("--json", action="store_true")

    bs = bsub.add_parser("serve", help="aggregate tok/s of the serving engine per slot count")
    bs.add_argument("--model", "-m", default="smollm2")
    bs.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    bs.add_argument("--threads", "-t", type=int, default=2)
    bs.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                    help="slot counts to compare, e.g. 1,4")
    bs.add_argument("--requests", type=int, default=16)
    bs.add_argument("--n-gen", "-n", type=int, default=64)
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
    pp.add_argument("--make-text", default=None, metavar="OUT",
                    help="write the standard-library docstring text to OUT and exit")
    pp.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    pp.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    pp.add_argument("--threads", "-t", type=int, default=None)
    _device_args(pp)

    im = sub.add_parser("imatrix", help="llama-imatrix: importance matrix (GGUF) for llama-quantize --imatrix")
    im.add_argument("model", nargs="?", default="smollm2", help="a known model (smollm2) or a .gguf path")
    im.add_argument("--text", "-f", required=True, help="text file to evaluate")
    im.add_argument("--output", "-o", required=True, help="imatrix GGUF to write")
    im.add_argument("--ctx", "-c", type=int, default=512, help="tokens per chunk")
    im.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: all)")
    im.add_argument("--process-output", action="store_true", help="also collect output.weight")
    im.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    im.add_argument("--threads", "-t", type=int, default=None)
    _device_args(im)

    qz = sub.add_parser("quantize", help="llama-quantize: requantize a GGUF (IQ3_XXS, IQ3_S, Q4_0, ...)")
    qz.add_argument("input", help="source .gguf (a quantized source is dequantized first)")
    qz.add_argument("output", help=".gguf to write")
    qz.add_argument("type", help="IQ3_XXS, IQ3_S, Q4_0, Q4_1, Q8_0 or IQ4_NL (llama.cpp's mix for it)")
    qz.add_argument("--imatrix", default=None, help="importance matrix, llama.cpp's GGUF imatrix format")
    qz.add_argument("--tensor-type", action="append", metavar="REGEX=TYPE",
                    help="type of the tensors whose name matches REGEX (repeatable; first match wins)")
    qz.add_argument("--pure", action="store_true", help="TYPE for every tensor: no mix (fallback still applies)")
    qz.add_argument("--threads", "-t", type=int, default=2, help="tensors quantized at once")

    cv = sub.add_parser("convert", help="Hugging Face Qwen3.8-Flash-Next checkpoint -> GGUF, as llama.cpp writes it")
    cv.add_argument("hf_dir", help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    cv.add_argument("output", help=".gguf to write; an mtp.* block goes to mtp-<name> beside it")
    cv.add_argument("--outtype", default="f16", help="f32, f16 (default), bf16 or q8_0")

    from strata.storage.experts import add_expert_args
    pk = sub.add_parser("pack", help="write experts.bin and its index for the packed expert tier")
    pk.add_argument("model", help="a .gguf path (or a known model); the other shards of its set come along")
    pk.add_argument("--out", default=None, metavar="DIR",
                    help="directory for experts.bin and experts.txt (default: packs/<model> in the Strata cache)")

    pl = sub.add_parser("plan", help="what sits where, what a prompt reads from the drive, the drive's speed")
    pl.add_argument("model", help="a known model, a .gguf path, or flash-next[:EXPERT_TYPE] (the real "
                                   "shapes, no file: with --gpu-mem, --gpus and --ram)")
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


def _interpret(argv: list[str] | None) -> None:
    """`--kernels triton` on the CPU runs the Triton interpreter, which must be on before
    triton is imported: start again with TRITON_INTERPRET=1."""
    import os
    env = dict(os.environ, TRITON_INTERPRET="1")
    args = sys.argv[1:] if argv is None else argv
    os.execve(sys.executable, [sys.executable, "-m", "strata", *args], env)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from strata import commands
    from strata.hub import HubError
    from triton_kernels import configs
    from triton_kernels.backend import choose_device, interpreter_on
    if hasattr(args, "dtype"):  # one spelling on the command line, a torch dtype past here
        args.dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    if args.command in ("generate", "chat", "serve", "perplexity", "imatrix") or (
            args.command == "bench" and args.what == "model"):
        try:
            args.device = choose_device(args.device)
        except ValueError as e:
            print(f"strata: {e}", file=sys.stderr)
            return 2
    elif args.command == "plan" and args.device is None:  # a plan may be for another machine
        args.device = "cuda" if args.gpu_mem else choose_device(None)
    interpret = getattr(args, "kernels", None) == "triton" and str(args.device).startswith("cpu")
    if interpret and not interpreter_on():
        _interpret(argv)
    with configs.interpreter_tiles(interpret):
        return _run(args, commands, HubError)


def _run(args, commands, HubError) -> int:
    try:
        if args.command in ("pack", "plan", "probe"):
            from strata.storage import experts, plan, probe
            if args.command == "pack":
                from strata.hub import resolve_model
                experts.pack(resolve_model(args.model), args.out)
                return 0
            return {"plan": plan.run, "probe": probe.run}[args.command](args)
        if args.command == "synth":
            from strata.hub import synth_flash_tiny
            print(synth_flash_tiny(force=args.force))
            return 0
        if args.command == "convert":
            from strata.convert import convert
            convert(args.hf_dir, args.output, args.outtype)
            return 0
        if args.command == "quantize":
            from strata import quantize
            return quantize.run(args)
        if args.command in ("perplexity", "imatrix"):
            from strata import imatrix, perplexity
            return {"perplexity": perplexity.run, "imatrix": imatrix.run}[args.command](args)
        if args.command == "bench" and args.what == "ple":
            from strata.bench import ple
            return ple.run(args)
        if args.command == "bench":
            from strata.bench import dequant, kernels, model, serve
            return {"dequant": dequant.run, "kernels": kernels.run, "model": model.run,
                    "serve": serve.run}[args.what](args)
        return {"pull": commands.pull, "generate": commands.generate_cmd,
                "chat": commands.chat_cmd, "serve": commands.serve_cmd}[args.command](args)
    except (ValueError, HubError) as e:  # bad input or file, named by the code that found it
        print(f"strata: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
