"""Quantized tensors: raw GGUF blocks, their format and their logical shape."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

import quant

if TYPE_CHECKING:  # torch at first use: `strata quantize` (numpy alone) never imports it
    import torch


def stand_in(shape: tuple[int, int]) -> np.ndarray:
    """uint8 blocks of `shape` with no memory behind them (one zero byte seen everywhere):
    a tensor's size and shape where its bytes are not held."""
    return np.broadcast_to(np.zeros(1, np.uint8), shape)


def host_tensor(a: np.ndarray) -> torch.Tensor:
    """A contiguous torch view of blocks `a` (a copy only where `a` is strided). A file's
    blocks are a read-only mapping, which torch warns about: nothing writes them."""
    import torch
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(a))


def module_to(module: torch.nn.Module, device) -> torch.nn.Module:
    """`module.to(device)` for parameters and buffers, through `to_device` (the one door
    from the host to a device, which a fake-CUDA trace replaces: strata.runtime.trace)."""
    import torch

    from triton_kernels.backend import to_device
    device = torch.device(device)
    if device.type == "cpu":
        return module.to(device)
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.device != device:
                m._parameters[name] = torch.nn.Parameter(to_device(p.data, device), requires_grad=False)
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = to_device(b, device)
    return module


@dataclass
class QTensor:
    """A weight as stored: `data` is uint8 (rows, row_bytes), blocks end to end along each
    row; `shape` is the logical shape in torch order (rows first: GGUF's ne reversed), so
    a linear layer's weight is (out_features, in_features)."""
    name: str
    fmt: quant.Format
    shape: tuple[int, ...]
    data: np.ndarray  # uint8, zero-copy view of the file where it came from one

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def numpy(self) -> np.ndarray:
        """Dequantized, float32, in the logical shape (numpy reference codec)."""
        return self.fmt.dequantize(self.data).reshape(self.shape)

    def blocks(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The raw blocks as a uint8 torch tensor (rows, row_bytes); zero-copy on the CPU."""
        t = host_tensor(self.data)
        if str(device) == "cpu":
            return t
        from triton_kernels.backend import to_device
        return to_device(t, device)

    def dequantize(self, dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
        """Dequantized in `dtype` on `device`, by the device's default kernels (Triton on a
        GPU, torch on the CPU: see triton_kernels.backend.choose_kernels); float32 by default."""
        import torch

        from triton_kernels.backend import choose_kernels
        from triton_kernels.ops import impl
        fn = impl("dequantize", choose_kernels(None, device))
        return fn(self.blocks(device), self.fmt, torch.float32 if dtype is None else dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return f"QTensor({self.name!r}, {self.fmt.name}, shape={self.shape}, {self.nbytes / 2**20:.2f} MiB)"
