"""The text front ends: `strata pull`, `strata generate`, `strata chat`."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from strata.hub import resolve_model
from strata.runtime import SamplingParams, generate

def pull(args) -> int:
    path = resolve_model(args.name)
    print(path)
    return 0


def load(args):
    """Model and tokenizer for `--model`, with the plan line on stderr."""
    from strata.gguf import open_gguf
    from strata.models import load_model
    from strata.tokenizer import Tokenizer
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    g = open_gguf(path)
    model = load_model(g, dtype=args.dtype, device=getattr(args, "device", None) or "cpu",
                       kernels=getattr(args, "kernels", None), **model_options(args, g, path))
    print(f"strata: {model.plan_line()}", file=sys.stderr)
    if g.arch == "qwen4exp":  # where the parts sit and what a long prompt will read
        from strata.storage.plan import plan_from_args
        for line in plan_from_args(g, args).lines():
            print(f"strata: {line}", file=sys.stderr)
    return model, Tokenizer.from_gguf(g)


def model_options(args, g, path) -> dict:
    """The architecture's own options from the command line (qwen4exp: QSA, PLE table I/O)."""
    if g.arch != "qwen4exp":
        return {}
    from strata.storage.experts import store_kwargs
    opts = {"qsa": getattr(args, "qsa", "on") != "off"}
    if getattr(args, "experts", None):
        opts["expert_opts"] = store_kwargs(args)
    elif str(getattr(args, "device", "cpu")).startswith("cuda"):
        # no --experts on a GPU: the placement decides (what fits VRAM, then RAM, then the
        # drive), and says so
        from strata.storage import placement as pl
        from strata.storage.experts import PACK_INDEX, default_pack_dir
        pack = Path(getattr(args, "experts_dir", None) or default_pack_dir(path)) / PACK_INDEX
        p = pl.place(pl.shape_of(g), pl.this_machine(args.device, getattr(args, "vram_reserve_mib", 1024)),
                     pack_exists=pack.is_file())
        for line in p.lines():
            print(f"strata: {line}", file=sys.stderr)
        opts["expert_opts"] = store_kwargs(SimpleNamespace(**{**vars(args), "experts": p.expert_tier}))
    # commands without the PLE flags (perplexity, imatrix, bench) take their defaults
    args = SimpleNamespace(**{"ple_io": "auto", "ple_gguf": None, "no_ple_prefetch": False,
                              "ple_io_depth": 16, **vars(args)})
    if "per_layer_token_embd.weight" in g.tensors or args.ple_gguf:
        from strata.storage.ple import open_from_args
        # ram is a candidate only when the table fits beside the rest of the model
        rest = sum(t.nbytes for n, t in g.tensors.items() if n != "per_layer_token_embd.weight")
        opts["ple_table"] = open_from_args(args, path, reserve_bytes=rest)
    return opts


def sampling(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.n_predict,
                          stop=list(args.stop or []))


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def generate_cmd(args) -> int:
    model, tok = load(args)
    prompt = args.prompt
    if not args.raw and tok.chat_template:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tok.encode(prompt)
    res = generate(model, tok, ids, sampling(args), on_text=_print)
    print()
    print(f"strata: {res.prompt_tokens} prompt tokens at {res.prefill_tok_s:.1f} tok/s, "
          f"{len(res.tokens)} generated at {res.decode_tok_s:.1f} tok/s ({res.finish_reason})",
          file=sys.stderr)
    return 0


def chat_cmd(args) -> int:
    """Interactive chat: one line per turn; /reset clears the history, /exit or EOF quits."""
    model, tok = load(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    params = sampling(args)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            _print("> ")
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(history))
        res = generate(model, tok, ids, params, on_text=_print)
        print()
        history.append({"role": "assistant", "content": res.text})
    return 0


def serve_cmd(args) -> int:
    """The HTTP server runs on a thread of its own and the engine on the main thread (see
    strata.server.engine on why); the model loads while /health already answers 503."""
    import logging
    import threading

    import uvicorn

    from strata.server.app import create_app
    from strata.server.engine import Engine
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    path = resolve_model(args.model)  # fail now on a bad --model
    app = create_app(args.model if args.model == "smollm2" else path.stem, default_max_tokens=args.max_tokens)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    http = threading.Thread(target=server.run, name="strata-http", daemon=True)
    http.start()
    state = app.state.strata
    try:
        model, tok = load(args)
        state.engine = Engine(model, tok, slots=args.slots, queue_size=args.queue,
                              cache_mib=args.conversation_cache_mib, ctx_size=args.ctx_size, start_thread=False)
    except Exception as e:
        logging.getLogger("strata.server").exception("loading failed")
        state.load_error = str(e)
        http.join()
        return 1
    logging.getLogger("strata.server").info("ready: %s, %d slots", path.name, args.slots)
    try:
        state.engine.run()
    except KeyboardInterrupt:
        server.should_exit = True
    return 0
