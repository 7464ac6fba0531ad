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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from strata.names import OUTPUT
from strata.perplexity import (
    LogitsModel,
    chunk_logits,
    iter_chunks,
    n_chunks_of,
    token_nll,
)

MIN_ROWS = 16  # llama-imatrix skips matmuls of fewer rows


@dataclass
class IMatrix:
    """Raw sums, as the file holds them: `sums[name]` (n_mat, in) and `counts[name]` (n_mat,)."""
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    ppl: float | None = None  # PPL of the chunks, scored as llama-perplexity does

    def mean_sq(self) -> dict[str, np.ndarray]:
        """Mean squared activation per input column, as llama-quantize computes it from the
        file: in_sum2 / count, and 1 where a matrix saw no tokens (an unused expert)."""
        out = {}
        for name, s in self.sums.items():
            c = self.counts[name].astype(np.float32)[:, None]
            m = np.where(c > 0, s / np.where(c > 0, c, 1), np.float32(1)).astype(np.float32)
            out[name] = m[0] if m.shape[0] == 1 else m
        return out


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


# -- the file --------------------------------------------------------------------------------

def write_imatrix(path: str | Path, im: IMatrix) -> Path:
    """imatrix.cpp's save_imatrix layout (see the module docstring)."""
    from gguf import GGUFWriter
    path = Path(path)
    if not im.datasets:  # and gguf-py cannot write an empty array
        raise ValueError(f"write_imatrix({path}): name the text(s) the matrix was computed on in "
                         "IMatrix.datasets: llama-quantize refuses a file without imatrix.datasets")
    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(tmp, arch="")  # gguf-py skips an empty string: no general.architecture, as imatrix.cpp
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", [str(d) for d in im.datasets])
    w.add_uint32("imatrix.chunk_count", im.chunk_count)
    w.add_uint32("imatrix.chunk_size", im.chunk_size)
    for name in sorted(im.sums):
        s = np.ascontiguousarray(im.sums[name], dtype=np.float32)
        if s.ndim != 2 or np.size(im.counts[name]) != s.shape[0]:
            raise ValueError(f"write_imatrix({path}): {name!r} has sums of shape {s.shape} and "
                             f"{np.size(im.counts[name])} counts; (n_mat, in) and n_mat expected")
        c = np.asarray(im.counts[name], dtype=np.float32).reshape(s.shape[0], 1)
        if s.shape[0] == 1:  # ggml writes n_dims without trailing 1s: ne [in] and [1]
            s, c = s[0], c[0]
        w.add_tensor(f"{name}.in_sum2", s)  # torch order (n_mat, in): ne [in, n_mat]
        w.add_tensor(f"{name}.counts", c)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_imatrix(path: str | Path) -> IMatrix:
    """An imatrix GGUF file, from llama-imatrix or `strata imatrix`."""
    from strata.gguf import open_gguf
    g = open_gguf(path)
    if g.get("general.type") != "imatrix":
        raise ValueError(f"{path}: general.type is {g.get('general.type')!r}, not 'imatrix': "
                         "not an importance matrix (llama-imatrix's old .dat format is not read)")
    im = IMatrix(datasets=list(g.get("imatrix.datasets") or []),
                 chunk_count=int(g.get("imatrix.chunk_count", 0)),
                 chunk_size=int(g.get("imatrix.chunk_size", 0)))
    for tname, t in g.tensors.items():
        if not tname.endswith(".in_sum2"):
            continue
        name = tname[:-len(".in_sum2")]
        counts = g.tensors.get(f"{name}.counts")
        if counts is None:
            raise ValueError(f"{path}: tensor {tname!r} has no {name}.counts beside it")
        if t.fmt.name != "F32" or counts.fmt.name != "F32":
            raise ValueError(f"{path}: {tname!r} and {name}.counts must be F32, are "
                             f"{t.fmt.name} and {counts.fmt.name}")
        s = t.numpy().reshape(-1, t.shape[-1])
        c = np.rint(counts.numpy().reshape(-1)).astype(np.int64)
        if c.size != s.shape[0]:
            raise ValueError(f"{path}: {name}.counts has {c.size} entries for {s.shape[0]} matrices")
        im.sums[name], im.counts[name] = s, c
    orphans = [n for n in g.tensors if n.endswith(".counts") and n[:-len(".counts")] not in im.sums]
    if orphans:
        raise ValueError(f"{path}: {orphans[0]!r} has no .in_sum2 beside it")
    if not im.sums:
        raise ValueError(f"{path}: no <weight>.in_sum2 tensors: the importance matrix is empty")
    return im


def load_imatrix(path: str | Path) -> dict[str, np.ndarray]:
    """Weight name (blk.N.ffn_down.weight, ...) -> mean squared activation per input column,
    float32 (in,) (or (n_experts, in)): what llama-quantize hands its quantizers."""
    return read_imatrix(path).mean_sq()
