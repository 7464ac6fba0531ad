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


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="smollm2",
                   help="a known model (smollm2: pulled on first use) or a .gguf path")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16",
                   help="compute dtype on the CPU (bf16: fast; f32: exact weights)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: torch's)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-predict", "-n", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", "--temp", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="0: off")
    p.add_argument("--top-p", type=float, default=0.95, help="1.0: off")
    p.add_argument("--min-p", type=float, default=0.05, help="0.0: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    pull = sub.add_parser("pull", help="fetch a known model into the cache")
    pull.add_argument("name", choices=("smollm2",))

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

    bm = bsub.add_parser("model", help="llama-bench's pp/tg tests, optionally against llama.cpp")
    bm.add_argument("--model", "-m", default="smollm2")
    bm.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    bm.add_argument("--threads", "-t", type=int, default=2)
    bm.add_argument("--n-prompt", "-p", type=int, default=512)
    bm.add_argument("--n-gen", "-n", type=int, default=128)
    bm.add_argument("--repeats", "-r", type=int, default=3)
    bm.add_argument("--peer", choices=("llama.cpp",), default=None,
                    help="also run the same GGUF through llama-cpp-python, in the same run")
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from strata import commands
    from strata.hub import HubError
    if hasattr(args, "dtype"):  # one spelling on the command line, a torch dtype past here
        args.dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    try:
        if args.command == "bench":
            from strata.bench import dequant, model, serve
            return {"dequant": dequant.run, "model": model.run, "serve": serve.run}[args.what](args)
        return {"pull": commands.pull, "generate": commands.generate_cmd,
                "chat": commands.chat_cmd, "serve": commands.serve_cmd}[args.command](args)
    except (ValueError, HubError) as e:  # bad input or file, named by the code that found it
        print(f"strata: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
