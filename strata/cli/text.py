"""The text front ends: `strata pull`, `strata generate`, `strata chat`, `strata serve`."""
from __future__ import annotations

import sys

from strata.cli.load import load, load_vision, say
from strata.hub import resolve_model
from strata.runtime import SamplingParams, generate
from strata.runtime.background import compile_in_background
from triton_kernels.cpu import compiled


def pull(args) -> int:
    path = resolve_model(args.name)
    print(path)
    return 0


def _think(args, tok) -> bool | None:
    """--think/--no-think for the chat template, said once where the template has no switch."""
    if args.think is not None and not tok.has_thinking_switch:
        print(f"strata: --{'' if args.think else 'no-'}think: this model's chat template has no thinking "
              f"switch; ignored", file=sys.stderr)
        return None
    return args.think


def sampling(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.n_predict,
                          stop=list(args.stop or []))


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def generate_cmd(args) -> int:
    from strata.vision.images import MARKER, flatten
    from strata.vision.preprocess import decode
    parts = [{"type": "image", "image": p} for p in args.image or []] + [{"type": "text", "text": args.prompt}]
    messages, sources = flatten([{"role": "user", "content": parts}], where="--image", local=True)
    # every image decoded before the model loads: a bad file is refused at once, not after the load
    decoded = [(decode(src), str(src)) for src, _ in sources]
    model, tok = load(args)
    vision = load_vision(args, model, tok, need=True) if args.image else None  # a tower only for images
    images = [vision.read(rgb, label=path) for rgb, path in decoded]  # an image is named by its path
    if not args.raw and tok.chat_template:
        prompt = tok.apply_chat_template(messages, enable_thinking=_think(args, tok))
    else:
        prompt = MARKER * len(images) + args.prompt
    ids = tok.encode(prompt)
    if images:
        ids = vision.expand(ids, images)
    compile_in_background(model, args.n_predict)
    res = generate(model, tok, ids, sampling(args), on_text=_print, spec=args.spec, spec_min_p=args.spec_min_p,
                   vision=vision, images=images)
    print()
    say(f"{res.prompt_tokens} prompt tokens at {res.prefill_tok_s:.1f} tok/s, "
        f"{len(res.tokens)} generated at {res.steady_tok_s:.1f} tok/s ({res.finish_reason})")
    if res.first_step_s:  # one-time costs, on their own lines
        say(f"the first decode step took {1e3 * res.first_step_s:.0f} ms (its one-time costs: first "
            f"calls and allocations, batch-invariant probes where the steps are); the rate above is "
            f"the steps after it")
    if (line := compiled.ready_line()) is not None:
        say(line)
    if res.spec is not None:
        say(res.spec.summary())
    return 0


def chat_cmd(args) -> int:
    """Interactive chat: one line per turn; /image PATH shows an image with the next turn,
    /reset clears the history, /exit or EOF quits."""
    from strata.vision.images import PartError, flatten
    from strata.vision.preprocess import ImageError
    model, tok = load(args)
    vision = None  # loaded at the first /image
    history = [{"role": "system", "content": args.system}] if args.system else []
    pending: list = []   # this turn's image parts
    seen: dict = {}      # path -> its Image, read once
    think = _think(args, tok)
    params = sampling(args)
    compile_in_background(model)  # built while the first line is typed; turns decode eagerly until then
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
            pending = []
            continue
        if line.startswith("/image"):
            path = line[len("/image"):].strip()
            try:
                vision = vision or load_vision(args, model, tok, need=True)
                seen[path] = seen.get(path) or vision.read(path)
            except ValueError as e:
                print(f"strata: {e}", file=sys.stderr)
                continue
            pending.append({"type": "image", "image": path})
            print(f"strata: {path}: {seen[path].n_tokens} image tokens, shown with your next line", file=sys.stderr)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": pending + [{"type": "text", "text": line}] if pending else line})
        pending = []
        messages, sources = flatten(history, local=True)
        images = [seen[src] for src, _ in sources]
        ids = tok.encode(tok.apply_chat_template(messages, enable_thinking=think))
        try:
            ids = vision.expand(ids, images) if images else ids
        except (ImageError, PartError) as e:  # the line is refused; its images wait for the next
            print(f"strata: {e}", file=sys.stderr)
            content = history.pop()["content"]
            pending = content[:-1] if isinstance(content, list) else []
            continue
        res = generate(model, tok, ids, params, on_text=_print, spec=args.spec, spec_min_p=args.spec_min_p,
                       vision=vision, images=images)
        print()
        history.append({"role": "assistant", "content": res.text})
    return 0


def serve_cmd(args) -> int:
    """The HTTP server runs on a thread of its own and the engine on the main thread (see
    strata.server.engine on why); the model loads while /health already answers 503."""
    import logging
    import os
    import threading
    import time

    import uvicorn

    from strata import dist
    from strata.dist import RankLost
    from strata.server.app import create_app
    from strata.server.engine import Engine
    from strata.server.ranks import Leader, follow
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    path = resolve_model(args.model)  # fail now on a bad --model
    comm = dist.comm()
    if comm is not None and args.spec:
        raise ValueError("--spec with --ep/--pp in serve: speculative slots are not shared over ranks yet; "
                         "drop --spec, or serve in one process")
    if comm is not None and comm.layout.rank != 0:  # a follower: rank 0 serves
        model, _ = load(args)
        follow(model, comm)
        return 0
    key = args.api_key or os.environ.get("STRATA_API_KEY") or None
    if not key and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("strata.server").warning(
            "listening on %s without --api-key: anyone who can reach port %d can use this model "
            "(set --api-key KEY or STRATA_API_KEY)", args.host, args.port)
    from strata.hub import MODELS
    app = create_app(args.model if args.model in MODELS else path.stem, default_max_tokens=args.max_tokens,
                     api_key=key, max_request_bytes=args.max_request_bytes,
                     max_prompt_tokens=args.max_prompt_tokens)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    http = threading.Thread(target=server.run, name="strata-http", daemon=True)
    http.start()
    state = app.state.strata
    try:
        model, tok = load(args)
        vision = None
        if comm is None:
            vision = load_vision(args, model, tok)
        elif args.mmproj:
            logging.getLogger("strata.server").warning(
                "--mmproj with --ep/--pp: the server takes images in one process only; it takes none now")
        if comm is not None:
            model = Leader(model, comm)
        state.engine = Engine(model, tok, slots=args.slots, queue_size=args.queue,
                              cache_mib=args.conversation_cache_mib, ctx_size=args.ctx_size, start_thread=False,
                              spec=args.spec, spec_min_p=args.spec_min_p, vision=vision)
    except Exception as e:
        logging.getLogger("strata.server").exception("loading failed")
        state.load_error = str(e)
        http.join()
        return 1
    if comm is None:
        compile_in_background(model)  # with --no-batch-invariant: the server decodes eagerly until it is built
    logging.getLogger("strata.server").info("ready: %s, %d slots", path.name, args.slots)
    try:
        state.engine.run()
    except KeyboardInterrupt:
        server.should_exit = True
    except RankLost as e:  # requests in flight get the error; then 503 naming the rank, and exit
        engine, state.engine = state.engine, None
        state.load_error = f"{e}; the server stops (torchrun --max-restarts N starts every rank again)"
        engine.fail_all(state.load_error)
        logging.getLogger("strata.server").error("%s", state.load_error)
        time.sleep(5)  # the error events reach their streams; callers meanwhile hear 503 and why
        server.should_exit = True
        return 3
    if comm is not None:
        model.stop()
    return 0
