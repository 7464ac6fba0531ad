"""`strata imatrix`: llama-imatrix's importance matrix, in its GGUF format.

For every weight matrix W (out, in) and every input column j: the sum over the tokens seen
of x_j^2 (x: the activation row W multiplies) and the number of tokens. llama-quantize weighs
each column's rounding error by in_sum2 / count, the mean squared activation (`load_imatrix`).

What llama-imatrix does, mirrored here (tools/imatrix/imatrix.cpp):
- the text is tokenized and chunked as llama-perplexity does (strata.perplexity); every
  token of a chunk is evaluated, and every one counts;
- only weights named `blk.*` are collected (`output.weight` with --process-output; a tied
  output is `token_embd.weight` there, and is never collected);
- matmuls of fewer than 16 rows are skipped (its collect_imatrix: "why are small batches
  ignored (<16 tokens)?"): a chunk's prefill always counts, single-token decodes never;
- the file: general.type = "imatrix", imatrix.datasets (the text files), imatrix.chunk_count,
  imatrix.chunk_size, then per weight, in name order, F32 tensors `<name>.in_sum2` (ne
  [in, n_mat]) and `<name>.counts` (ne [1, n_mat]); n_mat is 1 for a dense weight (ggml then
  writes ne [in] and [1]: trailing 1s are dropped), the expert count for a merged-experts
  one. No general.architecture: gguf_init_empty writes none.

The activations are taken with torch forward pre-hooks on each QuantLinear: registered only
inside `collect()`, so normal inference runs exactly as before (no hook: torch's fast path).
A fused QuantLinear (Q, K and V in one) has one input, shared by the weights it holds, so
each of them gets the same sums. Strata permutes the rows (outputs) of Q and K at load; the
input columns, which the imatrix describes, are in file order.

Routed experts (a MoE layer's merged `ffn_{gate,up,down}_exps`, which llama.cpp multiplies
with MUL_MAT_ID) are collected per expert, as imatrix.cpp does: each (token, expert) pair
the router chose adds the token's input to that expert's row of the sums and 1 to its
count, whatever the batch's size (the 16-row rule is MUL_MAT's alone). Gate and up read the
hidden state the store is given; down reads silu(gate_e x) * up_e x, which the hook
computes in float32 from the expert's weights (the dense tier's own, else the file's blocks
dequantized). The file then holds, per expert tensor, `.in_sum2` ne
[in, n_expert] and `.counts` ne [1, n_expert]; an expert no token reached has count 0 and
llama-quantize weighs its columns alike. The MTP head (blk.N past the trunk, from its own
file) is not collected: llama-imatrix never runs it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from strata.imatrix_file import IMatrix, load_imatrix, read_imatrix, write_imatrix  # noqa: F401 (re-exported)
from strata.names import OUTPUT
from strata.perplexity import (
    LogitsModel,
    chunk_logits,
    iter_chunks,
    n_chunks_of,
    token_nll,
)

MIN_ROWS = 16  # llama-imatrix skips matmuls of fewer rows


class _Stat:
    """Sums on the device the activations are on (summed there, no copy a matmul)."""
    __slots__ = ("count", "n_in", "sums")

    def __init__(self, n_in: int):
        self.n_in, self.sums, self.count = n_in, None, 0

    def add(self, sq: torch.Tensor, rows: int) -> None:
        # not in place: a fused layer's weights share one `sq`
        self.sums = sq if self.sums is None else self.sums + sq
        self.count += rows

    def matrix(self) -> np.ndarray:
        """(1, in): the sums as one matrix of the file."""
        if self.sums is None:
            return np.zeros((1, self.n_in), dtype=np.float32)
        return self.sums.float().cpu().numpy()[None, :]

    def counts(self) -> np.ndarray:
        return np.array([self.count], dtype=np.int64)


class _ExpertStat:
    """A merged-experts tensor's sums, one row per expert, and its per-expert counts."""
    __slots__ = ("count", "sums")

    def __init__(self, n_experts: int, n_in: int, device):
        self.sums = torch.zeros((n_experts, n_in), dtype=torch.float64, device=device)
        self.count = torch.zeros(n_experts, dtype=torch.long)

    def add(self, e: int, sq: torch.Tensor, rows: int) -> None:
        self.sums[e] += sq
        self.count[e] += rows

    def matrix(self) -> np.ndarray:
        return self.sums.float().cpu().numpy()

    def counts(self) -> np.ndarray:
        return self.count.numpy().astype(np.int64)


def expert_rows(t, e: int, device="cpu") -> torch.Tensor:
    """Expert `e`'s matrix of a merged-experts QTensor (E, rows, in), float32 (rows, in)."""
    from strata.tensors import QTensor
    rows = t.data.shape[0] // t.shape[0]
    return QTensor(t.name, t.fmt, tuple(t.shape[1:]), t.data[e * rows:(e + 1) * rows]).dequantize(
        torch.float32, device)


def _gate_up(store, e: int, device) -> torch.Tensor:
    """Expert `e`'s gate and up stacked (2I, H), float32: the dense tier's own weights where it
    holds them, else dequantized from the file's blocks."""
    w13 = getattr(store, "w13", None)
    if w13 is not None:
        return w13[e].to(device=device, dtype=torch.float32)
    if not store.blocks_kept:
        raise ValueError(f"{store.names[0]}: experts made in memory and copied to {store.device} keep no "
                         f"host copy of their blocks to read; compute the importance from a GGUF file")
    gate, up = store.tensors[:2]
    return torch.cat([expert_rows(gate, e, device), expert_rows(up, e, device)])


def _expert_hook(stats: dict, store):
    """The forward pre-hook of an ExpertStore: store(x (T, H), weights (T, k), ids (T, k))."""
    gate_s, up_s, down_s = (stats[n] for n in store.names)

    def hook(_module, args):
        x, _weights, ids = args
        x = x.float().reshape(-1, x.shape[-1])
        k = ids.shape[-1]
        flat = ids.reshape(-1).long().to(x.device)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
        keep = flat >= 0  # -1: an expert another rank holds (--ep)
        flat, token = flat[keep], token[keep]
        counts = torch.bincount(flat, minlength=store.n_experts).cpu()
        sq = x.square().double()[token]  # a row per (token, expert) pair
        for st in (gate_s, up_s):
            st.sums.index_add_(0, flat.to(st.sums.device), sq.to(st.sums.device))
            st.count += counts
        order = torch.argsort(flat, stable=True)
        at = 0
        for e in torch.nonzero(counts).flatten().tolist():
            c = int(counts[e])
            xe = x[token[order[at:at + c]]]
            at += c
            g, u = (xe @ _gate_up(store, e, x.device).T).chunk(2, dim=-1)
            down_s.add(e, (F.silu(g) * u).square().sum(0, dtype=torch.float64), c)
    return hook


def _collected_names(layer, process_output: bool) -> list[str]:
    return [n for n in layer.name.split("+")
            if n.startswith("blk.") or (process_output and n == OUTPUT)]


@contextmanager
def collect(model: torch.nn.Module, process_output: bool = False) -> Iterator[dict[str, _Stat]]:
    """Within the block, every QuantLinear of `model` adds its input's squared columns to
    the dict yielded (weight name -> sums, count); the hooks go when the block ends."""
    from strata.nn import QuantLinear
    from strata.storage.experts import ExpertStore
    stats: dict[str, _Stat | _ExpertStat] = {}
    names_of: dict[torch.nn.Module, list[str]] = {}
    handles = []
    mtp = getattr(model, "mtp", None)
    skip = set(mtp.modules()) if isinstance(mtp, torch.nn.Module) else set()

    def hook(layer, args):
        x = args[0].reshape(-1, layer.in_features)
        if x.shape[0] < MIN_ROWS:
            return
        sq = x.float().square().sum(0, dtype=torch.float64)
        for name in names_of[layer]:
            stats[name].add(sq, x.shape[0])

    for m in model.modules():
        if m in skip:
            continue
        if isinstance(m, ExpertStore):
            for n, t in zip(m.names, m.tensors):
                stats[n] = _ExpertStat(m.n_experts, t.shape[-1], "cpu" if m.device is None else m.device)
            handles.append(m.register_forward_pre_hook(_expert_hook(stats, m)))
            continue
        # a "parts" layer (mixed formats) passes its input to QuantLinears of its own
        if not isinstance(m, QuantLinear) or m.mode == "parts":
            continue
        names = _collected_names(m, process_output)
        if not names:
            continue
        names_of[m] = names
        for n in names:
            stats[n] = _Stat(m.in_features)
        handles.append(m.register_forward_pre_hook(hook))
    if not handles:
        raise ValueError(f"{type(model).__name__} has no QuantLinear weights named blk.*: "
                         "nothing to collect an importance matrix from")
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


def compute_imatrix(model: LogitsModel, tokens, n_ctx: int = 512, n_chunks: int | None = None,
                    bos_id: int | None = None, process_output: bool = False, datasets=(),
                    on_chunk: Callable[[int, float], None] | None = None) -> IMatrix:
    """llama-imatrix over `tokens` (the whole text, tokenized): every chunk evaluated from an
    empty context, its activations summed; the PPL of the chunks comes for free."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = n_chunks_of(len(tokens), n_ctx, n_chunks)
    nlls = []
    with collect(model, process_output) as stats:
        for i, chunk in enumerate(iter_chunks(tokens, n_ctx, n)):
            logits = chunk_logits(model, chunk, bos_id)
            nlls.append(token_nll(logits, torch.as_tensor(chunk[n_ctx // 2 + 1:])))
            if on_chunk:
                on_chunk(i, float(np.exp(np.concatenate(nlls).mean())))
    sums = {k: s.matrix() for k, s in sorted(stats.items())}
    for name, v in sums.items():
        if not np.isfinite(v).all():
            raise ValueError(f"non-finite activations reached {name}; the model overflows on this text")
    return IMatrix(sums=sums,
                   counts={k: s.counts() for k, s in sorted(stats.items())},
                   datasets=list(datasets), chunk_count=n, chunk_size=n_ctx,
                   ppl=float(np.exp(np.concatenate(nlls).mean())))
