"""`strata quantize`: llama-quantize's type choice, its progress lines, and files that load
in Strata and in llama.cpp.

The mixes are llama-quantize's own (tests/data/llama_tools_golden.json, from
scripts/golden_llama_tools.py): the type --dry-run lists for every tensor of SmolLM2 and of
flash-tiny, for each ftype Strata names, without and with an importance matrix, --pure, and
with a --tensor-type override."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

import quant
from strata.cli import main
from strata.gguf import open_gguf, write_gguf
from strata.quantize import FTYPES, Plan, choose_type, make_plan, quantize_model, target_types
from strata.tensors import QTensor

GOLDEN = json.loads((Path(__file__).resolve().parents[2] / "tests" / "data" / "llama_tools_golden.json").read_text())
MIXES = GOLDEN["quantize"]["mixes"]


def _mix_id(m):
    return "-".join([m["model"], m["ftype"]] + ["imatrix"] * m["imatrix"] + ["pure"] * m["pure"]
                    + ["override"] * bool(m["tensor_types"]))


def _golden_mix(model, ftype, imatrix=False, pure=False, override=False):
    return next(m for m in MIXES if (m["model"], m["ftype"], m["imatrix"], m["pure"], bool(m["tensor_types"]))
                == (model, ftype, imatrix, pure, override))

LINE = re.compile(r"\[\s*\d+/\s*\d+\] \S+\s+- \[(\s*\d+, ){3}\s*\d+\], type = \s*\w+, "
                  r"(converting to \w+ \.\. size = \s*[\d.]+ MiB -> \s*[\d.]+ MiB|size = \s*[\d.]+ MiB)$")


def plan(ftype, **kw):
    return Plan(ftype=ftype, n_layer=30, n_gqa=3, tied_output=True, **kw)


def test_fallback_for_rows_that_do_not_fit_the_blocks():
    p = plan("IQ3_XXS", pure=True)
    assert choose_type(p, "blk.0.ffn_down.weight", (576, 1536)) == ("IQ3_XXS", None)
    t, note = choose_type(p, "blk.0.ffn_up.weight", (1536, 576))
    assert t == "IQ4_NL" and "not divisible by 256" in note
    q = Plan(ftype="Q8_0", n_layer=1, pure=True, overrides=[(re.compile("up"), "Q3_K")])
    assert choose_type(q, "blk.0.ffn_up.weight", (8, 576))[0] == "Q4_0"     # Q3_K -> Q4_0
    assert choose_type(q, "blk.0.ffn_up.weight", (8, 80))[0] == "F16"       # no 32-block fits
    assert choose_type(p, "blk.0.attn_norm.weight", (576,)) == (None, None)  # 1-D: copied


def test_the_golden_mixes_cover_every_ftype():
    for model in ("smollm2", "flash-tiny"):
        assert {m["ftype"] for m in MIXES if m["model"] == model and not m["pure"]} == set(FTYPES)
    assert {m["ftype"] for m in MIXES if m["imatrix"]} == set(FTYPES)


@pytest.mark.parametrize("mix", MIXES, ids=_mix_id)
def test_mix_is_llama_quantizes(mix, smollm2_gguf, flash_tiny_gguf):
    """Every tensor's type, as llama-quantize --dry-run chose it for the same file and flags."""
    g = smollm2_gguf if mix["model"] == "smollm2" else flash_tiny_gguf
    plan = make_plan(g, mix["ftype"], has_imatrix=mix["imatrix"], tensor_types=mix["tensor_types"],
                     pure=mix["pure"])
    want = dict(zip(GOLDEN["quantize"]["tensors"][mix["model"]], mix["types"]))
    got = target_types(g, plan)
    assert sorted(got) == sorted(want)  # llama-quantize lists them in its own order
    assert {n: (got[n], t) for n, t in want.items() if got[n] != t} == {}


def test_a_bad_type_or_flag_is_named(tmp_path, capsys):
    src = tiny_gguf(tmp_path)
    assert main(["quantize", str(src), str(tmp_path / "o.gguf"), "Q9_9"]) == 2
    assert "Q9_9" in capsys.readouterr().err
    assert main(["quantize", str(src), str(tmp_path / "o.gguf"), "Q8_0", "--tensor-type", "ffn"]) == 2
    assert "--tensor-type 'ffn': expected REGEX=TYPE" in capsys.readouterr().err


def tiny_gguf(tmp_path):
    rng = np.random.default_rng(0)
    f32 = quant.get("F32")
    tensors = [QTensor(n, f32, s, f32.quantize(rng.standard_normal(s).astype(np.float32)).reshape(s[0] if len(s) > 1 else 1, -1))
               for n, s in (("blk.0.ffn_down.weight", (8, 512)), ("blk.0.ffn_up.weight", (8, 96)),
                            ("blk.0.attn_norm.weight", (96,)))]
    return write_gguf(tmp_path / "tiny.gguf", "llama", {"llama.block_count": 1}, tensors)


def test_synthetic_model_progress_lines_and_round_trip(tmp_path):
    lines = []
    src = tiny_gguf(tmp_path)
    quantize_model(src, tmp_path / "q.gguf", "IQ3_S", pure=True, log=lines.append)
    tensor_lines = [l for l in lines if l.startswith("[")]
    assert len(tensor_lines) == 3 and all(LINE.match(l) for l in tensor_lines), lines
    # llama-quantize's order: by block, then by name
    assert [l.split("] ", 1)[1].split()[0] for l in tensor_lines] == ["blk.0.attn_norm.weight", "blk.0.ffn_down.weight",
                                                    "blk.0.ffn_up.weight"]
    assert "converting to iq3_s" in tensor_lines[1] and "converting to iq4_nl" in tensor_lines[2]
    assert any(l.startswith("quant size  =") for l in lines)
    g, q = open_gguf(src), open_gguf(tmp_path / "q.gguf")
    assert q.tensors["blk.0.ffn_down.weight"].fmt.name == "IQ3_S"
    assert q.tensors["blk.0.attn_norm.weight"].fmt.name == "F32"
    x, y = g.tensors["blk.0.ffn_down.weight"].numpy(), q.tensors["blk.0.ffn_down.weight"].numpy()
    assert np.sqrt(((x - y) ** 2).mean()) < 0.3 * np.sqrt((x ** 2).mean())


@pytest.fixture(scope="module")
def smollm2_quantized(smollm2_gguf, tmp_path_factory):
    """SmolLM2 (Q4_1) to llama.cpp's IQ3_XXS mix without an imatrix (for its shapes: Q4_K,
    Q3_K, IQ4_NL, the Q8_0 embedding copied), two ffn_down forced to IQ3_XXS."""
    out = tmp_path_factory.mktemp("q") / "smollm2-iq3_xxs.gguf"
    lines = []
    quantize_model(smollm2_gguf.path, out, "IQ3_XXS", tensor_types=[r"blk\.(0|1)\.ffn_down=IQ3_XXS"],
                   threads=2, log=lines.append)
    return out, lines


@pytest.mark.slow
def test_smollm2_requantized_lines_and_types(smollm2_quantized):
    out, lines = smollm2_quantized
    tensor_lines = [l for l in lines if l.startswith("[")]
    assert len(tensor_lines) == 272 and all(LINE.match(l) for l in tensor_lines)
    assert any("blk.0.ffn_down.weight" in l and "type =   q4_1, converting to iq3_xxs" in l for l in tensor_lines)
    assert any("blk.0.attn_v.weight" in l and "falling back to  iq4_nl" in l for l in lines)
    g = open_gguf(out)
    mix = _golden_mix("smollm2", "IQ3_XXS", override=True)  # the same --tensor-type, in llama.cpp
    assert {n: t.fmt.name for n, t in g.tensors.items()} == dict(zip(GOLDEN["quantize"]["tensors"]["smollm2"],
                                                                     mix["types"]))
    assert g.get("general.file_type") == 23


@pytest.mark.slow
def test_smollm2_requantized_generates_in_strata(smollm2_quantized):
    from strata.load import load_model
    from strata.runtime import SamplingParams, generate
    from strata.tokenizer import Tokenizer
    g = open_gguf(smollm2_quantized[0])
    model, tok = load_model(g), Tokenizer.from_gguf(g)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    res = generate(model, tok, ids, SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in tok.decode(res.tokens)


@pytest.mark.slow
def test_smollm2_requantized_generates_in_llama_cpp(smollm2_quantized):
    # CI checks the same file without llama.cpp: every tensor's type is llama-quantize's
    # (test_mix_is_llama_quantizes), and the file generates "Paris" in Strata
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                                    "(scripts/build_llama_cpp.sh); the types are held to llama-quantize's here")
    llm = llama_cpp.Llama(model_path=str(smollm2_quantized[0]), n_ctx=256, verbose=False)
    out = llm.create_chat_completion([{"role": "user", "content": "What is the capital of France?"}],
                                     max_tokens=12, temperature=0)
    assert "Paris" in out["choices"][0]["message"]["content"]


FILES = GOLDEN["quantize"]["files"]


@pytest.mark.parametrize("ftype", [pytest.param(f, marks=() if f == "Q4_K_M" else pytest.mark.slow)
                                   for f in ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q6_K", "IQ4_XS")])
def test_smollm2_file_is_llama_quantizes_byte_for_byte(ftype, smollm2_gguf, tmp_path):
    """The whole file llama-quantize writes from SmolLM2 for the mixes people download: the
    same types, the same blocks (ggml's quantizers), the same header and tensor order."""
    import hashlib
    assert FILES["model"] == smollm2_gguf.path.name
    out = tmp_path / f"{ftype}.gguf"
    quantize_model(smollm2_gguf.path, out, ftype, threads=2, log=lambda _line: None)
    assert out.stat().st_size == FILES[ftype]["bytes"]
    assert hashlib.sha256(out.read_bytes()).hexdigest() == FILES[ftype]["sha256"]


def test_each_expert_is_quantized_with_its_own_importance(tmp_path):
    """A merged-experts tensor (E, rows, in) and an imatrix with a row per expert (and an
    expert no token reached, weighed all ones): each expert's rows are the quantizer's for
    that expert's importance, as llama-quantize's imatrix_for_row hands it."""
    from strata.imatrix import IMatrix, write_imatrix
    rng = np.random.default_rng(1)
    f32, q4k = quant.get("F32"), quant.get("Q4_K")
    E, rows, cols = 4, 8, 512
    w = rng.standard_normal((E, rows, cols)).astype(np.float32)
    src = write_gguf(tmp_path / "moe.gguf", "llama", {"llama.block_count": 1},
                     [QTensor("blk.0.ffn_down_exps.weight", f32, (E, rows, cols), f32.quantize(w).reshape(E * rows, -1))])
    sums = rng.exponential(1.0, (E, cols)).astype(np.float32) ** 3  # columns that matter, per expert
    counts = np.array([5, 3, 0, 7])
    write_imatrix(tmp_path / "im.gguf", IMatrix(sums={"blk.0.ffn_down_exps.weight": sums},
                                                counts={"blk.0.ffn_down_exps.weight": counts},
                                                datasets=["x.txt"], chunk_count=1, chunk_size=16))
    quantize_model(src, tmp_path / "q.gguf", "Q4_K_M", imatrix=tmp_path / "im.gguf", pure=True, log=lambda _l: None)
    got = open_gguf(tmp_path / "q.gguf").tensors["blk.0.ffn_down_exps.weight"]
    assert got.fmt.name == "Q4_K"
    blocks = np.asarray(got.data).reshape(E, rows, -1)
    imp = [sums[e] / counts[e] if counts[e] else np.ones(cols, np.float32) for e in range(E)]
    for e in range(E):
        np.testing.assert_array_equal(blocks[e], q4k.quantize(w[e], imp[e]).reshape(rows, -1))
        other = q4k.quantize(w[e], imp[(e + 1) % E]).reshape(rows, -1)
        assert not np.array_equal(blocks[e], other)  # another expert's importance: other blocks
    with pytest.raises(Exception, match="matrices"):  # an imatrix of one row for E experts
        write_imatrix(tmp_path / "one.gguf", IMatrix(sums={"blk.0.ffn_down_exps.weight": sums[:1]},
                                                      counts={"blk.0.ffn_down_exps.weight": counts[:1]},
                                                      datasets=["x.txt"], chunk_count=1, chunk_size=16))
        quantize_model(src, tmp_path / "q1.gguf", "Q4_K_M", imatrix=tmp_path / "one.gguf", pure=True,
                       log=lambda _l: None)
