"""llama.cpp's logits (through llama-cpp-python) scored as `strata perplexity` scores Strata's.

llama-cpp-python cannot run the llama-perplexity tool, so this evaluates the same chunks
through `llama_cpp.Llama(logits_all=True)` (each chunk from an empty context, BOS as the
vocabulary says) and scores them with strata.perplexity: the two PPLs differ only by the
models' logits. With --save-all-logits it also writes llama.cpp's log-probs in Strata's
format, so that `strata perplexity MODEL --kl-divergence-base FILE --kl-divergence` gives
the KL divergence of Strata from llama.cpp.

    python scripts/ppl_llama_cpp.py smollm2 --text stdlib.txt --ctx 512 --chunks 20

`--cache-type-k/-v q8_0` run llama.cpp with a quantized KV cache (as llama-perplexity's
flags), and `--kl-divergence-base FILE` gives its KL divergence from a saved run, e.g.
llama.cpp's own f16 cache: what a quantized cache costs in llama.cpp, beside what
`strata perplexity --kv int8 --kl-divergence-base MODEL` says it costs in Strata.

llama-cpp-python is not a dependency of Strata: pip install llama-cpp-python==0.3.36.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from strata.hub import resolve_model
from strata.perplexity import DEFAULT_TOP_K, perplexity, save_logits, text_sha256
from strata.perplexity.kld import kl_divergence, print_kld
from strata.perplexity.saved import SavedLogits


CACHE_TYPES = {"f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "f32": "GGML_TYPE_F32"}


class LlamaCppModel:
    """strata.perplexity's model interface over a llama_cpp.Llama: the "cache" is the
    context itself, cleared for each call (perplexity evaluates every chunk afresh)."""

    def __init__(self, llm):
        self.llm = llm

    def new_cache(self, capacity: int):
        if capacity > self.llm.n_ctx():
            raise ValueError(f"a chunk of {capacity} tokens does not fit llama.cpp's n_ctx {self.llm.n_ctx()}")

    def forward(self, tokens, cache, last_only: bool = False) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(list(tokens))
        scores = np.array(self.llm.scores[:len(tokens)], dtype=np.float32)
        return torch.from_numpy(scores[-1:] if last_only else scores)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--text", "-f", required=True)
    p.add_argument("--ctx", "-c", type=int, default=512)
    p.add_argument("--chunks", type=int, default=None)
    p.add_argument("--threads", "-t", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--save-all-logits", default=None, metavar="FILE")
    p.add_argument("--save-top-k", type=int, default=DEFAULT_TOP_K)
    p.add_argument("--cache-type-k", "-ctk", choices=tuple(CACHE_TYPES), default="f16")
    p.add_argument("--cache-type-v", "-ctv", choices=tuple(CACHE_TYPES), default="f16")
    p.add_argument("--flash-attn", "-fa", choices=("on", "off", "auto"), default="auto",
                   help="llama.cpp's flash attention (auto: on where the V cache is quantized, which "
                        "needs it); compare caches with the same setting")
    p.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                   help="a --save-all-logits file: print the KL divergence from it")
    args = p.parse_args(argv)
    import llama_cpp

    path = resolve_model(args.model)
    types = {k: getattr(llama_cpp, v) for k, v in CACHE_TYPES.items()}
    llm = llama_cpp.Llama(str(path), n_ctx=args.ctx, n_batch=args.ctx, n_threads=args.threads,
                          logits_all=True, verbose=False, type_k=types[args.cache_type_k],
                          type_v=types[args.cache_type_v],
                          flash_attn=args.flash_attn == "on" or (args.flash_attn == "auto"
                                                                 and args.cache_type_v not in ("f16", "f32")))
    text = Path(args.text).read_text(encoding="utf-8")
    sha = text_sha256(text)
    # llama-perplexity's common_tokenize(ctx, text, add_special=true, parse_special=false)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    add_bos = llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model))
    bos = llm.token_bos() if add_bos else None
    print(f"llama.cpp: {args.text}: {len(tokens)} tokens, sha256 {sha}; BOS {'added' if add_bos else 'not added'}",
          file=sys.stderr)
    model = LlamaCppModel(llm)

    def progress(i, ppl):
        sys.stdout.write(f"[{i + 1}]{ppl:.4f},")
        sys.stdout.flush()

    t0 = time.perf_counter()
    if args.kl_divergence_base:
        base = SavedLogits(args.kl_divergence_base)
        res = kl_divergence(model, base.tokens, base, base.n_ctx, args.chunks, base.bos_id,
                            base_name=args.kl_divergence_base, text_sha=sha)
        print()
        print_kld(res)
    elif args.save_all_logits:
        res = save_logits(args.save_all_logits, model, tokens, args.ctx, args.chunks, bos, top_k=args.save_top_k,
                          source=f"llama.cpp {llama_cpp.__version__}: {path.name}", text_sha=sha, on_chunk=progress)
    else:
        res = perplexity(model, tokens, args.ctx, args.chunks, bos, on_chunk=progress, text_sha=sha)
    print(f"\nFinal estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}")
    print(f"llama.cpp: {res.n_chunks} chunks of {res.n_ctx} tokens ({res.n_tokens} in the text) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
