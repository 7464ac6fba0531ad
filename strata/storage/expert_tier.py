"""The `--experts` tier spec: which tier holds a layer's routed experts (`parse_tier`).

A layer's experts are three GGUF tensors: gate and up (E, I, H) and down (E, H, I), each
a run of E equal slabs of quantized rows. The tiers (the store: strata.storage.experts):

- `dense`: dequantized once into the compute dtype (CPU, while the model's DenseBudget
  lasts); a matmul per routed expert.
- `device` (alias `blocks`): the raw blocks resident where the model computes: copied to
  the device on CUDA; on the CPU zero-copy views of the mapped GGUF (the page cache keeps
  them in RAM). The fused MoE kernel (triton_kernels.moe) on CUDA, `moe_torch` on the CPU.
- `host`: the raw blocks read once from the file into host RAM (anonymous memory, so the
  page cache keeps no second copy; pinned on CUDA). On the CPU the matmul runs on them in
  place; on CUDA each call copies the experts the batch routes to onto the device.
- `cache:N[:host|packed|file]`: N expert slots on the device, least recently used out
  first, filled from the tier named last (default `host`). Hits and misses are counted;
  a batch that routes to more than N experts runs in groups of N (see
  `ExpertStore._grouped`).
- `packed`: `experts.bin` written by `strata pack` (strata.storage.pack): per layer, expert
  after expert, each expert's gate, up and down blocks adjacent, so one expert is one
  read; a text index beside it records where each tensor came from in the GGUF.
- `file`: read in place from the GGUF, three reads an expert.

`packed` and `file` read in one of IO_MODES (`--experts-io`, see
strata.storage.expert_sources.SpanReader).
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("dense", "device", "host", "cache", "packed", "file")
BACKINGS = ("host", "packed", "file")
IO_MODES = ("direct", "mmap")


@dataclass(frozen=True)
class ExpertTier:
    """A parsed `--experts` spec: `kind` one of KINDS; a cache has `slots` and `backing`."""
    kind: str
    slots: int = 0
    backing: str = ""

    def __str__(self) -> str:
        return f"cache:{self.slots}:{self.backing}" if self.kind == "cache" else self.kind


def parse_tier(spec: str, flag: str = "--experts") -> ExpertTier:
    """`device|host|cache:N[:host|packed|file]|packed|file` (and `dense`, `blocks` = device)."""
    text = spec.strip().lower()
    if text == "blocks":
        return ExpertTier("device")
    if text in KINDS and text != "cache":
        return ExpertTier(text)
    parts = text.split(":")
    if parts[0] == "cache" and len(parts) in (2, 3):
        backing = parts[2] if len(parts) == 3 else "host"
        if parts[1].isdigit() and int(parts[1]) > 0 and backing in BACKINGS:
            return ExpertTier("cache", int(parts[1]), backing)
    raise ValueError(f"{flag} {spec!r}: expected device, host, packed, file or cache:N[:host|packed|file] "
                     f"with N the number of expert slots (at least 1), e.g. cache:64:file")
