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

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (..., S, head_dim) float32; pos: (S,) positions."""
        top = int(pos.max())
        if top >= self.cos.shape[0]:
            self._table(2 * top + 1)
        pos = pos.to(self.cos.device)
        cos, sin = self.cos[pos].to(x.device), self.sin[pos].to(x.device)
        r, rest = x[..., :self.dim], x[..., self.dim:]
        half = self.dim // 2
        rotated = torch.cat([-r[..., half:], r[..., :half]], dim=-1)
        out = r * cos + rotated * sin
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
