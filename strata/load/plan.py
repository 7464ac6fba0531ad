"""The decision: what a model's load will do, made once, in one place.

`decide(gguf, options, machine)` turns a GGUF file, what the user asked for (`Options`:
the command-line flags, or a notebook's keywords) and the machine into a `LoadPlan`:
where the model computes and with which kernels, in which dtype; where the routed
experts live (`--experts`, or what the placement fits on a GPU); how the PLE table is
read (`--ple-io`, `auto` measured here); and why. The loaders build the model from the
plan and nothing else (strata.load.build), the plan lines are printed from it
(`LoadPlan.lines`), and `LoadPlan.check(model)` says whether a loaded model holds what
its plan says.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.gguf import GGUFFile
from strata.names import qwen4exp as qn
from strata.nn import kv
from strata.nn.rope import RopeScaling
from strata.storage.expert_sources import in_file
from strata.storage.expert_tier import parse_tier
from triton_kernels import backend, invariant
from triton_kernels.backend import choose_device, choose_kernels
from triton_kernels.deltanet_fla import deltanet_path


@dataclass(frozen=True)
class Options:
    """What a load is asked to do. None: decided (see `decide`)."""
    dtype: torch.dtype = torch.bfloat16
    device: str | None = None  # cuda[:N] or cpu; None: cuda when torch sees one
    kernels: str | None = None  # triton or torch; None: the device's default
    threads: int | None = None  # CPU threads; None: torch's
    qsa: bool = True  # qwen4exp: QSA sparse attention past the indexer's budget
    experts: str | None = None  # an --experts spec; None: the default for the device
    experts_dir: str | None = None  # where `strata pack` wrote the pack
    experts_io: str = "direct"
    experts_io_depth: int = 16
    ple_io: str | None = None  # ram, mmap, direct or auto; None: the table's blocks in the mapping
    ple_file: str | None = None  # the file holding the PLE table (default: the model's GGUF)
    ple_prefetch: bool = True
    ple_io_depth: int = 16
    vram_reserve_mib: int = 1024
    gpu_mem_gib: float | None = None  # place for a GPU of this many GiB (None: the device's free memory)
    ram_gib: float | None = None  # place for this much free host RAM (None: MemAvailable)
    tokens: int = 32768  # the prompt length the drive plan counts reads for
    rope_scaling: str | None = None  # none, linear or yarn; None: the file's
    rope_scale: float | None = None  # the context's stretch factor; None: the file's
    yarn_orig_ctx: int | None = None  # the trained context; None: the file's
    max_context: int | None = None  # tokens a sequence may hold; None: the trained (x the scale)
    kv: str | None = None  # the KV cache's storage (strata.nn.kv); None: f32
    # batch-invariant numerics (triton_kernels.invariant) for the whole process: True
    # everywhere, False nowhere; None: leave the process's setting (STRATA_BATCH_INVARIANT;
    # by default decode steps alone) as it is
    batch_invariant: bool | None = None


@dataclass(frozen=True)
class ExpertChoice:
    """Where the routed experts live: `tier` an --experts spec, or None for the CPU's
    default (dense while the DenseBudget lasts, else the blocks in the mapping)."""
    tier: str | None
    why: str
    experts_dir: str | None = None
    io_mode: str = "direct"
    depth: int = 16

    def store_kwargs(self) -> dict:
        return {"tier": self.tier, "experts_dir": self.experts_dir, "io_mode": self.io_mode, "depth": self.depth}

    def kinds(self) -> set[str]:
        """The ExpertStore tier names a store built from this choice may report."""
        if self.tier is None:
            return {"dense", "blocks"}
        return {"blocks"} if self.tier == "blocks" else {str(parse_tier(self.tier))}


@dataclass(frozen=True)
class PleChoice:
    """How the PLE table is read: `mode` ram, mmap or direct through strata.storage.ple
    from `path`, or None: the table's blocks in the model's own mapping."""
    mode: str | None
    why: str
    source: object = None  # strata.storage.ple_source.PleSource, for a mode
    depth: int = 16
    prefetch: bool = True
    host: bool = False  # no mode, on a GPU: the blocks stay in host memory, read over PCIe (the placement's)


@dataclass
class LoadPlan:
    gguf: GGUFFile
    options: Options
    device: str
    kernels: str
    dtype: torch.dtype
    threads: int
    experts: ExpertChoice | None  # None: a dense model
    ple: PleChoice | None  # None: no PLE table
    placement: object | None = None  # strata.storage.placement.Placement, on a GPU
    rope: RopeScaling | None = None  # None: RoPE as trained
    context: int = 4096  # tokens a sequence may hold
    context_why: str = ""
    kv: str = "f32"  # the KV cache's storage (strata.nn.kv)
    layout: object | None = None  # strata.dist.Layout: this rank's layers and experts; None: one process

    @property
    def batch_invariant(self) -> bool | None:
        """True: everywhere; False: nowhere; None: decode steps alone (triton_kernels.invariant)."""
        b = self.options.batch_invariant
        return invariant.setting() if b is None else b

    @property
    def arch(self) -> str:
        return self.gguf.arch

    def lines(self, drive: bool = True) -> list[str]:
        """What the load does and why; with `drive`, first the parts' sizes and tiers and
        what a prompt reads from the drive (strata.storage.plan, from this plan's choices)."""
        o = self.options
        out = self.drive_plan().lines() if drive and self.arch == qn.ARCH else []
        out += [f"plan: {self.arch} on {self.device}, {self.kernels} kernels, "
               f"{str(self.dtype).replace('torch.', '')}, {self.threads} threads"
               + ("" if self.arch != qn.ARCH else f", {'QSA on' if o.qsa else 'QSA off (dense attention)'}")]
        if torch.device(self.device).type == "cpu" and self.kernels == "torch":
            out.append(backend.cpu_line())
        if self.arch == qn.ARCH and torch.device(self.device).type == "cuda":
            out.append("DeltaNet: a prompt's chunks through {}'s kernels ({})".format(
                *deltanet_path(self.device, self.kernels)))
        out.append(f"context: {self.context} tokens, {self.context_why}; KV cache {self.kv}"
                   f"{' (given)' if o.kv else ' (the default; --kv bf16|f16|int8 to shrink it)'}")
        if self.batch_invariant:
            out.append("numerics: batch-invariant: a token's result does not depend on the prompt's chunks "
                       "or the requests batched beside it (fixed-shape matmuls, DeltaNet token by token, "
                       "QSA's sparse path at every length; --no-batch-invariant for speed)")
        elif self.batch_invariant is None and self.arch == qn.ARCH:
            out.append("numerics: decode steps batch-invariant where an MTP head can speculate (a verify's "
                       "rows compute as one-token steps: greedy --spec N gives --spec 0's tokens); prefill "
                       "plain; --batch-invariant for both, --no-batch-invariant for neither")
        if self.layout is not None:
            out.append(f"parallel: {self.layout.describe(*_counts(self.gguf))}, pid {os.getpid()}")
        if self.placement is not None:
            out += self.placement.lines()
        if self.experts is not None:
            out.append(f"--experts {self.experts.tier or 'default'}: {self.experts.why}")
        if self.ple is not None:
            out.append(f"PLE table: {self.ple.why}")
        return out

    def drive_plan(self, measure: bool = True):
        """strata.storage.plan.Plan for this plan's tiers: sizes, page cache, drive reads."""
        from strata.storage.plan import make_plan
        e = self.experts
        ple = self.ple.mode if self.ple is not None and self.ple.mode else "mmap"
        return make_plan(self.gguf, experts=e.tier if e else None, ple_io=ple, device=self.device,
                         experts_io=e.io_mode if e else "direct", experts_dir=e.experts_dir if e else None,
                         tokens=self.options.tokens, measure=measure)

    def check(self, model) -> list[str]:
        """What the loaded model holds that its plan does not say: empty when they agree."""
        bad = []
        if torch.device(self.device) != model.device:
            bad.append(f"device {model.device}, planned {self.device}")
        if model.kernels != self.kernels:
            bad.append(f"kernels {model.kernels}, planned {self.kernels}")
        if model.dtype != self.dtype:
            bad.append(f"dtype {model.dtype}, planned {self.dtype}")
        if getattr(model, "kv", self.kv) != self.kv:
            bad.append(f"KV cache {model.kv}, planned {self.kv}")
        stores = [l.moe.experts for l in getattr(model, "layers", [])]
        if self.experts is not None:
            kinds = self.experts.kinds()
            for i, s in enumerate(stores):
                if s.tier not in kinds or s.kernels != self.kernels:
                    bad.append(f"layer {i}'s experts: {s.tier} with {s.kernels} kernels, planned "
                               f"{' or '.join(sorted(kinds))} with {self.kernels}")
        ple = getattr(model, "ple", None)
        if self.ple is not None:
            held = getattr(ple.table, "table", None) if ple is not None else None
            mode = getattr(held, "mode", None)
            if ple is None or mode != self.ple.mode:
                bad.append(f"PLE table {mode or 'in the mapping' if ple else 'absent'}, planned "
                           f"{self.ple.mode or 'in the mapping'}")
        return bad


def _counts(g: GGUFFile) -> tuple[int, int]:
    """(layers, experts a layer) of a model, for --ep/--pp."""
    return int(g.require(f"{g.arch}.block_count")), int(g.get(f"{g.arch}.expert_count", 1) or 1)


def _layout(g: GGUFFile):
    from strata import dist
    c = dist.comm()
    if c is None:
        return None
    if g.arch != qn.ARCH:
        raise ValueError(f"{g.path.name}: --ep/--pp run {qn.ARCH} models; this one is {g.arch}")
    n_layers, n_experts = _counts(g)
    c.layout.layers(n_layers), c.layout.experts(n_experts)  # a bad split fails here, named
    return c.layout


def _holds_ple(g: GGUFFile, layout) -> bool:
    """Whether this process builds the PLE layer (under --pp, only its stage does)."""
    if layout is None:
        return True
    mine = layout.layers(_counts(g)[0])
    return any(int(i) in mine for i in g.get(f"{qn.ARCH}.ple.layers") or [])


def _rest_bytes(g: GGUFFile) -> int:
    return sum(t.nbytes for n, t in g.tensors.items() if n != qn.PLE_TABLE)


def _experts(g: GGUFFile, o: Options, device: str, machine) -> tuple[ExpertChoice | None, object | None]:
    gate = next((t for n, t in g.tensors.items() if n.endswith(qn.MOE["gate_exps"])), None)
    if gate is None:
        return None, None
    from strata.storage.pack import PACK_INDEX, default_pack_dir
    # the pack is the model's, named after its file: `strata pack` puts the MTP sidecar's
    # experts in it too, and the sidecar's store must not look for a pack of its own name
    kw = dict(experts_dir=o.experts_dir or str(default_pack_dir(g.path)), io_mode=o.experts_io,
              depth=o.experts_io_depth)
    if o.experts:
        return ExpertChoice(str(parse_tier(o.experts)) if o.experts != "blocks" else "blocks", "given", **kw), None
    if not device.startswith("cuda"):
        held = ("the blocks in the mapped file (the page cache holds them)" if in_file(gate)
                else "the blocks made in memory")
        return ExpertChoice(None, f"dense copies while STRATA_DENSE_MIB lasts, else {held}", **kw), None
    # a GPU without --experts: what fits VRAM, then RAM, then the drive (the placement)
    from strata.storage import placement as pl
    pack = Path(kw["experts_dir"]) / PACK_INDEX
    machine = machine or pl.this_machine(device, o.vram_reserve_mib, o.gpu_mem_gib, o.ram_gib)
    p = pl.place(pl.shape_of(g), machine, ctx=o.tokens, pack_exists=pack.is_file())
    return ExpertChoice(p.expert_tier, "the placement's (above)", **kw), p


def _ple(g: GGUFFile, o: Options, placement=None) -> PleChoice | None:
    t = g.tensors.get(qn.PLE_TABLE)
    if t is None and not o.ple_file and not g.get(f"{qn.ARCH}.ple.layers"):
        return None
    where = placement.ple_where if placement is not None else None  # a GPU's placement: vram, ram or drive
    # a table made in memory (flash-shape) has no file to read it from: its blocks stay
    # where they were made (the placement refuses to put it on a drive)
    made = t is not None and not o.ple_file and not in_file(t)
    if made and o.ple_io in ("mmap", "direct"):
        raise ValueError(f"--ple-io {o.ple_io}: {g.path}'s PLE table is made in memory, with no file to read "
                         f"it from; leave --ple-io out")
    if made or (o.ple_io is None and t is not None and not o.ple_file and where != "drive"):
        # on a GPU where the placement keeps the table in RAM, its blocks stay on the host
        host = where == "ram"
        size = f"{t.nbytes / 2**20:.0f} MiB {t.fmt.name}"
        return PleChoice(None, (f"its blocks made in memory ({size}, no file" if made else
                                f"the file's blocks in memory ({size}, no --ple-io: read through the mapping")
                               + (", held in host memory as the placement says)" if host else ")"), host=host)
    from strata.storage.ple_source import find_ple
    # the model's own file, or another shard of its set (the releases keep the table alone
    # in shard 2), or --ple-gguf's
    source = find_ple(o.ple_file or g.path, opened=g)
    if o.ple_io is None and where == "drive":  # no room in RAM beside the rest: the page cache has none either
        return PleChoice("direct", f"{source.describe()}: the placement keeps it on the drive (no room in RAM "
                                   f"beside the rest): --ple-io direct (no --ple-io given)",
                         source, o.ple_io_depth, o.ple_prefetch)
    if o.ple_io is None:  # a table outside the model's file is read as a storage tier does
        return PleChoice("mmap", f"{source.describe()}: another file than the model's: --ple-io mmap "
                                 f"(no --ple-io given)", source, o.ple_io_depth, o.ple_prefetch)
    if o.ple_io == "auto":
        from strata.storage.ple_auto import choose_mode
        # ram is a candidate only when the table fits beside the rest of the model
        mode, line = choose_mode(source, depth=o.ple_io_depth, prefetch=o.ple_prefetch,
                                 reserve_bytes=_rest_bytes(g))
    else:
        mode, line = o.ple_io, f"--ple-io {o.ple_io} (given; not measured)"
    return PleChoice(mode, f"{source.describe()}: {line}", source, o.ple_io_depth, o.ple_prefetch)


def _rope(g: GGUFFile, o: Options) -> tuple[RopeScaling | None, int, str]:
    """RoPE scaling (the flags, else the file's rope.scaling keys) and the context."""
    a = g.arch
    trained = int(g.get(f"{a}.context_length", 4096))
    kind = o.rope_scaling or g.get(f"{a}.rope.scaling.type")
    kind = None if kind in (None, "none") else kind
    if kind is None and o.rope_scale is not None and o.rope_scaling != "none":
        kind = "linear"  # llama.cpp's --rope-scale alone: linear interpolation
    rope, why = None, "as trained"
    if kind is not None:
        factor = o.rope_scale or g.get(f"{a}.rope.scaling.factor")
        if not factor:
            raise ValueError(f"--rope-scaling {kind} needs --rope-scale S (the context's stretch factor); "
                             f"{g.path.name} gives none")
        orig = o.yarn_orig_ctx or int(g.get(f"{a}.rope.scaling.original_context_length", 0)) or trained
        attn = g.get(f"{a}.rope.scaling.attn_factor")
        rope = RopeScaling(kind, float(factor), orig, attn_factor=float(attn) if attn else None)
        given = o.rope_scaling is not None or o.rope_scale is not None
        why = f"{rope.describe()} ({'given' if given else 'the file' + chr(39) + 's'})"
    if o.max_context:
        ctx = o.max_context
        limit = rope.context if rope else trained
        why = f"--max-context; {why}" + (f"; past the {limit} the RoPE was trained or scaled for"
                                         if ctx > limit else "")
    else:
        ctx = rope.context if rope else trained
        why = f"the model's; {why}"
    return rope, ctx, why


def decide(g: GGUFFile, options: Options | None = None, machine=None) -> LoadPlan:
    """The plan for loading `g` as `options` ask on this machine (or `machine`, a
    strata.storage.placement.Machine, for a GPU placement). Measures what `auto` leaves
    open (the PLE table's I/O mode); reads nothing else of the file."""
    o = options or Options()
    device = choose_device(o.device)
    kernels = choose_kernels(o.kernels, device)
    layout = _layout(g)
    experts, placement = _experts(g, o, device, machine) if g.arch == qn.ARCH else (None, None)
    ple = _ple(g, o, placement) if g.arch == qn.ARCH and _holds_ple(g, layout) else None
    rope, context, why = _rope(g, o)
    return LoadPlan(g, o, device, kernels, o.dtype, o.threads or torch.get_num_threads(), experts, ple, placement,
                    rope, context, why, kv.check(o.kv or "f32"), layout)

