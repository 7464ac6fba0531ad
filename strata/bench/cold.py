"""Graph-timed calls that read their operands from device memory, not from the L2.

triton.testing.do_bench_cudagraph replays a call back to back with no cache flush between
calls (its own comment says so). An operand smaller than the L2 (50 MB on an H100 or an
H200) is then read from the cache after the first call: a Q4_0 weight of 4096 x 14336
(33 MB) or the MoE's ten routed experts (22 MB) would "stream" faster than the memory can.
A decode reads each weight once a token, from device memory, so the bench must too.

Each graph-timed call here therefore takes its operands in turn from several copies (or,
for the MoE, several disjoint sets of routed experts) that hold COLD_L2 times the L2
between them: by the time a copy comes round again, the copies read after it have pushed
it out. do_bench (the "launched" column) flushes the L2 itself before every call.
"""
from __future__ import annotations

import itertools

import torch

COLD_L2 = 3  # the copies' bytes over the L2's


def copies(nbytes: int, l2_bytes: int) -> int:
    """How many copies of an operand of `nbytes` a timed call cycles through: enough to hold
    COLD_L2 x the L2 between them, and two at least."""
    return max(2, -(-COLD_L2 * l2_bytes // max(1, nbytes)))


def l2_bytes(device="cuda") -> int:
    return torch.cuda.get_device_properties(torch.device(device)).L2_cache_size


def cycled(t: torch.Tensor, l2: int) -> list[torch.Tensor]:
    """`t` and copies of it, copies(its bytes, l2) tensors in all."""
    return [t] + [t.clone() for _ in range(copies(t.numel() * t.element_size(), l2) - 1)]


def expert_sets(n_experts: int, k: int, routed_bytes: int, l2: int, rng, device="cuda") -> list[torch.Tensor]:
    """Disjoint top-k routings, (1, k) int32 each, as many as copies(routed_bytes, l2) asks
    for, or every disjoint set the experts allow (then their whole weight cycles)."""
    n = min(copies(routed_bytes, l2), max(1, n_experts // k))
    order = rng.permutation(n_experts)[:n * k].astype("int32")
    return [torch.from_numpy(order[i * k:(i + 1) * k].copy()).reshape(1, k).to(device) for i in range(n)]


def graph_ms(fn, variants: list[tuple], timer=None) -> float:
    """Milliseconds a call of fn takes, replayed from a CUDA graph whose successive calls
    take fn(*variants[0]), fn(*variants[1]), ... in turn (timer: do_bench_cudagraph by
    default; it calls its function once to warm up, five times to size the graph, then
    once for each call it captures)."""
    if timer is None:
        import triton.testing

        def timer(f):
            return triton.testing.do_bench_cudagraph(f, rep=50)
    turn = itertools.cycle(variants)
    return timer(lambda: fn(*next(turn)))
