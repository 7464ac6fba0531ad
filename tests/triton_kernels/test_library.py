"""The Triton ops as torch ops (triton_kernels.library): each op's fake implementation
gives the real one's shape, dtype and device (torch.library.opcheck's schema and fake
tensor checks, on inputs run through the interpreter), and torch.compile traces a call
of `ops.impl` into the registered op with no graph break, computing the launcher's result
exactly (the same kernel runs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import quant
from triton_kernels import library
from triton_kernels.backend import interpreter_on
from triton_kernels.ops import impl

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="the ops run on the CPU under TRITON_INTERPRET=1 (the suite sets it)")


def blocks(fmt: str, rows: int, cols: int, rng) -> torch.Tensor:
    f = quant.get(fmt)
    return torch.from_numpy(f.quantize(rng.standard_normal((rows, cols)).astype(np.float32)).reshape(rows, -1))


def cases():
    """(op, the registered op's arguments) for every op, small."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32))
    q = blocks("Q8_0", 32, 64, rng)
    E, H, I, k = 4, 64, 32, 2
    wg = blocks("Q4_0", E * I, H, rng).reshape(E, I, -1)
    wu = blocks("Q4_0", E * I, H, rng).reshape(E, I, -1)
    wd = blocks("Q8_0", E * H, I, rng).reshape(E, H, -1)
    weights = torch.full((2, k), 0.5)
    ids = torch.tensor([[0, 3], [1, 3]], dtype=torch.int32)
    sizes, offsets = torch.tensor([97, 101, 103, 107]), torch.tensor([0, 97, 198, 301])
    table = blocks("Q8_0", 408, 32, rng)
    qi = torch.randn(2, 3, 16)
    pooled = torch.randn(5, 16)
    qh, kh, vh = torch.randn(4, 3, 16), torch.randn(2, 24, 16), torch.randn(2, 24, 16)
    sel = torch.tensor([[0, 1], [1, -1], [2, 0]])
    return [
        ("qmatmul", (x, q, "Q8_0", None, None, None)),
        ("gemv_pair", (torch.randn(1, 64), blocks("F32", 8, 64, rng), "F32", 8, blocks("Q4_0", 24, 64, rng), "Q4_0",
                       24, torch.bfloat16)),
        ("dequantize", (q, "Q8_0", torch.bfloat16, 1024)),
        ("gated_qmatmul", (x, torch.randn(2, 64), torch.from_numpy(quant.get("F16").quantize(np.ones((8, 64), np.float32)).reshape(8, -1)), "F16", True, torch.bfloat16)),
        ("route", (torch.randn(3, 16), 4, True)),
        ("moe", (x, wg, wu, wd, "Q4_0", "Q4_0", "Q8_0", weights, ids, None, None, None, torch.bfloat16)),
        ("ngram_ids", (torch.tensor([5, 6, 7]), None, torch.tensor([7, 11, 13]), sizes, offsets, 2, 2, 64, False)),
        ("ngram_ids", (torch.tensor([5]), torch.tensor([2, 9]), torch.tensor([7, 11, 13]), sizes, offsets, 2, 2, 64,
                       True)),
        ("ple_gather", (table, torch.tensor([[0, 5, 9, 2], [1, 1, 3, 4]]), "Q8_0", None, 0.5, torch.float32, 16, 10)),
        ("ple_gather", (table, torch.tensor([[3], [7]]).expand(2, 4), "Q8_0", None, None, torch.float32, 16, 408)),
        ("qsa_scores", (qi, pooled, 20, 4, 16)),
        ("qsa_select", (torch.tensor([[0.0, 2.0, 2.0, float("-inf"), 1.0], [0.0, 0.0, -1.0, 3.0, 0.0]]), 3, 8192, 4, 4)),
        ("qsa_attention", (qh, kh, vh, sel, 21, 4, None, None, 16)),
        ("attention_rows", (torch.randn(2, 3, 2 * 16)[..., :16], torch.randn(16), torch.randn(2, 1, 16), torch.randn(16),
                            torch.randn(2, 1, 16), 1e-6, torch.randn(12, 8), torch.randn(12, 8), torch.tensor([5, 6]),
                            torch.zeros(1, 12, 16).bfloat16(), torch.zeros(1, 12, 16).bfloat16(), torch.randn(2, 24),
                            torch.randn(12), torch.randn(2, 12), torch.zeros(12, 12).bfloat16(), 4, torch.randn(12),
                            torch.zeros(4, 12))),
        ("attention_rows", (torch.randn(1, 2, 16), torch.randn(16), torch.randn(1, 2, 16), torch.randn(16),
                            torch.randn(1, 2, 16), 1e-6, torch.randn(12, 8), torch.randn(12, 8), torch.tensor([3]),
                            torch.zeros(2, 12, 16), torch.zeros(2, 12, 16), None, None, None, None, 0, None, None,
                            torch.tensor([7]))),
        ("qsa_pool", (torch.randn(24, 16), None, torch.tensor([9, 13]), 4, torch.randn(16), 1e-6,
                      torch.randn(40, 8), torch.randn(40, 8), torch.zeros(7, 16))),
        ("stage_rows", ([torch.arange(40, dtype=torch.uint8).reshape(5, 8), torch.arange(15, dtype=torch.uint8).reshape(5, 3)],
                        [torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8)],
                        torch.tensor([4, 0]), torch.tensor([-1, 2]), 1)),
        ("route_align", (torch.randn(1, 16), 4, True, 16, 20, torch.zeros(16, dtype=torch.int64),
                         torch.tensor([-1, 3] * 8), torch.zeros(16, dtype=torch.int64),
                         torch.zeros(16, dtype=torch.int64), 16)),
        ("router_gemv", (torch.randn(1, 64), blocks("Q8_0", 24, 64, rng), "Q8_0", 24, 2, True, 0, 8, 8, 4,
                         torch.zeros(8, dtype=torch.int64), None, None, None, 0)),
        ("cache_lookup", (torch.tensor([3, 0, 3], dtype=torch.int32), torch.tensor([-1, 1, -1, 0]),
                          torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), 2)),
        ("deltanet_step", (torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 16), -torch.rand(2),
                           torch.rand(2), torch.randn(2, 8, 16))),
        ("deltanet_inputs", (torch.randn(2, 2 * 8 + 4 * 6), torch.randn(2, 4), torch.randn(2, 4), torch.randn(4),
                             -torch.rand(4), 1, 8)),
        ("deltanet_conv_inputs", (torch.randn(2 * 8 + 4 * 6, 3), torch.randn(1, 2 * 8 + 4 * 6),
                                  torch.randn(2 * 8 + 4 * 6, 4), torch.randn(1, 4), torch.randn(1, 4), torch.randn(4),
                                  -torch.rand(4), 1, 8)),
        ("deltanet_gated_norm", (torch.randn(2, 4, 6), torch.randn(2, 24), torch.randn(6), 1e-6)),
        ("deltanet_decode", (torch.randn(2 * 8 + 4 * 6, 3), torch.randn(1, 2 * 8 + 4 * 6),
                             torch.randn(2 * 8 + 4 * 6, 4), torch.randn(1, 4), torch.randn(1, 4), torch.randn(4),
                             -torch.rand(4), 1, 8, torch.randn(4, 8, 6), torch.randn(1, 24), torch.randn(6), 1e-6)),
        ("deltanet_decode", (torch.randn(2 * 8 + 4 * 6, 3), torch.randn(3, 2 * 8 + 4 * 6),
                             torch.randn(2 * 8 + 4 * 6, 4), torch.randn(3, 5)[:, 1:], torch.randn(3, 4), torch.randn(4),
                             -torch.rand(4), 1, 8, torch.randn(4, 8, 6), torch.randn(3, 24), torch.randn(6), 1e-6)),
        ("conv_step", (torch.randn(6, 6), torch.randn(1, 6), torch.randn(6, 4), 2)),
        ("conv_step", (torch.randn(6, 6), torch.randn(3, 6), torch.randn(6, 4), 2)),
        ("hc_norm", (torch.randn(2, 4 * 24), torch.randn(4, 24), 1e-6)),
        ("hc_gates", (torch.randn(2, 8 + 4), 8, 4)),
        ("hc_combine", (torch.randn(2, 4 * 24), torch.randn(2, 4 * 24), 4)),
        ("hc_mix", (torch.randn(2, 8 + 4), torch.randn(4 * 24, 8), torch.randn(2, 4 * 24), 8, 4)),
        ("hc_write", (torch.randn(2, 4 * 24), torch.randn(2, 24).bfloat16(), torch.rand(2, 4))),
        ("hc_write_moe", (torch.randn(2, 4 * 24), torch.randn(2, 3, 24), torch.randn(2, 1), torch.randn(2, 24),
                          torch.rand(2, 4), torch.randn(4, 24), 1e-6)),
        ("hc_write_norm", (torch.randn(2, 4 * 24), torch.randn(2, 24), torch.rand(2, 4), torch.randn(4, 24), 1e-6)),
        ("hc_down", (torch.randn(2, 4 * 64), torch.randn(4, 64), 1e-6, blocks("Q4_0", 12, 4 * 64, rng), "Q4_0", 12,
                     torch.randn(2, 64), None, None, None, torch.rand(2, 4), torch.float32)),
        ("ple_mix", (torch.randn(1, 4 * 24), torch.randn(1, 4 * 24), torch.randn(1, 24), torch.randn(4 * 24),
                     torch.randn(4 * 24), torch.randn(4 * 24), torch.randn(4 * 24, 4), torch.randn(4 * 24, 9), 4,
                     1e-6, 3)),
        ("norm_rope", (torch.randn(2, 3, 2 * 16)[..., :16], torch.randn(16), 1e-6, torch.randn(2, 8), torch.randn(2, 8))),
        ("norm_rope2", (torch.randn(2, 3, 2 * 16)[..., :16], torch.randn(16), torch.randn(2, 1, 16), torch.randn(16), 1e-6,
                        torch.randn(2, 8), torch.randn(2, 8))),
        ("norm_rope2", (torch.randn(2, 3, 2 * 16)[..., :16], torch.randn(16), torch.randn(2, 1, 16), torch.randn(16), 1e-6,
                        torch.randn(5, 8), torch.randn(5, 8), torch.tensor([4, 0]))),
        ("silu_mul", (torch.randn(2, 40)[:, :20], torch.randn(2, 40)[:, 20:])),
        ("sigmoid_mul", (torch.randn(2, 40)[:, :20], torch.randn(2, 20))),
        ("gated_add", (torch.randn(2, 24), torch.randn(2, 25)[:, 24:], torch.randn(2, 24))),
        ("gated_add", (torch.randn(2, 3, 24), torch.randn(2, 25)[:, 24:], torch.randn(2, 24))),
    ]


def test_every_op_is_registered():
    from triton_kernels.ops import OPS
    assert sorted(library.OPS) == sorted(OPS) == sorted({op for op, _ in cases()})


@pytest.mark.parametrize("op, args", cases(), ids=[op for op, _ in cases()])
def test_the_fake_implementation_gives_the_real_outputs_shape(op, args):
    torch.library.opcheck(library.OPS[op], args, test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_the_ops_without_a_graph_break():
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((1, 64)).astype(np.float32))
    q = blocks("Q8_0", 16, 64, rng)
    logits = torch.randn(1, 8)

    def f(x, q, logits):
        y = impl("qmatmul", "triton")(x, q, quant.get("Q8_0"))
        w, i = impl("route", "triton")(logits, 2)
        return y * 2, w, i

    got = torch.compile(f, backend="eager", fullgraph=True)(x, q, logits)
    want = f(x, q, logits)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
