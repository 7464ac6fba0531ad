"""The expert cache's decode on the device: `cache:N:host` with the Triton kernels.

A step looks its routed experts up in a table on the device (expert -> one of N VRAM
slots, or -1) and hands the MoE kernels one weight tensor per matrix whose first N rows
are the slots and whose last rows are the step's staging rows: a hit's slot id for a hit,
for a miss its own staging row, which `stage_rows` fills from the expert's bytes in
(pinned) host memory, on NVIDIA read over PCIe by the kernel itself. Hits and misses are
counted per expert on the device. Nothing in the step reads device data on the host, so
a CUDA graph can hold it, and the MoE meets the same bytes in the same kernel as the
resident tier, so its output is the resident tier's bit for bit whatever hits and misses.

Between steps (`rebalance`, before the next step is queued) the host decides what the
slots hold, from counters copied back asynchronously one step late:

- policy: LFU over decayed counts (each expert's routed tokens, halved every HALF_LIFE
  steps). Decode routing is skewed and drifts slowly: the experts a layer used most of
  late are the likeliest next, and an LRU of N slots thrashes as soon as a token's k
  choices plus the previous tokens' exceed N (k = 10 of 512 at the real shape);
- a promotion takes a free slot, else the resident with the lowest score, when the
  candidate's score beats it by MARGIN (no ping-pong between equals); at most PROMOTE a
  layer a step, so a step's PCIe time stays bounded;
- the evicted expert's entry turns -1 at once (later steps stage it), the copy into the
  slot runs on a side stream after the steps queued before it, and the new entry is
  published at the first `rebalance` after the copy completed. So every step's table
  names only slots whose bytes are whole.

Batches of more routed slots than staging rows (prefill, a verify) take the store's host
path (strata.storage.experts): their experts are fetched from host memory for that call,
as the host tier does, and the slots stay the decode policy's.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from triton_kernels import backend, host_memory
from triton_kernels.ops import impl

HALF_LIFE = 32   # steps over which an expert's count halves
MARGIN = 1.25    # a candidate must beat the resident it evicts by this factor
PROMOTE = 2      # promotions a layer a step


class DeviceCache:
    def __init__(self, host: tuple[torch.Tensor, ...], slots: int, staging: int, device, kernels: str,
                 partial: bool = False):
        """`host`: the experts' blocks (E, rows, row bytes) of gate, up and down, pinned on a
        GPU; `slots` VRAM slots; `staging` rows a step (its routed slots at most)."""
        dev = torch.device(device)
        self.host, self.n, self.staging, self.device = host, slots, staging, dev
        self.n_experts = host[0].shape[0]
        # slots then staging rows, one tensor a matrix: the MoE kernels take ids into it
        self.w = tuple(torch.empty((slots + staging, *h.shape[1:]), dtype=torch.uint8, device=dev)
                       for h in host)
        self.lut = torch.full((self.n_experts,), -1, dtype=torch.int64, device=dev)
        self.routed = torch.zeros(self.n_experts, dtype=torch.int64, device=dev)
        self.missed = torch.zeros(self.n_experts, dtype=torch.int64, device=dev)
        self._rows = torch.arange(slots, slots + staging, device=dev)
        self._ones = torch.ones(staging, dtype=torch.int64, device=dev)
        self._stage = impl("stage_rows", kernels)
        # the lookup and its counters in one launch (the Triton kernels, every id held here)
        self._lookup = impl("cache_lookup", kernels) if kernels == "triton" and not partial else None
        self.partial = partial  # ids of -1: experts another rank holds (--ep)
        # the host's view: published slots, copies in flight, free slots, scores
        self.slot_of: dict[int, int] = {}
        self.transit: list[tuple[int, int, object]] = []  # (expert, slot, event)
        self.free = list(range(slots))
        self.score = np.zeros(self.n_experts)
        self._seen = np.zeros(self.n_experts, dtype=np.int64)
        self._pending = None  # (host copy of `routed`, its event) for the next rebalance
        self.promotions = 0
        self._side = torch.cuda.Stream(dev) if dev.type == "cuda" and backend._fake is None else None
        if self._side is not None:
            # promotions still copying when the cache goes: the slots' VRAM returns to the
            # main stream's pool and the host pages are unlocked, neither of which waits
            # for the side stream
            weakref.finalize(self, self._side.synchronize)

    # -- a step: on the device only --------------------------------------------------------

    def __call__(self, ids: torch.Tensor):
        """(gate, up, down, local ids) for routed `ids` (T, k), T * k <= staging."""
        flat = ids.reshape(-1)
        n = flat.numel()
        if self._lookup is not None:
            slot, local = self._lookup(flat, self.lut, self.routed, self.missed, self.n)
            self._stage(list(self.host), list(self.w), flat, slot, self.n)  # the three matrices: one launch
            return (*self.w, local.reshape(ids.shape))
        safe = flat.clamp(min=0) if self.partial else flat
        slot = self.lut[safe]
        local = torch.where(slot >= 0, slot, self._rows[:n])
        if self.partial:
            local = torch.where(flat >= 0, local, -1)
            slot = torch.where(flat >= 0, slot, 0)  # another rank's: nothing to stage
        self._stage(list(self.host), list(self.w), safe, slot, self.n)
        counts = self._ones[:n] if not self.partial else (flat >= 0).long()
        self.routed.index_add_(0, safe, counts)
        self.missed.index_add_(0, safe, counts * (slot < 0))
        return (*self.w, local.reshape(ids.shape).to(ids.dtype))

    def stages_on_device(self) -> bool:
        """Whether a step's lookup and counters may run in the router's launch
        (triton_kernels.route_align), leaving `stage` the misses' copy."""
        return self._lookup is not None

    def stage(self, ids: torch.Tensor, slot: torch.Tensor):
        """(gate, up, down) with the misses of routed `ids` staged, `slot` their table
        entries (-1: a miss) as route_align looked them up."""
        self._stage(list(self.host), list(self.w), ids.reshape(-1), slot, self.n)
        return self.w

    # -- between steps: the host decides -----------------------------------------------------

    def rebalance(self) -> None:
        """Publish finished copies, update the scores from the counters of a step ago, and
        start this step's promotions (see the module)."""
        for item in list(self.transit):
            e, s, event = item
            if event is None or event.query():
                self.transit.remove(item)
                self.slot_of[e] = s
                # a slice's fill_: `lut[e] = s` would copy s from pageable host memory, a copy
                # the host waits for (torch makes a Python number a host tensor for a CUDA one)
                self.lut[e:e + 1].fill_(s)
        counts = self._read_counts()
        if counts is None:
            return
        self.score *= 0.5 ** (1 / HALF_LIFE)
        self.score += counts - self._seen
        self._seen = counts
        busy = set(self.slot_of) | {e for e, _, _ in self.transit}
        for e in np.argsort(-self.score, kind="stable")[:self.n]:
            if self.promotions_now >= PROMOTE or self.score[e] <= 0:
                break
            e = int(e)
            if e in busy:
                continue
            if self.free:
                s = self.free.pop(0)
            else:
                victim = min(self.slot_of, key=lambda v: self.score[v], default=None)
                if victim is None or self.score[e] <= MARGIN * self.score[victim]:
                    break
                s = self.slot_of.pop(victim)
                self.lut[victim:victim + 1].fill_(-1)  # staged from now on: its slot is about to change
            self._copy(e, s)
            busy.add(e)
        self.promotions_now = 0

    promotions_now = 0
    _turn = 0  # which of the two count buffers the next copy fills

    def _copy(self, e: int, s: int) -> None:
        """Expert e's bytes into slot s, after every step queued so far (which may read s)."""
        event = None
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                for h, w in zip(self.host, self.w):
                    w[s].copy_(h[e], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
        else:
            for h, w in zip(self.host, self.w):
                w[s].copy_(backend.to_device(h[e], self.device))
        self.transit.append((e, s, event))
        self.promotions += 1
        self.promotions_now += 1

    def _read_counts(self) -> np.ndarray | None:
        """`routed` as copied back at the previous call (None the first time); starts the next copy."""
        if backend._fake is not None:
            return None  # a traced step: no values to read
        out = None
        if self._pending is not None:
            host, event = self._pending
            if event is None or event.query():
                out = host.numpy().copy()
        if self.device.type == "cuda":
            # two page-locked buffers in turn: the one read above is free again
            if not hasattr(self, "_buffers"):
                self._buffers = [host_memory.pinned(torch.empty(self.n_experts, dtype=torch.int64)) for _ in range(2)]
            host = self._buffers[self._turn]
            self._turn = 1 - self._turn
            host.copy_(self.routed, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))  # the copy's stream, whatever device is current
            self._pending = (host, event)
        else:
            self._pending = (self.routed.clone(), None)
        return out

    # -- what it has done ---------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """(slots routed, of which missed) since construction: a read of the device."""
        routed, missed = torch.stack([self.routed.sum(), self.missed.sum()]).tolist()  # one wait, not two
        return routed, missed

    def order(self) -> list[int]:
        """Published experts, lowest score first."""
        return sorted(self.slot_of, key=lambda e: self.score[e])
