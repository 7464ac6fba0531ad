"""Integer instructions Triton has no op for, each with a pure-Triton twin.

    dp4a(a, b, c, ASM)    c + the dot product of a's and b's four signed bytes
    pack16(lo, hi, ASM)   two 16-bit halves -> one 32-bit word (lo in the low half)

ASM is a constexpr naming the instruction set: "ptx" (NVIDIA: `dp4a.s32.s32`, sm_61 on),
"gcn" (AMD CDNA/RDNA: `v_dot4_i32_i8`), or "" for the twin. The interpreter cannot run
inline assembly, so the tests run the twin on the CPU; on a device the two give the same
integers (tests/triton_kernels/test_asm.py runs both under `-m cuda`). `asm_for(device)`
is the one place that picks ASM.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import backend
from .backend import interpreter_on


def asm_for(device: torch.device | str) -> str:
    """The ASM constexpr for kernels launched on `device`: "" under the interpreter (and
    the target's while triton_kernels.analysis.launches compiles for one)."""
    if backend._target is None and (torch.device(device).type != "cuda" or interpreter_on()):
        return ""
    return "gcn" if backend.backend_name() == "hip" else "ptx"


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cvt_pairs(device: torch.device | str) -> bool:
    """Whether an NVIDIA device converts two float32 to a bf16 or float16 pair in one
    instruction (cvt.rn.bf16x2.f32 / f16x2: sm_80 and later, PTX ISA); a fake or absent
    CUDA device (a trace, a static compile) counts as a Hopper."""
    if backend.backend_name() == "hip":
        return False
    device = torch.device(device)
    if device.type != "cuda":  # the interpreter's tensors, a replay's for a compile
        return True
    try:
        return _capability(device.index) >= (8, 0)  # asked at every launch: cached
    except (RuntimeError, AssertionError):
        return True


@triton.jit
def _sbyte(v, i: tl.constexpr):
    """Signed byte i (0 = lowest) of int32 v, as int32."""
    return (v << (24 - 8 * i)) >> 24


@triton.jit
def dp4a(a, b, c, ASM: tl.constexpr):
    if ASM == "ptx":
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    elif ASM == "gcn":
        return tl.inline_asm_elementwise("v_dot4_i32_i8 $0, $1, $2, $3", "=v,v,v,v", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (c + _sbyte(a, 0) * _sbyte(b, 0) + _sbyte(a, 1) * _sbyte(b, 1)
                + _sbyte(a, 2) * _sbyte(b, 2) + _sbyte(a, 3) * _sbyte(b, 3))


@triton.jit
def pack16(lo, hi, ASM: tl.constexpr):
    """lo, hi: uint16 tensors. One PRMT on NVIDIA (the compiler's own zero-extend, shift
    and or take three instructions)."""
    if ASM == "ptx":
        return tl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (lo.to(tl.uint32) | (hi.to(tl.uint32) << 16)).to(tl.int32, bitcast=True)


@triton.jit
def _pick(a, b, s):
    """Byte s (0..7) of the 8 bytes b:a (a holds bytes 0-3), as uint32."""
    v = a.to(tl.uint32, bitcast=True).to(tl.uint64) | (b.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
    return ((v >> (8 * s).to(tl.uint64)) & 0xFF).to(tl.uint32)


@triton.jit
def prmt(a, b, sel, ASM: tl.constexpr):
    """Byte permute: result byte i is byte (sel >> 4i) & 7 of b:a, for i = 0..3. The
    selector nibbles must have bit 3 clear (PTX reads it as sign replication)."""
    if ASM == "ptx":
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = (tl.zeros_like(a) + sel).to(tl.uint32, bitcast=True)  # sel may be a constant
        r = (_pick(a, b, s & 7) | (_pick(a, b, (s >> 4) & 7) << 8)
             | (_pick(a, b, (s >> 8) & 7) << 16) | (_pick(a, b, (s >> 12) & 7) << 24))
        return r.to(tl.int32, bitcast=True)
