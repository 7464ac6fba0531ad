"""Where a model's parts go on a machine with GPUs: VRAM, host RAM, the drive; and what a
decoded token then moves over PCIe and reads from the drive. Computed from shapes alone,
so it can plan for a machine that is not this one (`strata plan --gpu-mem 24 --ram 46`).

The rules, in order (decode reads experts most, so they come first):
1. Each GPU keeps `--vram-reserve-mib` free (the CUDA context, activations) and holds its
   share of the layers' dense weights (attention/DeltaNet, routers, shared experts,
   norms), a layer split in equal runs, the output on the last GPU, and the KV cache of
   its attention layers for the context. What is left is for experts.
2. Routed experts: resident on their layer's GPU when all fit; else a cache of N slots a
   layer in VRAM, beside room for one layer's experts that a prompt's batch fetches, its
   misses copied from pinned host RAM when all experts fit 90% of the RAM, else read from
   the drive (the pack, or the GGUF in place).
3. The PLE table (Flash-Next): in VRAM on the GPU of the PLE layer when it fits beside the
   experts, else in RAM (`--ple-io ram`) when it fits beside what RAM holds, else read
   from the drive a page a row (`--ple-io direct`; `mmap` where the page cache keeps it).
4. The token embedding: rows gathered on the host from the mapped file.

Per decoded token: PCIe = expert misses x their bytes + PLE rows from the host; drive =
misses whose backing is the drive + PLE pages. The miss rate assumes routing spread evenly
over the experts (1 - slots/experts): real routing is skewed, so measured hit rates are
higher (seeds/003: 99.7% with 74% of the experts cached).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import quant
from strata.storage.io import PAGE, gib
from strata.names.qwen4exp import EXPERT_TENSOR, PLE_ROWS_PER_TOKEN, PLE_TABLE, TOKEN_EMBD
from strata.storage.expert_sources import in_file

GiB = 2**30
PREFILL_TOKENS = 512  # a prompt's batch (strata.runtime.generate's ubatch, bench model's pp512)


@dataclass
class ModelShape:
    """What placement needs to know of a model: bytes by part, per layer and per expert."""
    name: str
    n_layers: int
    n_experts: int
    top_k: int
    expert_bytes: int           # one expert's gate + up + down
    layer_bytes: list[int]      # each layer's dense weights
    embedding_bytes: int
    embedding_row_bytes: int
    output_bytes: int
    kv_bytes_per_token: int     # all attention layers, bf16 keys and values
    ple_layer: int | None = None
    ple_rows: int = 0
    ple_row_bytes: int = 0
    dim: int = 0                # the hidden size (what --ep/--pp send a token: strata.storage.ranks)
    streams: int = 1            # hyper-connection streams between layers
    vocab: int = 0
    on_drive: bool = True       # False: made in memory (flash-shape), no file to read a part from

    @property
    def experts_total(self) -> int:
        return self.expert_bytes * self.n_experts * self.n_layers

    @property
    def ple_bytes(self) -> int:
        return self.ple_rows * self.ple_row_bytes


def _nbytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) weight in `fmt`; where cols is no multiple of its block (640
    is none of 256), IQ4_NL, the fallback llama-quantize takes for the IQ formats."""
    f = quant.get(fmt)
    if cols % f.block_elems:
        f = quant.get("IQ4_NL")
    return rows * (cols // f.block_elems) * f.block_bytes


def flash_next(experts: str = "IQ3_XXS", dense: str = "Q8_0") -> ModelShape:
    """Qwen3.8-Flash-Next at its real shapes (REFERENCE.md section 3): 48 layers, hidden
    2560, 512 experts of 640 top-10, 12 gated-attention layers (24 q heads with an output
    gate, 2 kv heads, head dim 256, a QSA indexer of 4 x 128), 36 DeltaNet layers (16 k
    heads, 48 v heads of 128), 4 hyper-connection streams, the PLE table of 320,001,536
    rows x 160 at layer 1 in IQ4_NL (90 B a row), vocabulary 248,320 (embedding IQ3_S and
    output Q5_K, as llama-quantize's IQ3 mixes write them). Dense weights in `dense`; the
    experts' down projections (640 wide) fall back to IQ4_NL as llama-quantize's do."""
    H, L, E, I = 2560, 48, 512, 640
    layers = []
    for i in range(L):
        if (i + 1) % 4 == 0:  # gated attention + indexer
            rows = 24 * 256 * 2 + 2 * 256 * 2 + 4 * 128 + 128
            proj = _nbytes(dense, rows, H) + _nbytes(dense, H, 24 * 256)
        else:                 # gated DeltaNet: q, k, v, z, beta, alpha in; out
            rows = 2 * 16 * 128 + 48 * 128 + 48 * 128 + 2 * 48
            proj = _nbytes(dense, rows, H) + _nbytes(dense, H, 48 * 128)
        moe = _nbytes(dense, E + 2 * I + 1, H) + _nbytes(dense, H, I)  # router, shared expert
        hc = 2 * (_nbytes("F32", 64 + 4, 4 * H) + _nbytes("F32", 4 * H, 64))
        ple = 2 * _nbytes(dense, H, 16 * 160) if i == 1 else 0
        layers.append(proj + moe + hc + ple)
    expert = _nbytes(experts, 2 * I, H) + _nbytes(experts, H, I)
    return ModelShape(
        name=f"Qwen3.8-Flash-Next ({experts} experts, {dense} dense weights)", n_layers=L, n_experts=E,
        top_k=10, expert_bytes=expert, layer_bytes=layers,
        embedding_bytes=_nbytes("IQ3_S", 248320, H), embedding_row_bytes=_nbytes("IQ3_S", 1, H),
        output_bytes=_nbytes("Q5_K", 248320, H), kv_bytes_per_token=12 * 2 * 2 * 256 * 2,
        ple_layer=1, ple_rows=320_001_536, ple_row_bytes=_nbytes("IQ4_NL", 1, 160), dim=H, streams=4,
        vocab=248320)


SHAPES = {"flash-next": flash_next}


def shape_of(g) -> ModelShape:
    """The shape of a GGUF file's model (a GGUFFile)."""
    a = g.arch
    L = int(g.get(f"{a}.block_count", 0))
    layer_bytes, expert_total = [0] * L, 0
    for name, t in g.tensors.items():
        m = EXPERT_TENSOR.match(name)
        if m:
            expert_total += t.nbytes
        elif name.startswith("blk.") and int(name.split(".")[1]) < L:
            layer_bytes[int(name.split(".")[1])] += t.nbytes
    E = int(g.get(f"{a}.expert_count", 0))
    emb = g.tensors.get(TOKEN_EMBD)
    ple = g.tensors.get(PLE_TABLE)
    out = sum(t.nbytes for n, t in g.tensors.items()
              if not n.startswith("blk.") and n not in (TOKEN_EMBD, PLE_TABLE))
    kv_heads = int(g.get(f"{a}.attention.head_count_kv", 0))
    head_dim = int(g.get(f"{a}.attention.key_length", 0) or
                   int(g.get(f"{a}.embedding_length", 0)) // max(int(g.get(f"{a}.attention.head_count", 1)), 1))
    rec = g.get(f"{a}.attention.recurrent_layers")
    n_attn = L - sum(bool(r) for r in rec) if rec is not None else (L // 4 if a == "qwen4exp" else L)
    ple_layers = g.get(f"{a}.ple.layers") or []
    return ModelShape(
        name=str(g.get("general.name", g.path.name)), n_layers=L, n_experts=E,
        top_k=int(g.get(f"{a}.expert_used_count", 0)),
        expert_bytes=expert_total // max(E * L, 1), layer_bytes=layer_bytes,
        embedding_bytes=emb.nbytes if emb is not None else 0,
        embedding_row_bytes=int(emb.data.shape[-1]) if emb is not None else 0, output_bytes=out,
        kv_bytes_per_token=n_attn * 2 * kv_heads * head_dim * 2,
        ple_layer=int(ple_layers[0]) if len(ple_layers) else None,
        ple_rows=ple.shape[0] if ple is not None else 0,
        ple_row_bytes=int(ple.data.shape[-1]) if ple is not None else 0,
        dim=int(g.get(f"{a}.embedding_length", 0)), streams=int(g.get(f"{a}.hyper_connection.count", 1) or 1),
        vocab=emb.shape[0] if emb is not None else 0,
        on_drive=all(in_file(t) for t in g.tensors.values()))


def size_text(n: float, digits: int = 1) -> str:
    """Bytes as MiB, or KiB below one MiB."""
    return f"{n / 2**20:.{digits}f} MiB" if n >= 2**20 else f"{n / 1024:.{digits}f} KiB"


@dataclass
class Machine:
    gpus: int
    gpu_bytes: int      # each
    ram_bytes: int      # free host RAM
    reserve_bytes: int  # kept free a GPU

    def describe(self) -> str:
        return (f"{self.gpus} x {gib(self.gpu_bytes)} GPU{'s' if self.gpus > 1 else ''} "
                f"({gib(self.reserve_bytes)} kept free each), {gib(self.ram_bytes)} host RAM")


@dataclass
class Placement:
    shape: ModelShape
    machine: Machine
    ctx: int
    gpu_layers: list[range]
    gpu_dense: list[int]                 # per GPU: dense weights + output + KV
    expert_tier: str                     # an --experts spec
    slots: int                           # cached experts a layer (n_experts when resident)
    expert_backing: str                  # "vram", "host" or "drive"
    ple_where: str                       # "vram", "ram", "drive" or "none"
    why: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return min(1.0, self.slots / self.shape.n_experts) if self.shape.n_experts else 1.0

    @property
    def fetch_bytes(self) -> int:
        """VRAM a GPU keeps for the experts a prompt fetches (a cache tier's), or 0."""
        return prompt_fetch_bytes(self.shape) if self.expert_backing != "vram" else 0

    def per_token(self) -> tuple[float, float]:
        """(PCIe bytes, drive bytes) a decoded token moves."""
        s = self.shape
        misses = (1 - self.hit_rate) * s.n_layers * s.top_k * s.expert_bytes
        pcie = misses + s.embedding_row_bytes
        drive = misses if self.expert_backing == "drive" else 0.0
        if self.ple_where in ("ram", "drive"):
            pcie += PLE_ROWS_PER_TOKEN * s.ple_row_bytes
        if self.ple_where == "drive":
            drive += PLE_ROWS_PER_TOKEN * max(PAGE, s.ple_row_bytes)
        return pcie, drive

    def lines(self) -> list[str]:
        s, m = self.shape, self.machine
        usable = m.gpu_bytes - m.reserve_bytes
        out = [f"placement of {s.name} on {m.describe()}, context {self.ctx:,} tokens:"]
        for i, (lr, dense) in enumerate(zip(self.gpu_layers, self.gpu_dense)):
            held = dense + self.slots * s.expert_bytes * len(lr) + self.fetch_bytes
            if self.ple_where == "vram" and s.ple_layer in lr:
                held += s.ple_bytes
            out.append(f"  GPU {i}: layers {lr.start}-{lr.stop - 1}: dense weights, KV{' and output' if i == m.gpus - 1 else ''} "
                       f"{gib(dense)}, experts {gib(self.slots * s.expert_bytes * len(lr))}"
                       f"{f', a prompt fetching experts {gib(self.fetch_bytes)}' if self.fetch_bytes else ''}"
                       f"{', PLE table ' + gib(s.ple_bytes) if self.ple_where == 'vram' and s.ple_layer in lr else ''}"
                       f" = {gib(held)} of {gib(usable)}")
        exp = ("none (a dense model)" if not s.n_experts else
               f"resident in VRAM ({s.n_experts} a layer)" if self.expert_backing == "vram" else
               f"--experts {self.expert_tier}: {self.slots} of {s.n_experts} slots a layer in VRAM, misses from "
               + ("pinned host RAM" if self.expert_backing == "host" else "the drive"))
        out.append(f"  experts {gib(s.experts_total)} ({s.expert_bytes / 2**20:.2f} MiB each, "
                   f"{s.n_layers} layers x {s.n_experts}, top-{s.top_k}): {exp}")
        ple = {"vram": f"in VRAM on the GPU of layer {s.ple_layer}", "ram": "--ple-io ram: in host RAM, locked",
               "drive": "--ple-io direct: read from the drive, a page a row", "none": "none"}[self.ple_where]
        if s.ple_rows:
            out.append(f"  PLE table {gib(s.ple_bytes)} ({s.ple_rows:,} rows x {s.ple_row_bytes} B): {ple}")
        host = (s.experts_total if self.expert_backing == "host" else 0) + (s.ple_bytes if self.ple_where == "ram" else 0)
        out.append(f"  host RAM: {gib(host)} held of {gib(m.ram_bytes)}; token embedding {gib(s.embedding_bytes)} "
                   f"mapped (a row a token)")
        pcie, drive = self.per_token()
        out.append(f"  a decoded token moves {size_text(pcie)} over PCIe and reads {size_text(drive)} "
                   f"from the drive" + (f" (expert hit rate {self.hit_rate:.1%} if routing spreads evenly: "
                                        f"real routing is skewed, so it hits more)" if s.n_experts else ""))
        out += [f"  why: {w}" for w in self.why]
        return out


def this_machine(device: str = "cuda", reserve_mib: int = 1024, gpu_gib: float | None = None,
                 ram_gib: float | None = None) -> Machine:
    """The machine the engine runs on: the GPU's free memory as torch reports it, free RAM;
    `gpu_gib`, `ram_gib`: this many instead (a larger card held to a smaller one's budget)."""
    from strata.storage.io import mem_available
    if gpu_gib:
        gpu = int(gpu_gib * GiB)
    else:
        import torch
        gpu = torch.cuda.mem_get_info(torch.device(device))[0]
    ram = int(ram_gib * GiB) if ram_gib else (mem_available() or 0)
    return Machine(1, gpu, ram, reserve_mib * 2**20)


def prompt_fetch_bytes(s: ModelShape) -> int:
    """The experts of one layer that a prompt's PREFILL_TOKENS tokens route to, at most all
    of them: what a cache tier fetches into VRAM for a batch longer than a decode step."""
    return min(s.n_experts, PREFILL_TOKENS * s.top_k) * s.expert_bytes


def _in_memory_needs_ram(s: ModelShape, part: str, need: int, ram: int) -> None:
    """A part that fits neither VRAM nor RAM is read from the drive, which a model made in
    memory does not have: it stops here, not at the first read."""
    if not s.on_drive:
        raise ValueError(f"{s.name} is made in memory, with no file to read from: its {part} ({gib(need)}) "
                         f"need the VRAM or 90% of the host RAM left ({gib(max(ram, 0))}); give more --ram, "
                         f"a larger --gpu-mem, or a smaller model (flash-shape:LAYERS, --rows)")


def place(shape: ModelShape, machine: Machine, ctx: int = 32768, pack_exists: bool = False) -> Placement:
    """The placement (see the module's docstring for the rules)."""
    s, m = shape, machine
    usable = m.gpu_bytes - m.reserve_bytes
    per = -(-s.n_layers // m.gpus)
    runs = [range(i * per, min(s.n_layers, (i + 1) * per)) for i in range(m.gpus)]
    runs = [r for r in runs if len(r)]
    kv = s.kv_bytes_per_token * ctx
    dense = []
    for i, r in enumerate(runs):
        d = sum(s.layer_bytes[j] for j in r) + kv * len(r) // max(s.n_layers, 1)
        if i == len(runs) - 1:
            d += s.output_bytes
        dense.append(d)
    why = []
    worst = max(dense)
    if worst > usable:
        raise ValueError(f"{s.name} does not fit {m.describe()}: a GPU's share of the dense weights, KV and "
                         f"output is {gib(worst)}, more than its {gib(usable)}; use more GPUs (--gpus) or "
                         f"a smaller context")
    # experts: what the fullest GPU has left, per layer it holds
    room = min(usable - d for d in dense)
    slots = min(s.n_experts, int(room // max(s.expert_bytes * per, 1))) if s.n_experts else 0
    # a cache leaves room for the experts a batch longer than a decode step fetches, a layer
    # at a time (a prompt's PREFILL_TOKENS tokens route to nearly all of them)
    fetch = prompt_fetch_bytes(s)
    if slots < s.n_experts:  # (a card too small for both keeps one slot: its prompts fetch what they can)
        slots = max(min(slots, 1), int((room - fetch) // max(s.expert_bytes * per, 1)))
    if not s.n_experts:
        tier, backing = "device", "vram"
    elif slots >= s.n_experts:
        tier, backing = "device", "vram"
        why.append(f"all experts fit beside the dense weights ({gib(s.experts_total)} in {len(runs)} GPUs' "
                   f"{gib(room * len(runs))} left)")
    else:
        if s.experts_total <= 0.9 * m.ram_bytes:
            backing, src = "host", "host"
            why.append(f"{slots} of {s.n_experts} experts a layer fit the VRAM left ({gib(room)} a GPU, "
                       f"{gib(fetch)} of it kept for a prompt's fetched experts); all experts fit 90% of the "
                       f"host RAM, so misses come from pinned RAM over PCIe")
        else:
            _in_memory_needs_ram(s, "experts", s.experts_total, m.ram_bytes)
            backing, src = "drive", ("packed" if pack_exists else "file")
            why.append(f"{slots} of {s.n_experts} experts a layer fit the VRAM left ({gib(room)} a GPU, "
                       f"{gib(fetch)} of it kept for a prompt's fetched experts); the "
                       f"experts ({gib(s.experts_total)}) do not fit 90% of the host RAM, so misses are read "
                       f"from the drive ({'the pack' if pack_exists else 'the GGUF in place; `strata pack` makes one read an expert'}; "
                       f"counted as all missing the page cache, which keeps some)")
        tier = f"cache:{slots}:{src}"
    ple = "none"
    if s.ple_rows:
        ple_gpu = next((i for i, r in enumerate(runs) if s.ple_layer in r), 0)
        left = usable - dense[ple_gpu] - slots * s.expert_bytes * len(runs[ple_gpu])
        ram_left = m.ram_bytes - (s.experts_total if backing == "host" else 0)
        if backing == "vram" and s.ple_bytes <= left:
            ple = "vram"
            why.append(f"the PLE table ({gib(s.ple_bytes)}) fits the VRAM left on GPU {ple_gpu} ({gib(left)})")
        elif s.ple_bytes <= 0.9 * ram_left:
            ple = "ram"
            why.append(f"the PLE table fits 90% of the RAM left ({gib(ram_left)}): rows gathered on the host, "
                       f"{PLE_ROWS_PER_TOKEN} a token over PCIe")
        else:
            _in_memory_needs_ram(s, "PLE table", s.ple_bytes, ram_left)
            ple = "drive"
            why.append(f"the PLE table ({gib(s.ple_bytes)}) fits neither VRAM nor the RAM left "
                       f"({gib(max(ram_left, 0))}): its rows are read from the drive, announced a step ahead")
    return Placement(s, m, ctx, runs, dense, tier, s.n_experts if backing == "vram" else slots, backing, ple, why)
