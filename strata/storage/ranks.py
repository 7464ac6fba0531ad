"""The plan across ranks (`strata plan MODEL --ep E --pp P`): what each rank holds, the
bytes the ranks send a decoded token and a prefill chunk (strata.dist's collectives:
float32 MoE outputs all-reduced a layer, float32 streams between stages, the last stage's
float32 logits broadcast back), and the interconnect bandwidth at which sending takes as
long as reading the experts a token routes to."""
from __future__ import annotations

from strata.dist import Layout
from strata.storage.placement import ModelShape, gib, size_text

F32 = 4  # bytes of what strata.dist sends: MoE outputs, streams and logits in float32


def _size(n: float) -> str:
    return size_text(n, 2) if n >= 2**20 else size_text(n)


def sent_per_token(s: ModelShape, layout: Layout, rows: int, logits_rows: int = 1) -> float:
    """Bytes every rank together sends for `rows` tokens in one forward (logits of
    `logits_rows` of them): per stage layer, each rank's ring share of the all-reduce; per
    stage boundary, the streams once per share; the logits once per earlier stage."""
    E, P = layout.ep, layout.pp
    allreduce = s.n_layers * E * (2 * (E - 1) / E) * rows * s.dim * F32
    streams = (P - 1) * E * rows * s.streams * s.dim * F32
    logits = (P - 1) * E * logits_rows * s.vocab * F32
    return allreduce + streams + logits


def lines(s: ModelShape, layout: Layout, gpu_bytes: int | None, ctx: int, chunk: int, mem_bw: float) -> list[str]:
    """The plan's lines for every rank of `layout`'s world (rank fields ignored)."""
    E, P = layout.ep, layout.pp
    out = [f"ranks: {s.name} over {E * P} ranks (--ep {E} --pp {P}), context {ctx:,} tokens"]
    worst = 0.0
    for stage in range(P):
        L = Layout(E, P, stage * E, layout.split)
        lr = L.layers(s.n_layers)
        dense = sum(s.layer_bytes[i] for i in lr) + s.kv_bytes_per_token * ctx * len(lr) // max(s.n_layers, 1)
        dense += s.output_bytes if L.last else 0
        experts = [len(Layout(E, P, stage * E + i).experts(s.n_experts)) for i in range(E)]
        held = dense + max(experts) * s.expert_bytes * len(lr)
        if s.ple_layer is not None and s.ple_layer in lr:
            ple = f"; the PLE table ({gib(s.ple_bytes)}) is read by this stage's ranks (RAM or drive)"
        else:
            ple = ""
        fits = "" if gpu_bytes is None else (f" of {gib(gpu_bytes)}: fits" if held <= gpu_bytes else
                                            f" of {gib(gpu_bytes)}: does NOT fit (more ranks, or an expert cache)")
        out.append(f"  stage {stage} (ranks {stage * E}-{stage * E + E - 1}): layers {lr.start}-{lr.stop - 1}; "
                   f"a rank holds dense weights, KV{' and output' if L.last else ''} {gib(dense)} + "
                   f"{max(experts)} of {s.n_experts} experts a layer {gib(max(experts) * s.expert_bytes * len(lr))}"
                   f" = {gib(held)}{fits}{ple}")
        worst = max(worst, held)
    tok = sent_per_token(s, layout, 1)
    pre = sent_per_token(s, layout, chunk)
    out.append(f"  sent a decoded token: {_size(tok)} (all ranks); a prefill chunk of {chunk}: {_size(pre)} "
               f"({_size(pre / chunk)} a token)")
    # the experts a token reads: top-k a layer, spread over the shares; a rank reads its
    # share from memory at mem_bw, the ranks at once
    read_s = s.n_layers * s.top_k / E * s.expert_bytes / mem_bw
    per_rank = tok / (E * P)
    if read_s > 0 and per_rank > 0:
        out.append(f"  break-even link: {per_rank / read_s / 1e9:.1f} GB/s a rank: below it, sending a token "
                   f"({_size(per_rank)} a rank) takes longer than reading its {s.top_k / E:.1f} experts a layer "
                   f"({_size(s.n_layers * s.top_k / E * s.expert_bytes)} a rank) at {mem_bw / 1e9:,.0f} GB/s")
    if P > 1:
        out.append(f"  of that, the logits broadcast is {_size((P - 1) * E * s.vocab * F32)} a token "
                   f"({s.vocab:,} float32 to each earlier stage)")
    return out
