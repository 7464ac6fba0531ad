"""Where a kernel runs: the one place that decides.

Three decisions, all here:
- a model's: `choose_kernels(kernels, device)` gives "triton" or "torch" for the whole
  model (default: triton on a GPU, torch on the CPU); every module records it at load and
  takes its ops through `triton_kernels.ops.impl`, so nothing re-derives it;
- a launcher's: a public launcher (qmatmul, moe, ...) called directly runs the Triton
  kernel for CUDA tensors, and for CPU tensors only under the Triton interpreter
  (TRITON_INTERPRET=1, as the tests set it), which runs the kernel's code on the CPU,
  slowly, so that CI checks it; else the op's torch implementation;
- the CPU path's: whether torch.compile may build its C++ loops (`cpu_compile`).
"""
from __future__ import annotations

import os

import torch


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreter_on()


KERNELS = ("triton", "torch")


def choose_device(device: str | None) -> str:
    """`--device`: as given, else "cuda" when torch sees a GPU, else "cpu"."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no GPU here (torch {torch.__version__}, "
                         f"CUDA build {torch.version.cuda or 'none'}); use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]")
    return str(dev)


def choose_kernels(kernels: str | None, device) -> str:
    """"triton" or "torch" for a model on `device` (`--kernels`; None: triton on a GPU,
    torch on the CPU). Triton on the CPU is the interpreter: it checks the GPU path's code
    and is slow (minutes a token for a real model)."""
    dev = torch.device(device)
    if kernels is None:
        return "triton" if dev.type == "cuda" else "torch"
    if kernels not in KERNELS:
        raise ValueError(f"--kernels {kernels!r}: expected one of {', '.join(KERNELS)}")
    if kernels == "triton" and dev.type == "cpu" and not interpreter_on():
        raise ValueError("--kernels triton on the CPU runs the Triton interpreter, which must be on "
                         "before triton is imported: set TRITON_INTERPRET=1 (the command line does "
                         "this itself), or use --kernels torch")
    return kernels


def device_name(device: torch.device) -> str | None:
    """The GPU's name (triton_kernels.configs keys its tuned tables by it); None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def backend_name() -> str:
    """"hip" on a ROCm build of torch, else "cuda": the configuration family."""
    return "hip" if torch.version.hip else "cuda"


def cpu_compile() -> bool:
    """Whether the CPU path compiles with torch.compile (triton_kernels.compiled: the llama
    decode step, the int8-code matmul, the DeltaNet step, the dense experts' decode).
    STRATA_CPU_COMPILE=0 turns them all off (no C++ compiler, or to measure what they buy)."""
    return os.environ.get("STRATA_CPU_COMPILE", "1") not in ("", "0")
