"""`strata`: the command line. The parser (strata.cli.parser) and the flags several
commands share (strata.cli.args); each command's function takes the parsed flags, turns
them into a library call's plain arguments, and prints. Nothing below this package
imports it."""
from __future__ import annotations

import sys

from strata.cli.parser import build_parser

# commands that load a model, and so take --device and --kernels
_LOADS = ("generate", "chat", "serve", "perplexity", "imatrix")


def _interpret(argv: list[str] | None) -> None:
    """`--kernels triton` on the CPU runs the Triton interpreter, which must be on before
    triton is imported: start again with TRITON_INTERPRET=1."""
    import os
    env = dict(os.environ, TRITON_INTERPRET="1")
    args = sys.argv[1:] if argv is None else argv
    os.execve(sys.executable, [sys.executable, "-m", "strata", *args], env)


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["quantize"]:
        # numpy alone: neither the full parser nor the torch setup below (seconds of imports)
        from strata.cli.parser import quantize_parser
        from strata.cli.quantize import quantize
        return quantize(quantize_parser().parse_args(argv))
    args = build_parser().parse_args(argv)
    if args.command in _LOADS:  # a wrong --model named at once, not after seconds of imports
        from strata.hub import HubError, check_model
        try:
            check_model(args.model)
        except HubError as e:
            print(f"strata: {e}", file=sys.stderr)
            return 2
    from strata.cli.args import DTYPES
    from triton_kernels import configs
    from triton_kernels.backend import choose_device, cpu_compile_mode, interpreter_on, use_device
    try:
        cpu_compile_mode()  # a misspelt STRATA_CPU_COMPILE is named now, not in the first step
    except ValueError as e:
        print(f"strata: {e}", file=sys.stderr)
        return 2
    if hasattr(args, "dtype"):  # one spelling on the command line, a torch dtype past here
        args.dtype = DTYPES[args.dtype]
    if args.command in _LOADS or (args.command == "bench" and args.what == "model"):
        try:
            args.device = choose_device(args.device)
        except ValueError as e:
            print(f"strata: {e}", file=sys.stderr)
            return 2
        use_device(args.device)
    elif args.command == "plan" and args.device is None:  # a plan may be for another machine
        args.device = "cuda" if args.gpu_mem else choose_device(None)
    interpret = getattr(args, "kernels", None) == "triton" and str(args.device).startswith("cpu")
    if interpret and not interpreter_on():
        _interpret(argv)
    try:
        _join(args)
    except ValueError as e:
        print(f"strata: {e}", file=sys.stderr)
        return 2
    try:
        with configs.interpreter_tiles(interpret):
            return _run(args)
    finally:
        from strata import dist
        dist.close()


# commands that run as several processes under torchrun (--ep, --pp)
_PARALLEL = ("generate", "serve", "perplexity", "bench")


def _join(args) -> None:
    """Under torchrun with --ep/--pp: join the world (strata.dist.init); only rank 0 prints
    to stdout, and only rank 0 (or every rank, prefixed, with --plan-all-ranks) says
    what it loads; errors are every rank's."""
    import os

    from strata import dist
    from strata.cli import load
    if args.command == "plan":  # --ep/--pp plan ranks there; this process is one
        return
    ep, pp = getattr(args, "ep", 1), getattr(args, "pp", 1)
    if ep * pp == 1 and not (dist.launched() and int(os.environ["WORLD_SIZE"]) > 1):
        return
    if args.command not in _PARALLEL or (args.command == "bench" and args.what != "model"):
        raise ValueError(f"--ep/--pp: `strata {args.command}` runs in one process; "
                         f"{', '.join(_PARALLEL[:-1])} and bench model run under torchrun")
    comm = dist.init(ep, pp, dist.parse_split(getattr(args, "layer_split", None)), args.dist_timeout,
                     str(args.device))
    rank = comm.layout.rank
    if getattr(args, "plan_all_ranks", False):
        load.prefix = f"[rank {rank}] "
    elif rank != 0:
        load.quiet = True
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
    if hasattr(args, "seed"):  # every rank samples the same tokens from the same logits
        import random
        seed = args.seed if args.seed is not None else random.randrange(2**31)
        args.seed = comm.broadcast_object(seed, "the broadcast of the sampling seed")


def _bench(args) -> int:
    from strata import hub
    if args.what == "ple":
        from strata.bench import ple
        return ple.run(args)
    if args.what in ("dequant", "kernels"):
        from strata.bench import dequant, kernels
        return {"dequant": dequant.run, "kernels": kernels.run}[args.what](args)
    if args.what == "model":
        memory = hub.in_memory(args.model, args.rows)
        if memory is not None:  # flash-shape[:LAYERS]: built in memory, no file, no peer
            if args.peer:
                raise ValueError(f"--peer {args.peer}: {args.model} is built in memory; a peer reads a file")
            if not str(args.device).startswith("cuda"):
                if args.gpu_mem or args.ram:
                    raise ValueError("--gpu-mem, --ram: the placement of a GPU's parts; give --device cuda")
                from strata.storage.io import mem_available
                need, have = sum(t.nbytes for t in memory.tensors.values()), mem_available()
                if have and need > 0.9 * have:  # on the CPU every block is made in RAM
                    from strata.names.qwen4exp import PLE_TABLE
                    ple = memory.tensors[PLE_TABLE].nbytes
                    layers = memory.get(f"{memory.get('general.architecture')}.block_count")
                    fewer = "" if layers == 1 else " or fewer layers (flash-shape:1)"
                    raise ValueError(f"{args.model}: {need / 2**30:.1f} GiB of blocks ({ple / 2**30:.1f} GiB "
                                     f"the PLE table's), more than 90% of the {have / 2**30:.1f} GiB of RAM "
                                     f"available; give a smaller PLE table (--rows 65536){fewer}")
            from strata.bench import model
            return model.run(args, memory)
        if args.rows is not None:
            raise ValueError(f"--rows: flash-shape's PLE table; {args.model} is a file")
    path = hub.resolve_model(args.model)
    if args.what == "serve":
        from strata.bench import serve
        return serve.run(args, path)
    from strata.bench import model
    hf_dir = getattr(args, "hf_dir", None) or (hub.flash_tiny_checkpoint() if path == hub.flash_tiny_path() else None)
    return model.run(args, path, hf_dir)


def _run(args) -> int:
    from strata.dist import RankLost
    from strata.hub import HubError
    try:
        if args.command in ("pack", "plan", "probe"):
            from strata.cli import storage
            return {"pack": storage.pack, "plan": storage.plan, "probe": storage.probe}[args.command](args)
        if args.command == "synth":
            from strata import hub
            if args.name == "flash-shape":
                print(hub.synth_flash_shape(args.layers or 4, args.rows, args.out, force=args.force))
                return 0
            given = [f for f in ("layers", "rows", "out") if getattr(args, f) is not None]
            if given:
                raise ValueError(f"--{', --'.join(given)}: flash-shape's flags; {args.name} takes none")
            print(hub.synth_flash_tiny(force=args.force, vision=args.name == "flash-tiny-vision"))
            return 0
        if args.command == "convert":
            from strata.convert import convert
            convert(args.hf_dir, args.output, args.outtype, mmproj=args.mmproj)
            return 0
        if args.command in ("perplexity", "imatrix"):
            from strata.cli import eval as ev
            return {"perplexity": ev.perplexity, "imatrix": ev.imatrix}[args.command](args)
        if args.command == "bench":
            return _bench(args)
        from strata.cli import text
        return {"pull": text.pull, "generate": text.generate_cmd, "chat": text.chat_cmd,
                "serve": text.serve_cmd}[args.command](args)
    except (ValueError, HubError) as e:  # bad input or file, named by the code that found it
        print(f"strata: {e}", file=sys.stderr)
        return 2
    except RankLost as e:  # --ep/--pp: another process is gone
        print(f"strata: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
