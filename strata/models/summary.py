"""The pieces of a model's plan line that every architecture shares: what its file holds,
and where and how it runs."""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch


def file_summary(g) -> str:
    """`134.5M weights in 92 MiB: Q4_1 x210, F32 x61`: a GGUF file's weights and formats."""
    ts = g.tensors.values()
    n_weights = sum(int(np.prod(t.shape)) for t in ts)
    fmts = Counter(t.fmt.name for t in ts)
    return (f"{n_weights / 1e6:.1f}M weights in {sum(t.nbytes for t in ts) / 2**20:.0f} MiB: "
            + ", ".join(f"{k} x{v}" for k, v in fmts.most_common()))


def name(g) -> str:
    return g.get("general.name", g.path.name)


def run_summary(model) -> str:
    """`on cpu, torch kernels, bfloat16, 2 threads`."""
    return (f"on {model.device}, {model.kernels} kernels, {str(model.dtype).replace('torch.', '')}, "
            f"{torch.get_num_threads()} threads")


def kv_summary(model) -> str:
    """`KV int8 (1,980 B a token)`: how the attention cache stores keys and values."""
    return f"KV {model.kv} ({model.kv_bytes_per_token():,} B a token)"
