"""Printing benchmark results: a markdown table, or JSON."""
from __future__ import annotations

import json
import platform
import sys

import torch


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def copy_bandwidth(device="cuda", nbytes: int = 1 << 30) -> float:
    """Bytes/s a plain copy of `nbytes` moves on `device`, counting bytes read and written:
    the roof every bench holds its kernels against (do_bench on a GPU, wall time on the CPU)."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        import triton.testing
        ms = triton.testing.do_bench(lambda: dst.copy_(src), quantiles=[0.5, 0.2, 0.8])[0]
        return 2 * nbytes / (ms * 1e-3)
    import time
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    return 2 * nbytes * 10 / (time.perf_counter() - t)


def markdown(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """rows of dicts -> a markdown table; columns are (key, header) pairs."""
    cells = [[_fmt(r.get(k)) for k, _ in columns] for r in rows]
    heads = [h for _, h in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"
    out = [line(heads), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    out += [line(c) for c in cells]
    return "\n".join(out)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e5 else f"{v:,.0f}"
    return str(v)


def emit(result: dict, table: str, as_json: bool) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(table)
