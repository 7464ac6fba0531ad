"""`strata bench model --profile`: where a decode step's time goes.

After a short prompt and a few warm-up steps, `steps` one-token decode steps run under
torch.profiler, each module's forward wrapped in a `strata::<Class>` label. Three answers:

- the top ops by self time a step (an op's time less its child ops'), with calls a step;
- per module class, the time a step inside its forwards (nested classes count in both) and
  the part of it spent in Python outside any op ("python ms": the label's self time);
- the split of the step: time in ops against the rest (Python, dispatch, the profiler).

The profiler costs a few microseconds an op, so the profiled step is slower than the tg
row's; the ranking, not the absolute sum, is the answer. On a GPU the op times are the
host's (launches); a step replayed from a CUDA graph shows as one op.
"""
from __future__ import annotations

import time

LABEL = "strata::"


def _label_modules(model) -> list:
    """Forward hooks that open a `strata::<Class>` profiler label around each module's forward."""
    from torch.autograd.profiler import record_function
    stack: list = []

    def enter(m, args):
        ctx = record_function(LABEL + type(m).__name__)
        ctx.__enter__()
        stack.append(ctx)

    def leave(m, args, out):
        stack.pop().__exit__(None, None, None)

    handles = []
    for m in model.modules():
        if m is not model:  # the whole step is the step; its label would say nothing
            handles.append(m.register_forward_pre_hook(enter))
            handles.append(m.register_forward_hook(leave))
    return handles


def decode_profile(model, prompt: list[int], tokens: list[int], warmup: int = 4, top: int = 15,
                   sync=lambda: None) -> dict:
    """Profile one-token decode steps of `tokens` after `prompt` (and `warmup` of them
    unprofiled). Per-step figures in ms."""
    from torch.profiler import ProfilerActivity, profile
    cache = model.new_cache(len(prompt) + len(tokens) + warmup + 1)
    model(prompt, cache, last_only=True)
    for tok in tokens[:warmup]:
        model([tok], cache, last_only=True)
    steps = tokens[warmup:]
    if not steps:
        raise ValueError(f"--profile: {len(tokens)} tokens leave no step after {warmup} warm-up steps")
    cuda = any(p.is_cuda for p in model.parameters()) or any(b.is_cuda for b in model.buffers())
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    handles = _label_modules(model)
    try:
        sync()
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            for tok in steps:
                model([tok], cache, last_only=True)
            sync()
            wall_s = time.perf_counter() - t
    finally:
        for h in handles:
            h.remove()
    n = len(steps)
    ops, mods = [], []
    for e in prof.key_averages():
        if e.key.startswith(LABEL):
            mods.append({"module": e.key[len(LABEL):], "calls": e.count / n,
                         "ms": e.cpu_time_total / 1e3 / n, "python_ms": e.self_cpu_time_total / 1e3 / n})
        else:
            ops.append({"op": e.key, "calls": e.count / n, "self_ms": e.self_cpu_time_total / 1e3 / n,
                        "total_ms": e.cpu_time_total / 1e3 / n})
    step_ms = wall_s * 1e3 / n
    in_ops = sum(o["self_ms"] for o in ops)
    ops.sort(key=lambda o: -o["self_ms"])
    mods.sort(key=lambda m: -m["ms"])
    for o in ops:
        o["pct"] = 100 * o["self_ms"] / step_ms
    return {"steps": n, "step_ms": step_ms, "ops_ms": in_ops, "outside_ops_ms": step_ms - in_ops,
            "op_calls": sum(o["calls"] for o in ops), "top_ops": ops[:top], "modules": mods[:top]}


def text(p: dict) -> str:
    from strata.bench.report import markdown
    ops = markdown(p["top_ops"], [("op", "op"), ("calls", "calls/step"), ("self_ms", "self ms/step"),
                                  ("pct", "% of step"), ("total_ms", "with children ms/step")])
    mods = markdown(p["modules"], [("module", "module"), ("calls", "calls/step"), ("ms", "ms/step"),
                                   ("python_ms", "python ms/step")])
    return (f"Decode step profile ({p['steps']} steps under torch.profiler): {p['step_ms']:.2f} ms a step, "
            f"{p['ops_ms']:.2f} ms in {p['op_calls']:.0f} op calls, {p['outside_ops_ms']:.2f} ms outside ops "
            f"(Python, dispatch, the profiler)\n\n{ops}\n\nBy module class (nested classes count in both; "
            f"python: inside its forward, outside any op):\n\n{mods}")
