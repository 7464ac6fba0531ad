"""The evaluation commands: `strata perplexity` (PPL, saved log-probs, KL divergence),
`strata imatrix` (an importance matrix for quantizing) and `strata quantize`. Each takes the
parsed arguments and returns the exit status; the progress rows llama.cpp's tools print
(`[1]12.3456,`, the KL divergence table) are printed here, from the library's `on_chunk`.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from strata.imatrix import compute_imatrix, write_imatrix
from strata.perplexity import (
    DEFAULT_TOP_K,
    STDLIB_MODULES,
    SavedLogits,
    kl_divergence,
    n_chunks_of,
    print_kld,
    save_logits,
    stdlib_text,
    text_sha256,
)
from strata.perplexity import perplexity as score_perplexity


def _load(args, name: str, dtype, **override):
    # imported here: `strata quantize` needs neither the models nor the hub
    from strata.cli.load import load
    return load(args, model=name, dtype=dtype, **override)


def _is_model(name: str) -> bool:
    """A known model name or a GGUF file (else --kl-divergence-base is a log-probs file)."""
    from strata.hub import MODELS
    p = Path(name).expanduser()
    if name in MODELS:
        return True
    if p.is_file():
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    return False


def _read_text(path: str | None) -> tuple[str, str]:
    if path is None:
        raise ValueError("--text FILE is needed (make one with `strata perplexity --make-text OUT`)")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--text {path}: no such file")
    text = p.read_text(encoding="utf-8")
    return text, text_sha256(text)


def _ppl_progress(i: int, ppl: float) -> None:
    sys.stdout.write(f"[{i + 1}]{ppl:.4f},")
    sys.stdout.flush()


def _kld_row(i: int, r: dict) -> None:
    if i == 0:
        print("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
              "              Δp RMS            Same top p")
    print(f"{i + 1:4d}    {r['ppl']:9.4f} ± {r['ppl_err']:9.4f}    {r['ln_ratio']:10.5f} ± "
          f"{r['ln_ratio_err']:10.5f}    {r['kld']:10.5f} ± {r['kld_err']:10.5f}    "
          f"{100 * r['rms']:6.3f} ± {100 * r['rms_err']:6.3f} %    {100 * r['top']:6.3f} ± "
          f"{100 * r['top_err']:6.3f} %", flush=True)


def perplexity(args) -> int:
    """`strata perplexity`: --make-text, or PPL of a model over --text, or its log-probs
    saved (--save-all-logits), or its KL divergence from --kl-divergence-base."""
    if args.make_text:
        text = stdlib_text()
        Path(args.make_text).write_text(text, encoding="utf-8")
        print(f"strata: wrote {args.make_text}: {len(text)} characters, sha256 {text_sha256(text)}, "
              f"Python {sys.version.split()[0]}, docstrings of {len(STDLIB_MODULES)} modules: "
              f"{' '.join(STDLIB_MODULES)}", file=sys.stderr)
        return 0
    base_arg = args.kl_divergence_base
    compare = bool(base_arg) and (args.kl_divergence or _is_model(base_arg))
    save_to = args.save_all_logits or (base_arg if base_arg and not compare else None)
    if args.kl_divergence and not base_arg:
        raise ValueError("--kl-divergence needs --kl-divergence-base (a model, or a file from --save-all-logits)")
    if compare and args.save_all_logits:
        raise ValueError("--save-all-logits with a --kl-divergence-base to compare against: run them "
                         "one after the other (save the base's log-probs first)")
    saved = SavedLogits(base_arg) if compare and not _is_model(base_arg) else None
    if saved and args.ctx not in (None, saved.n_ctx):
        raise ValueError(f"--ctx {args.ctx}: {base_arg} was saved with --ctx {saved.n_ctx}; "
                         "leave --ctx out (the file's is used)")
    text, sha = _read_text(args.text) if saved is None or args.text else (None, None)
    model, tok = _load(args, args.model, args.dtype)
    n_ctx = args.ctx or 512
    bos = tok.bos_id if tok.add_bos else None
    if text is not None:
        # llama.cpp's common_tokenize(ctx, text, add_special=true, parse_special=false)
        tokens = tok.encode(text, parse_special=False)
        print(f"strata: {args.text}: {len(tokens)} tokens, sha256 {sha}", file=sys.stderr)
        n_chunks_of(len(tokens), saved.n_ctx if saved else n_ctx, args.chunks, where=f"--text {args.text}")
        if saved is not None:
            n = saved.n_chunks * saved.n_ctx
            if saved.text_sha256 not in (None, sha) or list(saved.tokens[:n]) != tokens[:n]:
                raise ValueError(f"--text {args.text} is not the text {base_arg} was saved from "
                                 f"(sha256 {saved.text_sha256}); leave --text out to use the file's tokens")
    else:
        tokens, sha = saved.tokens, saved.text_sha256
    if compare:
        if saved is not None:
            base, name = saved, base_arg
            print(f"strata: base log-probs from {base_arg} ({saved.source}; "
                  f"{'top ' + str(saved.top_k) if saved.top_k else 'all'} per token, "
                  f"{saved.n_chunks} chunks of {saved.n_ctx})", file=sys.stderr)
        else:
            base, _ = _load(args, base_arg, args.base_dtype, kv=args.base_kv)
            name = f"{base_arg} ({args.base_dtype}, KV {args.base_kv or 'f32'})"
        res = kl_divergence(model, tokens, base, n_ctx, args.chunks, bos, on_chunk=_kld_row,
                            base_name=name, text_sha=sha)
        print()
        print_kld(res)
    elif save_to:
        top_k = DEFAULT_TOP_K if args.save_top_k is None else args.save_top_k
        res = save_logits(save_to, model, tokens, n_ctx, args.chunks, bos, top_k=top_k,
                          source=f"{args.model} ({str(args.dtype).replace('torch.', '')})", text_sha=sha,
                          on_chunk=_ppl_progress)
        print(f"\nFinal estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}")
        print(f"strata: saved log-probs of {res.n_scored} tokens to {save_to}", file=sys.stderr)
    else:
        res = score_perplexity(model, tokens, n_ctx, args.chunks, bos, on_chunk=_ppl_progress, text_sha=sha)
        print(f"\nFinal estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}")
    print(f"strata: {res.n_chunks} chunks of {res.n_ctx} tokens ({res.n_tokens} in the text, sha256 "
          f"{res.text_sha256}) in {res.seconds:.1f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(asdict(res)))
    return 0


def imatrix(args) -> int:
    """`strata imatrix`: the importance matrix of a model over --text, written to --output."""
    text, sha = _read_text(args.text)
    model, tok = _load(args, args.model, args.dtype)
    tokens = tok.encode(text, parse_special=False)  # as llama-imatrix: no special-token parsing
    print(f"strata: {args.text}: {len(tokens)} tokens, sha256 {sha}", file=sys.stderr)
    n_chunks_of(len(tokens), args.ctx, args.chunks, where=f"--text {args.text}")
    t0 = time.perf_counter()
    im = compute_imatrix(model, tokens, args.ctx, args.chunks, tok.bos_id if tok.add_bos else None,
                         process_output=args.process_output, datasets=[args.text], on_chunk=_ppl_progress)
    print(f"\nFinal estimate: PPL = {im.ppl:.4f}")
    write_imatrix(args.output, im)
    print(f"strata: stored {len(im.sums)} weights' importance after {im.chunk_count} chunks of "
          f"{im.chunk_size} tokens in {args.output} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0
