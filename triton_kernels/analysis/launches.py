"""The launches a model makes, recorded on the CPU and compiled for a GPU.

    with record() as calls:          # under the Triton interpreter, a model runs with
        model(tokens, state)         # --kernels triton; each Triton op call is noted
    results = compile_calls(calls, ("sm_90", "gfx942"))

A call is recorded at the launcher (qmatmul, moe, route, ngram_ids, ple_gather,
dequantize): its arguments' shapes, dtypes and strides, its other arguments as given.
`compile_calls` replays each call in a child process without the interpreter, with
tensors that say they are on a GPU (zeros: no value reaches a signature), the target's
configuration tables and instruction family (PTX or GCN), and, in place of a launch,
compiles the kernel with the signature and constexprs the launcher chose. So what
compiles is what the engine would launch on that GPU for the same calls, tiles included:
the interpreter's own larger tiles (configs.interpreter_tiles) do not leak in.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

import quant

from .. import ops
from ..hc_down import Down
from . import problems

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8,
    torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.bool)}
_TL = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "uint8": "u8",
       "int8": "i8", "int16": "i16", "uint16": "u16", "int32": "i32", "uint32": "u32",
       "int64": "i64", "bool": "i1"}


def _encode(v):
    if isinstance(v, torch.Tensor):
        base = v.untyped_storage().nbytes() // max(v.element_size(), 1)
        return {"tensor": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                "stride": list(v.stride()), "offset": v.storage_offset(), "base": base}
    if isinstance(v, quant.Format):
        return {"format": v.name}
    if isinstance(v, torch.dtype):
        return {"torch_dtype": str(v).replace("torch.", "")}
    if isinstance(v, (list, tuple)):
        return {"seq": [_encode(x) for x in v]}
    if isinstance(v, Down):  # hc_down's sums, which hc_mix takes
        return {"down": [_encode(x) for x in (v.y, v.ss, v.part, v.w)], "eps": v.eps}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"cannot record an argument of type {type(v).__name__}")


def _decode(v):
    if not isinstance(v, dict):
        return v
    if "tensor" in v:
        dt = _DTYPES[v["dtype"]]
        base = torch.zeros(max(v["base"], 1), dtype=dt)
        return base.as_strided(v["tensor"], v["stride"], v["offset"])
    if "format" in v:
        return quant.get(v["format"])
    if "torch_dtype" in v:
        return _DTYPES[v["torch_dtype"]]
    if "down" in v:
        return Down(*(_decode(x) for x in v["down"]), v["eps"])
    return [_decode(x) for x in v["seq"]]


def describe(op: str, args: tuple, kwargs: dict) -> dict:
    """One launcher call as plain data (JSON)."""
    return {"op": op, "args": [_encode(a) for a in args],
            "kwargs": {k: _encode(v) for k, v in kwargs.items()}}


@contextlib.contextmanager
def record():
    """Note every Triton op call made while open (in this process); yields the list."""
    calls: list[dict] = []
    held, ops.recorder = ops.recorder, calls
    try:
        yield calls
    finally:
        ops.recorder = held


def distinct(calls: list[dict]) -> list[dict]:
    seen, out = set(), []
    for c in calls:
        key = json.dumps(c, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


@dataclass
class Compiled:
    """One kernel as a call launches it on `target`: compiled, or the error."""
    op: str
    kernel: str
    target: str
    signature: str
    constexprs: str
    num_warps: int
    ok: bool
    regs: int = 0
    spill_bytes: int = 0
    shared_bytes: int = 0
    error: str = ""

    @property
    def problems(self) -> str:
        """Why this kernel would not run as compiled on its target ("" when it would)."""
        return problems(self.target, self.spill_bytes, self.shared_bytes, self.error, self.ok)


def compile_calls(calls: list[dict], targets=("sm_90", "gfx942")) -> list[Compiled]:
    """Every kernel that `calls` launch, compiled for each target (in a child process
    without the interpreter; distinct kernels once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    payload = json.dumps({"calls": distinct(calls), "targets": list(targets)})
    done = subprocess.run([sys.executable, "-m", "triton_kernels.analysis.launches"], input=payload, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"replaying the recorded launches failed:\n{done.stderr[-4000:]}")
    return [Compiled(**r) for r in json.loads(done.stdout)]


# --- the child: replay with a compile in place of each launch ------------------------------

def _type_of(v) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + _TL[str(v.dtype).replace("torch.", "")]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(v).__name__}")


def _replay(calls: list[dict], targets: list[str]) -> list[dict]:
    import triton.runtime.jit as jit

    from .. import backend
    from . import static
    results: dict[tuple, dict] = {}
    state = {"op": "", "target": ""}

    def compile_launch(kernel, args, kwargs):
        params = kernel.params
        bound = {p.name: a for p, a in zip(params, args)}
        options = {k: v for k, v in kwargs.items() if k not in {p.name for p in params}}
        bound.update({k: v for k, v in kwargs.items() if k not in options})
        for p in params:
            if p.name not in bound and p.has_default:
                bound[p.name] = p.default
        sig, cx, aligned = {}, {}, []
        for p in params:
            v = bound[p.name]
            # Triton's launches take an integer argument of 1 as a constant (its specialization;
            # do_not_specialize aside): a loop over T tokens at T = 1 compiles without its loop
            one = type(v) is int and v == 1 and not p.do_not_specialize
            if p.is_constexpr or v is None or one:
                sig[p.name], cx[p.name] = "constexpr", v
            else:
                sig[p.name] = _type_of(v)
                # Triton's specialization of a launch's arguments: multiples of 16 said so
                if (isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0) or (
                        isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0):
                    aligned.append(p.name)
        num_warps = int(options.pop("num_warps", 4))
        opts = {k: v for k, v in options.items() if k in ("num_stages", "num_ctas")}
        t = state["target"]
        key = (kernel.__name__, t, json.dumps(sig), repr(sorted(cx.items(), key=lambda kv: kv[0])), num_warps,
               tuple(aligned))
        if key in results:
            return
        row = dict(op=state["op"], kernel=kernel.__name__, target=t, signature=json.dumps(sig),
                   constexprs=repr({k: getattr(v, "__name__", v) for k, v in cx.items()}),
                   num_warps=num_warps, ok=False)
        try:
            k = static._compile(kernel, tuple(sig.items()), tuple(cx.items()), t, num_warps,
                                tuple(opts.items()), tuple(aligned))
            res = static.usage(k, t)
            row.update(ok=True, regs=res["regs"], spill_bytes=res["spill"], shared_bytes=res["shared"])
        except Exception as e:  # noqa: BLE001: the error is the result
            row["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
        results[key] = row

    def fake_run(self, *args, grid, warmup, **kwargs):
        compile_launch(self, args, kwargs)

    jit.JITFunction.run = fake_run
    torch.Tensor.is_cuda = property(lambda self: True)  # launchers take their GPU branches
    for t in targets:
        state["target"] = t
        # the launchers' choices of family, lanes and instruction set (backend_name,
        # warp_lanes, asm.asm_for) follow the target
        backend._target = (static.TARGETS[t].backend, static.TARGETS[t].warp_size)
        for c in calls:
            state["op"] = c["op"]
            fn = ops.OPS[c["op"]][0]
            fn(*[_decode(a) for a in c["args"]], **{k: _decode(v) for k, v in c["kwargs"].items()})
    return list(results.values())


if __name__ == "__main__":
    req = json.loads(sys.stdin.read())
    out = _replay(req["calls"], req["targets"])
    json.dump(out, sys.stdout)
