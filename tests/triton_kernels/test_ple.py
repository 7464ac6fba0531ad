"""PLE: n-gram row ids == transformers' for any token stream and any split of it into
chunks; gathered rows == the numpy dequantizer's, bit for bit, for the seven table formats."""
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.tiers import examples
from transformers import DynamicCache, Qwen4ExpTextConfig
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

import quant
from triton_kernels.decode import UNITS
from tests.blocks import blocks, same_bits
from triton_kernels import (
    dequantize,
    dequantize_torch,
    ngram_ids,
    ngram_ids_torch,
    ple_gather,
    ple_gather_torch,
)
from triton_kernels.backend import interpreter_on
from triton_kernels.ple import ngram_constants


def test_the_interpreter_is_on():
    assert interpreter_on()  # else the launchers would test the torch paths twice


# --- hash -------------------------------------------------------------------------------

class _IdsOut(torch.nn.Module):
    """Stands in for the n-gram embedding table: returns the row ids it is asked to look up."""
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0))  # forward() reads .weight.device

    def forward(self, ids):
        return ids.unsqueeze(-1)  # forward() flattens the last two axes: [1, T, heads]


class Setup:
    """One PLE layer of a small transformers config: its NGramEmbedding (table swapped for
    _IdsOut: with embedding_dim 0 its real table, 320M rows for the real constants, holds
    no bytes) and our constants for it."""
    def __init__(self, name, *, vocab, eos, ple_layer_ids=(2,), layer=0, **hash_cfg):
        self.name, self.vocab, self.eos = name, vocab, eos
        self.cfg = Qwen4ExpTextConfig(vocab_size=vocab, eos_token_id=eos, num_hidden_layers=4,
                                      hidden_size=64, ple_layer_ids=list(ple_layer_ids), ple_embed_dim=144,
                                      **hash_cfg)
        self.layer_idx = self.cfg.ple_layer_ids[layer] - 1
        self.module = hf.Qwen4ExpTextNGramEmbedding(self.cfg, 0, self.layer_idx, layer)
        self.rows = self.module.ngram_embedding.num_embeddings  # its padded row count
        self.module.ngram_embedding = _IdsOut()
        self.consts = ngram_constants(
            vocab, ngram_size=self.cfg.ngram_size, heads_per_ngram=self.cfg.heads_per_ngram,
            ngram_vocab_size_base=self.cfg.ngram_vocab_size_base,
            make_divisible_by=self.cfg.make_ngram_vocab_size_divisible_by, seed=self.cfg.seed,
            ple_layer_index=layer)

    def hf_ids(self, tokens, cache=None):
        return self.module(tokens[None], cache)[0]

    def args(self):
        c = self.consts
        return c.multipliers, c.head_vocab_sizes, c.head_offsets, self.eos, c.heads_per_ngram


SETUPS = [
    Setup("real", vocab=248320, eos=248044),  # Qwen3.8-Flash-Next's hash
    # SmolLM2's vocabulary, small prime moduli, 4-grams of 3 heads, the second PLE layer
    Setup("small", vocab=49152, eos=0, ple_layer_ids=(2, 3), layer=1, ngram_size=4, heads_per_ngram=3,
          ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=64, seed=7),
]


def test_real_constants():
    c = ngram_constants(248320)
    assert c.multipliers == (23703573157769, 20109073645365, 8052911324071)
    assert c.head_vocab_sizes[0] == 20000003 and c.head_vocab_sizes[-1] == 20000171 and c.n_heads == 16
    assert sum(c.head_vocab_sizes) == 320_001_446 and c.rows == 320_001_536
    assert c.head_offsets[0] == 0 and c.head_offsets[-1] == 320_001_446 - 20000171


@pytest.mark.parametrize("s", SETUPS, ids=lambda s: s.name)
def test_constants_equal_transformers(s):
    m, c = s.module, s.consts
    assert list(c.multipliers) == m.layer_multipliers.tolist()
    assert list(c.head_vocab_sizes) == m.head_vocab_sizes and list(c.head_offsets) == m.head_offsets
    assert c.rows == s.rows


def streams(s):
    """Token streams that stress the EOS rule: EOS often (first, last, in runs), a few tokens
    that repeat (the same n-grams recur), any in-vocabulary token, and rarely any int64 at
    all (wrapping products, negative mixes)."""
    token = st.one_of(st.just(s.eos), st.sampled_from([1, 2, 3, s.vocab - 1]),
                      st.integers(0, s.vocab - 1), st.integers(-2 ** 63, 2 ** 63 - 1))
    return st.lists(token, min_size=1, max_size=24)


@st.composite
def split_stream(draw, s):
    """(tokens, chunk bounds): any split, from one prefill to single-token decode steps."""
    toks = draw(streams(s))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(toks) - 1)), max_size=len(toks))))
    bounds = [0] + [c for c in cuts if c < len(toks)] + [len(toks)]
    return torch.tensor(toks, dtype=torch.int64), list(pairwise(bounds))


@pytest.mark.parametrize("s", SETUPS, ids=lambda s: s.name)
def test_ids_equal_transformers_for_any_stream_and_split(s):
    eos = s.eos

    @given(split_stream(s))
    @settings(max_examples=examples(100))
    @example((torch.tensor([eos]), [(0, 1)]))
    @example((torch.tensor([eos, eos, 5, eos, eos, 7, 8, 9, eos]), [(0, 1), (1, 2), (2, 6), (6, 7), (7, 9)]))
    @example((torch.tensor([5, 6, 7, 8, 9, eos]), [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]))
    def prop(case):
        tokens, chunks = case
        want = s.hf_ids(tokens)
        context = s.consts.ngram_size - 1
        cache, hist, hist_t = DynamicCache(config=s.cfg), None, None
        held = [torch.full((context,), eos) for _ in range(2)]  # a graph's buffers, written in place
        hf_parts, parts, torch_parts, held_parts = [], [], [], []
        for lo, hi in chunks:
            hf_parts.append(s.hf_ids(tokens[lo:hi], cache))
            ids, hist = ngram_ids(tokens[lo:hi], hist, *s.args())
            ids_t, hist_t = ngram_ids_torch(tokens[lo:hi], hist_t, *s.args())
            parts.append(ids)
            torch_parts.append(ids_t)
            for f, buf in zip((ngram_ids, ngram_ids_torch), held):
                ids_h, same = f(tokens[lo:hi], buf, *s.args(), in_place=True)
                assert same is buf and torch.equal(buf, hist)
                held_parts.append(ids_h)
        assert torch.equal(torch.cat(hf_parts), want)  # transformers agrees with itself
        assert torch.equal(torch.cat(parts), want)
        assert torch.equal(torch.cat(torch_parts), want)
        assert torch.equal(torch.cat(held_parts[0::2]), want) and torch.equal(torch.cat(held_parts[1::2]), want)
        assert torch.equal(hist, torch.cat([torch.full((context,), eos), tokens])[-context:])
        assert ((want >= 0) & (want < s.consts.rows)).all()
    prop()


def test_history_is_the_last_raw_tokens_eos_filled_at_the_start():
    s = SETUPS[0]
    _, hist = ngram_ids(torch.tensor([7]), None, *s.args())
    assert hist.tolist() == [s.eos, 7]
    _, hist = ngram_ids(torch.tensor([8, s.eos, 9]), hist, *s.args())
    assert hist.tolist() == [s.eos, 9]


def test_no_tokens_keep_the_history():
    s = SETUPS[0]
    ids, hist = ngram_ids(torch.zeros(0, dtype=torch.int64), torch.tensor([5, 6]), *s.args())
    assert ids.shape == (0, 16) and hist.tolist() == [5, 6]


@pytest.mark.parametrize("fn", [ngram_ids, ngram_ids_torch])
def test_strided_tokens_and_history_hash_as_contiguous_ones(fn):
    """Tokens and a history given as strided views hash as their contiguous copies; a
    history to write in place must be contiguous int64, and the error says so."""
    s = SETUPS[0]
    tokens, history = torch.tensor([5, 0, 7, 0, 9, 0, 11, 0]), torch.tensor([[3, 0], [4, 0]])
    want = fn(tokens[::2].clone(), history[:, 0].clone(), *s.args())
    got = fn(tokens[::2], history[:, 0], *s.args())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].tolist() == [9, 11]
    with pytest.raises(ValueError, match=r"in_place needs a contiguous int64 history"):
        fn(tokens[::2], history[:, 0], *s.args(), in_place=True)


def test_many_programs():
    s = SETUPS[0]
    tokens = torch.randint(0, 40, (300,), generator=torch.Generator().manual_seed(1))
    tokens[tokens < 5] = s.eos
    assert torch.equal(ngram_ids(tokens, None, *s.args(), block=16)[0], s.hf_ids(tokens))


@pytest.mark.parametrize("fn", [ngram_ids, ngram_ids_torch])
def test_hash_bad_arguments(fn):
    m, sizes, offsets, eos, hpn = SETUPS[0].args()
    t = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"history must be the previous 2 tokens .* got \(3,\)"):
        fn(t, torch.tensor([1, 2, 3]), m, sizes, offsets, eos, hpn)
    with pytest.raises(ValueError, match=r"head_vocab_sizes has 15 entries .* both need 16"):
        fn(t, None, m, sizes[:15], offsets, eos, hpn)
    with pytest.raises(ValueError, match=r"tokens must be a 1-D integer tensor"):
        fn(t[None], None, m, sizes, offsets, eos, hpn)


# --- gather -----------------------------------------------------------------------------

PLE_FORMATS = [quant.get(n) for n in ("F32", "F16", "BF16", "FP8_E4M3", "Q8_0", "Q4_0", "IQ4_NL")]
bf16_scales = st.floats(width=32, allow_nan=False, allow_infinity=False).map(
    lambda x: torch.tensor(x).to(torch.bfloat16))  # as safetensors stores `weight_scale`


@st.composite
def gather_case(draw, fmt, dims=(16, 32, 64)):
    """(table uint8 [R, row_bytes], ids [T, H], scale or None): any bytes (finite fp16 block
    scales), ids anywhere in the table, the first and last rows and repeats favoured."""
    dim = draw(st.sampled_from([d for d in dims if d % fmt.block_elems == 0]))
    n_rows = draw(st.integers(1, 6))
    raw = draw(blocks(fmt, min_blocks=n_rows * dim // fmt.block_elems, max_blocks=n_rows * dim // fmt.block_elems))
    tok, heads = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    row = st.one_of(st.sampled_from([0, n_rows - 1]), st.integers(0, n_rows - 1))
    ids = draw(st.lists(row, min_size=tok * heads, max_size=tok * heads))
    scale = draw(bf16_scales) if fmt.name == "FP8_E4M3" and draw(st.booleans()) else None
    ids = torch.tensor(ids).reshape(tok, heads)
    view = draw(st.sampled_from(["contiguous", "expanded", "transposed"]))
    if view == "expanded":  # a token's first id for every head, read through a stride of 0
        ids = ids[:, :1].expand(tok, heads)
    elif view == "transposed":
        ids = ids.t().contiguous().t()
    return raw.reshape(n_rows, -1), ids, scale


def reference(raw, ids, fmt, scale):
    """quant's dequantizer on the picked rows, times the scale in float32, rows side by side."""
    rows = fmt.dequantize(raw[ids.numpy().reshape(-1)])
    if scale is not None:
        rows = rows * np.float32(scale.float().item())
    return rows.reshape(ids.shape[0], -1)


@pytest.mark.parametrize("fmt", PLE_FORMATS, ids=lambda f: f.name)
def test_gather_equals_reference(fmt):
    @given(gather_case(fmt))
    @settings(max_examples=examples(60))
    def prop(case):
        raw, ids, scale = case
        want = reference(raw, ids, fmt, scale)
        table = torch.from_numpy(raw)
        assert same_bits(ple_gather(table, ids, fmt, scale=scale).numpy(), want)
        assert same_bits(ple_gather_torch(table, ids, fmt, scale=scale).numpy(), want)
    prop()


@pytest.mark.parametrize("fmt", [quant.get(n) for n in UNITS if quant.get(n) not in PLE_FORMATS],
                         ids=lambda f: f.name)
def test_gather_of_the_other_unit_formats_equals_reference(fmt):
    """Tables in the other formats with int8 units (ZEROs, minimums, look-ups, grids,
    scales a 16 or a 32), rows of 256 values, out in bf16 too: the numpy codec's bits."""
    @given(gather_case(fmt, dims=(256,)), st.booleans())
    @settings(max_examples=examples(10))
    def prop(case, bf16):
        raw, ids, scale = case
        want = reference(raw, ids, fmt, scale)
        dtype = torch.bfloat16 if bf16 else torch.float32
        want = torch.from_numpy(want).to(dtype).float().numpy()
        out = ple_gather(torch.from_numpy(raw), ids, fmt, scale=scale, out_dtype=dtype)
        assert out.dtype == dtype and same_bits(out.float().numpy(), want)
    prop()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", PLE_FORMATS, ids=lambda f: f.name)
def test_half_outputs_round_the_float32_result(fmt, dtype):
    @given(gather_case(fmt))
    @settings(max_examples=examples(15))
    def prop(case):
        raw, ids, scale = case
        want = torch.from_numpy(reference(raw, ids, fmt, scale)).to(dtype).float().numpy()
        table = torch.from_numpy(raw)
        for fn in (ple_gather, ple_gather_torch):
            out = fn(table, ids, fmt, scale=scale, out_dtype=dtype)
            assert out.dtype == dtype and same_bits(out.float().numpy(), want)
    prop()


@pytest.mark.parametrize("fmt", PLE_FORMATS, ids=lambda f: f.name)
def test_real_row_geometry(fmt):
    """Rows of 160 values, 16 heads, two tokens, the first and last rows among them, and more
    (token, head) pairs than one program gathers."""
    rng = np.random.default_rng(0)
    raw = fmt.quantize(rng.standard_normal((9, 160)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, 9, (2, 16)))
    ids[0, 0], ids[1, 15] = 0, 8
    scale = torch.tensor(0.0123, dtype=torch.bfloat16) if fmt.name == "FP8_E4M3" else None
    want = reference(raw, ids, fmt, scale)
    out = ple_gather(torch.from_numpy(raw), ids, fmt, scale=scale, block_rows=8)
    assert out.shape == (2, 16 * 160) and same_bits(out.numpy(), want)


def test_row_of_a_token_is_head_major():
    raw = np.arange(3 * 16, dtype=np.float32).reshape(3, 16).view(np.uint8)  # the tiny model's F32 rows
    out = ple_gather(torch.from_numpy(raw), torch.tensor([[2, 0, 1]]), "F32")
    assert out[0].tolist() == list(range(32, 48)) + list(range(16)) + list(range(16, 32))


@pytest.mark.parametrize("fn", [ple_gather, ple_gather_torch])
@pytest.mark.parametrize("bad", [-1, 5])
def test_out_of_range_ids_raise_index_error(fn, bad):
    table = torch.zeros((5, 18), dtype=torch.uint8)
    with pytest.raises(IndexError, match=rf"row id {bad} \(ids\[1, 0\]\) is out of range for a table of 5 rows"):
        fn(table, torch.tensor([[0, 4], [bad, 1]]), "Q4_0")


@pytest.mark.parametrize("fn", [ple_gather, ple_gather_torch])
def test_gather_bad_arguments(fn):
    with pytest.raises(ValueError, match=r"IQ4_NL: 20 bytes per row is not a whole number of blocks"):
        fn(torch.zeros((2, 20), dtype=torch.uint8), torch.zeros((1, 1), dtype=torch.int64), "IQ4_NL")
    with pytest.raises(ValueError, match=r"FP8_E4M3: quantized data must be a uint8 tensor, got torch.float8_e4m3fn"):
        fn(torch.zeros((2, 16), dtype=torch.float8_e4m3fn), torch.zeros((1, 1), dtype=torch.int64), "FP8_E4M3")
    with pytest.raises(ValueError, match=r"ids must be an integer tensor \[tokens, heads\], got \(3,\)"):
        fn(torch.zeros((2, 4), dtype=torch.uint8), torch.zeros(3, dtype=torch.int64), "F32")


def test_no_ids_no_rows():
    out = ple_gather(torch.zeros((4, 90), dtype=torch.uint8), torch.zeros((0, 16), dtype=torch.int64), "IQ4_NL")
    assert out.shape == (0, 16 * 160)


def test_fp8_dequantize_every_code():
    """The FP8 decode function and torch path serve dequantize() too (test_dequant covers the
    GGUF formats only)."""
    raw = np.arange(256, dtype=np.uint8)
    want = quant.get("FP8_E4M3").dequantize(raw)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        w = torch.from_numpy(want).to(dtype).float().numpy()
        for fn in (dequantize, dequantize_torch):
            assert same_bits(fn(torch.from_numpy(raw), "FP8_E4M3", dtype).float().numpy(), w)
