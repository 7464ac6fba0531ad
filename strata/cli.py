"""`strata`: the one command-line parser."""
from __future__ import annotations

import argparse
import sys


def _formats(text: str) -> list[str]:
    import quant
    try:
        return [quant.get(t.strip()).name for t in text.split(",") if t.strip()]
    except ValueError as e:  # argparse prints an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench" and args.what == "dequant":
            from strata.bench.dequant import run
            return run(args)
    except ValueError as e:  # bad input named by the code that found it
        print(f"strata: {e}", file=sys.stderr)
        return 2
    return 1
