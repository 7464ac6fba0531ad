"""flash-shape: Qwen3.8-Flash-Next at its real widths, random but valid, written straight to
GGUF (no checkpoint, no transformers). It measures movement, not meaning: what the expert
tiers and the PLE table read from the drive when the model is larger than the machine's
RAM, at the sizes a real release has.

`write_flash_shape(out_dir, layers, rows, tokenizer_gguf)` writes, as the releases lay
them out (REFERENCE.md section 3):

    <stem>-00001-of-00002.gguf      everything but the PLE table
    <stem>-00002-of-00002.gguf      the PLE table alone (found by strata.storage.ple_source
                                    through the shard set)
    mtp-<stem>-00001-of-00002.gguf  the MTP block, as `strata convert` writes it (the
                                    loader's sidecar)

The widths (REFERENCE.md section 3; one table, `REAL`): hidden 2560 in 4 hyper-connection
streams, layer i full attention when (i+1) % 4 == 0 (24 q heads with an output gate, 2 kv
heads, head dim 256, partial RoPE of 64 dims, a QSA indexer of 4 heads x 128 in blocks of 4,
top 2048), the others gated DeltaNet (16 k heads, 48 v heads, head dim 128, conv kernel 4);
every layer 512 experts of 640, top-10, and a shared expert of 640 with a sigmoid gate; the
n-gram PLE block at layer index 1 (layer 0 when there is only one layer) with the full
table of 320,001,536 rows x 160; vocabulary 248,320; the MTP block a full-attention layer
after the last. The hyper-connections' rank is 64, as strata.storage.placement's shape of
the model takes it (the released config is not at hand; transformers' class default is
320, which would add about 6 MB a layer).

Formats, and why:
- routed experts IQ3_XXS (gate, up), down IQ4_NL: a down row is 640 weights, no whole
  256-weight IQ3 block, and llama-quantize falls back to IQ4_NL for such rows;
- PLE table IQ4_NL (90 B a row, 26.8 GiB at the real count), the releases' format;
- token embedding IQ3_S, as llama-quantize's IQ3 mixes write it (a row is 1100 B, read a
  page at a time from the mapping);
- every other matrix (attention, DeltaNet, shared experts, hyper-connections, PLE
  projections, MTP projection, lm_head) Q4_0: on the CPU with bf16 compute torch's int4
  kernel keeps Q4_0 at 4 bits a weight (strata.nn.linear), so the resident part of the
  model stays small in RAM and the drive's reads are the experts' and the table's;
- the routers (`ffn_gate_inp`, `ffn_gate_inp_shexp`) and the QSA indexer's projections
  F32, as llama.cpp's converter and llama-quantize leave them (strata.quantize's
  _NOT_QUANTIZED): a projection then mixes formats as a released file's does;
- norms, conv kernels and the DeltaNet's decay constants F32.

Random but valid: quantized blocks are random bytes (every byte pattern of these formats
decodes to finite values) with their fp16 scales set so that a matrix's weights have an
RMS of 1/sqrt(fan_in) and a mean of zero (a projection of a unit-RMS input stays near
unit RMS, so the layers stay finite in bf16, and the routers spread the tokens over the
experts as evenly as the plan assumes: 60-63 of 64 experts met by 24 tokens in every one
of 4 layers); embeddings and PLE rows 0.02 (transformers' initializer_range); norm
weights 1 + N(0, 0.02); conv kernels U(-0.5, 0.5) (torch's default for a depthwise
kernel of 4); ssm_a = -U(1, 16) and dt_bias 1, as transformers draws them. Each tensor
draws from its own generator (seed, its name, and a quantized tensor's piece:
strata.convert.flash_shape_blocks), so no tensor's bytes depend on another's, the pieces
are made on every core at once, and the model built in memory
(strata.convert.flash_shape_memory) holds the written files' bytes. Data is made and written piece by piece (the PLE table is larger than RAM);
written pages are flushed and dropped from the page cache as the write goes, so the
write neither fills the cache nor leaves the files warm for a measurement.
"""
from __future__ import annotations

import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType, LlamaFileType, TokenType

import quant
from strata.gguf import open_gguf
from strata.names import qwen4exp as n
from strata.storage import io
from triton_kernels.ple import ngram_constants

from .flash_shape_blocks import tensor_pieces
from .writer import Progress, write_streamed

U16, U32, I32, U64, F32, BOOL, STR = (GGUFValueType.UINT16, GGUFValueType.UINT32, GGUFValueType.INT32,
                                      GGUFValueType.UINT64, GGUFValueType.FLOAT32, GGUFValueType.BOOL,
                                      GGUFValueType.STRING)

# Qwen3.8-Flash-Next's numbers (REFERENCE.md section 3)
REAL = {
    "hidden": 2560, "streams": 4, "hc_rank": 64, "vocab": 248_320, "context": 262_144,
    "heads": 24, "kv_heads": 2, "head_dim": 256, "rope_dim": 64, "rope_theta": 1e7,
    "rope_sections": [11, 11, 10, 0], "eps": 1e-6,
    "idx_heads": 4, "idx_dim": 128, "idx_top_k": 2048, "idx_ratio": 4,
    "k_heads": 16, "v_heads": 48, "ssm_dim": 128, "conv": 4,
    "experts": 512, "top_k": 10, "expert_dim": 640, "shared_dim": 640,
    "ple_rows": 320_001_536, "ple_row": 160, "ngram": 3, "heads_per_ngram": 8, "ple_conv": 4,
    "full_every": 4,
}
FORMATS = {"experts": "IQ3_XXS", "experts_down": "IQ4_NL", "ple": "IQ4_NL", "embedding": "IQ3_S",
           "dense": "Q4_0", "vector": "F32"}
SEED = 0
EMBED_STD = 0.02
DROP_EVERY = 1 << 30  # flush and drop the written pages this often


@dataclass(frozen=True)
class Spec:
    """One tensor to write: name, format name, logical shape (torch order) and how its
    values are drawn: ("normal", std), ("norm",) 1 + N(0, 0.02), ("uniform", bound),
    ("ssm_a",) -U(1, 16), ("ones",)."""
    name: str
    fmt: str
    shape: tuple[int, ...]
    init: tuple

    @property
    def nbytes(self) -> int:
        f = quant.get(self.fmt)
        return int(np.prod(self.shape[:-1], dtype=np.int64)) * f.row_bytes(self.shape[-1])


@dataclass(frozen=True)
class Shape:
    """What a flash-shape file set holds: `layers` layers, `rows` PLE rows, and the counts
    a test may shrink (`experts`, `top_k`, `vocab`); every width is REAL's."""
    layers: int = 4
    rows: int = REAL["ple_rows"]
    experts: int = REAL["experts"]
    vocab: int = REAL["vocab"]
    top_k: int = REAL["top_k"]

    def __post_init__(self):
        if self.layers < 1:
            raise ValueError(f"--layers {self.layers}: at least 1")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top-k {self.top_k} of {self.experts} experts: 1 to {self.experts}")
        least = ngram_constants(self.vocab, ngram_vocab_size_base=2).rows
        if self.rows < least:
            raise ValueError(f"--rows {self.rows:,}: the PLE table needs at least {least} rows (16 heads "
                             f"of distinct primes, padded to 128)")

    def recurrent(self, i: int) -> bool:
        return (i + 1) % REAL["full_every"] != 0

    @property
    def ple_layer(self) -> int:
        # the real model's PLE layer is index 1; a one-layer model keeps it on layer 0
        return min(1, self.layers - 1)

    @property
    def stem(self) -> str:
        rows = "" if self.rows == REAL["ple_rows"] else f"-{self.rows}rows"
        counts = "" if (self.experts, self.top_k, self.vocab) == (REAL["experts"], REAL["top_k"], REAL["vocab"]) \
            else f"-{self.experts}x{self.top_k}-{self.vocab}v"
        return f"flash-shape-{self.layers}l{rows}{counts}"

    def paths(self, out_dir: Path) -> tuple[Path, Path, Path]:
        """(first shard, the PLE shard, the MTP sidecar)."""
        main = out_dir / f"{self.stem}-00001-of-00002.gguf"
        return main, out_dir / f"{self.stem}-00002-of-00002.gguf", n.mtp_sidecar(main)


# --- the tensors ---------------------------------------------------------------------------

def _mat(name: str, rows: int, cols: int, fmt: str = FORMATS["dense"]) -> Spec:
    return Spec(name, fmt, (rows, cols), ("normal", 1 / math.sqrt(cols)))


def _vec(name: str, size: int, init=("norm",)) -> Spec:
    return Spec(name, FORMATS["vector"], (size,), init)


def _hc(prefix: str, inject: bool) -> list[Spec]:
    c, h = REAL, n.hc(prefix)
    sh = c["streams"] * c["hidden"]
    out = [_vec(h["norm"], sh), _mat(h["down"], c["hc_rank"], sh), _mat(h["up"], sh, c["hc_rank"])]
    return out + ([_mat(h["inject"], c["streams"], sh)] if inject else [])


def _deltanet(i: int) -> list[Spec]:
    c, d = REAL, {k: n.blk(i, v) for k, v in n.DELTANET.items()}
    H, key, value = c["hidden"], c["k_heads"] * c["ssm_dim"], c["v_heads"] * c["ssm_dim"]
    return [_mat(d["qkv"], 2 * key + value, H), _mat(d["gate"], value, H), _mat(d["beta"], c["v_heads"], H),
            _mat(d["alpha"], c["v_heads"], H), Spec(d["conv"], FORMATS["vector"], (2 * key + value, c["conv"]),
                                                    ("uniform", 1 / math.sqrt(c["conv"]))),
            _vec(d["dt_bias"], c["v_heads"], ("ones",)), _vec(d["a"], c["v_heads"], ("ssm_a",)),
            _vec(d["norm"], c["ssm_dim"]), _mat(d["out"], H, value)]


def _attention(i: int) -> list[Spec]:
    c, a = REAL, {k: n.blk(i, v) for k, v in n.ATTENTION.items()}
    H, q, kv = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    return [_mat(a["q"], 2 * q, H), _mat(a["k"], kv, H), _mat(a["v"], kv, H),  # q rows: [q | gate] a head
            _vec(a["q_norm"], c["head_dim"]), _vec(a["k_norm"], c["head_dim"]),
            _mat(a["idx_q"], c["idx_heads"] * c["idx_dim"], H, FORMATS["vector"]),
            _mat(a["idx_k"], c["idx_dim"], H, FORMATS["vector"]),
            _vec(a["idx_q_norm"], c["idx_dim"]), _vec(a["idx_k_norm"], c["idx_dim"]), _mat(a["out"], H, q)]


def _moe(i: int, experts: int) -> list[Spec]:
    c, m = REAL, {k: n.blk(i, v) for k, v in n.MOE.items()}
    H, I, S = c["hidden"], c["expert_dim"], c["shared_dim"]
    exp = (lambda name, rows, cols, fmt: Spec(name, fmt, (experts, rows, cols), ("normal", 1 / math.sqrt(cols))))
    return [_mat(m["router"], experts, H, FORMATS["vector"]),
            exp(m["gate_exps"], I, H, FORMATS["experts"]), exp(m["up_exps"], I, H, FORMATS["experts"]),
            exp(m["down_exps"], H, I, FORMATS["experts_down"]),
            _mat(m["shexp_gate"], S, H), _mat(m["shexp_up"], S, H), _mat(m["shexp_down"], H, S),
            _mat(m["shexp_router"], 1, H, FORMATS["vector"])]


def _ple(i: int) -> list[Spec]:
    c, p = REAL, {k: n.blk(i, v) for k, v in n.PLE.items()}
    H, sh, e = c["hidden"], c["streams"] * c["hidden"], 2 * c["heads_per_ngram"] * c["ple_row"]
    return [_mat(p["key"], sh, e), _mat(p["value"], H, e), _vec(p["norm_key"], sh), _vec(p["norm_query"], sh),
            _vec(p["norm_conv"], sh), Spec(p["conv"], FORMATS["vector"], (sh, c["ple_conv"]),
                                            ("uniform", 1 / math.sqrt(c["ple_conv"])))]


def _layer(s: Shape, i: int, mtp: bool = False) -> list[Spec]:
    recurrent = not mtp and s.recurrent(i)
    specs = _hc(n.blk(i, "hc_attn"), True) + (_deltanet(i) if recurrent else _attention(i))
    if not mtp and i == s.ple_layer:
        specs += _ple(i)
    return specs + _moe(i, s.experts) + _hc(n.blk(i, "hc_ffn"), True)


def tensor_specs(s: Shape) -> tuple[list[Spec], Spec, list[Spec]]:
    """(the first shard's tensors, the PLE table, the MTP sidecar's tensors)."""
    H = REAL["hidden"]
    main = [Spec(n.TOKEN_EMBD, FORMATS["embedding"], (s.vocab, H), ("normal", EMBED_STD))]
    main += _hc(n.OUTPUT_HC, False) + [_mat(n.OUTPUT, s.vocab, H)]
    for i in range(s.layers):
        main += _layer(s, i)
    ple = Spec(n.PLE_TABLE, FORMATS["ple"], (s.rows, REAL["ple_row"]), ("normal", EMBED_STD))
    L, m = s.layers, {k: n.blk(s.layers, v) for k, v in n.MTP.items()}
    mtp = [_mat(m["eh_proj"], H, 2 * H), _vec(m["enorm"], H), _vec(m["hnorm"], H), _vec(m["head_norm"], H)]
    return main, ple, mtp + _layer(s, L, mtp=True)


# --- metadata ------------------------------------------------------------------------------

def ple_constants(vocab: int, rows: int):
    """The n-gram hash constants for a table of `rows` rows: the real ones (the primes from
    20,000,000 on) when they fit, else those of the largest prime base whose padded total
    fits, so that every hashed id lands inside the table."""
    real = ngram_constants(vocab)
    if real.rows <= rows:
        return real
    lo, hi = 2, max(2, rows // (2 * REAL["heads_per_ngram"]))  # padded totals grow with the base
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ngram_constants(vocab, ngram_vocab_size_base=mid).rows <= rows:
            lo = mid
        else:
            hi = mid - 1
    return ngram_constants(vocab, ngram_vocab_size_base=lo)


def _tokenizer(tokenizer_gguf: Path, vocab: int) -> tuple[list[tuple], int]:
    """The tokenizer metadata of `tokenizer_gguf`, its token list padded to `vocab` with
    `[PAD<id>]` tokens typed UNUSED (llama.cpp's converter pads a vocabulary so), and its eos id."""
    g = open_gguf(tokenizer_gguf)
    md = {k: v for k, v in g.typed_metadata().items() if k.startswith("tokenizer.")}
    tokens, ttype = md["tokenizer.ggml.tokens"][0], md["tokenizer.ggml.token_type"]
    if len(tokens) > vocab:
        raise ValueError(f"{tokenizer_gguf}: {len(tokens)} tokens do not fit a vocabulary of {vocab}")
    md["tokenizer.ggml.tokens"] = (list(tokens) + [f"[PAD{i}]" for i in range(len(tokens), vocab)], STR)
    md["tokenizer.ggml.token_type"] = (list(ttype[0]) + [int(TokenType.UNUSED)] * (vocab - len(tokens)), ttype[1])
    return [(k, v, t) for k, (v, t) in md.items()], int(md["tokenizer.ggml.eos_token_id"][0])


def metadata(s: Shape, eos: int, mtp: bool = False) -> list[tuple]:
    """The `qwen4exp.*` keys the loader reads (and llama.cpp's converter writes), with the
    real values; `mtp`: the sidecar's (one more block, full attention)."""
    c, a = REAL, n.ARCH
    L = s.layers + (1 if mtp else 0)
    rec = [s.recurrent(i) for i in range(s.layers)] + ([False] if mtp else [])
    ratios = [0 if r else c["idx_ratio"] for r in rec]
    k = ple_constants(s.vocab, s.rows)
    md = [("general.type", "model", STR), ("general.name", f"Flash-Shape {s.layers}L", STR),
          (f"{a}.block_count", L, U32), (f"{a}.context_length", c["context"], U32),
          (f"{a}.embedding_length", c["hidden"], U32), (f"{a}.attention.head_count", c["heads"], U32),
          (f"{a}.attention.head_count_kv", c["kv_heads"], U32),
          (f"{a}.rope.dimension_sections", c["rope_sections"], I32), (f"{a}.rope.freq_base", c["rope_theta"], F32),
          (f"{a}.attention.layer_norm_rms_epsilon", c["eps"], F32), (f"{a}.expert_count", s.experts, U32),
          (f"{a}.expert_used_count", s.top_k, U32), (f"{a}.attention.key_length", c["head_dim"], U32),
          (f"{a}.attention.value_length", c["head_dim"], U32),
          ("general.file_type", int(LlamaFileType.MOSTLY_IQ3_XXS), U32),
          (f"{a}.expert_feed_forward_length", c["expert_dim"], U32),
          (f"{a}.expert_shared_feed_forward_length", c["shared_dim"], U32),
          (f"{a}.ssm.conv_kernel", c["conv"], U32), (f"{a}.ssm.state_size", c["ssm_dim"], U32),
          (f"{a}.ssm.group_count", c["k_heads"], U32), (f"{a}.ssm.time_step_rank", c["v_heads"], U32),
          (f"{a}.ssm.inner_size", c["v_heads"] * c["ssm_dim"], U32),
          (f"{a}.attention.recurrent_layers", rec, BOOL), (f"{a}.full_attention_interval", c["full_every"], U32),
          (f"{a}.rope.dimension_count", c["rope_dim"], U32), (f"{a}.hyper_connection.count", c["streams"], U32),
          (f"{a}.hyper_connection.low_rank", c["hc_rank"], U32),
          (f"{a}.attention.indexer.head_count", c["idx_heads"], U32),
          (f"{a}.attention.indexer.key_length", c["idx_dim"], U32),
          (f"{a}.attention.indexer.top_k", c["idx_top_k"], U32),
          (f"{a}.attention.compress_ratios", ratios, I32), (f"{a}.ple.layers", [s.ple_layer], I32),
          (f"{a}.ple.ngram_size", c["ngram"], U32), (f"{a}.ple.heads_per_ngram", c["heads_per_ngram"], U32),
          (f"{a}.ple.conv_kernel", c["ple_conv"], U32), (f"{a}.ple.eos_token_id", eos, U32),
          (f"{a}.embedding_length_per_layer_input", c["ple_row"], U32),
          (f"{a}.ple.layer_multipliers", list(k.multipliers), U64),
          (f"{a}.ple.head_offsets", list(k.head_offsets), U64),
          (f"{a}.ple.head_vocab_sizes", list(k.head_vocab_sizes), U64)]
    if mtp:
        md.append((f"{a}.nextn_predict_layers", 1, U32))
    md.append(("general.quantization_version", 2, U32))
    return md


def _split(no: int, tensors: int) -> list[tuple]:
    # gguf-split's keys: which shard this is, of how many, and the tensors of the whole set
    return [("split.no", no, U16), ("split.count", 2, U16), ("split.tensors.count", tensors, I32)]


# --- writing -------------------------------------------------------------------------------

class _Written:
    """Bytes written to one file: its pages flushed and dropped from the page cache every
    DROP_EVERY bytes (so that the write neither fills the cache with 30 GB of dirty pages
    nor leaves the files cached for a measurement), and a progress line every 2% of a file
    of more than 4 GiB."""

    def __init__(self, partial: Path, total: int, quiet: bool, stream=None):
        self.partial, self.total = partial, total
        self.talk = not quiet and total > 4 << 30
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.done = self.dropped = self.said = 0

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.done - self.dropped >= DROP_EVERY:
            io.drop_cache(self.partial)
            self.dropped = self.done
        if not self.talk or self.done - self.said < self.total // 50:
            return
        self.said = self.done
        dt = time.perf_counter() - self.t0
        rate = self.done / dt if dt else 0.0
        left = (self.total - self.done) / rate if rate else 0.0
        self.stream.write(f"strata: flash-shape: {self.partial.name.removesuffix('.partial')} "
                          f"{self.done / 2**30:6.2f} of {self.total / 2**30:.2f} GiB ({self.done / self.total:4.0%}), "
                          f"{rate / 1e9:.2f} GB/s, {left:.0f} s left\n")
        self.stream.flush()


def _write(path: Path, md: list[tuple], specs: list[Spec], seed: int, quiet: bool) -> Path:
    infos = [(s.name, s.shape, quant.get(s.fmt)) for s in specs]
    total = sum(s.nbytes for s in specs)
    progress = Progress(f"strata: {path.name}", len(specs), total, enabled=not quiet)
    written = _Written(path.with_name(path.name + ".partial"), total, quiet)  # write_streamed's until done
    out = write_streamed(path, n.ARCH, md, infos, lambda i: tensor_pieces(specs[i], seed, on_piece=written),
                         progress)
    io.drop_cache(out)
    return out


def write_flash_shape(out_dir: str | Path, layers: int = 4, rows: int = REAL["ple_rows"], *,
                      tokenizer_gguf: str | Path, experts: int = REAL["experts"], top_k: int = REAL["top_k"],
                      vocab: int = REAL["vocab"], seed: int = SEED, quiet: bool = False) -> Path:
    """Write the flash-shape file set into `out_dir` and return its first shard. The
    tokenizer is `tokenizer_gguf`'s (padded to the vocabulary: the model's text means
    nothing). `experts`, `top_k` and `vocab` are counts a test may shrink; every width is real."""
    s = Shape(layers, rows, experts, vocab, top_k)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    main_path, ple_path, mtp_path = s.paths(out_dir)
    main, ple, mtp = tensor_specs(s)
    tok, eos = _tokenizer(Path(tokenizer_gguf), s.vocab)
    free = shutil.disk_usage(out_dir).free
    need = sum(x.nbytes for x in (*main, ple, *mtp))
    if need > free:
        raise ValueError(f"{out_dir}: flash-shape needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB are free; "
                         f"pass another directory, or fewer --layers / --rows")
    if not quiet:
        print(f"strata: flash-shape: writing {need / 1e9:.1f} GB ({s.layers} layers, {s.rows:,} PLE rows) "
              f"into {out_dir}", file=sys.stderr)
    md = metadata(s, eos)
    _write(mtp_path, metadata(s, eos, mtp=True), mtp, seed, quiet)
    _write(ple_path, md[:2] + _split(1, len(main) + 1), [ple], seed, quiet)
    # the first shard last: a set whose first shard exists is complete
    _write(main_path, md + _split(0, len(main) + 1) + tok, main, seed, quiet)
    return main_path
