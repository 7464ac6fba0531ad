"""triton_kernels.asm: dp4a, pack16 and prmt against numpy models of the instructions.

The interpreter cannot run inline assembly, so the properties run the pure-Triton twins
(ASM=""), elementwise through small test kernels, against numpy models of the instructions
(tests/instruction_models.py; elsewhere the suite's interpreter computes the twins' calls
by these models, on the strength of the tests here):

    dp4a(a, b, c)    c + sum_i sbyte_i(a) * sbyte_i(b), wrapping in int32 (PTX dp4a.s32.s32)
    pack16(lo, hi)   lo | hi << 16, as int32 (PTX mov.b32 {lo, hi})
    prmt(a, b, sel)  byte i of the result = byte (sel >> 4i) & 7 of the eight bytes b:a
                     (a holds bytes 0-3), for selector nibbles with bit 3 clear (PTX
                     prmt.b32, default mode; bits 16-31 of sel are ignored)

`test_ptx_equals_the_twin_on_cuda` (marked `cuda`) runs the same kernels with ASM="ptx"
and ASM="" on a GPU and compares them, with each other and with the models. Under
scripts/gpu_check.sh (STRATA_TEST_DEVICE=cuda) the interpreter is off and it runs in
process; with the interpreter on it runs in a subprocess with TRITON_INTERPRET=0, since
`triton.jit` picks interpreter or compiler when a function is decorated.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings, strategies as st
from tests.tiers import examples

from tests.instruction_models import dp4a_model, pack16_model, prmt_model
from tests.triton_interpreter import modelled, twins
from triton_kernels.asm import asm_for, dp4a, pack16, prmt
from triton_kernels.backend import interpreter_on

ROOT = Path(__file__).resolve().parents[2]
I32 = st.integers(-2 ** 31, 2 ** 31 - 1)


def i32(v) -> np.ndarray:
    return np.asarray(v, dtype=np.int64).astype(np.int32)  # two's complement wrap


# corner words: bytes -128, 127, -1, 0 and mixes
CORNERS = [int(v) for v in i32([0, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0x7F7F7F7F, 0x80808080,
                                0x80807F01, 0x01FF7F80])]


# --- test kernels: each helper applied elementwise ---------------------------------------

@triton.jit
def _dp4a_kernel(a_ptr, b_ptr, c_ptr, out_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(a_ptr + i, mask=m, other=0)
    b = tl.load(b_ptr + i, mask=m, other=0)
    c = tl.load(c_ptr + i, mask=m, other=0)
    tl.store(out_ptr + i, dp4a(a, b, c, ASM), mask=m)


@triton.jit
def _pack16_kernel(lo_ptr, hi_ptr, out_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    lo = tl.load(lo_ptr + i, mask=m, other=0)
    hi = tl.load(hi_ptr + i, mask=m, other=0)
    tl.store(out_ptr + i, pack16(lo, hi, ASM), mask=m)


@triton.jit
def _prmt_kernel(a_ptr, b_ptr, sel_ptr, out_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(a_ptr + i, mask=m, other=0)
    b = tl.load(b_ptr + i, mask=m, other=0)
    sel = tl.load(sel_ptr + i, mask=m, other=0)
    tl.store(out_ptr + i, prmt(a, b, sel, ASM), mask=m)


@triton.jit
def _prmt_const_kernel(a_ptr, b_ptr, out_ptr, n, SEL: tl.constexpr, BLOCK: tl.constexpr,
                       ASM: tl.constexpr):
    """prmt with a constant selector, as decode/iq4.py calls it (prmt(a, b, 0x6420, ASM))."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(a_ptr + i, mask=m, other=0)
    b = tl.load(b_ptr + i, mask=m, other=0)
    tl.store(out_ptr + i, prmt(a, b, SEL, ASM), mask=m)


def _block(n: int, device) -> int:
    # the interpreter pays per program, a GPU per register: one program there, 1024 lanes here
    if torch.device(device).type == "cuda":
        return 1024
    return max(16, min(triton.next_power_of_2(n), 2 ** 18))


def _t(arr: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr)).to(device)


def run_dp4a(a, b, c, asm="", device="cpu") -> np.ndarray:
    n = len(a)
    out = torch.empty(n, dtype=torch.int32, device=device)
    block = _block(n, device)
    _dp4a_kernel[(triton.cdiv(n, block),)](_t(a, device), _t(b, device), _t(c, device), out, n,
                                          BLOCK=block, ASM=asm)
    return out.cpu().numpy()


def run_pack16(lo, hi, asm="", device="cpu") -> np.ndarray:
    n = len(lo)
    out = torch.empty(n, dtype=torch.int32, device=device)
    block = _block(n, device)
    _pack16_kernel[(triton.cdiv(n, block),)](_t(lo, device), _t(hi, device), out, n,
                                            BLOCK=block, ASM=asm)
    return out.cpu().numpy()


def run_prmt(a, b, sel, asm="", device="cpu") -> np.ndarray:
    n = len(a)
    out = torch.empty(n, dtype=torch.int32, device=device)
    block = _block(n, device)
    grid = (triton.cdiv(n, block),)
    if isinstance(sel, int):
        _prmt_const_kernel[grid](_t(a, device), _t(b, device), out, n, SEL=sel, BLOCK=block, ASM=asm)
    else:
        _prmt_kernel[grid](_t(a, device), _t(b, device), _t(sel, device), out, n,
                           BLOCK=block, ASM=asm)
    return out.cpu().numpy()


@pytest.fixture(autouse=True)
def _the_twins_themselves():
    """The Triton twins run here, not their models (tests/triton_interpreter.py computes the
    kernels' calls by the models elsewhere, on the strength of these tests)."""
    with twins():
        yield


def test_the_models_on_known_values():
    # the models are the oracle: pin them to hand-computed instruction results
    assert dp4a_model([0x02_03_FF_80], [0x04_05_FF_80], [10])[0] == 10 + 16384 + 1 + 15 + 8
    assert dp4a_model([-2 ** 31], [-2 ** 31], [2 ** 31 - 1])[0] == -2 ** 31 + 16383  # wraps
    assert pack16_model([0xBEEF], [0xDEAD])[0] == i32(0xDEADBEEF - 2 ** 32)
    a, b = i32([0x33221100]), i32([0x77665544])
    assert prmt_model(a, b, 0x3210)[0] == 0x33221100
    assert prmt_model(a, b, 0x7654)[0] == 0x77665544
    assert prmt_model(a, b, 0x0000)[0] == 0x00000000
    assert prmt_model(a, b, 0x6420)[0] == 0x66442200
    assert prmt_model(a, b, 0x1357)[0] == 0x11335577


def test_the_interpreter_is_on():
    assert interpreter_on()  # the properties below run the twins on the CPU


def test_the_suites_interpreter_computes_the_helpers_by_their_models():
    """Outside `twins()` (in every other test file) the kernels' dp4a, pack16 and prmt calls
    compute by the models in one step (tests/triton_interpreter.py): the same integers as
    the twins, and a selector nibble with bit 3 set, which the models leave out, runs the
    twin."""
    if not modelled:
        pytest.skip("this Triton's interpreter keeps no table of rewritten functions: the twins run")
    rng = np.random.default_rng(2)
    a, b, c = (i32(np.concatenate([CORNERS, rng.integers(-2 ** 31, 2 ** 31, 300)])) for _ in range(3))
    lo, hi = (rng.integers(0, 2 ** 16, 300).astype(np.uint16) for _ in range(2))
    sel = i32(rng.integers(0, 2 ** 31, a.size) & ~0x8888)
    calls = [lambda: run_dp4a(a, b, c), lambda: run_pack16(lo, hi), lambda: run_prmt(a, b, sel),
             lambda: run_prmt(a, b, 0x6420), lambda: run_prmt(a, b, sel | 0x8)]
    with twins():
        want = [f() for f in calls]
    before = dict(modelled)
    with twins(False):
        got = [f() for f in calls[:4]]
        assert all(modelled[n] > before[n] for n in ("dp4a", "pack16", "prmt")), (before, modelled)
        held = modelled["prmt"]
        got.append(calls[4]())
        assert modelled["prmt"] == held  # the twin ran
    for w, g in zip(want, got):
        assert np.array_equal(w, g)
    assert np.array_equal(got[0], dp4a_model(a, b, c)) and np.array_equal(got[2], prmt_model(a, b, sel))


def test_asm_for(monkeypatch):
    assert asm_for("cpu") == ""
    assert asm_for(torch.device("cuda")) == ""  # the interpreter runs no inline assembly
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert asm_for("cpu") == ""
    assert asm_for("cuda") == ("gcn" if torch.version.hip else "ptx")


# --- the twins against the models ------------------------------------------------------------

def words(n: int):
    return st.lists(st.one_of(I32, st.sampled_from(CORNERS)), min_size=n, max_size=n)


@st.composite
def triples(draw):
    n = draw(st.integers(1, 40))
    return (np.array(draw(words(n)), np.int32), np.array(draw(words(n)), np.int32),
            np.array(draw(words(n)), np.int32))


@given(triples())
@example((i32([-2 ** 31 + 0x00808080, 0x7F7F7F7F, -1]), i32([-2 ** 31 + 0x00808080, 0x7F7F7F7F, -1]),
          i32([2 ** 31 - 1, 2 ** 31 - 1, -2 ** 31])))  # wraps both ways
@settings(max_examples=examples(60))
def test_dp4a_twin(abc):
    a, b, c = abc
    assert np.array_equal(run_dp4a(a, b, c), dp4a_model(a, b, c))


def test_dp4a_twin_every_byte_pair_in_every_lane():
    # 256 x 256 signed byte pairs, each in lane k of a and b with random other lanes
    rng = np.random.default_rng(0)
    pa, pb = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    for k in range(4):
        a = rng.integers(-2 ** 31, 2 ** 31, pa.size, dtype=np.int64)
        b = rng.integers(-2 ** 31, 2 ** 31, pa.size, dtype=np.int64)
        mask = 0xFF << (8 * k)
        a = i32((a & ~mask) | (pa.reshape(-1) << (8 * k)))
        b = i32((b & ~mask) | (pb.reshape(-1) << (8 * k)))
        c = i32(rng.integers(-2 ** 31, 2 ** 31, pa.size, dtype=np.int64))
        got = run_dp4a(a, b, c)
        assert np.array_equal(got, dp4a_model(a, b, c)), f"lane {k}"
        # and lane k's product alone, with the other lanes zero
        a0, b0 = i32(pa.reshape(-1) << (8 * k)), i32(pb.reshape(-1) << (8 * k))
        want = pa.reshape(-1).astype(np.int8).astype(np.int32) * pb.reshape(-1).astype(np.int8)
        assert np.array_equal(run_dp4a(a0, b0, np.zeros_like(a0)), want), f"lane {k} alone"


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 0xFFFF), min_size=n, max_size=n),
    st.lists(st.integers(0, 0xFFFF), min_size=n, max_size=n))))
@example(([0, 0xFFFF, 0x8000, 0x7FFF], [0xFFFF, 0, 0x7FFF, 0x8000]))
@settings(max_examples=examples(60))
def test_pack16_twin(lohi):
    lo, hi = np.array(lohi[0], np.uint16), np.array(lohi[1], np.uint16)
    assert np.array_equal(run_pack16(lo, hi), pack16_model(lo, hi))


def selectors(n: int):
    """Selector words: the four low nibbles with bit 3 clear, bits 16-31 free."""
    return st.lists(I32.map(lambda s: s & ~0x8888), min_size=n, max_size=n)


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(words(n), words(n), selectors(n))))
@settings(max_examples=examples(60))
def test_prmt_twin(abs_):
    a, b, sel = (np.array(v, np.int32) for v in abs_)
    assert np.array_equal(run_prmt(a, b, sel), prmt_model(a, b, sel))


def test_prmt_twin_every_selector():
    # all 8^4 selectors, upper half of the selector word random
    rng = np.random.default_rng(1)
    nib = np.arange(4096)
    sel = (nib & 7) | ((nib >> 3 & 7) << 4) | ((nib >> 6 & 7) << 8) | ((nib >> 9 & 7) << 12)
    sel = i32(sel | (rng.integers(0, 2 ** 16, 4096) << 16))
    a = i32(rng.integers(-2 ** 31, 2 ** 31, 4096, dtype=np.int64))
    b = i32(rng.integers(-2 ** 31, 2 ** 31, 4096, dtype=np.int64))
    assert np.array_equal(run_prmt(a, b, sel), prmt_model(a, b, sel))


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(words(n), words(n))),
       st.one_of(st.sampled_from([0x6420, 0x7531, 0x3210, 0x7654, 0x32103210]),
                 st.integers(0, 0x7FFFFFFF).map(lambda s: s & ~0x8888)))
@settings(max_examples=examples(30))
def test_prmt_twin_constant_selector(ab, sel):
    a, b = (np.array(v, np.int32) for v in ab)
    assert np.array_equal(run_prmt(a, b, sel), prmt_model(a, b, sel))


# --- inline PTX against the twins, on a GPU --------------------------------------------------

def compare_ptx_with_twin(n: int = 4096, seed: int = 0) -> str:
    """Runs in a process with the interpreter off: every kernel with ASM="ptx" and ASM="",
    on CUDA tensors, equal to each other and to the model."""
    assert not interpreter_on(), "run with TRITON_INTERPRET=0"
    rng = np.random.default_rng(seed)
    r32 = lambda: i32(rng.integers(-2 ** 31, 2 ** 31, n, dtype=np.int64))
    a, b, c = r32(), r32(), r32()
    a[:len(CORNERS)], b[:len(CORNERS)] = i32(CORNERS), i32(CORNERS[::-1])
    sel = i32(r32() & ~0x8888)
    lo = rng.integers(0, 2 ** 16, n).astype(np.uint16)
    hi = rng.integers(0, 2 ** 16, n).astype(np.uint16)
    checks = {
        "dp4a": (lambda asm: run_dp4a(a, b, c, asm, "cuda"), dp4a_model(a, b, c)),
        "pack16": (lambda asm: run_pack16(lo, hi, asm, "cuda"), pack16_model(lo, hi)),
        "prmt": (lambda asm: run_prmt(a, b, sel, asm, "cuda"), prmt_model(a, b, sel)),
    }
    for s in (0x6420, 0x7531, 0x3210, 0x1357, 0x32103210):
        checks[f"prmt {s:#x}"] = (lambda asm, s=s: run_prmt(a, b, s, asm, "cuda"), prmt_model(a, b, s))
    for name, (run, want) in checks.items():
        ptx, twin = run("ptx"), run("")
        assert np.array_equal(ptx, twin), f"{name}: ptx != twin at {np.flatnonzero(ptx != twin)[:8]}"
        assert np.array_equal(twin, want), f"{name}: twin != model"
    return f"ok {len(checks)}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                    reason="needs an NVIDIA CUDA device (scripts/gpu_check.sh); CI checks the twins against "
                           "the instruction models in this file (test_*_twin)")
def test_ptx_equals_the_twin_on_cuda():
    if not interpreter_on():  # scripts/gpu_check.sh: these kernels are compiled already
        assert compare_ptx_with_twin() == "ok 8"
        return
    env = dict(os.environ, TRITON_INTERPRET="0")
    code = ("from tests.triton_kernels.test_asm import compare_ptx_with_twin; "
            "print(compare_ptx_with_twin())")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "ok 8", r.stdout
