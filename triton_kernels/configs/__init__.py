"""Launch configurations as data: the one place that picks tiles and warps.

    pick(op, fmt, device=None, family="cuda", n=None) -> dict   e.g. {"block_n": 8, "block_u": 16, "num_warps": 4}

`default.json` beside this file holds, per op, a configuration for every format and any
per-format overrides, and under "hip" the same for AMD GPUs (64-lane wavefronts: twice
the lanes a program, so twice the rows for the same work a lane), under "rdna" what AMD's
32-lane waves (RDNA3: family(device)) take over "hip"'s (CDNA's tiles where it names none); `<device>.json` (the device name as torch reports it, spaces and
slashes as underscores, e.g. `NVIDIA_H200.json`), written by `strata bench kernels
--tune` on that device, overrides it. Later entries win: op defaults, then the op's
format entry, then "hip"'s and "rdna"'s for their families, then the device file's op
defaults and format entry. A format entry's "by_n"
holds tiles per weight height N (a GEMV's rows), written by --tune: the entry of the
smallest bound at or above n ("1024": up to 1024 rows), the largest bound's beyond them,
over the format's own tiles; a pick with no n (the static check) takes the format's own
tiles, which --tune sets from 4096 x 14336, the shape `bench kernels` times. The MoE ops' tiles and
num_warps are the dp4a kernels'; `dot_num_warps` is the tl.dot kernels' (a prompt's; a
decode's for experts without int8 units, FP8 and batch-invariant mode), and
"gemv"'s `float_num_warps` the float GEMV's (float_gemv_warps); "gemm"'s `num_warps` is
the per-weight GEMM's, `unit_num_warps` the unit GEMM's; "qsa_scores" names no format. The
dp4a GEMV's `split_k` is an integer or "auto" (triton_kernels.int8.split_for).

Under "interpreter", larger tiles for a whole model run by the Triton interpreter
(`--kernels triton` on the CPU): the interpreter's cost is per program and per
operation, so a GPU's small tiles make a vocabulary-sized GEMV take minutes. They apply
only inside `interpreter_tiles()` (the CLI opens it for that run); `tiles(name,
default)` gives the fixed tiles of the paths that take none from `pick`.
"""
from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import re

HERE = pathlib.Path(__file__).parent
BY_N = "by_n"  # a format entry's tiles per weight height (see the module)
_interpreter = False  # interpreter_tiles() is open


@contextlib.contextmanager
def interpreter_tiles(on: bool = True):
    """Launches inside take the "interpreter" entries (see the module's docstring)."""
    global _interpreter
    held, _interpreter = _interpreter, on
    try:
        yield
    finally:
        _interpreter = held


def tiles(name: str, default: tuple) -> tuple:
    """A path's fixed tiles: `default`, or the interpreter's inside interpreter_tiles()."""
    if _interpreter:
        t = _load(str(HERE / "default.json")).get("interpreter", {}).get("tiles", {}).get(name)
        if t:
            return tuple(t)
    return default


def device_file(device_name: str) -> pathlib.Path:
    return HERE / (re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name.strip()) + ".json")


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict:
    p = pathlib.Path(path)
    return json.loads(p.read_text()) if p.exists() else {}


def family(device) -> str:
    """The configuration family of `device` (a torch.device): "cuda", "hip", or "rdna" for
    AMD's 32-lane waves, whose entries lie over "hip"'s."""
    from ..backend import backend_name, warp_lanes
    return family_of(backend_name(), warp_lanes(device))


def family_of(backend: str, lanes: int) -> str:
    """family() of a GPU of `backend` ("cuda", "hip") and `lanes` a warp (a static target's)."""
    return "rdna" if backend == "hip" and lanes == 32 else backend


def pick(op: str, fmt: str, device: str | None = None, family: str = "cuda", n: int | None = None) -> dict:
    """`op`'s configuration for `fmt` on a GPU named `device` of configuration `family`
    (family()), a GEMV's for `n` rows (see the module)."""
    default = _load(str(HERE / "default.json"))
    tables = [default]
    if family in ("hip", "rdna"):
        tables.append(default.get("hip", {}))
    if family == "rdna":
        tables.append(default.get("rdna", {}))
    if device:
        tables.append(_load(str(device_file(device))))
    if _interpreter:
        tables.append(default.get("interpreter", {}))
    out: dict = {}
    for t in tables:
        entry = t.get(op, {})
        out.update({k: v for k, v in entry.items() if not isinstance(v, dict)})
        own = entry.get(fmt, {})
        out.update({k: v for k, v in own.items() if k != BY_N})
        if n is not None and own.get(BY_N):
            out.update(by_n(own[BY_N], n))
    return out


def by_n(buckets: dict, n: int) -> dict:
    """The entry of `buckets` ({"1024": {...}, "8192": {...}}: bounds on N) for n rows."""
    bounds = sorted(int(b) for b in buckets)
    return buckets[str(next((b for b in bounds if n <= b), bounds[-1]))]


def num_warps(op: str, fmt: str, device, key: str = "num_warps") -> int:
    """The warps a launch on `device` (a torch.device) takes: `key` of pick(), else 4."""
    from ..backend import device_name
    return pick(op, fmt, device_name(device), family(device)).get(key, 4)


def float_gemv_warps(fmt: str, device) -> int:
    """The float GEMV's warps (the per-weight decode: qmatmul's "gemv" path and the launches
    that run its programs): the "gemv" entry's `float_num_warps` where a format's float
    GEMV needs other warps than its dp4a GEMV, else its num_warps."""
    from ..backend import device_name
    return float_warps(pick("gemv", fmt, device_name(device), family(device)))


def float_warps(gemv_config: dict) -> int:
    """float_gemv_warps of a "gemv" configuration from pick (the static check's, too)."""
    return gemv_config.get("float_num_warps", gemv_config.get("num_warps", 4))


def write(device_name: str, table: dict) -> pathlib.Path:
    """Store a tuned table for one device; returns its path."""
    path = device_file(device_name)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()
    return path
