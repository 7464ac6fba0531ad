"""Where a kernel runs: the one place that decides.

Three decisions, all here, and the one door from the host to a device (`to_device`):
- a model's: `choose_kernels(kernels, device)` gives "triton" or "torch" for the whole
  model (default: triton on a GPU, torch on the CPU); every module records it at load and
  takes its ops through `triton_kernels.ops.impl`, so nothing re-derives it;
- a launcher's: a public launcher (qmatmul, moe, ...) called directly runs the Triton
  kernel for CUDA tensors, and for CPU tensors only under the Triton interpreter
  (TRITON_INTERPRET=1, as the tests set it), which runs the kernel's code on the CPU,
  slowly, so that CI checks it; else the op's torch implementation;
- the CPU path's: whether and when torch.compile builds its C++ loops (`cpu_compile_mode`), and
  what this CPU's vector units do well (`cpu_bf16_native`, `cpu_int8_vectors`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re

import torch

from . import invariant


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_fake(t: torch.Tensor) -> bool:
    """A fake tensor (torch.compile's trace, strata.runtime.trace): a shape with no values."""
    from torch._subclasses.fake_tensor import is_fake as fake
    return fake(t)


def use_triton(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return True
    if interpreter_on():
        interpreter_check()
        return True
    return False


@functools.cache
def interpreter_check() -> None:
    """Fail at once, saying what to install, where this Triton's interpreter cannot run.

    Before 3.7 the interpreter turns a scalar into a Python int with `int(array)` on a
    1-element array (`range(0, K, BLOCK_K)` in every kernel), which numpy 2.4 refuses:
    every launch would fail deep inside Triton with "only 0-dimensional arrays can be
    converted to Python scalars". Measured with Triton 3.6 (the lent GPUs') and 3.9."""
    import numpy as np
    import triton
    tv = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2])
    nv = tuple(int(p) for p in re.findall(r"\d+", np.__version__)[:2])
    if tv < (3, 7) and nv >= (2, 4):
        raise RuntimeError(
            f"TRITON_INTERPRET=1: Triton {triton.__version__}'s interpreter cannot run with numpy "
            f"{np.__version__} (it converts 1-element arrays to int, which numpy 2.4 refuses); "
            f"pip install 'numpy<2.4' or 'triton>=3.7'")


KERNELS = ("triton", "torch")

# set by strata.runtime.trace while it runs a model on fake CUDA tensors: an object with
# `copy(t, device)` (a fake allocation: a CPU-only torch refuses `t.to("cuda")` before any
# dispatch mode sees it, so every copy from the host to a device goes through `to_device`)
# and `name` (the GPU it stands for, whose tuned tables the launchers read)
_fake = None


def faking() -> bool:
    """Whether a fake device (strata.runtime.trace) stands in for the GPU: its tensors have
    shapes and no values, so nothing need make the values they are copied from."""
    return _fake is not None


def constant(cache: dict, key, make, device) -> torch.Tensor:
    """A launcher's table on `device`, made once (`make()` on the host) and kept in `cache`
    under `key`; under a fake device kept by the fake device instead (a fake tensor belongs
    to its trace)."""
    if _fake is not None and torch.device(device).type != "cpu":
        held = _fake.constants
        if (id(cache), key) not in held:
            held[id(cache), key] = to_device(make(), device)
        return held[id(cache), key]
    if key not in cache:
        # real bytes even while torch.compile's fake implementations run the launchers: a
        # fake tensor kept here would reach a later real launch
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            cache[key] = to_device(make(), device)
    return cache[key]


def to_device(t: torch.Tensor, device, non_blocking: bool = False) -> torch.Tensor:
    """`t` on `device` (itself where it lies there already): the loader's and the steps'
    host-to-device copies all pass here."""
    device = torch.device(device)
    if _fake is not None and device.type != "cpu" and t.device.type == "cpu":
        return _fake.copy(t, device)
    if _fake is not None and t.device.type == device.type:  # (a CPU-only torch cannot move a fake tensor)
        return t
    if device.type == "cuda" and t.device.type == "cpu" and t.numel() * t.element_size() <= ASYNC_BYTES:
        # a step's few indices (tokens, positions): from pinned memory, asynchronously. A
        # pageable copy makes the host wait for the GPU's queue (and raises under
        # torch.cuda.set_sync_debug_mode("error")); the pinned block is the caching host
        # allocator's, kept until the copy has run
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=non_blocking)


ASYNC_BYTES = 1 << 16  # host-to-device copies this small go through pinned memory (to_device)


def choose_device(device: str | None) -> str:
    """`--device`: as given, else "cuda" when torch sees a GPU, else "cpu"."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available() and _fake is None:
        raise ValueError(f"--device {device}: torch sees no GPU here (torch {torch.__version__}, "
                         f"CUDA build {torch.version.cuda or 'none'}); use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]")
    if dev.type == "cuda" and dev.index is not None and _fake is None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: torch sees {torch.cuda.device_count()} GPU(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return str(dev)


def check_current(device) -> None:
    """Refuse a model on cuda:N while another GPU is current: Triton would launch its
    kernels on the current one (use_device makes a command's GPU current; a notebook
    calls torch.cuda.set_device)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None and _fake is None and torch.cuda.current_device() != dev.index:
        raise ValueError(f"device {dev}: the current CUDA device is cuda:{torch.cuda.current_device()}, and "
                         f"Triton launches on the current one; call torch.cuda.set_device({dev.index}) first")


def use_device(device: str) -> None:
    """Make a command's GPU the process's current one: Triton launches on the current
    device's stream and a CUDA graph captures on it, so cuda:1 with cuda:0 current would
    launch on the wrong card. One process, one GPU (strata.dist's ranks set theirs)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None and _fake is None:
        torch.cuda.set_device(dev)


def choose_kernels(kernels: str | None, device) -> str:
    """"triton" or "torch" for a model on `device` (`--kernels`; None: triton on a GPU,
    torch on the CPU). Triton on the CPU is the interpreter: it checks the GPU path's code
    and is slow (minutes a token for a real model)."""
    dev = torch.device(device)
    if kernels is None:
        return "triton" if dev.type == "cuda" else "torch"
    if kernels not in KERNELS:
        raise ValueError(f"--kernels {kernels!r}: expected one of {', '.join(KERNELS)}")
    if kernels == "torch" and dev.type == "cuda":
        # its int4 and dense weights are the CPU's forms, held where the CPU reads them, and
        # its routing reads the device on the host, which no CUDA graph can hold
        raise ValueError(f"--kernels torch --device {device}: the torch path is the CPU's; on a GPU the "
                         f"Triton kernels run (drop --kernels, or use --device cpu)")
    if kernels == "triton" and dev.type == "cpu" and not interpreter_on():
        raise ValueError("--kernels triton on the CPU runs the Triton interpreter, which must be on "
                         "before triton is imported: set TRITON_INTERPRET=1 (the command line does "
                         "this itself), or use --kernels torch")
    return kernels


def device_name(device: torch.device) -> str | None:
    """The GPU's name (triton_kernels.configs keys its tuned tables by it); None on the CPU."""
    if device.type != "cuda":
        return None
    return _fake.name if _fake is not None else torch.cuda.get_device_name(device)


# set by triton_kernels.analysis.launches while it compiles a model's launches for a target
# with no GPU: (its backend, "cuda" or "hip", and its warp's lanes), which backend_name and
# warp_lanes then give (and so configs.family)
_target = None


def backend_name() -> str:
    """"hip" on a ROCm build of torch, else "cuda" (configs.family refines it by lanes)."""
    if _target is not None:
        return _target[0]
    return "hip" if torch.version.hip else "cuda"


def device_properties(device: torch.device):
    """torch's properties of the GPU `device` (cached); None off a GPU or under a fake one."""
    if device.type != "cuda" or faking():
        return None
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def warp_lanes(device: torch.device) -> int:
    """Lanes of a warp (a wavefront on AMD) where `device`'s kernels run: 32 on NVIDIA; on
    AMD the device's own (64 on CDNA: MI200, MI300; 32 on RDNA3, as Triton compiles for
    it), 64 where no device answers (a fake one)."""
    if _target is not None:
        return _target[1]
    if backend_name() != "hip":
        return 32
    props = device_properties(device)
    return 64 if props is None else props.warp_size


def rdna(device: torch.device) -> bool:
    """An AMD GPU of 32-lane waves (RDNA3: a Radeon PRO W7900, an RX 7900), where a tile
    sized for CDNA's 64-lane waves puts twice the values in each lane's registers: the
    configuration family "rdna" (configs.family_of, the one rule)."""
    from .configs import family_of
    return family_of(backend_name(), warp_lanes(device)) == "rdna"


COMPILE_MODES = ("auto", "on", "off")


def cpu_compile_mode() -> str:
    """How the CPU path uses torch.compile (triton_kernels.cpu.compiled: the llama decode step,
    a Flash-Next layer's halves, the int8-code matmul, the DeltaNet step, the dense
    experts' decode, a head's one-row loop), from STRATA_CPU_COMPILE:

      auto (default, or unset)  compiled only in the background: a command that decodes
                long enough (`chat`, `serve`, a long `generate`) builds the compiled step on
                a thread while it decodes eagerly, and switches when it is ready; every
                other run stays eager and never imports Dynamo (seconds on 2 cores), so
                no command is slower than with compiles off;
      1 / on    compiled at the first call, in the caller's thread (`bench model`, which
                wants the steady rate, and the tests of the compiled paths);
      0 / off   never (no C++ compiler, or to measure what the compiles buy)."""
    v = os.environ.get("STRATA_CPU_COMPILE", "auto").strip().lower()
    if v in ("", "auto"):
        return "on" if _steady else "auto"
    if v in ("0", "off", "false", "no"):
        return "off"
    if v in ("1", "on", "true", "yes"):
        return "on"
    raise ValueError(f"STRATA_CPU_COMPILE={v!r}: expected auto, 1 (on) or 0 (off)")


_steady = False


@contextlib.contextmanager
def compile_at_first_call():
    """Inside, the default (auto) compiles at the first call, as `on` (`bench model`: its
    warm-up takes the compiles, then the rates are the compiled steady state); 0 stays off."""
    global _steady
    before, _steady = _steady, True
    try:
        yield
    finally:
        _steady = before


# a GEMM of this many rows or more upcasts a bfloat16 weight to float32 where the CPU has no
# bfloat16 dot product (see cpu_bf16_native); below it the bfloat16 GEMV reads half the bytes
UPCAST_ROWS = 8


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512_BF16 or AMX, as oneDNN
    reports it). Without, torch's bfloat16 GEMM converts element by element: measured on a
    2-core AVX2 EPYC, 128 x 576 x 1536 takes 12.7 ms in bfloat16 against 1.6 ms in float32
    (1.9 ms with the weight upcast first), while one row is faster in bfloat16 (0.11 ms
    against 0.12-0.20 ms): so a prefill upcasts the weight (`upcast`), a decode does not.
    STRATA_CPU_BF16=0/1 overrides the detection."""
    forced = os.environ.get("STRATA_CPU_BF16", "")
    return forced != "0" if forced else _onednn_bf16()


@functools.cache
def _onednn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def upcast(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether x @ W.T, W held in `dtype`, should run in float32: a half-precision weight,
    x on the CPU with UPCAST_ROWS rows or more, a CPU without bfloat16 dot products, and
    batch-invariant mode off (its row tiles stay in the weight's dtype: upcast, flash-tiny's
    prompt in chunks of 7 no longer gave the bits of chunks of 512, test_invariance.py)."""
    return (dtype in (torch.bfloat16, torch.float16) and x.shape[0] >= UPCAST_ROWS
            and x.device.type == "cpu" and not invariant.enabled() and not cpu_bf16_native())


@functools.cache
def cpu_int8_vectors() -> bool:
    """Whether Inductor's C++ turns an int8 weight into floats at vector speed here: on
    AVX-512 it loads 16 int8 lanes in one instruction, on AVX2 its 8-lane int8 load goes
    through memcpy (ATen's Vectorized<int8_t>::loadu has no fast path for a count of 8).
    Measured, SmolLM2's 49152 x 576 Q8_0 head as int8 codes: 1.4 ms on AVX-512, 22 ms on
    AVX2 (where bfloat16 takes 3.5 ms). The int8-code matmul is chosen only where this
    holds (strata.nn.linear)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def cpu_line() -> str:
    """The plan's line on what this CPU's vector units decided (strata.load.plan)."""
    isa = torch.backends.cpu.get_cpu_capability()
    bf16 = ("bfloat16 dot products: matmuls in bfloat16" if cpu_bf16_native() else
            f"no bfloat16 dot products: matmuls of {UPCAST_ROWS} rows or more in float32")
    codes = ("int8-code matmuls on" if cpu_int8_vectors() else
             "int8-code matmuls off (Inductor loads int8 slowly without AVX-512): those weights dense")
    return f"cpu: {isa}; {bf16}; {codes}"
