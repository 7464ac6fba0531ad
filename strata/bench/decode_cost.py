"""What a decoded token costs besides its time, for `strata bench model`: the weight bytes
a step reads (`step_bytes`), the kernels a step launches on a GPU (strata.load.launches:
traced once, on fake CUDA), and what the storage tiers did during the tg runs: bytes over
PCIe a token (expert misses copied or read from pinned host memory, PLE rows read from
host memory) against the host-to-device copy rate measured in the same run, and the
expert cache's hit rate."""
from __future__ import annotations

import time

import torch


def step_bytes(model) -> int:
    """Bytes of weights one decode step reads: every matmul's weight as held, and per MoE
    layer top-k experts (a token's; more when a batch routes to more)."""
    from strata.nn import QuantLinear
    from strata.nn.moe import MoE
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.mode != "parts":
            total += m.held_bytes()
        elif isinstance(m, MoE):
            total += m.top_k * m.experts.expert_bytes
    return total


def counters(model) -> dict:
    """The tiers' counters now (model.io_stats, flattened), or {} for a model without tiers."""
    io = getattr(model, "io_stats", None)
    if io is None:
        return {}
    return {f"{part}.{k}": v for part, d in io().items() for k, v in d.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def tiers(model, before: dict, after: dict, tokens: int) -> dict:
    """A decoded token's share of what the tiers did between two `counters`: PCIe bytes
    (on a GPU: the expert bytes the stores fetched, and the PLE rows read from host memory),
    expert hits and misses, and the hit rate (None where no store fetches: resident)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    gpu = getattr(model, "device", torch.device("cpu")).type == "cuda"
    hits, misses = d.get("experts.hits", 0), d.get("experts.misses", 0)
    pcie = d.get("experts.bytes", 0) + d.get("ple.pcie_bytes", 0) if gpu else 0
    stores = [l.moe.experts for l in getattr(model, "layers", []) if hasattr(getattr(l, "moe", None), "experts")]
    fetching = any(s.spec.kind in ("cache", "host", "packed", "file") for s in stores)
    return {"tokens": tokens, "pcie_bytes_per_token": pcie / max(tokens, 1) if gpu else None,
            "expert_hits_per_token": hits / max(tokens, 1), "expert_misses_per_token": misses / max(tokens, 1),
            "expert_hit_rate": hits / (hits + misses) if fetching and hits + misses else None,
            "tiers": sorted({s.tier for s in stores})}


def h2d_bandwidth(device, nbytes: int = 256 << 20) -> float | None:
    """Bytes/s a copy from pinned host memory to `device` moves (None on the CPU): the roof
    of what a step's misses can read over PCIe."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 5 * nbytes / (time.perf_counter() - t)


def text(launches, io: dict | None, tg_tok_s: float, h2d: float | None) -> str:
    """The lines `strata bench model` prints under its table."""
    out = [launches.line()]
    if io is not None:
        if io["pcie_bytes_per_token"] is None:
            pcie = "no PCIe (the model computes on the CPU)"
        else:
            rate = io["pcie_bytes_per_token"] * tg_tok_s
            pcie = (f"{io['pcie_bytes_per_token'] / 2**20:.2f} MiB over PCIe" + (
                f" ({rate / 1e9:.2f} GB/s at tg's rate, {rate / h2d:.1%} of the {h2d / 1e9:.1f} GB/s a pinned "
                f"host-to-device copy moves)" if h2d else ""))
        hit = ("expert hit rate " + (f"{io['expert_hit_rate']:.1%}" if io["expert_hit_rate"] is not None
                                     else "n/a (no store fetches: every expert is held where it runs)"))
        out.append(f"a decoded token (over the tg runs' {io['tokens']} steps): {pcie}; "
                   f"experts {', '.join(io['tiers']) or 'none'}: "
                   f"{hit}, {io['expert_hits_per_token']:.1f} hits and {io['expert_misses_per_token']:.1f} misses "
                   f"a token")
    return "\n".join(out)
