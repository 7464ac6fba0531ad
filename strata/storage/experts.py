"""The store of a layer's routed experts, and the matmuls over them.

A layer's experts are three GGUF tensors: gate and up (E, I, H) and down (E, H, I), each
a run of E equal slabs of quantized rows. The store of one layer answers
`store(x, weights, ids)`: the routed experts' SwiGLU outputs, weighted and summed per
token. Which tier holds them is a `--experts` spec (strata.storage.expert_tier lists the
tiers); the tiers that fetch read through strata.storage.expert_sources, the packed ones
from the pack that strata.storage.pack writes.

Every tier that fetches hands the matmul the compact set of experts a batch needs, with
ids remapped into it, so its output equals the resident tier's bit for bit: the same bytes
meet the same kernel, in the same tiles (see `ExpertStore._moe`). `summarize` and
`stats_line` add up the stores' counters over a model.
"""
from __future__ import annotations

import collections
import os
import time

import numpy as np
import torch

import quant
import torch.nn.functional as F

from strata.nn.linear import DenseBudget
from strata.storage.expert_sources import (
    FileSource,
    HostSource,
    PackedSource,
    Source,
    in_file,
    read_host,
    slab_shape,
    slabs,
    tensor_file,
)
from strata.storage.expert_cache import DeviceCache
from strata.storage.expert_tier import ExpertTier, parse_tier
from strata.storage.pack import Pack, default_pack_dir
from strata.tensors import QTensor, stand_in
from triton_kernels import invariant, layout
from triton_kernels.cpu import compiled
from triton_kernels.backend import choose_kernels, upcast
from triton_kernels.cpu.compiled import Compiled
from triton_kernels.moe import block_m_for, choose_path
from triton_kernels.ops import impl


# --- the store ---------------------------------------------------------------------------

class ExpertStore(torch.nn.Module):
    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, dtype=torch.float32, device="cpu",
                 budget: DenseBudget | None = None, tier: str | ExpertTier | None = None, *,
                 experts_dir: str | os.PathLike | None = None, io_mode: str = "direct", depth: int = 16,
                 kernels: str | None = None, experts: range | None = None, top_k: int = 1):
        """`tier`: a `--experts` spec (see `parse_tier`), or None: dense on the CPU while
        `budget` lasts, else device. `experts_dir`: where `strata pack` wrote the pack
        (packed tiers; default `default_pack_dir` of the GGUF). `io_mode`, `depth`: how
        packed and file tiers read (`--experts-io`, `--experts-io-depth`). `kernels`: "triton"
        (the MoE kernels) or "torch" (None: the device's default, see
        triton_kernels.backend.choose_kernels). `experts`: hold only these (a rank's share
        under --ep, strata.dist); the store answers them as ids 0.. in order. `top_k`: the
        experts a token routes to (a cache tier's staging rows a decode step)."""
        super().__init__()
        packed_from, first = (gate, up, down), 0  # the pack's entries are of the whole tensors
        # a rank's share (--ep): ids of -1 mark the experts the other ranks hold
        self.partial = experts is not None and len(experts) != gate.shape[0]
        if experts is not None and len(experts) != gate.shape[0]:
            first = experts.start
            gate, up, down = (_experts_of(t, experts) for t in (gate, up, down))
        self.kernels = choose_kernels(kernels, device)
        self.names = (gate.name, up.name, down.name)
        self.tensors = (gate, up, down)  # as the file holds them (strata.imatrix reads them)
        self.n_experts, self.inter, self.hidden = gate.shape
        self.dtype, self.device = dtype, device
        # as the kernels read them: on a GPU in its layout (triton_kernels.layout), every
        # tier alike, so that a slot, a staged row and a resident expert hold the same bytes
        self.fmts = tuple(self._held(t) for t in (gate, up, down))
        on_cpu = torch.device(device).type == "cpu"
        dense_bytes = 3 * self.n_experts * self.inter * self.hidden * torch.finfo(dtype).bits // 8
        if tier is None:
            dense = on_cpu and self.kernels == "torch"  # the MoE kernels take blocks
            tier = "dense" if dense and (budget or DenseBudget()).take(dense_bytes) else "blocks"
        spec = tier if isinstance(tier, ExpertTier) else parse_tier(tier)
        self.spec = spec
        # `tier` is what the plan line counts: "blocks" (the default's name) stays "blocks"
        self.tier = "blocks" if tier == "blocks" else str(spec)
        # tokens routed to each expert: on a GPU's resident tier counted there (no read back)
        on_device = spec.kind == "device" and not on_cpu
        self.hits = torch.zeros(self.n_experts, dtype=torch.long, device=device if on_device else "cpu")
        self._counts = {"calls": 0, "experts": 0, "hits": 0, "misses": 0, "evictions": 0,
                        "bytes": 0, "fetch_s": 0.0}
        self.expert_bytes = gate.nbytes // self.n_experts + up.nbytes // self.n_experts + down.nbytes // self.n_experts
        self.source: Source | None = None
        self.compact = False  # fetch what a batch needs, then compute on that compact set
        self.device_cache: DeviceCache | None = None  # cache:N:host under the Triton kernels
        ts = (gate, up, down)
        kind = spec.kind
        if kind == "dense":
            # gate and up stacked: one matmul gives both halves
            self.w13 = torch.cat([gate.dequantize(dtype), up.dequantize(dtype)], dim=1)
            self.w2 = down.dequantize(dtype)
        elif kind == "device":
            self.wg, self.wu, self.wd = (layout.place(slabs(t), t.fmt, device, held)
                                         for t, held in zip(ts, self.fmts))
        elif kind == "host":
            host = read_host(ts, pin=not on_cpu, fmts=self.fmts)
            if on_cpu:
                self.wg, self.wu, self.wd = host
            else:
                self.source, self.compact = HostSource(host), True
        else:
            backing = spec.backing if kind == "cache" else kind
            if backing == "host":
                self.source = HostSource(read_host(ts, pin=not on_cpu, fmts=self.fmts))
            elif backing == "packed":
                where = experts_dir or default_pack_dir(tensor_file(gate)[0])
                self.source = PackedSource(packed_from, Pack.open(where), io_mode, depth, first=first)
            else:
                self.source = FileSource(ts, io_mode, depth)
            if kind == "cache" and backing == "host" and self.kernels == "triton":
                # decode steps look up, stage and count on the device (strata.storage.expert_cache);
                # longer batches fetch their experts from host memory, as the host tier does
                self.slots = min(spec.slots, self.n_experts)
                self.device_cache = DeviceCache(self.source.tensors, self.slots, top_k, device, self.kernels,
                                                self.partial)
                self.wg, self.wu, self.wd = (w[:self.slots] for w in self.device_cache.w)
                self.compact = True
            elif kind == "cache":
                n = min(spec.slots, self.n_experts)
                self.slots = n
                self.wg, self.wu, self.wd = (torch.empty((n, *slab_shape(t)), dtype=torch.uint8, device=device)
                                             for t in ts)
                self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # expert -> slot
                self._free = list(range(n))
            else:
                self.compact = True
        if not on_cpu and not all(in_file(t) for t in ts):
            # blocks made in memory (strata.gguf.MemoryGGUF: flash-shape) were copied where the
            # tier holds them: keeping them too would hold the experts twice in host RAM
            self.tensors = tuple(QTensor(t.name, t.fmt, t.shape, stand_in(t.data.shape)) for t in ts)
            self.blocks_kept = False

    blocks_kept = True  # `tensors` hold the blocks (strata.imatrix reads them)

    def _held(self, t: QTensor) -> quant.Format:
        if self.kernels != "triton":
            return t.fmt
        blocks = t.data.size // t.fmt.block_bytes
        return layout.choose(t.fmt, self.device, blocks, slab_blocks=blocks // t.shape[0])

    # what it holds and has done

    def held_bytes(self) -> int:
        if self.spec.kind == "dense":
            ts = (self.w13, self.w2)
        elif hasattr(self, "wg"):
            ts = (self.wg, self.wu, self.wd)
        else:
            ts = self.source.tensors if isinstance(self.source, HostSource) else ()
        return sum(t.numel() * t.element_size() for t in ts)

    def describe(self) -> str:
        if self.device_cache is not None:
            return (f"{self.tier} ({self.slots} slots on {self.device}, decode steps' misses staged on the "
                    f"device from {self.source.describe()}, LFU)")
        if self.spec.kind == "cache":
            return f"{self.tier} ({self.slots} slots on {self.device}, misses from {self.source.describe()})"
        if self.source is not None:
            return f"{self.tier} ({self.source.describe()})"
        return self.tier

    def cache_order(self) -> list[int]:
        """Cached experts, least recently used first (cache tier; empty otherwise); under
        the device cache, least often used first."""
        if self.device_cache is not None:
            return self.device_cache.order()
        return list(self._lru) if self.spec.kind == "cache" else []

    def stats(self) -> dict:
        """Counters since construction (or `reset_stats`): calls, experts asked for, hits,
        misses (fetched), evictions, bytes fetched and seconds fetching."""
        c = dict(self._counts)
        if self.device_cache is not None:  # the decode steps' counters: read from the device
            routed, missed, promoted = (a - b for a, b in zip(self._device_counts(), self._device_base))
            c["experts"] += routed
            c["hits"] += routed - missed
            c["misses"] += missed
            c["bytes"] += (missed + promoted) * self.expert_bytes
            c["evictions"] += max(0, promoted - self.slots)
        asked = c["hits"] + c["misses"]
        c.update(tier=self.tier, hit_rate=c["hits"] / asked if asked else None,
                 gb_per_s=c["bytes"] / c["fetch_s"] / 1e9 if c["fetch_s"] else None)
        return c

    def reset_stats(self) -> None:
        for k in self._counts:
            self._counts[k] = 0.0 if k == "fetch_s" else 0
        if self.device_cache is not None:
            self._device_base = self._device_counts()

    _device_base = (0, 0, 0)

    def _device_counts(self) -> tuple[int, int, int]:
        """The device cache's slots routed, missed and experts promoted."""
        return (*self.device_cache.counts(), self.device_cache.promotions)

    def rebalance(self) -> None:
        """Between steps: the device cache's promotions (nothing for the other tiers)."""
        if self.device_cache is not None:
            self.device_cache.rebalance()

    # running

    def count(self, ids: torch.Tensor) -> torch.Tensor:
        """Count a call routed to `ids` (T, k) (-1: held elsewhere); its ids flat, on the host."""
        flat = ids.reshape(-1).long().cpu()
        if not compiled.warming():  # the background compile's scratch steps count nothing
            self.hits += torch.bincount(flat[flat >= 0], minlength=self.n_experts)
            self._counts["calls"] += 1
        return flat

    def route_tally(self) -> torch.Tensor | None:
        """The tally of slots per expert that the router's launch may count into
        (triton_kernels.moe.route's `hits`): a GPU's resident tier holding every expert,
        where each routed slot is a hit; then `forward(..., counted=True)`. None otherwise:
        the store counts."""
        if self.hits.device.type != "cpu" and not self.partial and not compiled.warming():
            return self.hits
        return None

    def _count_on_device(self, ids: torch.Tensor, counted: bool = False) -> None:
        """A GPU's resident tier: every routed slot reads its expert's weights, so each is a
        hit; tokens per expert added up on the device (one kernel, nothing read back; none
        where the router's launch `counted` them into `hits`, see route_tally)."""
        flat = ids.reshape(-1)
        if counted:
            pass
        elif self.partial:  # -1: another rank's expert (--ep), which counts nothing here
            self.hits.index_add_(0, flat.clamp(min=0), (flat >= 0).long())
        else:
            # one tensor of ones a size, kept: a CUDA graph of each window reads its own
            if self._ones is None:
                self._ones = {}
            ones = self._ones.get(flat.numel())
            if ones is None:
                ones = self._ones[flat.numel()] = torch.ones(flat.numel(), dtype=torch.long, device=flat.device)
            self.hits.index_add_(0, flat, ones)
        self._counts["calls"] += 1
        self._counts["experts"] += flat.numel()  # slots (under --ep, with other ranks' too)
        self._counts["hits"] += flat.numel()

    _ones = None  # a slot's count by the number of slots, kept on the device

    def route_plan(self, tokens: int, top_k: int) -> dict | None:
        """route_align's keywords for a one-token step whose router's launch also counts,
        looks up and aligns for this store (triton_kernels.route_align): the tally of a GPU's
        resident tier, or the device cache's table and counters; the weight rows its ids
        name and the alignment's block_m. Then `forward(..., plan=...)`. None where the
        store routes otherwise."""
        if tokens != 1 or self.kernels != "triton" or self.partial or compiled.warming():
            return None
        dc = self.device_cache
        if self.hits.device.type != "cpu":
            plan, rows = {"hits": self.hits}, self.wg.shape[0]
        elif dc is not None and top_k <= dc.staging and dc.stages_on_device():
            plan = {"lut": dc.lut, "routed": dc.routed, "missed": dc.missed, "first": dc.n}
            rows = dc.w[0].shape[0]
        else:
            return None
        return {**plan, "rows": rows, "block_m": block_m_for(*self.fmts, tokens, tokens * top_k, rows)}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                slots: bool = False, counted: bool = False, plan: tuple | None = None,
                pair: tuple | None = None) -> torch.Tensor:
        """The routed experts' sum (T, H); `slots`: where one call of the MoE kernels runs
        them all (the resident and streamed tiers, a device cache's decode), their weighted
        rows unsummed (T, k, H) instead, for the MoE's last launch to sum (shared_expert.gated_add);
        `counted`: the router's launch added `ids` to the tally `route_tally` gave; `plan`:
        (local ids, cache slots, alignment) of route_align's launch for `route_plan`'s keywords;
        `pair`: with a plan, the shared expert's down GEMV for the down launch (moe(pair=))."""
        if plan is not None:
            local, slot, aligned = plan
            if self.hits.device.type != "cpu":
                self._count_on_device(ids, counted=True)
                ws = self.wg, self.wu, self.wd
            else:
                self._counts["calls"] += 1
                ws = self.device_cache.stage(ids, slot)
            return self._moe(x, *ws, weights, local, slots=slots, aligned=aligned, pair=pair)
        if pair is not None:
            raise ValueError("ExpertStore: a shared expert's GEMV joins a planned step's MoE launch only")
        if self.hits.device.type != "cpu":  # a GPU's resident tier: no host read in the step
            if not compiled.warming():
                self._count_on_device(ids, counted)
            return self._moe(x, self.wg, self.wu, self.wd, weights, ids, slots=slots)
        dc = self.device_cache
        if dc is not None and ids.numel() <= dc.staging:  # a decode step: on the device
            self._counts["calls"] += 1
            wg, wu, wd, local = dc(ids)
            return self._moe(x, wg, wu, wd, weights, local, slots=slots)
        flat = self.count(ids)
        kept = flat[flat >= 0]
        if self.spec.kind == "dense":
            return self._dense(x, weights, ids)
        needed = torch.unique(kept)  # sorted: the compact set keeps the experts' order
        self._counts["experts"] += needed.numel()
        if self.spec.kind == "cache" and dc is None:
            return self._cached(x, weights, ids, flat, needed.tolist())
        if not self.compact:  # resident: every expert a hit
            self._counts["hits"] += needed.numel()
            return self._moe(x, self.wg, self.wu, self.wd, weights, ids, slots=slots)
        ws = self._fetch(needed.tolist())
        self._counts["misses"] += needed.numel()
        lut = torch.full((self.n_experts,), -1, dtype=torch.long)
        lut[needed] = torch.arange(needed.numel())
        return self._moe(x, *ws, weights, self._remap(lut, ids, flat), slots=slots)

    def _remap(self, lut: torch.Tensor, ids: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        # -1 (an expert held elsewhere) stays -1: the MoE drops it
        out = torch.where(flat >= 0, lut[flat.clamp(min=0)], -1)
        return out.reshape(ids.shape).to(device=ids.device, dtype=ids.dtype)

    def _moe(self, x, wg, wu, wd, weights, ids, n_slots: int | None = None,
             tokens: int | None = None, slots: bool = False, aligned: tuple | None = None,
             pair: tuple | None = None) -> torch.Tensor:
        if self.kernels == "torch":
            return impl("moe", "torch")(x, wg, wu, wd, *self.fmts, weights, ids).float()
        # the path and tiles of the resident call (all E experts, the batch's T tokens and
        # T * k slots), so that a compact set or a group runs the kernels' arithmetic and
        # blocks exactly as the resident tier does
        n = ids.numel() if n_slots is None else n_slots
        path = choose_path(*self.fmts, x.shape[0] if tokens is None else tokens)
        if slots and not torch.compiler.is_compiling():  # the registered op sums
            return impl("moe", "triton")(x, wg, wu, wd, *self.fmts, weights, ids, path=path,
                                         tile_slots=n, slots=True, aligned=aligned, pair=pair, dtype=self.dtype)
        return impl("moe", "triton")(x, wg, wu, wd, *self.fmts, weights, ids, path=path,
                                     tile_slots=n, dtype=self.dtype).float()

    def _fetch(self, experts: list[int]) -> tuple[torch.Tensor, ...]:
        t = time.perf_counter()
        # host memory holds the blocks as the kernels read them (read_host), copied from
        # where they lie; a drive's arrive in GGUF order and are repacked where they land
        if isinstance(self.source, HostSource):
            on_cpu = torch.device(self.device).type == "cpu"
            ws = self.source.fetch(experts) if on_cpu else self.source.fetch_to(experts, self.device)
        else:
            ws = tuple(layout.place(w, t.fmt, self.device, held, non_blocking=True)
                       for w, t, held in zip(self.source.fetch(experts), self.tensors, self.fmts))
        self._counts["fetch_s"] += time.perf_counter() - t
        self._counts["bytes"] += len(experts) * self.expert_bytes
        return ws

    def _ensure(self, experts: list[int]) -> None:
        """Make every expert of `experts` (at most `slots`) resident in a slot: hits move to
        the recent end; misses take free slots, then the least recently used ones."""
        lru, want = self._lru, set(experts)
        misses = []
        for e in experts:
            if e in lru:
                lru.move_to_end(e)
                self._counts["hits"] += 1
            else:
                misses.append(e)
        if not misses:
            return
        slots = []
        for _ in misses:
            if self._free:
                slots.append(self._free.pop(0))
                continue
            old = next(e for e in lru if e not in want)  # hits are at the recent end
            slots.append(lru.pop(old))
            self._counts["evictions"] += 1
        g, u, d = self._fetch(misses)
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.wg.device)
        for dst, src in ((self.wg, g), (self.wu, u), (self.wd, d)):
            dst.index_copy_(0, idx, src)
        for e, s in zip(misses, slots):
            lru[e] = s
        self._counts["misses"] += len(misses)

    def _cached(self, x, weights, ids, flat, needed: list[int]) -> torch.Tensor:
        if len(needed) <= self.slots:
            self._ensure(needed)
            return self._moe(x, self.wg, self.wu, self.wd, weights, self._remap(self._lut(), ids, flat))
        return self._grouped(x, weights, ids, flat, needed)

    def _lut(self) -> torch.Tensor:
        lut = torch.full((self.n_experts,), -1, dtype=torch.long)
        if self._lru:
            lut[list(self._lru)] = torch.tensor(list(self._lru.values()))
        return lut

    def _grouped(self, x, weights, ids, flat, needed: list[int]) -> torch.Tensor:
        """More experts than slots: the experts in groups of `slots`, each group's token
        choices run as tokens of their own (k = 1, whose sum over one choice is exact), each
        choice's output written to its place; then the choices are summed per token in the
        resident tier's order, so the result is the same bit for bit."""
        T, k = ids.shape
        per_slot = torch.zeros((T * k, self.hidden), dtype=torch.float32, device=x.device)
        w = weights.reshape(-1)
        for i in range(0, len(needed), self.slots):
            group = needed[i:i + self.slots]
            self._ensure(group)
            sel = torch.isin(flat, torch.tensor(group)).nonzero().squeeze(1)
            ids1 = self._lut()[flat[sel]].reshape(-1, 1).to(device=ids.device, dtype=ids.dtype)
            sel_d = sel.to(x.device)
            per_slot[sel_d] = self._moe(x[sel_d // k], self.wg, self.wu, self.wd, w[sel_d].reshape(-1, 1),
                                        ids1, n_slots=T * k, tokens=T)
        return per_slot.view(T, k, self.hidden).sum(dim=1)

    def _dense(self, x, weights, ids) -> torch.Tensor:
        T, k = ids.shape
        if T <= FEW_TOKENS and not invariant.enabled():
            # decode: a compiled pass a token (a token's result whatever the batch beside it)
            ys = [_FEW_TOKENS(x[t:t + 1].float(), weights[t:t + 1].float(), ids[t:t + 1], self.w13, self.w2)
                  for t in range(T)]
            if all(y is not None for y in ys):  # None: not compiled (triton_kernels.cpu.compiled)
                return torch.cat(ys)
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        skip = int((flat < 0).sum())  # slots held elsewhere (-1, --ep): sorted first, dropped
        order = order[skip:]
        counts = torch.bincount(flat[flat >= 0], minlength=self.n_experts).tolist()
        out = torch.zeros(T, self.hidden, dtype=torch.float32, device=x.device)
        w = weights.reshape(-1)
        at = 0
        # experts in increasing id order, each over its tokens (as transformers' loop)
        for e in np.nonzero(counts)[0].tolist():
            slots = order[at:at + counts[e]]
            at += counts[e]
            rows = slots // k
            xe, w13, w2 = x[rows], self.w13[e], self.w2[e]
            # an expert of many rows in float32 where the CPU has no bfloat16 dot products
            # (backend.upcast)
            if upcast(xe, w13.dtype):
                w13, w2 = w13.float(), w2.float()
            g, u = invariant.linear(xe.to(w13.dtype), w13).float().chunk(2, dim=-1)
            y = invariant.linear((F.silu(g) * u).to(w2.dtype), w2)
            # a token meets each expert once, so rows are distinct: a plain indexed add
            # (index_add_ spins up threads for a few rows; this is 100x cheaper on a busy CPU)
            out[rows] += y.float() * w[slots, None]
        return out


def _few_tokens(x, weights, ids, w13, w2):
    """The dense tier's experts for a few tokens in one expression that Inductor turns into
    loops over the routed experts' rows, read in place (no gathered copy, no Python loop a
    slot: measured 130 us against 870 for flash-tiny's 8 of 64 on 2 cores). Float32 from x
    to the sum, where the loop rounds x and the SwiGLU product to the weights' dtype.
    Slots held elsewhere (-1, --ep) weigh nothing."""
    e = ids.clamp(min=0).long()                                    # (T, k)
    g, u = (w13[e].float() * x[:, None, None, :]).sum(-1).chunk(2, dim=-1)
    h = F.silu(g) * u                                              # (T, k, I)
    y = (w2[e].float() * h[:, :, None, :]).sum(-1)                 # (T, k, H)
    return (y * torch.where(ids >= 0, weights, 0.0)[:, :, None]).sum(1)


_FEW_TOKENS = Compiled(_few_tokens, "the dense experts' decode", dynamic=False)
# tokens up to this take _few_tokens (each reads its k experts' weights; more tokens share them in the loop)
FEW_TOKENS = 4


def _experts_of(t: QTensor, experts: range) -> QTensor:
    """The slabs of `experts` of a stacked expert tensor: a view (the file tiers still
    read it at its own offset)."""
    rows = t.data.shape[0] // t.shape[0]
    return QTensor(t.name, t.fmt, (len(experts), *t.shape[1:]), t.data[experts.start * rows:experts.stop * rows])


# --- counters over a model ---------------------------------------------------------------

def summarize(stores) -> dict:
    """The counters of several stores (a model's layers) added up, per tier."""
    total = {"calls": 0, "experts": 0, "hits": 0, "misses": 0, "evictions": 0, "bytes": 0, "fetch_s": 0.0}
    tiers = collections.Counter()
    for s in stores:
        c = s.stats()
        tiers[c["tier"]] += 1
        for k in total:
            total[k] += c[k]
    asked = total["hits"] + total["misses"]
    total.update(tiers=dict(tiers), hit_rate=total["hits"] / asked if asked else None,
                 gb_per_s=total["bytes"] / total["fetch_s"] / 1e9 if total["fetch_s"] else None)
    return total


def stats_line(stores) -> str:
    """One line of expert counters for STRATA_DECODE_TIMING=1."""
    c = summarize(stores)
    tiers = ", ".join(f"{t} x{n}" for t, n in c["tiers"].items())
    rate = "-" if c["hit_rate"] is None else f"{c['hit_rate']:.1%}"
    speed = f" ({c['gb_per_s']:.2f} GB/s)" if c["gb_per_s"] else ""
    return (f"experts [{tiers}]: {c['hits']:,} hits, {c['misses']:,} misses (hit rate {rate}), "
            f"{c['evictions']:,} evictions, {c['bytes'] / 1e9:.3f} GB fetched in {c['fetch_s']:.3f} s{speed}")
