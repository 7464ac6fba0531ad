"""`strata plan`, `strata probe`, `strata pack`: where a model's parts go and how fast the
drive reads them."""
from __future__ import annotations

import json

from strata.cli.args import load_options
from strata.hub import resolve_model


def _gguf(model: str):
    """`model` opened: flash-shape[:LAYERS] as `strata bench model` builds it (in memory,
    its blocks made when read: a plan reads none), else a known model or a .gguf path."""
    from strata.gguf import open_gguf
    from strata.hub import in_memory
    memory = in_memory(model)
    return memory if memory is not None else open_gguf(resolve_model(model))


def _placement(args):
    """`strata plan --device cuda`: the placement on a machine with GPUs (this one, or the
    one --gpu-mem, --gpus and --ram describe), for a GGUF, a known shape (flash-next) or
    flash-shape[:LAYERS]."""
    from strata.storage import io
    from strata.storage import placement as pl
    name, _, experts = args.model.partition(":")
    shape = pl.SHAPES[name](experts or "IQ3_XXS") if name in pl.SHAPES else pl.shape_of(_gguf(args.model))
    if args.gpu_mem:
        gpu = int(args.gpu_mem * pl.GiB)
    else:
        import torch
        if not torch.cuda.is_available():
            raise ValueError("strata plan --device cuda: torch sees no GPU here; give --gpu-mem GIB "
                             "(and --gpus, --ram) to plan for another machine")
        gpu = torch.cuda.mem_get_info()[1]
    ram = int(args.ram * pl.GiB) if args.ram else (io.mem_available() or 0)
    machine = pl.Machine(args.gpus, gpu, ram, args.vram_reserve_mib * 2**20)
    return pl.place(shape, machine, ctx=args.tokens)


def _ranks(args) -> int:
    """`strata plan MODEL --ep E --pp P`: each rank's share, the bytes sent (strata.storage.ranks)."""
    from strata.dist import Layout, parse_split
    from strata.storage import placement as pl
    from strata.storage import ranks
    name, _, experts = args.model.partition(":")
    shape = pl.SHAPES[name](experts or "IQ3_XXS") if name in pl.SHAPES else pl.shape_of(_gguf(args.model))
    layout = Layout(args.ep, args.pp, 0, parse_split(args.layer_split))
    layout.layers(shape.n_layers), layout.experts(max(shape.n_experts, args.ep))  # a bad split, named
    gpu = int(args.gpu_mem * pl.GiB) - args.vram_reserve_mib * 2**20 if args.gpu_mem else None
    out = ranks.lines(shape, layout, gpu, args.tokens, args.chunk, args.mem_bw * 1e9)
    print(json.dumps({"lines": out}, indent=1) if args.json else "\n".join(out))
    return 0


def plan(args) -> int:
    """`strata plan MODEL`: on a GPU (or for one), the placement; on the CPU, the plan a
    start would make (strata.load.decide), with the drive's reads."""
    from strata.load import decide
    from strata.storage import placement as pl
    from strata.storage.plan import measure_drive, save_drive
    if args.ep * args.pp > 1:
        return _ranks(args)
    if str(args.device).startswith("cuda") or args.gpu_mem or args.model.partition(":")[0] in pl.SHAPES:
        p = _placement(args)
        print(json.dumps({"lines": p.lines(), "expert_tier": p.expert_tier, "slots": p.slots,
                          "ple": p.ple_where, "per_token_bytes": p.per_token()}, indent=1)
              if args.json else "\n".join(p.lines()))
        return 0
    g = _gguf(args.model)
    on_drive = pl.shape_of(g).on_drive  # flash-shape: made in memory, nothing read from a drive
    if not on_drive and (args.remeasure or args.json):
        raise ValueError(f"--remeasure, --json: the drive's reads; {args.model} is made in memory and reads none")
    if args.remeasure:
        save_drive(measure_drive(g.path))
    lp = decide(g, load_options(args))
    if args.json:
        print(json.dumps(lp.drive_plan().as_dict(), indent=1))
    else:
        print("\n".join(lp.lines(drive=on_drive)))
    return 0


def probe(args) -> int:
    """`strata probe [MODEL]`."""
    from strata.storage.probe import probe as run_probe
    from strata.storage.probe import table
    path = resolve_model(args.model) if args.model else None
    out = run_probe(path, device=args.device, seconds=args.seconds)
    print(json.dumps(out, indent=1) if args.json else table(out))
    return 0


def pack(args) -> int:
    from strata.storage.pack import pack as write_pack
    write_pack(resolve_model(args.model), args.out)
    return 0
