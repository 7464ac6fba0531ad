"""`strata bench serve`: aggregate decode throughput of the serving engine per slot count.

The same requests (distinct prompts, greedy, a fixed number of tokens each, all submitted
at once) run through the engine with each slot count; tok/s is generated tokens over wall
time, prompt processing included, as a client sees it.
"""
from __future__ import annotations

import time

import torch

from strata.bench.report import emit, machine, markdown
from triton_kernels import invariant


def run(args, path) -> int:
    """`strata bench serve` on the GGUF at `path`."""
    from strata.gguf import open_gguf
    from strata.load import load_model
    from strata.runtime.sampling import SamplingParams
    from strata.server.engine import Engine, Request
    from strata.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    g = open_gguf(path)
    model, tok = load_model(g, dtype=args.dtype), Tokenizer.from_gguf(g)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Tell me about the number {i}."}]))
               for i in range(args.requests)]
    # plain numerics, and with --batch-invariant also batch-invariant (the server's default)
    # on the same loaded model: its cost, measured in one run
    modes = (False, True) if args.batch_invariant else (False,)
    rows = []
    for slots in args.slots:
        for inv in modes:
            with invariant.batch_invariant(inv):
                engine = Engine(model, tok, slots=slots, queue_size=len(prompts), cache_mib=0, start_thread=False)
                t = time.perf_counter()
                reqs = [engine.submit(Request(p, SamplingParams(temperature=0, max_tokens=args.n_gen),
                                              lambda ev: None)) for p in prompts]
                engine.run(until_idle=True)  # on this (the main) thread, as `strata serve` runs it
                wall = time.perf_counter() - t
            n = sum(len(r.tokens) for r in reqs)
            rows.append({"slots": slots, "numerics": "batch-invariant" if inv else "plain", "requests": len(prompts),
                         "generated": n, "wall_s": wall, "tok_s": n / wall})
    base = rows[0]["tok_s"]
    for r in rows:
        r["vs_first"] = r["tok_s"] / base
        if args.batch_invariant:
            plain = next(p for p in rows if p["slots"] == r["slots"] and p["numerics"] == "plain")
            r["vs_plain"] = r["tok_s"] / plain["tok_s"] if r is not plain else None
    result = {"bench": "serve", "machine": machine(), "dtype": str(args.dtype).replace("torch.", ""), "rows": rows}
    cols = [("slots", "slots"), ("numerics", "numerics"), ("requests", "requests"), ("generated", "tokens"),
            ("wall_s", "wall s"), ("tok_s", "tok/s"), ("vs_first", f"x {rows[0]['slots']} slot(s) plain")]
    if args.batch_invariant:
        cols.append(("vs_plain", "x plain"))
    table = markdown(rows, cols)
    emit(result, table, args.json)
    return 0
