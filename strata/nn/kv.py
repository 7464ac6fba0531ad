"""How attention keys and values are stored (`--kv f32|bf16|f16|int8`).

The float kinds store the rows as that dtype. `int8` stores each head's row of one token
as int8 codes times one bfloat16 scale (amax / 127, round to nearest): head_dim + 2 bytes
a row against 2 x head_dim for bf16, 0.52x at head_dim 64 and 0.51x at 256 (llama.cpp's
q8_0 cache: 34 bytes per 32 values, 0.53x). The scale is bfloat16, not float16 as in
q8_0, so that no row's scale overflows or underflows (float16 holds amax only between
about 8e-6 and 8e6). A row's values come back within half a step of its scale:
|x - decode(encode(x))| <= amax / 254 x (1 + 2^-8), the scale's rounding included.
Attention reads the rows back as float32.
"""
from __future__ import annotations

import torch

KV_TYPES = ("f32", "bf16", "f16", "int8")
SCALE_DTYPE = torch.bfloat16
_STORE = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "int8": torch.int8}


def check(kind: str) -> str:
    if kind not in _STORE:
        raise ValueError(f"--kv {kind!r} is not a KV cache type: use one of {', '.join(KV_TYPES)}")
    return kind


def store_dtype(kind: str) -> torch.dtype:
    return _STORE[check(kind)]


def row_bytes(kind: str, head_dim: int) -> int:
    """Bytes one head's row of one token takes."""
    return head_dim + 2 if check(kind) == "int8" else head_dim * _STORE[kind].itemsize


def encode(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows x (..., head_dim) as stored: (data, scale (..., 1) bfloat16 for int8, else None)."""
    if kind != "int8":
        return x.to(_STORE[kind]), None
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).to(SCALE_DTYPE)
    s = scale.float()
    q = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0).round().clamp(-127, 127)
    return q.to(torch.int8), scale


def decode(data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored rows back as float32."""
    return data.float() if scale is None else data.float() * scale.float()
