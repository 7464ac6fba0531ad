"""The n-gram PLE (per-layer embedding) of qwen4exp: hash tokens to table rows, gather rows.

    ngram_ids(tokens, history, multipliers, head_vocab_sizes, head_offsets, eos_id,
              heads_per_ngram=8) -> (ids int64 [T, n_heads], new_history)
    ple_gather(table, ids, fmt, scale=None, out_dtype=torch.float32) -> [T, n_heads * D]
    ngram_constants(vocab_size, ...) -> NgramConstants: the hash constants from config values

Hash (transformers' Qwen4ExpTextNGramEmbedding, 5.23). For token t_i of a sequence and
shift p, s_p = t_{i-p}, except that it reads EOS when position i-p lies before the sequence
start or when an EOS sits anywhere in t_{i-p} .. t_{i-1} (a document boundary cuts the
n-gram; s_0 = t_i itself, even an EOS). For n-gram size n = 2 .. ngram_size:

    mix_n = (s_0 * m_0) ^ (s_1 * m_1) ^ ... ^ (s_{n-1} * m_{n-1})    wrapping int64
    id[i, h] = floor_mod(mix_n, size_h) + offset_h   for each of the n-gram's heads h

with heads ordered bigram heads first (heads_per_ngram of them), then trigram heads, ...
The hash only looks back ngram_size - 1 tokens, so a stream is hashed chunk by chunk by
carrying those raw tokens (`history`, EOS-filled at the sequence start) from one call to
the next; any split of a stream gives the ids of the whole.

Gather. The table is raw bytes, uint8 [R, row_bytes], row r = D values in `fmt`; `ids`
[T, H] (T tokens, H heads) picks rows, and the output puts a token's rows side by side,
head-major:

    out[t] = | deq(table[ids[t,0]]) * scale | deq(table[ids[t,1]]) * scale | ... |
               <-------- D -------->

`scale` is the safetensors tables' global `weight_scale`, multiplied in float32. `ids` may
be a strided view (an expanded column repeats a token's row, read where it lies).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import quant

from . import configs
from .asm import asm_for, cvt_pairs
from .backend import is_fake, use_triton
from .host_memory import host_readable
from .decode import decoder, launch_args, unit, unit_table
from .decode import table as decode_table
from .decode.common import round_to_bf16_bits
from .decode.split import block_ptr
from .dequant import OUT_DTYPES, check_blocks, dequantize_torch, store_units

IntsLike = Sequence[int] | torch.Tensor
# (token, head) rows a program of the gather; units a program where the format has them
PLE_BLOCK_ROWS = 16
PLE_UNITS_BLOCK = 128

# --- constants ----------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _primes_after(start: int):
    n = start
    while True:
        n += 1
        if _is_prime(n):
            yield n


@dataclass(frozen=True)
class NgramConstants:
    """The hash constants of one PLE layer; GGUF stores them as metadata (`ple.layer_multipliers`,
    `ple.head_vocab_sizes`, `ple.head_offsets`)."""
    multipliers: tuple[int, ...]       # one per n-gram position: ngram_size of them
    head_vocab_sizes: tuple[int, ...]  # each head's prime modulus
    head_offsets: tuple[int, ...]      # each head's first row in the shared table
    rows: int                          # table rows, padded to the divisor
    heads_per_ngram: int

    @property
    def ngram_size(self) -> int:
        return len(self.multipliers)

    @property
    def n_heads(self) -> int:
        return len(self.head_vocab_sizes)


def ngram_constants(vocab_size: int, *, ngram_size: int = 3, heads_per_ngram: int = 8,
                    ngram_vocab_size_base: int = 20_000_000, make_divisible_by: int = 128,
                    seed: int = 1234, ple_layer_index: int = 0) -> NgramConstants:
    """The constants transformers derives from the config (`vocab_size`, `ngram_size`,
    `heads_per_ngram`, `ngram_vocab_size_base`, `make_ngram_vocab_size_divisible_by`, `seed`)
    for the `ple_layer_index`-th PLE layer (0 for the first entry of `ple_layer_ids`)."""
    # Multipliers odd and below (2^63 - 1) / vocab_size, so that an in-vocabulary token times
    # a multiplier never wraps.
    half = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + 10007 * ple_layer_index
    mults = tuple(2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1
                  for i in range(ngram_size))
    # Each head's modulus is the next prime >= the base, continuing across layers: layer k's
    # heads take the primes after those of layers 0 .. k-1.
    n_heads = (ngram_size - 1) * heads_per_ngram
    primes = _primes_after(ngram_vocab_size_base - 1)
    for _ in range(ple_layer_index * n_heads):
        next(primes)
    sizes = tuple(next(primes) for _ in range(n_heads))
    offsets = tuple(sum(sizes[:h]) for h in range(n_heads))
    rows = -(-sum(sizes) // make_divisible_by) * make_divisible_by
    return NgramConstants(mults, sizes, offsets, rows, heads_per_ngram)


# --- hash ---------------------------------------------------------------------------------

@triton.jit
def _joined(hist_ptr, tok_ptr, j, live, CONTEXT: tl.constexpr):
    """Token j of the CONTEXT carried tokens followed by the new ones."""
    carried = j < CONTEXT
    a = tl.load(hist_ptr + j, mask=live & carried, other=0)
    b = tl.load(tok_ptr + (j - CONTEXT), mask=live & (j >= CONTEXT), other=0)
    return tl.where(carried, a, b).to(tl.int64)


@triton.jit(do_not_specialize=["eos_id"])
def _ngram_ids_kernel(hist_ptr, tok_ptr, mult_ptr, size_ptr, offset_ptr, out_ptr, next_ptr, n_tokens, eos_id,
                      CONTEXT: tl.constexpr, HEADS_PER_NGRAM: tl.constexpr,
                      N_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, BLOCK: tl.constexpr,
                      CONTEXT_P2: tl.constexpr):
    # The carried tokens (hist_ptr) and the new ones (tok_ptr) read as one sequence in
    # which token t stands at CONTEXT + t: every look-back of up to CONTEXT places stays
    # inside it, and only the first program (BLOCK >= CONTEXT) reads the carried ones.
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK + tl.arange(0, BLOCK)
    live = t < n_tokens
    h = tl.arange(0, HEADS_P2)
    head_live = h < N_HEADS
    group = h // HEADS_PER_NGRAM  # head h hashes an n-gram of group + 2 tokens
    mix = tl.load(tok_ptr + t, mask=live, other=0).to(tl.int64) * tl.load(mult_ptr)
    # `intact`: no EOS among the tokens passed so far (t-1 .. t-p+1), so t-p is still readable
    intact = live
    picked = tl.zeros([BLOCK, HEADS_P2], dtype=tl.int64)
    for p in tl.static_range(1, CONTEXT + 1):
        src = _joined(hist_ptr, tok_ptr, CONTEXT + t - p, live, CONTEXT)
        shifted = tl.where(intact, src, eos_id)
        intact = intact & (src != eos_id)
        mix = mix ^ (shifted * tl.load(mult_ptr + p))  # int64 multiply wraps, as torch's
        picked = tl.where(group[None, :] == p - 1, mix[:, None], picked)
    size = tl.load(size_ptr + h, mask=head_live, other=1)
    offset = tl.load(offset_ptr + h, mask=head_live, other=0)
    # `%` truncates toward zero (C's, and LLVM's srem); torch.remainder floors: a negative
    # mix (a wrapped product) needs one more modulus added.
    r = picked % size[None, :]
    r = tl.where(r < 0, r + size[None, :], r)
    tl.store(out_ptr + t[:, None] * N_HEADS + h[None, :], r + offset[None, :],
             mask=live[:, None] & head_live[None, :])
    if pid == 0:  # the next call's history: the last CONTEXT tokens of the sequence
        i = tl.arange(0, CONTEXT_P2)
        nxt = _joined(hist_ptr, tok_ptr, n_tokens + i, i < CONTEXT, CONTEXT)
        # next_ptr may be hist_ptr itself (written in place): every lane has read the old
        # history before any lane writes it
        tl.debug_barrier()
        tl.store(next_ptr + i, nxt, mask=i < CONTEXT)


def _hash_args(tokens, history, multipliers, head_vocab_sizes, head_offsets, eos_id, heads_per_ngram,
               in_place=False):
    """Validated int64 tensors on the tokens' device: (history, tokens, mults, sizes, offsets)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype.is_floating_point:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"ngram_ids: tokens must be a 1-D integer tensor (one sequence), got {shape}")
    dev = tokens.device
    mults, sizes, offsets = (torch.as_tensor(v, dtype=torch.int64, device=dev).reshape(-1)
                             for v in (multipliers, head_vocab_sizes, head_offsets))
    context = mults.numel() - 1
    if context < 1:
        raise ValueError(f"ngram_ids: {mults.numel()} multipliers; give one per n-gram position "
                         f"(ngram_size >= 2)")
    n_heads = context * heads_per_ngram
    if sizes.numel() != n_heads or offsets.numel() != n_heads:
        raise ValueError(f"ngram_ids: head_vocab_sizes has {sizes.numel()} entries and head_offsets "
                         f"{offsets.numel()}; with {context + 1} multipliers and heads_per_ngram="
                         f"{heads_per_ngram} both need {n_heads}")
    if not sizes.is_cuda and not is_fake(sizes) and bool((sizes <= 0).any()):
        raise ValueError(f"ngram_ids: head_vocab_sizes must be positive, got {sizes.tolist()}")
    if history is None and in_place:
        raise ValueError("ngram_ids: in_place writes the next history into `history`; give one")
    if history is None:  # the sequence starts here
        history = torch.full((context,), eos_id, dtype=torch.int64, device=dev)
    if (not isinstance(history, torch.Tensor) or history.shape != (context,)
            or history.dtype.is_floating_point):
        shape = tuple(history.shape) if isinstance(history, torch.Tensor) else type(history).__name__
        raise ValueError(f"ngram_ids: history must be the previous {context} tokens (1-D, integer; "
                         f"None at a sequence start), got {shape}")
    if history.device != dev:
        raise ValueError(f"ngram_ids: history is on {history.device}, tokens on {dev}")
    if in_place and (history.dtype != torch.int64 or not history.is_contiguous()):
        raise ValueError(f"ngram_ids: in_place needs a contiguous int64 history, got {history.dtype} "
                         f"with stride {history.stride()}")
    # the kernel reads both where they lie, element after element
    return history.to(torch.int64).contiguous(), tokens.to(torch.int64).contiguous(), mults, sizes, offsets


def ngram_ids(tokens: torch.Tensor, history: torch.Tensor | None, multipliers: IntsLike,
              head_vocab_sizes: IntsLike, head_offsets: IntsLike, eos_id: int,
              heads_per_ngram: int = 8, *, block: int = 64, in_place: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ids [T, n_heads] of tokens [T] following `history` (the ngram_size - 1 tokens before
    them, None at a sequence start); returns the history for the next call too: a new tensor,
    or with `in_place` `history` itself, overwritten (a decode graph's held buffer). The
    constants may be sequences of ints; int64 tensors already on the tokens' device save a
    copy a call."""
    history, tokens, mults, sizes, offsets = _hash_args(tokens, history, multipliers, head_vocab_sizes,
                                                        head_offsets, eos_id, heads_per_ngram, in_place)
    if not use_triton(tokens):
        ids, nxt = _ngram_ids_torch(torch.cat([history, tokens]), mults, sizes, offsets, eos_id, heads_per_ngram)
        return (ids, history.copy_(nxt)) if in_place else (ids, nxt)
    context, n_heads, n = mults.numel() - 1, sizes.numel(), tokens.numel()
    if block < context:
        raise ValueError(f"ngram_ids: block {block} is under the history's {context} tokens")
    out = torch.empty((n, n_heads), dtype=torch.int64, device=tokens.device)
    nxt = history if in_place else torch.empty_like(history)
    # one launch (no cat): the kernel reads the history and the tokens where they lie
    _ngram_ids_kernel[(max(1, triton.cdiv(n, block)),)](
        history, tokens, mults, sizes, offsets, out, nxt, n, eos_id, CONTEXT=context,
        HEADS_PER_NGRAM=heads_per_ngram, N_HEADS=n_heads,
        HEADS_P2=triton.next_power_of_2(n_heads), BLOCK=block, CONTEXT_P2=triton.next_power_of_2(context))
    return out, nxt


def ngram_ids_torch(tokens: torch.Tensor, history: torch.Tensor | None, multipliers: IntsLike,
                    head_vocab_sizes: IntsLike, head_offsets: IntsLike, eos_id: int,
                    heads_per_ngram: int = 8, *, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    history, tokens, mults, sizes, offsets = _hash_args(tokens, history, multipliers, head_vocab_sizes,
                                                        head_offsets, eos_id, heads_per_ngram, in_place)
    ids, nxt = _ngram_ids_torch(torch.cat([history, tokens]), mults, sizes, offsets, eos_id, heads_per_ngram)
    return (ids, history.copy_(nxt)) if in_place else (ids, nxt)


def _ngram_ids_torch(hist, mults, sizes, offsets, eos_id, heads_per_ngram):
    context = mults.numel() - 1
    n = hist.numel() - context
    eos = torch.tensor(eos_id, dtype=torch.int64, device=hist.device)
    mix = hist[context:] * mults[0]
    intact = torch.ones(n, dtype=torch.bool, device=hist.device)
    mixes = []
    for p in range(1, context + 1):
        src = hist[context - p:context - p + n]
        mix = mix ^ (torch.where(intact, src, eos) * mults[p])
        intact = intact & (src != eos)
        mixes.append(mix)
    picked = torch.stack(mixes, dim=1).repeat_interleave(heads_per_ngram, dim=1)  # [T, n_heads]
    return torch.remainder(picked, sizes) + offsets, hist[-context:]  # (a view of the joined tokens)


# --- gather -------------------------------------------------------------------------------

@triton.jit
def _id_at(k, heads, id_st, id_sh, STRIDED: tl.constexpr):
    """Where pair k = t * heads + h's id lies: at k itself in contiguous ids, else by their
    strides (an expanded view's 0 repeats a token's id with no copy)."""
    out = k
    if STRIDED:
        out = (k // heads) * id_st + (k % heads) * id_sh
    return out


@triton.jit
def _ple_gather_kernel(q_ptr, tab_ptr, ids_ptr, scale_ptr, out_ptr, n_rows, heads, id_st, id_sh,
                       DECODE: tl.constexpr, QK: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                       ROW_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                       HAS_SCALE: tl.constexpr, OUT_BF16: tl.constexpr, STRIDED: tl.constexpr = False):
    # One program gathers BLOCK_ROWS (token, head) pairs; pair k = t * H + h lands at
    # out[k * ROW_DIM:], which is the head-major layout of out[t].
    pid = tl.program_id(0).to(tl.int64)
    k = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    k_live = k < n_rows
    row = tl.load(ids_ptr + _id_at(k, heads, id_st, id_sh, STRIDED), mask=k_live, other=0)
    j = tl.arange(0, DIM_P2)
    mask = k_live[:, None] & (j < ROW_DIM)[None, :]
    # rows are whole blocks, so block b of table row r is block r * ROW_BLOCKS + b overall
    blk = row[:, None] * ROW_BLOCKS + (j // QK)[None, :]
    jj = tl.broadcast_to((j % QK)[None, :], (BLOCK_ROWS, DIM_P2))
    v = DECODE(q_ptr, tab_ptr, blk, jj, mask)
    if HAS_SCALE:
        v = v * tl.load(scale_ptr)
    dst = out_ptr + k[:, None] * ROW_DIM + j[None, :]
    if OUT_BF16:
        tl.store(dst, round_to_bf16_bits(v), mask=mask)
    else:
        tl.store(dst, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ple_gather_units_kernel(q_ptr, tab_ptr, ids_ptr, scale_ptr, out_ptr, n_units, heads, id_st, id_sh,
                             UNIT: tl.constexpr, UW: tl.constexpr, UPB: tl.constexpr,
                             BLOCK_HW: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
                             BODY: tl.constexpr, ROW_UNITS: tl.constexpr, BLOCK: tl.constexpr,
                             HAS_SCALE: tl.constexpr, OUT: tl.constexpr, ASM: tl.constexpr,
                             CVT: tl.constexpr = True, STRIDED: tl.constexpr = False):
    # Formats with int8 units: a lane decodes one unit of one (token, head) row; unit v is
    # unit v % ROW_UNITS of pair v // ROW_UNITS, whose values land at out[v * UW:]
    v = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = v < n_units
    v = tl.where(live, v, 0)
    pair = v // ROW_UNITS
    ur = v % ROW_UNITS
    row = tl.load(ids_ptr + _id_at(pair, heads, id_st, id_sh, STRIDED))
    p = block_ptr(q_ptr, row * (ROW_UNITS // UPB) + ur // UPB, BLOCK_HW, BODY)
    words, a, b = UNIT(p, (ur % UPB).to(tl.int32), tab_ptr, ASM)
    scale = tl.load(scale_ptr) if HAS_SCALE else 1.0
    store_units(out_ptr + v * UW, words, a, b, live, scale, UW, ZERO, OFFSET, HAS_SCALE, OUT, ASM, CVT)


def _gather_args(table, ids, fmt, out_dtype, bound=None):
    fmt = quant.get(fmt)
    check_blocks(table, fmt)
    if table.dim() != 2:
        raise ValueError(f"ple_gather: table must be 2-D uint8 [rows, row_bytes] of {fmt.name} "
                         f"rows, got shape {tuple(table.shape)}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"ple_gather: ids must be an integer tensor [tokens, heads], got {shape}")
    if ids.device != table.device and not (ids.is_cuda and host_readable(table)):
        raise ValueError(f"ple_gather: ids are on {ids.device}, the table on {table.device}; "
                         f"move the ids to the table's device (or pin a host table: a GPU reads it there)")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"ple_gather: out_dtype must be float32, float16 or bfloat16, not {out_dtype}")
    rows = table.shape[0]
    if bound is not None and not 0 <= bound <= rows:
        raise ValueError(f"ple_gather: ids below {bound} do not all name rows of a table of {rows}")
    if bound is not None:  # in range by the caller's construction (the hash's heads): nothing to check
        pass
    elif ids.numel() and ids.is_cuda:  # checked on the device: a step never waits to read ids
        # 0 <= id < rows exactly where id // rows == 0 (floor division): a launch fewer
        torch._assert_async((ids // rows == 0).all(),
                            f"ple_gather: a row id is out of range for a table of {rows} rows")
    elif ids.numel() and not is_fake(ids):  # a fake tensor (torch.compile's trace) has no values
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()
        if lo < 0 or hi >= rows:
            bad = ids[(ids < 0) | (ids >= rows)][0].item()
            t, h = ((ids == bad).nonzero()[0]).tolist()
            raise IndexError(f"ple_gather: row id {bad} (ids[{t}, {h}]) is out of range for a "
                             f"table of {rows} rows; ids must lie in [0, {rows})")
    return fmt, table.shape[1] // fmt.block_bytes * fmt.block_elems


def ple_gather(table: torch.Tensor, ids: torch.Tensor, fmt: str | quant.Format, *,
               scale: float | torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
               block_rows: int = PLE_BLOCK_ROWS, bound: int | None = None) -> torch.Tensor:
    """[T, H * D]: for each token, its H rows of `table` dequantized and laid side by side.
    bound: the ids are known to lie in [0, bound) (the n-gram hash's heads make them so),
    bound <= the table's rows, checked on the host: no check of the ids themselves (on a
    GPU an asynchronous assert of four launches). ids may be any strided view: an
    `expand`ed column gathers a token's row H times side by side with no copy (Qwen4Exp's
    embedding into its hyper-connection streams)."""
    fmt, dim = _gather_args(table, ids, fmt, out_dtype, bound)
    if not use_triton(ids):
        return ple_gather_torch(table, ids, fmt, scale=scale, out_dtype=out_dtype, bound=bound)
    if not table.is_contiguous():
        # never copied here: the table can be tens of GB
        raise ValueError(f"ple_gather: the {fmt.name} table must be contiguous (rows laid end to "
                         f"end), got strides {table.stride()}")
    n_tok, n_heads = ids.shape
    # the rows land where the ids are: a pinned host table is read over PCIe by the GPU
    dev = ids.device
    out = torch.empty((n_tok, n_heads * dim), dtype=out_dtype, device=dev)
    n = ids.numel()
    if n:
        ids = ids.to(torch.int64)  # (a copy only of narrower ids: a strided view is read as it lies)
        where = (n_heads, *ids.stride())  # where pair t * H + h's id lies (_id_at)
        strided = not ids.is_contiguous()
        dst = out.view(torch.int16) if out_dtype == torch.bfloat16 else out
        s = (torch.as_tensor(scale, dtype=torch.float32, device=dev).reshape(1)
             if scale is not None else out)  # unused without a scale
        u = unit(fmt)
        if u is not None:
            row_units = dim // u.weights
            n_units = n * row_units
            _ple_gather_units_kernel[(triton.cdiv(n_units, PLE_UNITS_BLOCK),)](
                table.view(-1).view(torch.uint16), unit_table(fmt, dev),
                ids, s, dst, n_units, *where, **launch_args(fmt, u), STRIDED=strided,
                ROW_UNITS=row_units, BLOCK=PLE_UNITS_BLOCK, HAS_SCALE=scale is not None,
                OUT="bf16" if out_dtype == torch.bfloat16 else "", ASM=asm_for(dev), CVT=cvt_pairs(dev),
                enable_fp_fusion=False)
            return out
        _ple_gather_kernel[(triton.cdiv(n, block_rows),)](
            table, decode_table(fmt, dev), ids, s, dst, n, *where, STRIDED=strided,
            DECODE=decoder(fmt), QK=fmt.block_elems, ROW_BLOCKS=dim // fmt.block_elems,
            ROW_DIM=dim, DIM_P2=triton.next_power_of_2(dim), BLOCK_ROWS=block_rows,
            HAS_SCALE=scale is not None, OUT_BF16=out_dtype == torch.bfloat16,
            enable_fp_fusion=False,  # the decode's float steps round as numpy's do
            num_warps=configs.num_warps("ple_gather", fmt.name, dev))
    return out


def ple_gather_torch(table: torch.Tensor, ids: torch.Tensor, fmt: str | quant.Format, *,
                     scale: float | torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.float32, bound: int | None = None) -> torch.Tensor:
    fmt, dim = _gather_args(table, ids, fmt, out_dtype, bound)
    rows = table.index_select(0, ids.reshape(-1).to(torch.int64))
    v = dequantize_torch(rows, fmt)
    if scale is not None:
        v = v * torch.as_tensor(scale, dtype=torch.float32, device=v.device).reshape(())
    return v.to(out_dtype).reshape(ids.shape[0], ids.shape[1] * dim)
