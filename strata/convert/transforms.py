"""What `strata convert` does to a tensor on its way to GGUF: the transforms of the name
table (plus1, squeeze, a_log, the DeltaNet's value-head reordering; reasons in
qwen4exp.py), the output format each tensor takes, and its encoding to GGUF bytes."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import quant

# --outtype -> (default tensor format, general.file_type as llama.cpp's LlamaFileType)
OUTTYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7)}

# always F32 (llama.cpp keeps these unquantized: routers, the conv kernel)
_F32_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def widen(t: torch.Tensor) -> torch.Tensor:
    # llama.cpp computes in the stored dtype when it is f16 or f32, else in f32
    return t if t.dtype in (torch.float16, torch.float32) else t.to(torch.float32)


def _reorder_v(t: torch.Tensor, dim: int, n_k: int, r: int, d: int) -> torch.Tensor:
    """V heads grouped by k head -> tiled, along `dim` (n_k * r * d long)."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], n_k, r, d, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


class Transforms:
    """The name table's transforms (strata.names.qwen4exp), for the config's DeltaNet shape:
    `tf(key, t)` applies transform `key` (None: none) to `t`."""

    def __init__(self, hp: dict[str, Any]):
        self.n_k = hp.get("linear_num_key_heads", 0)
        self.n_v = hp.get("linear_num_value_heads", 0)
        self.dk = hp.get("linear_key_head_dim", 0)
        self.dv = hp.get("linear_value_head_dim", 0)
        self.reorder = self.n_k > 0 and self.n_v > 0 and self.n_k != self.n_v

    def __call__(self, key: str | None, t: torch.Tensor) -> torch.Tensor:
        r = self.n_v // self.n_k if self.reorder else 1
        if key is None:
            return t
        if key == "plus1":
            return t + 1
        if key == "squeeze":
            return t.squeeze()
        if key == "a_log":
            t = -torch.exp(t)
            return _reorder_v(t, 0, self.n_k, r, 1) if self.reorder else t
        if key == "v_conv":
            t = t.squeeze()
            if self.reorder:
                qk = self.dk * self.n_k * 2
                t = torch.cat([t[:qk], _reorder_v(t[qk:], 0, self.n_k, r, self.dv)], dim=0)
            return t
        if not self.reorder:
            return t
        if key == "v_qkv":
            qk = self.dk * self.n_k * 2
            return torch.cat([t[:qk], _reorder_v(t[qk:], 0, self.n_k, r, self.dv)], dim=0)
        if key == "v_rows":
            return _reorder_v(t, 0, self.n_k, r, self.dv)
        if key == "v_heads":
            return _reorder_v(t, 0, self.n_k, r, 1)
        if key == "v_cols":
            return _reorder_v(t, 1, self.n_k, r, self.dv)
        raise AssertionError(key)


@dataclass
class OutTensor:
    """An output tensor of the plan, with the function that makes its data."""
    name: str
    # loader -> the tensor, or (the PLE table) a list of zero-argument loaders of its row blocks
    make: Callable[[Callable[[str], torch.Tensor]], torch.Tensor | list[Callable[[], torch.Tensor]]]
    # set by plan(): logical shape (torch order) and format
    shape: tuple[int, ...] = ()
    fmt: quant.Format | None = None

    @property
    def nbytes(self) -> int:
        rows = math.prod(self.shape[:-1])
        return rows * self.fmt.row_bytes(self.shape[-1])


def tensor_format(name: str, shape: tuple[int, ...], outtype: str) -> quant.Format:
    """The format tensor `name` of `shape` takes under --outtype `outtype`."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or name.endswith(_F32_SUFFIXES) \
            or not name.endswith(".weight"):
        return quant.F32
    fmt = quant.get(OUTTYPES[outtype][0])
    if shape[-1] % fmt.block_elems:  # as gguf-py's QuantError fallback
        return quant.F16
    return fmt


def encode(t: torch.Tensor, fmt: quant.Format) -> np.ndarray:
    """A tensor in GGUF bytes: float types by numpy's cast (as gguf-py), others by quant's codec."""
    x = t.detach().cpu().contiguous().numpy()
    if fmt is quant.F32:
        return x.astype(np.float32, copy=False).view(np.uint8)
    if fmt is quant.F16:
        return x.astype(np.float16, copy=False).view(np.uint8)
    flat = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    return fmt.quantize(flat.astype(np.float32, copy=False))
