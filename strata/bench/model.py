"""`strata bench model`: llama-bench's tests, pp512 (prefill) and tg128 (decode).

pp: a fresh context takes `-p` tokens in one batch. tg: a fresh context takes one token
untimed (on CUDA, the step that captures the sequence's decode graph; its time is printed
apart), then `-n` tokens decoded one at a time. Both report tok/s as mean +- stddev over `--repeats` runs.
`--peer llama.cpp` runs the same GGUF through llama-cpp-python in the same process, after
Strata (so Strata's peak RSS is read before the peer loads), and prints the ratio.
`--device cuda` runs Strata on the GPU (the Triton kernels by default). The decode
step's weight bytes over its time, against a copy's bandwidth measured on the same
device in the same run, says how near the memory roof decode runs.
`--depth 1000,32000` (llama-bench's `-d`): per depth, the context is first filled with that
many tokens (in `--ubatch` chunks: its rate is the "fill" row), then pp and tg run from
copies of that state; Strata's rows give the attention states' bytes a token, and with
STRATA_DECODE_TIMING=1 each decode step's line gives the QSA indexer's and attention's ms.
`--peer transformers` runs transformers' eager forward (float32, with its cache) on the
checkpoint the GGUF was converted from (flash-tiny: the checkpoint beside it; else
`--hf-dir`): the same weights, the reference implementation.
"""
from __future__ import annotations

import functools
import resource
import statistics
import time

import numpy as np
import torch

from strata.bench.report import copy_bandwidth, emit, machine, markdown


def _tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    # fixed, ordinary-looking ids (skip the first 1000: specials and bytes; a small vocabulary's half)
    return np.random.default_rng(seed).integers(min(1000, vocab // 2), vocab, n).tolist()


def _stats(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _need_llama_cpp() -> None:
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        raise ValueError("--peer llama.cpp: llama-cpp-python is not importable here; build it as "
                         "the README says, or drop --peer")


def steady(fn):
    """A bench's rates are the steady state: inside `fn` the CPU's compiles happen at their
    first calls, the warm-up's, and weights are held as STRATA_CPU_COMPILE=1 holds them
    (triton_kernels.backend.compile_at_first_call); STRATA_CPU_COMPILE=0 still measures
    them off."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        from triton_kernels.backend import compile_at_first_call
        with compile_at_first_call():
            return fn(*args, **kwargs)
    return run


def _name(path) -> str:
    """A GGUF path's file name, or a model built in memory's (strata.gguf.MemoryGGUF)."""
    return getattr(path, "path", path).name


def _load_warm(path, args):
    """(model, device, load seconds), the model run once (warm-up, and the kernels' compiles);
    `path`: a GGUF file, or a model built in memory (its build counts in the load). Its plan
    lines go to stderr, and the launches of its decode step on a GPU, traced once, are
    `model.step_launches` (strata.load.launches). Called inside `steady`."""
    import sys

    from strata.gguf import GGUFFile, open_gguf
    from strata.load import Options, build, decide
    from strata.load.launches import count_launches
    device = torch.device(getattr(args, "device", None) or "cpu")
    t = time.perf_counter()
    g = path if isinstance(path, GGUFFile) else open_gguf(path)
    plan = decide(g, Options(dtype=args.dtype, device=str(device), kernels=getattr(args, "kernels", None),
                             gpu_mem_gib=getattr(args, "gpu_mem", None), ram_gib=getattr(args, "ram", None)))
    for line in plan.lines(drive=False):
        print(f"strata: {line}", file=sys.stderr)
    model = build(plan)
    load_s = time.perf_counter() - t
    print(f"strata: {model.plan_line()}", file=sys.stderr)
    model.step_launches = count_launches(plan)
    model(_tokens(16, model.cfg.vocab_size), model.new_cache())
    return model, device, load_s


def _pp_tg(model, args, device, vocab: int, pp: bool = True, tg: bool = True,
           first: list[float] | None = None) -> tuple[list[float], list[float]]:
    """pp and tg tok/s, args.repeats runs each (`pp`, `tg`: which); a tg run's first step
    untimed (on CUDA it captures the decode graph), its seconds in `first`."""
    runs, pp, tg = (pp, tg), [], []
    for r in range(args.repeats if runs[0] else 0):
        toks = _tokens(args.n_prompt, vocab, r)
        cache = model.new_cache(args.n_prompt)
        _sync(device)
        t = time.perf_counter()
        model(toks, cache, last_only=True)
        _sync(device)
        pp.append(args.n_prompt / (time.perf_counter() - t))
    for r in range(args.repeats if runs[1] else 0):
        toks = _tokens(args.n_gen + 1, vocab, 100 + r)
        cache = model.new_cache(args.n_gen + 1)
        _sync(device)
        t = time.perf_counter()
        model(toks[:1], cache, last_only=True)
        _sync(device)
        if first is not None:
            first.append(time.perf_counter() - t)
        t = time.perf_counter()
        for tok in toks[1:]:
            model([tok], cache, last_only=True)
        _sync(device)
        tg.append(args.n_gen / (time.perf_counter() - t))
    return pp, tg


@steady
def bench_strata(path, args, extra=None) -> dict:
    """Strata's pp and tg; with --batch-invariant, also batch-invariant (the process-wide
    switch, flipped on the same loaded model), so that its cost is measured in one run.
    `extra(model, args)`: more measurements on the loaded model, a dict kept as "extra"."""
    from strata.bench import decode_cost
    from triton_kernels import invariant
    model, device, load_s = _load_warm(path, args)
    vocab = model.cfg.vocab_size
    warm = model.new_cache()
    for tok in (5, 6, 7):  # decode steps at three lengths: a compiled step's compiles (strata.runtime.cpu_step)
        model([tok], warm)
    with invariant.batch_invariant(False):
        pp, _ = _pp_tg(model, args, device, vocab, tg=False)
        first: list[float] = []
        before = decode_cost.counters(model)
        _, tg = _pp_tg(model, args, device, vocab, pp=False, first=first)
        io = decode_cost.tiers(model, before, decode_cost.counters(model), args.repeats * (args.n_gen + 1))
    inv = None
    if getattr(args, "batch_invariant", None):
        with invariant.batch_invariant(True):
            model([5], model.new_cache())
            inv = dict(zip(("pp", "tg"), _pp_tg(model, args, device, vocab)))
    spec = None
    if getattr(args, "spec", 0):  # strata.bench.spec: the verify against a one-token step
        from strata.bench import spec as spec_bench
        with invariant.decoding():  # the numerics a speculative decode runs (triton_kernels.invariant)
            spec = spec_bench.measure(model, args.spec, _tokens(args.n_prompt, vocab, 200),
                                      _tokens(args.n_gen, vocab, 300), lambda: _sync(device))
    profile = None
    if getattr(args, "profile", False):  # strata.bench.profile: the top ops of a decode step
        from strata.bench import profile as profile_bench
        profile = profile_bench.decode_profile(model, _tokens(16, vocab, 400),
                                               _tokens(4 + args.profile_steps, vocab, 500),
                                               sync=lambda: _sync(device))
    nbytes = decode_cost.step_bytes(model)
    rss = _peak_rss_mib()  # before the copy's buffers
    vram = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None  # --gpu-mem's claim
    copy = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 28))  # bytes/s
    step_s = 1 / statistics.fmean(tg)
    return {"engine": "strata", "pp": pp, "tg": tg, "load_s": load_s, "peak_rss_mib": rss,
            "peak_vram_mib": vram, "vocab": vocab, "dtype": str(args.dtype).replace("torch.", ""), "device": str(device),
            "kernels": model.kernels, "step_bytes": nbytes, "copy_bytes_per_s": copy,
            "step_read_bytes_per_s": nbytes / step_s, "fraction_of_copy": nbytes / step_s / copy, "spec": spec,
            "profile": profile, "invariant": inv, "extra": extra(model, args) if extra else None,
            "plan_line": model.plan_line(), "launches": model.step_launches, "tiers": io,
            "h2d_bytes_per_s": decode_cost.h2d_bandwidth(device), "first_step_s": statistics.fmean(first)}


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
    from strata import dist
    torch.set_num_threads(args.threads)
    if dist.comm() is not None:
        return run_parallel(args, path, dist.comm())
    if getattr(args, "depth", None):
        return run_depths(args, path)
    ours = bench_strata(path, args)
    peer = None
    if args.peer == "llama.cpp":
        _need_llama_cpp()
        peer = bench_llama_cpp(path, args, ours["vocab"])
    elif args.peer == "transformers":
        if hf_dir is None:
            raise ValueError("--peer transformers: give --hf-dir, the Hugging Face checkpoint this GGUF was "
                             "converted from")
        peer = bench_transformers(hf_dir, args, ours["vocab"])
    inv = ours["invariant"] and {"engine": "strata --batch-invariant", **ours["invariant"]}
    rows = []
    for res in filter(None, (ours, inv, peer)):
        for test, key in ((f"pp{args.n_prompt}", "pp"), (f"tg{args.n_gen}", "tg")):
            mean, sd = _stats(res[key])
            row = {"engine": res["engine"], "model": _name(path), "threads": args.threads, "test": test,
                   "tok_s": mean, "stddev": sd, "runs": res[key]}
            if peer and res is not peer:
                row["vs_peer"] = mean / _stats(peer[key])[0]
            if inv:
                row["vs_plain"] = mean / _stats(ours[key])[0] if res is inv else None
            rows.append(row)
    result = {"bench": "model", "machine": machine(), "model": str(getattr(path, "path", path)),
              "dtype": ours["dtype"], "peak_rss_mib": ours["peak_rss_mib"], "load_s": ours["load_s"], "rows": rows}
    for r in rows:
        r["t/s"] = f"{r['tok_s']:.2f} ± {r['stddev']:.2f}"
    cols = [("engine", "engine"), ("model", "model"), ("threads", "threads"), ("test", "test"), ("t/s", "t/s")]
    if peer:
        cols.append(("vs_peer", f"x {args.peer}"))
    if inv:
        cols.append(("vs_plain", "x plain strata"))
    for k in ("device", "kernels", "step_bytes", "copy_bytes_per_s", "step_read_bytes_per_s", "fraction_of_copy",
              "first_step_s", "peak_vram_mib"):
        result[k] = ours[k]
    vram = "" if ours["peak_vram_mib"] is None else f", peak VRAM {ours['peak_vram_mib']:.0f} MiB (torch's allocations)"
    table = markdown(rows, cols) + (
        f"\n\nStrata: {ours['dtype']} on {ours['device']} ({ours['kernels']} kernels), load {ours['load_s']:.1f} s, "
        f"peak RSS {ours['peak_rss_mib']:.0f} MiB{vram}; a decode step reads {ours['step_bytes'] / 2**20:.1f} MiB of "
        f"weights: {ours['step_read_bytes_per_s'] / 1e9:.1f} GB/s, {ours['fraction_of_copy']:.1%} of the "
        f"{ours['copy_bytes_per_s'] / 1e9:.0f} GB/s a copy moves on {ours['device']} (read + written); a tg run's "
        f"first step, untimed there (on CUDA it captures the decode graph), took {ours['first_step_s'] * 1e3:.1f} ms")
    from strata.bench import decode_cost
    launches = ours["launches"]
    result.update(plan_line=ours["plan_line"], launches_per_step=launches.launches, launch_line=launches.line(),
                  tiers=ours["tiers"], h2d_bytes_per_s=ours["h2d_bytes_per_s"])
    table += (f"\n\n{ours['plan_line']}\n" + decode_cost.text(launches, ours["tiers"], _stats(ours["tg"])[0],
                                                              ours["h2d_bytes_per_s"]))
    if ours["spec"]:
        from strata.bench import spec as spec_bench
        result["spec"] = ours["spec"]
        table += "\n\n" + spec_bench.text(ours["spec"])
    if ours["profile"]:
        from strata.bench import profile as profile_bench
        result["profile"] = ours["profile"]
        table += "\n\n" + profile_bench.text(ours["profile"])
    emit(result, table, args.json)
    return 0


# --- at a depth (llama-bench -d) ------------------------------------------------------------

def _fill(step, toks: list[int], ubatch: int) -> float:
    """tok/s of feeding `toks` in ubatch chunks through `step`."""
    t = time.perf_counter()
    for i in range(0, len(toks), ubatch):
        step(toks[i:i + ubatch])
    return len(toks) / (time.perf_counter() - t)


def _attention_clocks(model) -> list[dict]:
    from strata.nn.gated_attention import GatedAttention
    clocks = []
    for m in model.modules():
        if isinstance(m, GatedAttention):
            m.clock = {}
            clocks.append(m.clock)
    return clocks


def depth_strata(model, args, device) -> dict:
    """Per depth: fill rate, pp and tg from copies of the filled state, and the attention
    states' bytes a token (K, V, the indexer's raw keys and pooled block keys)."""
    import sys
    from strata.nn.gated_attention import AttentionState
    from strata.runtime import timing
    vocab = model.cfg.vocab_size
    timer = timing.StepTimer(model) if timing.enabled() else None
    clocks = _attention_clocks(model) if timer else []
    out = {}
    for d in args.depth:
        state = model.new_cache(d + max(args.n_prompt, args.n_gen))
        for st in state.layers:  # allocated once, as llama.cpp's context is
            if isinstance(st, AttentionState):
                st.reserve(d + max(args.n_prompt, args.n_gen))
        fill = _fill(lambda c, st=state: model(c, st, last_only=True), _tokens(d, vocab, 7), args.ubatch)
        _sync(device)
        pp, tg, split = [], [], {"indexer": 0.0, "attention": 0.0}
        for r in range(args.repeats):
            s = state.copy()
            _sync(device)
            t = time.perf_counter()
            model(_tokens(args.n_prompt, vocab, r), s, last_only=True)
            _sync(device)
            pp.append(args.n_prompt / (time.perf_counter() - t))
        for r in range(args.repeats):
            s = state.copy()
            _sync(device)
            t = time.perf_counter()
            for tok in _tokens(args.n_gen, vocab, 100 + r):
                ts = time.perf_counter()
                before = {k: sum(c.get(k, 0.0) for c in clocks) for k in split}
                model([tok], s, last_only=True)
                if timer:
                    ms = {k: 1e3 * (sum(c.get(k, 0.0) for c in clocks) - before[k]) for k in split}
                    for k in split:
                        split[k] += ms[k] / (args.repeats * args.n_gen)
                    print(f"strata: {timer.line(1, 1e3 * (time.perf_counter() - ts), **ms)}", file=sys.stderr)
            _sync(device)
            tg.append(args.n_gen / (time.perf_counter() - t))
        attn = [st for st in state.layers if isinstance(st, AttentionState)]
        out[d] = {"fill": fill, "pp": pp, "tg": tg,
                  "kv_bytes_per_token": sum(st.nbytes() for st in attn) / d,
                  "split_ms": split if timer else None}
        _progress("strata", d, out[d])
        del state
    return out


def depth_llama_cpp(path, args, vocab: int) -> dict:
    from llama_cpp import Llama
    ub = args.ubatch
    llm = Llama(str(path), n_ctx=max(args.depth) + max(args.n_prompt, args.n_gen) + 16, n_batch=ub,
                n_ubatch=ub, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    out = {}
    for d in args.depth:
        llm.reset()
        fill = _fill(llm.eval, _tokens(d, vocab, 7), ub)
        saved = llm.save_state()
        pp, tg = [], []
        for r in range(args.repeats):
            llm.load_state(saved)
            t = time.perf_counter()
            llm.eval(_tokens(args.n_prompt, vocab, r))
            pp.append(args.n_prompt / (time.perf_counter() - t))
        for r in range(args.repeats):
            llm.load_state(saved)
            t = time.perf_counter()
            for tok in _tokens(args.n_gen, vocab, 100 + r):
                llm.eval([tok])
            tg.append(args.n_gen / (time.perf_counter() - t))
        out[d] = {"fill": fill, "pp": pp, "tg": tg}
        _progress("llama.cpp", d, out[d])
    return out


def _progress(engine: str, d: int, r: dict) -> None:
    """A line to stderr as each depth ends: a long run that is stopped keeps what it measured."""
    import sys
    print(f"bench: {engine} d{d}: fill {r['fill']:.1f} tok/s, pp {_stats(r['pp'])[0]:.1f} tok/s, "
          f"tg {_stats(r['tg'])[0]:.2f} tok/s", file=sys.stderr, flush=True)


@steady
def run_depths(args, path) -> int:
    """`strata bench model --depth ...`: each depth's fill, pp and tg, Strata then the peer."""
    model, device, load_s = _load_warm(path, args)
    ours = depth_strata(model, args, device)
    rss = _peak_rss_mib()
    peer = None
    if args.peer == "llama.cpp":
        _need_llama_cpp()
        peer = depth_llama_cpp(path, args, model.cfg.vocab_size)
    elif args.peer is not None:
        raise ValueError(f"--depth runs Strata and --peer llama.cpp only, not --peer {args.peer}")
    rows = []
    engines = [("strata", ours)] + ([("llama.cpp (llama-cpp-python)", peer)] if peer else [])
    for name, res in engines:
        for d, r in res.items():
            tests = ((f"fill {d} (ubatch {args.ubatch})", [r["fill"]], "fill"),
                     (f"pp{args.n_prompt} @ d{d}", r["pp"], "pp"), (f"tg{args.n_gen} @ d{d}", r["tg"], "tg"))
            for test, runs, key in tests:
                mean, sd = _stats(runs)
                row = {"engine": name, "model": _name(path), "threads": args.threads, "test": test,
                       "tok_s": mean, "stddev": sd, "runs": runs, "t/s": f"{mean:.2f} ± {sd:.2f}"}
                if peer and res is ours:
                    row["vs_peer"] = mean / _stats(peer[d][key] if key != "fill" else [peer[d]["fill"]])[0]
                if res is ours and d != args.depth[0]:
                    first = ours[args.depth[0]]
                    row["vs_first_depth"] = mean / _stats(first[key] if key != "fill" else [first["fill"]])[0]
                rows.append(row)
    result = {"bench": "model-depth", "machine": machine(), "model": str(getattr(path, "path", path)), "dtype": str(args.dtype),
              "peak_rss_mib": rss, "load_s": load_s, "rows": rows,
              "kv_bytes_per_token": {d: r["kv_bytes_per_token"] for d, r in ours.items()},
              "split_ms": {d: r["split_ms"] for d, r in ours.items()}}
    cols = [("engine", "engine"), ("threads", "threads"), ("test", "test"), ("t/s", "t/s"),
            ("vs_first_depth", f"x d{args.depth[0]}")]
    if peer:
        cols.append(("vs_peer", f"x {args.peer}"))
    notes = [f"d{d}: attention states {r['kv_bytes_per_token']:,.0f} bytes a token"
             + (f"; a decode step: indexer {r['split_ms']['indexer']:.2f} ms, attention "
                f"{r['split_ms']['attention']:.2f} ms" if r["split_ms"] else "") for d, r in ours.items()]
    table = markdown(rows, cols) + f"\n\nStrata: {_name(path)}, {args.dtype}, peak RSS {rss:.0f} MiB; " + "; ".join(notes)
    emit(result, table, args.json)
    return 0


# --- several processes (--ep, --pp) ---------------------------------------------------------

def _bytes_sent(model, args, comm) -> dict:
    """Payload bytes every rank together sends a token: in one prefill of -p tokens, and in
    decode (8 one-token steps), from the ranks' counters (strata.dist.Comm.sent)."""
    vocab, out = model.cfg.vocab_size, {}
    for key, toks, step in (("pp", _tokens(args.n_prompt, vocab, 900), args.n_prompt),
                            ("tg", _tokens(8, vocab, 901), 1)):
        cache, before = model.new_cache(len(toks)), comm.sent
        for i in range(0, len(toks), step):
            model(toks[i:i + step], cache, last_only=True)
        out[key] = comm.sum_over_ranks(comm.sent - before) / len(toks)
    return out


def run_parallel(args, path, comm) -> int:
    """`torchrun ... -m strata bench model --ep E --pp P`: pp and tg of the ranks together,
    the bytes they send a token, then (rank 0, the others gone) the same model in one
    process, same machine, same run."""
    from strata import dist
    L = comm.layout
    given = [f for f in ("peer", "depth", "profile", "spec", "batch_invariant") if getattr(args, f, None)]
    if given:
        raise ValueError(f"--ep/--pp: bench model measures pp and tg of the ranks against one process; "
                         f"--{', --'.join(g.replace('_', '-') for g in given)} run in one process: drop them")
    ours = bench_strata(path, args, extra=lambda m, a: _bytes_sent(m, a, comm))
    dist.close()
    if L.rank != 0:
        return 0
    one = bench_strata(path, args)
    name = f"strata --ep {L.ep} --pp {L.pp} ({L.world} processes)"
    rows = []
    for res, engine in ((ours, name), (one, "strata (1 process)")):
        for test, key in ((f"pp{args.n_prompt}", "pp"), (f"tg{args.n_gen}", "tg")):
            mean, sd = _stats(res[key])
            sent = ours["extra"][key] if res is ours else 0.0
            rows.append({"engine": engine, "model": _name(path), "threads": args.threads, "test": test,
                         "tok_s": mean, "stddev": sd, "runs": res[key], "t/s": f"{mean:.2f} ± {sd:.2f}",
                         "vs_one": mean / _stats(one[key])[0], "bytes_sent_per_token": sent,
                         "sent": f"{sent / 1024:,.1f} KiB"})
    result = {"bench": "model-parallel", "machine": machine(), "model": str(getattr(path, "path", path)), "dtype": ours["dtype"],
              "ep": L.ep, "pp": L.pp, "world": L.world, "rows": rows,
              "peak_rss_mib_rank0": ours["peak_rss_mib"]}
    cols = [("engine", "engine"), ("threads", "threads a process"), ("test", "test"), ("t/s", "t/s"),
            ("vs_one", "x 1 process"), ("sent", "sent a token (all ranks)")]
    table = markdown(rows, cols) + (
        f"\n\nSent: the payload the ranks' collectives carry (an all-reduce counted as a ring, 2 (E-1)/E of "
        f"the tensor per rank; activations and logits once per receiver). Rank 0's peak RSS as a rank: "
        f"{ours['peak_rss_mib']:.0f} MiB.")
    emit(result, table, args.json)
    return 0
