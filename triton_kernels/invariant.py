"""Batch-invariant numerics: a row's result depends on that row alone, never on how many
rows share the call or where the row sits among them.

A CPU GEMM (oneDNN, MKL) picks its algorithm, blocking and reduction order from the
shape: measured here, row 0 of a bf16 (M, 1536) @ (1536, 256) equals the M = 1 result for
M <= 32 and M >= 256, not for M = 63..128. So a prompt prefilled in chunks of 64 and the
same prompt in one chunk of 512 round differently, and greedy decoding can take another
branch; so can a request decoded beside three others. The cure (the batch-invariant
kernels vLLM and SGLang added on GPUs do the same with fixed tiles): every call has one
shape. `mm` multiplies in tiles of ROWS rows (a short last one padded as `rows` says), and
a fixed-shape GEMM computes each row the same way wherever it sits in the tile
(tests/triton_kernels/test_invariant.py checks both on the machine it runs on). On the GPU
path triton_kernels.qmatmul and .moe take one kernel and one tile for any rows instead.

Where it is on (the model's modules ask `enabled()` on every call):
- everywhere with `STRATA_BATCH_INVARIANT=1` or after `set_enabled(True)`
  (`--batch-invariant`, the server's default);
- by default, in the decode steps of a model that can speculate (an MTP head) alone: the
  runtime runs each of its one-token steps and speculative verifies `with decoding():`,
  so a verify's row computes as the one-token step at its position would, and greedy
  `--spec N` gives `--spec 0`'s tokens in any dtype (tests/strata/test_spec.py). Prefill
  keeps the plain GEMMs, which cost it least, and so does a model without a draft head;
- nowhere with `STRATA_BATCH_INVARIANT=0` or after `set_enabled(False)`
  (`--no-batch-invariant`): a decode's plain steps (compiled on the CPU, where they may be:
  triton_kernels.cpu.compiled), and greedy `--spec N` keeps `--spec 0`'s tokens only where a
  row's rounding does not move with the batch (float32). The other
order-dependent steps switch with it: strata.nn.deltanet runs its recurrence token by
token (a chunk's WY form sums in another order than single steps), strata.nn.gated_
attention attends through the sparse path also within the budget (the dense SDPA and the
gathered path order their sums differently), and `scores` below gives QSA's indexer
fixed-shape products, and `pointwise` runs the narrow activations (a gate a token, a
decay a head) through the same vector code for any number of tokens.
"""
from __future__ import annotations

import itertools
import os
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# rows a GEMM call: prefill pays a call per ROWS rows, decode its one row padded to the
# fewest rows the probe accepts (measured in bench model --batch-invariant)
ROWS = 8
# outputs compared for each size a probe tries, and rows at most (`_exact_size`)
PROBE, PROBE_ROWS = 1 << 16, 1 << 13
# block keys a call of the indexer's scores
BLOCKS = 64
# elements a pointwise call is padded to a multiple of: ATen's vector loops run the last
# (numel mod 2 vectors) elements through scalar code (std::exp, not the vector exp, and they
# round differently); 64 is two AVX-512 vectors of bfloat16, a multiple of every CPU's
VEC = 64

def _from_env() -> bool | None:
    v = os.environ.get("STRATA_BATCH_INVARIANT", "").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    return None


# True: everywhere; False: nowhere; None (the default): in decode steps (`decoding`), on
# the thread that runs them
_setting: bool | None = _from_env()
_local = threading.local()


def enabled() -> bool:
    """Whether the calls made now (on this thread) are batch-invariant."""
    return _setting is True or (_setting is None and getattr(_local, "decoding", False))


def decode_steps() -> bool:
    """Whether decode steps run batch-invariant (everywhere, or by default)."""
    return _setting is not False


def setting() -> bool | None:
    return _setting


def set_enabled(on: bool | None) -> None:
    """True: everywhere; False: nowhere; None: decode steps alone (the default)."""
    global _setting
    _setting = None if on is None else bool(on)


@contextmanager
def batch_invariant(on: bool | None = True):
    """`with batch_invariant():` the model's calls inside are batch-invariant (`on` as
    `set_enabled` takes it)."""
    before = _setting
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(before)


@contextmanager
def decoding(on: bool = True):
    """A decode step (a one-token step, a server's batched step, a speculative verify or
    draft) of a model that can speculate (`on`: the runtime passes whether it has a draft
    head); batch-invariant unless the process set it off."""
    before = getattr(_local, "decoding", False)
    _local.decoding = bool(on)
    try:
        yield
    finally:
        _local.decoding = before


def rows(f, x: torch.Tensor, key=None) -> torch.Tensor:
    """f applied to x (M, K) in calls of ROWS rows, joined: for a row-wise f (a matmul by a
    weight), row i of the result is the same for any M and any offset of the row in x.

    The last, short call of m rows is padded with zeros to the fewest rows (m or more, and
    never one) that a probe showed f computes as a full call computes them (`key` names f's
    kind and shapes for the probe's memo; None: pad to ROWS). Measured on CPUs: bfloat16
    GEMMs and the int4 kernel compute any short call's rows alike on AVX2, float32 ones all
    but a single row (a GEMV, which sums in another order): decode's one row then costs two
    rows, not ROWS. With AVX-512 and bfloat16 dot products, bfloat16 ones with K > 1024 all
    but a single row, and float32 ones calls of 4 rows and more. A single row is never
    taken: on a CPU with AMX a one-row bfloat16 call of K = 36 agreed with the full call in
    one process's probe and not in another's, so a probe cannot vouch for it."""
    M = x.shape[0]
    m = M % ROWS
    size = ROWS if not m else (_exact_size(f, x, key, m) if key is not None else ROWS)
    pad = size - m if m else 0
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    if M + pad <= ROWS:  # one call (a decode step's row): no joining
        y = f(x)
        return y[:M] if pad else y
    return torch.cat([f(x[a:a + ROWS]) for a in range(0, M + pad, ROWS)])[:M]


_sizes: dict = {}


def _exact_size(f, x: torch.Tensor, key, m: int) -> int:
    """The fewest rows n >= m (n <= ROWS) whose calls compute each of their rows bit for bit
    as a ROWS-row call does, on random rows like x (shapes, not values, choose a GEMM's
    algorithm); memoised by (key, dtype, K, device), each n probed when first asked.

    The probe's rows sit at every position of the n-row calls and of the ROWS-row ones, and
    there are rows enough that each n compares PROBE outputs (PROBE_ROWS rows at most): a
    low-precision output hides most of a changed summation order. Measured on an AVX-512 CPU
    with bfloat16 dot products: oneDNN's one-row bfloat16 GEMV for K > 1024 sums in another
    order than its GEMM, and 1.5e-4 of the bfloat16 outputs show it (13 of 65536), so one
    tile of 8 rows passed it and a one-token step parted from a speculative verify's row."""
    k = (key, x.dtype, tuple(x.shape[1:]), x.device)
    ok = _sizes.setdefault(k, {ROWS: True})
    for n in range(max(m, 2), ROWS + 1):  # never one row (see `rows`)
        if n not in ok:
            # calls from each multiple of n, and the last n rows (a ROWS-row probe holds
            # one call of n rows at its start and one at its end)
            ok[n] = all(torch.equal(f(t[a:a + n]), whole[a:a + n]) for t, whole in _probe_rows(f, x)
                        for a in [*range(0, len(t) - n + 1, n), len(t) - n])
        if ok[n]:
            return n
    return ROWS


def _probe_rows(f, x: torch.Tensor):
    """(rows, f's result in calls of ROWS rows) in chunks, random rows like x, the same each
    time (regenerated, not held: a narrow f's probe takes thousands of rows)."""
    chunk, done = ROWS, 0
    for c in itertools.count():
        g = torch.Generator().manual_seed(c)
        t = torch.randn(chunk, *x.shape[1:], generator=g).to(x.dtype).to(x.device)
        whole = torch.cat([f(t[a:a + ROWS]) for a in range(0, chunk, ROWS)])
        yield t, whole
        done += chunk
        width = max(whole[0].numel(), 1)
        if done * width >= PROBE or done >= PROBE_ROWS:
            return
        # the next chunk: the rows still wanting, in a multiple of ROWS, 32 ROWS at most
        chunk = min(-(-(-(-PROBE // width) - done) // ROWS), 32) * ROWS


def pointwise(f, x: torch.Tensor) -> torch.Tensor:
    """f(x) for an elementwise f (sigmoid, softplus, exp) on a narrow tensor, (T, a few):
    when enabled, through a flat buffer padded to a multiple of VEC, so that every element
    runs f's vector code whatever T (see VEC). Wide rows (a multiple of VEC) need none."""
    if not enabled():
        return f(x)
    flat = x.reshape(-1).contiguous()  # (T, 1) column views reshape to strided rows
    n = flat.numel()
    pad = (-n) % VEC
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return f(flat)[:n].view(x.shape)


def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K).T, batch-invariant (`rows`)."""
    wt = w.T
    return rows(lambda t: t @ wt, x, key=("mm", tuple(w.shape), w.dtype))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T: `mm` when enabled, the plain product otherwise (a GEMM whose M follows the
    batch, as an expert's token count does)."""
    return mm(x, w) if enabled() else x @ w.T


def scores(q: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """QSA's indexer products relu(q . b) summed over the heads, float32 (T, nb), from
    (n_idx, T, d) queries and (nb, d) block keys, in calls of ROWS queries x BLOCKS keys
    (the last of each padded): query t's score against block b is the same whatever T,
    nb, or the positions of t and b among them."""
    n_idx, T, d = q.shape
    nb = blocks.shape[0]
    tp, bp = (-T) % ROWS, (-nb) % BLOCKS
    qf = F.pad(q.float(), (0, 0, 0, tp))                       # (n_idx, T', d)
    kf = F.pad(blocks.float(), (0, 0, 0, bp))                  # (nb', d)
    out = torch.empty(T + tp, nb + bp, dtype=torch.float32, device=q.device)
    for a in range(0, T + tp, ROWS):
        qa = qf[:, a:a + ROWS].reshape(n_idx * ROWS, d)
        for b in range(0, nb + bp, BLOCKS):
            s = (qa @ kf[b:b + BLOCKS].T).view(n_idx, ROWS, BLOCKS).relu_()
            torch.sum(s, dim=0, out=out[a:a + ROWS, b:b + BLOCKS])
    return out[:T, :nb]
