from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from triton_kernels.backend import to_device
from triton_kernels.rope import rotate  # noqa: F401 (strata.nn.rope.rotate: the model code's name)


@dataclass(frozen=True)
class RopeScaling:
    """Stretching RoPE past the context a model was trained on.

    `linear`: every frequency divided by `factor` (position interpolation). `yarn`
    (arXiv 2309.00071, as transformers' `_compute_yarn_parameters` and llama.cpp's
    rope_yarn): frequencies that turn fewer than `beta_slow` times over the original
    context are interpolated, those that turn more than `beta_fast` times are kept, a
    linear ramp between; cos and sin are multiplied by 0.1 ln(factor) + 1, so that the
    attention logits keep their scale (`attn_factor` overrides it)."""
    kind: str                 # "linear" or "yarn"
    factor: float
    original_context: int     # the context the model was trained on
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float | None = None

    KINDS = ("linear", "yarn")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"RoPE scaling {self.kind!r} is not supported: use one of {', '.join(self.KINDS)}")
        if not self.factor > 0:
            raise ValueError(f"the RoPE scale must be positive, got {self.factor}")

    @property
    def context(self) -> int:
        """The context the scaling stretches the original to."""
        return int(self.original_context * self.factor)

    def describe(self) -> str:
        return f"RoPE {self.kind} x{self.factor:g} of {self.original_context} tokens"

    def mscale(self) -> float:
        if self.kind != "yarn":
            return 1.0
        if self.attn_factor is not None:
            return self.attn_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def inv_freq(self, base: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
        """The scaled inverse frequencies from the unscaled `base` (dim / 2 of them)."""
        if self.kind == "linear":
            return base / self.factor

        def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
            return dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate
        return base / self.factor * (1 - keep) + base * keep


class Rope(torch.nn.Module):
    """Rotary position embedding on the first `dim` dims of each head, in the
    rotate-half layout (the model's Q/K rows are in Hugging Face order), optionally
    scaled (`RopeScaling`).

    `sections` (t, h, w): multimodal RoPE, interleaved (qwen4exp; transformers'
    Qwen4ExpTextRotaryEmbedding): rotary pair i turns with the h position where i % 3 == 1
    and i < 3 * h, with the w position where i % 3 == 2 and i < 3 * w, else with the t
    position. It matters only for (3, S) positions (strata.nn.mrope); for text all three
    are one."""

    def __init__(self, dim: int, theta: float, max_pos: int = 8192, scaling: RopeScaling | None = None,
                 sections: tuple[int, int, int] | None = None):
        super().__init__()
        self.dim, self.scaling = dim, scaling
        self._held: dict = {}  # on_device's: a step's positions and indices on the device
        pairs = torch.zeros(dim // 2, dtype=torch.long)
        if sections is not None:
            pairs[1:3 * sections[1]:3], pairs[2:3 * sections[2]:3] = 1, 2
        # which of (t, h, w) turns each rotary column
        self.register_buffer("_axis", torch.cat([pairs, pairs]), persistent=False)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if scaling is not None:
            inv_freq = scaling.inv_freq(inv_freq, dim, theta)
        self.mscale = scaling.mscale() if scaling is not None else 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._table(max_pos)

    def _table(self, n: int) -> None:
        ang = torch.arange(n, dtype=torch.float64, device=self.inv_freq.device)[:, None] * self.inv_freq[None]
        ang = torch.cat([ang, ang], dim=-1)
        # buffers: model.to(device) moves them with the weights
        self.register_buffer("cos", (ang.cos() * self.mscale).float(), persistent=False)
        self.register_buffer("sin", (ang.sin() * self.mscale).float(), persistent=False)

    def _cover(self, pos: torch.Tensor) -> None:
        """The tables grown (to twice the need) to hold rows for the positions (on the host)."""
        top = int(pos.max())
        if top >= self.cos.shape[0]:
            self._table(2 * top + 1)

    def _rows(self, pos: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of `pos` on `device`. On a GPU the positions cross over once a
        step, not once a layer: every layer of a step asks for the same ones (a copy from
        the host waits for the GPU's queue)."""
        if pos.dim() == 2:  # (3, S) multimodal positions: each column from its axis's row
            self._cover(pos)
            idx = to_device(pos, self.cos.device)[self._axis].T     # (S, dim)
            cols = torch.arange(self.dim, device=self.cos.device)
            return to_device(self.cos[idx, cols], device), to_device(self.sin[idx, cols], device)
        key = _key(pos, device)
        if key is not None and self._last is not None and self._last[0] == key:
            return self._last[1]
        self._cover(pos)
        idx = to_device(pos, self.cos.device)
        rows = to_device(self.cos[idx], device), to_device(self.sin[idx], device)
        if key is not None:
            self._last = (key, rows)
        return rows

    _last = None  # (positions, (cos, sin)) of the last call

    def tables(self, pos: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, pos on `device`): the whole tables, grown to cover the positions (S,),
        for a kernel that reads their rows itself (triton_kernels.attention_rows); the
        positions cross over once a step, as `_rows`' rows do)."""
        self._cover(pos)
        return self.cos, self.sin, self.on_device(pos, device)

    def on_device(self, ids: torch.Tensor, device) -> torch.Tensor:
        """A step's few host positions or indices on `device`, copied once a step: every
        layer of the step asks for the same ones (a copy from the host waits for the GPU's
        queue). The last two asked are held (a step's positions and, after an image, its
        indices)."""
        key = _key(ids, device)
        if key is None:
            return to_device(ids, device)
        if key not in self._held:
            if len(self._held) >= 2:
                self._held.pop(next(iter(self._held)))
            self._held[key] = to_device(ids, device)
        return self._held[key]

    def _apply(self, fn, *args, **kwargs):  # model.to(): the remembered rows stay where they were
        self._last, self._held = None, {}
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (..., S, head_dim) float32; pos: (S,) positions, or (3, S) multimodal ones (on
        the host, preferably)."""
        cos, sin = self._rows(pos, x.device)
        return rotate(x, cos, sin, self.dim)


def _key(pos: torch.Tensor, device=None) -> tuple | None:
    """A step's few host positions as a key for the rows or positions made from them last
    (None for many, or positions not on the host)."""
    if pos.device.type != "cpu" or pos.numel() > 64:
        return None
    return (tuple(pos.tolist()), str(device))
