"""Where a kernel runs: the one place that decides.

CUDA tensors run the Triton kernel. CPU tensors run the op's torch implementation, unless
the Triton interpreter is on (TRITON_INTERPRET=1, as the tests set it), in which case the
Triton kernel itself runs on the CPU, slowly, so that CI checks the kernel's code.
"""
from __future__ import annotations

import os

import torch


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreter_on()


def device_name(device: torch.device) -> str | None:
    """The GPU's name (triton_kernels.configs keys its tuned tables by it); None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def backend_name() -> str:
    """"hip" on a ROCm build of torch, else "cuda": the configuration family."""
    return "hip" if torch.version.hip else "cuda"
