"""Q8_0, Q4_0 and IQ4_NL dequantized in one pass by torch.compile: the CPU path at the
speed of its writes.

    dequantize_torch(q, fmt, compiled=True)     or     STRATA_DEQUANT_COMPILE=1

Eager torch needs two passes over a dequantized tensor (the codes converted to float, then
scaled), and for these formats the C loop of ggml's `to_float` is bound by its writes, so no
eager sequence of ops matches it. Inductor fuses each function below into one C++ loop that
reads a block and writes its weights once. Each repeats the reference's float operations
(one product a weight), so the output is bit-identical to quant/ (the property tests in
tests/triton_kernels/test_dequant_torch.py say so, under STRATA_TEST_COMPILE=1).

Opt-in, because compiling costs more than most loads gain: measured on 2 cores, the first
compile in a process takes about 10 s with Inductor's disk cache warm and 30-45 s cold
(importing Dynamo and Inductor alone is about 4 s), a further format 0.3 s warm and 2-10 s
cold; one thread then dequantizes Q8_0 at about 1.2 G weights a second against eager's 0.5 G
(64 MiB of blocks). A server or a load of many GB gains; a notebook with a small model does
not. Each function compiles once (lazily, on first use), with the block count dynamic.

The IQ3 formats are absent on purpose: their eager path (gathered int8 codes) runs at about
twice ggml's speed, and Inductor's code for them measured slower than that.
"""
from __future__ import annotations

import warnings

import torch

import quant


def _lead_scale(b):
    return b.view(torch.float16)[:, :1].float()


def _q8_0(b, out, tab, shifts):
    out.copy_(b[:, 2:].view(torch.int8).float() * _lead_scale(b))


def _nibbles(b, shifts):
    """(n, 18) blocks -> (n, 2, 16) int32 nibble codes: low halves, then high halves. The
    shifts come in as a tensor: a stack or cat of the two halves does not vectorize."""
    return (b[:, None, 2:].to(torch.int32) >> shifts[None, :, None]) & 0x0F


def _q4_0(b, out, tab, shifts):
    n = b.shape[0]
    out.view(n, 2, 16).copy_(_lead_scale(b)[:, :, None] * (_nibbles(b, shifts) - 8).float())


def _iq4_nl(b, out, tab, shifts):
    n = b.shape[0]
    out.view(n, 2, 16).copy_(_lead_scale(b)[:, :, None] * tab[_nibbles(b, shifts)])


FUSED = {"Q8_0": _q8_0, "Q4_0": _q4_0, "IQ4_NL": _iq4_nl}
_COMPILED: dict[str, object] = {}
_TABS: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}


def has_fused(fmt: quant.Format) -> bool:
    return fmt.name in FUSED


def _tables(fmt: quant.Format, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (fmt.name, str(device))
    if key not in _TABS:
        from quant import iq4
        tab = torch.from_numpy(iq4.KVALUES.astype("float32")) if fmt.name == "IQ4_NL" else torch.zeros(1)
        _TABS[key] = (tab.to(device), torch.tensor([0, 4], dtype=torch.int32, device=device))
    return _TABS[key]


def dequantize_fused(b: torch.Tensor, fmt: quant.Format, out: torch.Tensor) -> None:
    """Fill `out` ((n, block_elems), float32, float16 or bfloat16, contiguous) from the
    (n, block_bytes) blocks `b` (contiguous, 2-byte aligned, n >= 2: a dimension of 1 would
    be specialized and compiled again)."""
    fn = _COMPILED.get(fmt.name)
    if fn is None:
        fn = _COMPILED[fmt.name] = torch.compile(FUSED[fmt.name], dynamic=False, fullgraph=True)
    torch._dynamo.maybe_mark_dynamic(b, 0)
    torch._dynamo.maybe_mark_dynamic(out, 0)
    with warnings.catch_warnings():
        # Inductor notes the fp16 scale beside a bf16 output; both are exact here
        warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed")
        fn(b, out, *_tables(fmt, b.device))
