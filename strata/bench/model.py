"""`strata bench model`: llama-bench's tests, pp512 (prefill) and tg128 (decode).

pp: a fresh context takes `-p` tokens in one batch. tg: from an empty context, `-n`
tokens decoded one at a time. Both report tok/s as mean +- stddev over `--repeats` runs.
`--peer llama.cpp` runs the same GGUF through llama-cpp-python in the same process, after
Strata (so Strata's peak RSS is read before the peer loads), and prints the ratio.
`--device cuda` runs Strata on the GPU (the Triton kernels by default). The decode
step's weight bytes over its time, against a copy's bandwidth measured on the same
device in the same run, says how near the memory roof decode runs.
`--peer transformers` runs transformers' eager forward (float32, with its cache) on the
checkpoint the GGUF was converted from (flash-tiny: the checkpoint beside it; else
`--hf-dir`): the same weights, the reference implementation.
"""
from __future__ import annotations

import resource
import statistics
import time

import numpy as np
import torch

from strata.bench.report import copy_bandwidth, emit, machine, markdown


def _tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    # fixed, ordinary-looking ids (skip the first 1000: specials and bytes)
    return np.random.default_rng(seed).integers(1000, vocab, n).tolist()


def _stats(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_bytes(model) -> int:
    """Bytes of weights one decode step reads: every matmul's weight as held, and per MoE
    layer top-k experts (a token's; more when a batch routes to more)."""
    from strata.nn import QuantLinear
    from strata.nn.moe import MoE
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.mode != "parts":
            total += m.held_bytes()
        elif isinstance(m, MoE):
            total += m.top_k * m.experts.expert_bytes
    return total


def bench_strata(path, args) -> dict:
    from strata.load import load_model
    device = torch.device(getattr(args, "device", None) or "cpu")
    t = time.perf_counter()
    model = load_model(path, dtype=args.dtype, device=device, kernels=getattr(args, "kernels", None))
    load_s = time.perf_counter() - t
    vocab = model.cfg.vocab_size
    model(_tokens(16, vocab), model.new_cache())  # warm-up (and the kernels' compiles)
    model([5], model.new_cache())
    pp, tg = [], []
    for r in range(args.repeats):
        toks = _tokens(args.n_prompt, vocab, r)
        cache = model.new_cache(args.n_prompt)
        _sync(device)
        t = time.perf_counter()
        model(toks, cache, last_only=True)
        _sync(device)
        pp.append(args.n_prompt / (time.perf_counter() - t))
    for r in range(args.repeats):
        toks = _tokens(args.n_gen, vocab, 100 + r)
        cache = model.new_cache(args.n_gen)
        _sync(device)
        t = time.perf_counter()
        for tok in toks:
            model([tok], cache, last_only=True)
        _sync(device)
        tg.append(args.n_gen / (time.perf_counter() - t))
    nbytes = step_bytes(model)
    rss = _peak_rss_mib()  # before the copy's buffers
    copy = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 28))  # bytes/s
    step_s = 1 / statistics.fmean(tg)
    return {"engine": "strata", "pp": pp, "tg": tg, "load_s": load_s, "peak_rss_mib": rss,
            "vocab": vocab, "dtype": str(args.dtype).replace("torch.", ""), "device": str(device),
            "kernels": model.kernels, "step_bytes": nbytes, "copy_bytes_per_s": copy,
            "step_read_bytes_per_s": nbytes / step_s, "fraction_of_copy": nbytes / step_s / copy}


def bench_llama_cpp(path, args, vocab: int) -> dict:
    from llama_cpp import Llama
    llm = Llama(str(path), n_ctx=max(args.n_prompt, args.n_gen) + 16, n_batch=max(args.n_prompt, 32),
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    llm.eval(_tokens(16, vocab))
    pp, tg = [], []
    for r in range(args.repeats):
        llm.reset()
        t = time.perf_counter()
        llm.eval(_tokens(args.n_prompt, vocab, r))
        pp.append(args.n_prompt / (time.perf_counter() - t))
    for r in range(args.repeats):
        llm.reset()
        t = time.perf_counter()
        for tok in _tokens(args.n_gen, vocab, 100 + r):
            llm.eval([tok])
        tg.append(args.n_gen / (time.perf_counter() - t))
    return {"engine": "llama.cpp (llama-cpp-python)", "pp": pp, "tg": tg}


def bench_transformers(hf_dir, args, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def step(toks, cache):
        with torch.no_grad():
            model(torch.tensor([toks]), past_key_values=cache, use_cache=True, logits_to_keep=1)

    step(_tokens(16, vocab), DynamicCache(config=model.config))
    pp, tg = [], []
    for r in range(args.repeats):
        cache = DynamicCache(config=model.config)
        t = time.perf_counter()
        step(_tokens(args.n_prompt, vocab, r), cache)
        pp.append(args.n_prompt / (time.perf_counter() - t))
    for r in range(args.repeats):
        cache = DynamicCache(config=model.config)
        t = time.perf_counter()
        for tok in _tokens(args.n_gen, vocab, 100 + r):
            step([tok], cache)
        tg.append(args.n_gen / (time.perf_counter() - t))
    return {"engine": "transformers (eager, float32)", "pp": pp, "tg": tg}


def run(args, path, hf_dir=None) -> int:
    """`strata bench model` on the GGUF at `path`; `hf_dir`: the checkpoint it came from
    (for --peer transformers)."""
    torch.set_num_threads(args.threads)
    ours = bench_strata(path, args)
    peer = None
    if args.peer == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise ValueError("--peer llama.cpp: llama-cpp-python is not importable here; build it as "
                             "the README says, or drop --peer") from None
        peer = bench_llama_cpp(path, args, ours["vocab"])
    elif args.peer == "transformers":
        if hf_dir is None:
            raise ValueError("--peer transformers: give --hf-dir, the Hugging Face checkpoint this GGUF was "
                             "converted from")
        peer = bench_transformers(hf_dir, args, ours["vocab"])
    rows = []
    for res in filter(None, (ours, peer)):
        for test, key in ((f"pp{args.n_prompt}", "pp"), (f"tg{args.n_gen}", "tg")):
            mean, sd = _stats(res[key])
            row = {"engine": res["engine"], "model": path.name, "threads": args.threads, "test": test,
                   "tok_s": mean, "stddev": sd, "runs": res[key]}
            if peer and res is ours:
                row["vs_peer"] = mean / _stats(peer[key])[0]
            rows.append(row)
    result = {"bench": "model", "machine": machine(), "model": str(path), "dtype": ours["dtype"],
              "peak_rss_mib": ours["peak_rss_mib"], "load_s": ours["load_s"], "rows": rows}
    for r in rows:
        r["t/s"] = f"{r['tok_s']:.2f} ± {r['stddev']:.2f}"
    cols = [("engine", "engine"), ("model", "model"), ("threads", "threads"), ("test", "test"), ("t/s", "t/s")]
    if peer:
        cols.append(("vs_peer", f"x {args.peer}"))
    for k in ("device", "kernels", "step_bytes", "copy_bytes_per_s", "step_read_bytes_per_s", "fraction_of_copy"):
        result[k] = ours[k]
    table = markdown(rows, cols) + (
        f"\n\nStrata: {ours['dtype']} on {ours['device']} ({ours['kernels']} kernels), load {ours['load_s']:.1f} s, "
        f"peak RSS {ours['peak_rss_mib']:.0f} MiB; a decode step reads {ours['step_bytes'] / 2**20:.1f} MiB of "
        f"weights: {ours['step_read_bytes_per_s'] / 1e9:.1f} GB/s, {ours['fraction_of_copy']:.1%} of the "
        f"{ours['copy_bytes_per_s'] / 1e9:.0f} GB/s a copy moves on {ours['device']} (read + written)")
    emit(result, table, args.json)
    return 0
