import torch


class Rope(torch.nn.Module):
    """Rotary position embedding on the first `dim` dims of each head, in the
    rotate-half layout (the model's Q/K rows are in Hugging Face order)."""

    def __init__(self, dim: int, theta: float, max_pos: int = 8192):
        super().__init__()
        self.dim = dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._table(max_pos)

    def _table(self, n: int) -> None:
        ang = torch.arange(n, dtype=torch.float64, device=self.inv_freq.device)[:, None] * self.inv_freq[None]
        ang = torch.cat([ang, ang], dim=-1)
        # buffers: model.to(device) moves them with the weights
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def _rows(self, pos: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of `pos` on `device`. On a GPU the positions cross over once a
        step, not once a layer: every layer of a step asks for the same ones (a copy from
        the host waits for the GPU's queue)."""
        key = (pos.device, tuple(pos.tolist())) if pos.device.type == "cpu" and pos.numel() <= 64 else None
        if key is not None and self._last is not None and self._last[0] == key:
            return self._last[1]
        top = int(pos.max())
        if top >= self.cos.shape[0]:
            self._table(2 * top + 1)
        idx = pos.to(self.cos.device)
        rows = self.cos[idx].to(device), self.sin[idx].to(device)
        if key is not None:
            self._last = (key, rows)
        return rows

    _last = None  # (positions, (cos, sin)) of the last call

    def _apply(self, fn, *args, **kwargs):  # model.to(): the remembered rows stay where they were
        self._last = None
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (..., S, head_dim) float32; pos: (S,) positions (on the host, preferably)."""
        cos, sin = self._rows(pos, x.device)
        r, rest = x[..., :self.dim], x[..., self.dim:]
        half = self.dim // 2
        rotated = torch.cat([-r[..., half:], r[..., :half]], dim=-1)
        out = r * cos + rotated * sin
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
