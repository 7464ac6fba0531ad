"""qwen4exp's vision tower: a Qwen3-VL ViT with a patch merger, read from an mmproj GGUF.

The math is transformers' Qwen4ExpVisionModel (5.23); the tensor names are those of
llama.cpp's mmproj converter (conversion/qwen3vl.py, Qwen3VLVisionModel). For one image of
grid (t, h, w) patches, its rows in 2x2 merge-block order (strata.vision.preprocess):

    x   = patches @ [w_t0 | w_t1]^T + b           the Conv3D patch embedding (two Conv2D
                                                  halves in the file, one per frame)
    x  += pos_table resampled to (h, w)           bilinear, corners aligned, merge-block order
    per block:  x += proj(attn(ln1(x)))           2-D axial RoPE: half the rotary pairs turn
                x += down(gelu_tanh(up(ln2(x))))  with the row, half with the column
    y   = mm.2(gelu(mm.0(post_ln(x) as 4-row groups)))   (h*w/4, text dim)

Attention runs within each frame of an image (transformers' cu_seqlens), never across
images. Everything is float32 torch with SDPA: the tower's work is dense GEMMs over an
image's patches and one attention per frame, which torch's kernels (cuBLAS and flash
attention on a GPU) already run at their best; its weights are not quantized, so a fused
dequant kernel has nothing to fuse.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from strata.gguf import GGUFFile, open_gguf
from strata.nn.rope import rotate

PROJECTOR = "qwen3vl_merger"


class VisionError(ValueError):
    """An mmproj file Strata cannot use; the message names the file and what to do."""


@dataclass(frozen=True)
class VisionConfig:
    dim: int
    n_heads: int
    depth: int
    ffn_dim: int
    patch: int
    merge: int
    out_dim: int
    n_pos: int                     # learned positions: a side x side grid
    eps: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    temporal: int = 2              # frames per temporal patch (the converter requires 2)
    rope_theta: float = 10000.0    # Qwen3-VL's; the file does not carry it

    @property
    def side(self) -> int:
        return int(round(self.n_pos ** 0.5))

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> VisionConfig:
        def req(key):
            value = g.get(f"clip.{key}")
            if value is None:
                raise VisionError(f"{g.path}: no clip.{key}; is this an mmproj file from "
                                  f"`strata convert --mmproj` or llama.cpp's converter?")
            return value
        return cls(dim=int(req("vision.embedding_length")), n_heads=int(req("vision.attention.head_count")),
                   depth=int(req("vision.block_count")), ffn_dim=int(req("vision.feed_forward_length")),
                   patch=int(req("vision.patch_size")), merge=int(req("vision.spatial_merge_size")),
                   out_dim=int(req("vision.projection_dim")),
                   n_pos=int(g.tensor("v.position_embd.weight").shape[0]),
                   eps=float(req("vision.attention.layer_norm_epsilon")),
                   image_mean=tuple(float(v) for v in req("vision.image_mean")),
                   image_std=tuple(float(v) for v in req("vision.image_std")))


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


class VisionTower(torch.nn.Module):
    def __init__(self, cfg: VisionConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        w = {k.replace(".", "_"): _param(v) for k, v in weights.items()}
        self.w = torch.nn.ParameterDict(w)
        D, half = cfg.dim // cfg.n_heads, cfg.dim // cfg.n_heads // 2
        # the axial RoPE: head_dim/4 frequencies, each turned by the row and by the column
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.head_dim = D

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu") -> VisionTower:
        g = open_gguf(path)
        if g.arch != "clip" or g.get("clip.projector_type") != PROJECTOR:
            raise VisionError(f"{path}: not a Qwen3-VL mmproj file (architecture {g.arch!r}, projector "
                              f"{g.get('clip.projector_type')!r}; want clip / {PROJECTOR}); convert the "
                              f"checkpoint's tower with `strata convert HF_DIR OUT.gguf --mmproj`")
        cfg = VisionConfig.from_gguf(g)
        # copies: the tower is small, and the file's read-only mapping must not become a weight
        weights = {name: torch.from_numpy(np.array(g.tensor(name).numpy(), dtype=np.float32)) for name in g.tensors}
        # the Conv3D patch embedding, put back together: rows of (C, frame, y, x) as the
        # preprocessor lays out a patch
        w0, w1 = weights.pop("v.patch_embd.weight"), weights.pop("v.patch_embd.weight.1")
        weights["v.patch_embd.weight"] = torch.stack([w0, w1], dim=2).reshape(cfg.dim, -1)
        return cls(cfg, weights).to(device)

    def _t(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "_")]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self._t(f"{name}.weight"), self._t(f"{name}.bias"))

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self._t(f"{name}.weight"), self._t(f"{name}.bias"), self.cfg.eps)

    def _grid_order(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column of each patch in merge-block order: (h/m, w/m) blocks of m x m."""
        m = self.cfg.merge
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // m, m, w // m, m)
        return rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()

    def _positions(self, h: int, w: int, rows, cols) -> torch.Tensor:
        """The learned side x side position table resampled to the (h, w) grid."""
        side, table = self.cfg.side, self._t("v.position_embd.weight")
        grid = table.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        out = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]   # (dim, h, w)
        return out[:, rows, cols].transpose(0, 1)

    def _rope(self, rows, cols) -> tuple[torch.Tensor, torch.Tensor]:
        ang = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
        ang = torch.cat([ang, ang], dim=-1).to(self.inv_freq.device)       # (N, head_dim)
        return ang.cos(), ang.sin()

    def _block(self, x: torch.Tensor, i: int, cos, sin) -> torch.Tensor:
        N, H, D = x.shape[0], self.cfg.n_heads, self.head_dim
        qkv = self._linear(self._ln(x, f"v.blk.{i}.ln1"), f"v.blk.{i}.attn_qkv").reshape(N, 3, H, D)
        q, k, v = (t.transpose(0, 1) for t in qkv.unbind(1))            # (H, N, D)
        q, k = rotate(q, cos, sin, D), rotate(k, cos, sin, D)
        a = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(N, -1)
        x = x + self._linear(a, f"v.blk.{i}.attn_out")
        up = F.gelu(self._linear(self._ln(x, f"v.blk.{i}.ln2"), f"v.blk.{i}.ffn_up"), approximate="tanh")
        return x + self._linear(up, f"v.blk.{i}.ffn_down")

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's (or video's) patch rows (t*h*w, C*temporal*patch*patch) in merge-block
        order -> its tokens for the text model, (t*h*w / merge^2, out_dim) float32."""
        t, h, w = grid
        m, dev = self.cfg.merge, self._t("v.patch_embd.bias").device
        if pixels.shape[0] != t * h * w or h % m or w % m:
            raise ValueError(f"pixel rows {tuple(pixels.shape)} do not fit the grid {grid} (merge {m})")
        x = self._linear(pixels.to(dev, torch.float32), "v.patch_embd")
        rows, cols = self._grid_order(h, w)
        x = x + self._positions(h, w, rows, cols).repeat(t, 1)
        cos, sin = self._rope(rows.float(), cols.float())
        frames = []
        for f in x.split(h * w):   # attention stays within a frame
            for i in range(self.cfg.depth):
                f = self._block(f, i, cos, sin)
            frames.append(f)
        x = self._ln(torch.cat(frames), "v.post_ln").reshape(-1, m * m * self.cfg.dim)
        return self._linear(F.gelu(self._linear(x, "mm.0")), "mm.2")
