"""`STRATA_DECODE_TIMING=1`: one stderr line per decode step, with the Triton op calls it
made, the kernels a step launches on a GPU (counted once per model where the command
traced it: `model.step_launches`, strata.load.launches), and what the storage tiers did
during it (PLE rows, pages, hints, bytes from the drive; expert hits, misses, fetches). A
speculative step's line starts with what it drafted and accepted and its verify's time
against a one-token step (strata.runtime.spec)."""
from __future__ import annotations

import os


def enabled() -> bool:
    return os.environ.get("STRATA_DECODE_TIMING", "0") not in ("", "0")


def _flat(stats: dict) -> dict:
    return {f"{part}.{k}": v for part, d in stats.items() for k, v in d.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class StepTimer:
    """Deltas of the model's storage counters between calls to `line`."""

    def __init__(self, model):
        self.model = model
        self.last = self._now()

    def _now(self) -> dict:
        from triton_kernels import ops
        io = getattr(self.model, "io_stats", None)
        return {**(_flat(io()) if io else {}), "triton.calls": ops.calls}

    def line(self, tokens: int, ms: float, **split_ms: float) -> str:
        now = self._now()
        d = {k: v - self.last.get(k, 0) for k, v in now.items()}
        self.last = now
        parts = [f"{tokens} tokens, {ms:.1f} ms"] + [f"{k} {v:.1f} ms" for k, v in split_ms.items()]
        # each call launches one kernel, or two or three (int8 activations, then the dot);
        # a step replayed from a CUDA graph makes none from Python
        parts.append(f"{d['triton.calls']:.0f} Triton op calls from Python")
        launches = getattr(self.model, "step_launches", None)
        if launches is not None:
            parts.append(launches.short())
        if "ple.rows" in d:
            parts.append(f"PLE: {d['ple.rows']:.0f} rows, {d.get('ple.distinct_pages', 0):.0f} pages, "
                         f"{d.get('ple.hints', 0):.0f} hints, gather {1e3 * d.get('ple.gather_s', 0):.2f} ms")
        else:
            parts.append("PLE: none")
        if any(k.startswith("experts.") for k in d):
            parts.append(f"experts: {d.get('experts.hits', 0):.0f} hits, {d.get('experts.misses', 0):.0f} misses, "
                         f"{d.get('experts.bytes', 0) / 2**20:.1f} MiB fetched in "
                         f"{1e3 * d.get('experts.fetch_s', 0):.2f} ms")
        else:
            parts.append("expert fetch: none (resident)")
        if "ple.drive_bytes" in d:  # /proc/self/io: every read of the process, not only the PLE's
            parts.append(f"drive: {d['ple.drive_bytes'] / 1024:.0f} KiB read by the process")
        return "step: " + "; ".join(parts)
