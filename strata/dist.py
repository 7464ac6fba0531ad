"""Several processes, one model: expert parallelism (`--ep`) and a layer pipeline (`--pp`)
over torch.distributed (gloo on CPUs, NCCL on GPUs), started by torchrun.

A world of E x P ranks. Rank r is stage r // E of the pipeline and share r % E of that
stage's experts:

    stage 0: ranks 0..E-1      layers [0, s1)      each rank holds 1/E of every layer's experts
    stage 1: ranks E..2E-1     layers [s1, s2)
    ...

Within a stage, every rank runs the whole of its layers but the routed experts: the
router, attention, DeltaNet, the PLE block and the shared expert are computed on each
rank (they are a small part of the bytes; replicated, they need no second collective a
layer and each rank keeps the sequence states itself), and each rank runs the MoE kernels
on its own experts (the slots routed elsewhere are -1, which the kernels drop). The
partial outputs are summed by an all-reduce: with top-k >= 2 a token reaches most shares,
so dispatching tokens to experts (all-to-all) would send k rows a token where the ring
all-reduce sends 2 (E-1)/E.

Between stages, the activations (T, streams x dim) go point to point from a rank to the
rank of the same share in the next stage; the last stage's logits go back to every rank
of its column by a broadcast, so that every rank samples the same token from the same
numbers. Each rank keeps the states of its own layers.

Every collective runs under the process group's timeout; one that fails raises
`RankLost`, which names the rank that is gone where it can tell (the peer of a
point-to-point transfer; otherwise the ranks whose process on this host has died).
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch


class RankLost(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or the network broke."""


@dataclass(frozen=True)
class Layout:
    """Which part of the model rank `rank` of an `ep` x `pp` world holds. `split`: the
    first layer of stages 1..pp-1 (`--layer-split 13,26,38`), or None: layers evenly."""
    ep: int = 1
    pp: int = 1
    rank: int = 0
    split: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.ep < 1 or self.pp < 1:
            raise ValueError(f"--ep {self.ep} --pp {self.pp}: both must be at least 1")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside a world of {self.world} (--ep {self.ep} x --pp {self.pp})")
        if self.split is not None and len(self.split) != self.pp - 1:
            raise ValueError(f"--layer-split {','.join(map(str, self.split))}: --pp {self.pp} takes "
                             f"{self.pp - 1} split points (the first layer of stages 1..{self.pp - 1})")

    @property
    def world(self) -> int:
        return self.ep * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.ep

    @property
    def share(self) -> int:
        return self.rank % self.ep

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def bounds(self, n_layers: int) -> list[int]:
        """The stages' first layers and n_layers: stage s holds [b[s], b[s+1])."""
        if self.split is None:
            b = [round(s * n_layers / self.pp) for s in range(self.pp)] + [n_layers]
        else:
            b = [0, *self.split, n_layers]
        if any(lo >= hi for lo, hi in zip(b, b[1:])):
            what = f"--layer-split {','.join(map(str, self.split))}" if self.split else f"--pp {self.pp}"
            raise ValueError(f"{what}: {n_layers} layers cannot be split so (every stage needs at least one "
                             f"layer, split points rising below {n_layers})")
        return b

    def layers(self, n_layers: int) -> range:
        b = self.bounds(n_layers)
        return range(b[self.stage], b[self.stage + 1])

    def experts(self, n_experts: int) -> range:
        """This rank's experts: a contiguous run, the first n_experts % ep shares one more."""
        if self.ep > n_experts:
            raise ValueError(f"--ep {self.ep}: the model has {n_experts} experts a layer, fewer than the shares")
        q, r = divmod(n_experts, self.ep)
        lo = self.share * q + min(self.share, r)
        return range(lo, lo + q + (self.share < r))

    def describe(self, n_layers: int, n_experts: int) -> str:
        ls, es = self.layers(n_layers), self.experts(n_experts)
        return (f"rank {self.rank} of {self.world} (--ep {self.ep} --pp {self.pp}): stage {self.stage}, "
                f"layers {ls.start}-{ls.stop - 1}, experts {es.start}-{es.stop - 1} of {n_experts} a layer")


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """`--layer-split 13,26,38`."""
    if not text:
        return None
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"--layer-split {text!r}: give the first layer of each stage after the first, "
                         f"comma-separated (e.g. 13,26,38 for --pp 4)") from None


class Comm:
    """The process group of this run, its subgroups, and the collectives the model uses,
    each with its failure turned into RankLost. Counts the payload bytes this rank sends
    (an all-reduce as a ring: 2 (g-1)/g of the tensor; a broadcast's root: the tensor
    once to each other member; a send: the tensor)."""

    def __init__(self, layout: Layout, timeout_s: float, device: str = "cpu"):
        import torch.distributed as dist
        self.layout, self.timeout_s, self.dist, self.device = layout, timeout_s, dist, torch.device(device)
        E, P = layout.ep, layout.pp
        # every rank creates every group, in the same order (torch.distributed's rule)
        self.ep_group = self.column = None
        for s in range(P):
            g = dist.new_group([s * E + i for i in range(E)]) if E > 1 else None
            if s == layout.stage:
                self.ep_group = g
        for i in range(E):
            g = dist.new_group([s * E + i for s in range(P)]) if P > 1 else None
            if i == layout.share:
                self.column = g
        self.sent = 0
        self._pids: dict[int, str] = {}
        self._register()

    # -- who is where (for naming a lost rank) --------------------------------------------

    def _register(self) -> None:
        store = _default_store()
        me = f"{socket.gethostname()}:{os.getpid()}"
        if store is not None:
            store.set(f"strata/rank/{self.layout.rank}", me)
            for r in range(self.layout.world):
                self._pids[r] = store.get(f"strata/rank/{r}").decode()

    def gone(self) -> list[int]:
        """Ranks whose process on this host has ended (a zombie too: torchrun reaps its
        workers only at its next check)."""
        host, out = socket.gethostname(), []
        for r, where in self._pids.items():
            h, _, pid = where.rpartition(":")
            if h == host and r != self.layout.rank and not _alive(int(pid)):
                out.append(r)
        return out

    def _lost(self, what: str, e: Exception, peers: list[int]) -> RankLost:
        dead = [r for r in self.gone() if r in peers] or self.gone()
        who = (f"rank {dead[0]}" if len(dead) == 1 else f"ranks {', '.join(map(str, dead))}") if dead else (
            f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {', '.join(map(str, peers))}")
        kind = "did not answer within the timeout" if "imeout" in str(e) else "is gone"
        return RankLost(f"rank {self.layout.rank}: {who} {kind} during {what} "
                        f"(--dist-timeout {self.timeout_s:g} s): {str(e).splitlines()[0][:200]}")

    def _run(self, what: str, peers: list[int], fn):
        try:
            return fn()
        except RankLost:
            raise
        except Exception as e:  # gloo and NCCL raise RuntimeError or DistBackendError
            raise self._lost(what, e, peers) from e

    # -- collectives ---------------------------------------------------------------------

    def ep_peers(self) -> list[int]:
        L = self.layout
        return [L.stage * L.ep + i for i in range(L.ep) if i != L.share]

    def all_reduce_experts(self, t: torch.Tensor, what: str):
        """Start summing `t` over this stage's shares, in place: (t, wait), where t holds
        the sum once wait() has returned."""
        if self.ep_group is None:
            return t, (lambda: None)
        t = t.contiguous()
        g = self.layout.ep
        self.sent += int(2 * (g - 1) / g * t.numel() * t.element_size())
        what = f"the all-reduce of {what}"
        work = self._run(what, self.ep_peers(), lambda: self.dist.all_reduce(t, group=self.ep_group, async_op=True))
        return t, (lambda: self._run(what, self.ep_peers(), work.wait))

    def send_next(self, t: torch.Tensor) -> None:
        L = self.layout
        peer = L.rank + L.ep
        t = t.contiguous()
        self.sent += t.numel() * t.element_size()
        self._run(f"the send of stage {L.stage}'s activations to stage {L.stage + 1}", [peer],
                  lambda: self.dist.send(t, dst=peer))

    def recv_prev(self, shape, dtype) -> torch.Tensor:
        L = self.layout
        peer = L.rank - L.ep
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self._run(f"the receive of stage {L.stage - 1}'s activations", [peer], lambda: self.dist.recv(t, src=peer))
        return t

    def logits_from_last(self, t: torch.Tensor | None, shape) -> torch.Tensor:
        """The last stage's logits on every rank of this column."""
        L = self.layout
        if self.column is None:
            return t
        root = (L.pp - 1) * L.ep + L.share
        if L.last:
            t = t.contiguous()
            self.sent += (L.pp - 1) * t.numel() * t.element_size()
        else:
            t = torch.empty(shape, dtype=torch.float32, device=self.device)
        peers = [root] if not L.last else [s * L.ep + L.share for s in range(L.pp - 1)]
        self._run("the broadcast of the last stage's logits", peers,
                  lambda: self.dist.broadcast(t, src=root, group=self.column))
        return t

    def broadcast_object(self, obj, what: str):
        """rank 0's `obj` on every rank (small things: the sampling seed, the engine's next call)."""
        box = [obj]
        peers = list(range(1, self.layout.world)) if self.layout.rank == 0 else [0]
        self._run(what, peers, lambda: self.dist.broadcast_object_list(box, src=0))
        return box[0]

    def sum_over_ranks(self, value: float) -> float:
        """`value` summed over every rank (a counter's total)."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        self._run("the sum of a counter over the ranks", [r for r in range(self.layout.world) if r != self.layout.rank],
                  lambda: self.dist.all_reduce(t))
        return float(t.item())


class ExpertShare:
    """A MoE layer's view of its experts under --ep: the global ids this rank holds become
    local ones, the rest -1 (the kernels drop them); the partial outputs are summed."""

    def __init__(self, comm: Comm, experts: range, what: str):
        self.comm, self.lo, self.hi, self.what = comm, experts.start, experts.stop, what

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        return torch.where(mine, ids - self.lo, torch.full_like(ids, -1))

    def reduce_start(self, t: torch.Tensor):
        """(t, wait): t is the sum over the shares once wait() has returned."""
        return self.comm.all_reduce_experts(t, self.what)


class Pipe:
    """A model's place in the layer pipeline: where its activations come from and go."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.first, self.last = comm.layout.first, comm.layout.last

    def receive(self, rows: int, width: int) -> torch.Tensor:
        return self.comm.recv_prev((rows, width), torch.float32)

    def hand_on(self, x: torch.Tensor) -> None:
        """A stage's streams to the next stage (not the last stage)."""
        self.comm.send_next(x.float())

    def logits(self, parts: list, vocab: int) -> list[torch.Tensor]:
        """The last stage's logits of a batch on every rank: `parts` are the last stage's
        (rows, vocab) tensors, or elsewhere the row counts; one broadcast for the batch."""
        rows = [p.shape[0] if torch.is_tensor(p) else p for p in parts]
        whole = torch.cat(parts) if self.last else None
        whole = self.comm.logits_from_last(whole, (sum(rows), vocab))
        return list(whole.split(rows))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")  # zombie, dead
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


# -- the process's group ----------------------------------------------------------------------

_COMM: Comm | None = None


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except Exception:  # no group, or a torch without it: lost ranks go unnamed
        return None


def launched() -> bool:
    """Started by torchrun (or anything that sets its environment)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init(ep: int = 1, pp: int = 1, split: tuple[int, ...] | None = None, timeout_s: float = 300.0,
         device: str = "cpu") -> Comm | None:
    """Join the torchrun world as `ep` x `pp` ranks; None when ep = pp = 1 (one process).
    Gloo on the CPU, NCCL on CUDA; every collective times out after `timeout_s`."""
    global _COMM
    if ep * pp == 1:
        if launched() and int(os.environ["WORLD_SIZE"]) > 1:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but neither --ep nor --pp "
                             f"was given: pass --ep E --pp P with E x P = {os.environ['WORLD_SIZE']}")
        return None
    if not launched():
        raise ValueError(f"--ep {ep} --pp {pp} runs {ep * pp} processes: start it with "
                         f"torchrun --nproc-per-node {ep * pp} -m strata ...")
    world = int(os.environ["WORLD_SIZE"])
    if world != ep * pp:
        raise ValueError(f"--ep {ep} x --pp {pp} = {ep * pp} ranks, but torchrun started {world}: "
                         f"make --nproc-per-node (x --nnodes) equal E x P")
    if _COMM is not None:
        return _COMM
    import torch.distributed as dist
    layout = Layout(ep, pp, int(os.environ["RANK"]), split)
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    _COMM = Comm(layout, timeout_s, f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    return _COMM


def comm() -> Comm | None:
    """This process's Comm, or None in a single-process run."""
    return _COMM


def close() -> None:
    global _COMM
    if _COMM is not None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        _COMM = None
