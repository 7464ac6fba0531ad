"""A model for a command: the flags become strata.load.Options, `decide` makes the plan,
its lines go to stderr, and the model is built from that same plan."""
from __future__ import annotations

import sys

from strata.cli.args import load_options
from strata.hub import resolve_model


# under --ep/--pp (strata.cli._join): ranks but 0 say nothing, or each says its rank
quiet, prefix = False, ""


def say(line: str) -> None:
    if not quiet:
        print(f"strata: {prefix}{line}", file=sys.stderr)


def load(args, model: str | None = None, dtype=None, **override):
    """(model, tokenizer) for `--model` (or `model`, a known name or a .gguf path) with the
    command's flags; `dtype` (a torch dtype, or bf16/f32) overrides --dtype, `override`
    other strata.load.Options fields."""
    from strata.gguf import open_gguf
    from strata.load import build, decide
    from strata.tokenizer import Tokenizer
    g = open_gguf(resolve_model(model or args.model))
    plan = decide(g, load_options(args, **({"dtype": dtype} if dtype is not None else {}), **override))
    for line in plan.lines():
        say(line)
    m = build(plan)
    say(m.plan_line())
    from strata.runtime import timing
    if timing.enabled():  # the launches a step, counted once for the STRATA_DECODE_TIMING lines
        from strata.load.launches import count_launches
        m.step_launches = count_launches(plan)
        say(m.step_launches.line())
    return m, Tokenizer.from_gguf(g)


def load_vision(args, model, tok, need: bool = False):
    """The model's vision tower (strata.vision.images.Vision) from --mmproj or the file beside
    the model, said in a line; None where there is none and `need` is false."""
    from strata.vision.images import Vision, find_mmproj
    model_path = resolve_model(args.model)
    path = find_mmproj(model_path, getattr(args, "mmproj", None))
    if path is None:
        if need:
            raise ValueError(f"images: {model_path.name} has no vision tower beside it (mmproj-{model_path.name}); "
                             f"give --mmproj PATH (`strata convert HF_DIR OUT.gguf --mmproj` writes one)")
        return None
    vision = Vision.load(model, tok, path)
    say(vision.describe())
    return vision
