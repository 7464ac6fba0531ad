"""numpy models of the integer instructions behind triton_kernels.asm, any shape in, that
shape out:

    dp4a(a, b, c)    c + sum_i sbyte_i(a) * sbyte_i(b), wrapping in int32 (PTX dp4a.s32.s32)
    pack16(lo, hi)   lo | hi << 16, as int32 (PTX mov.b32 {lo, hi})
    prmt(a, b, sel)  byte i of the result = byte (sel >> 4i) & 7 of the eight bytes b:a
                     (a holds bytes 0-3), for selector nibbles with bit 3 clear (PTX
                     prmt.b32, default mode; bits 16-31 of sel are ignored)

tests/triton_kernels/test_asm.py holds the kernels' pure-Triton twins to them (and the
instructions, on a device); the suite's interpreter computes the twins by them
(tests/triton_interpreter.py, instructions_by_their_models).
"""
import numpy as np


def _bytes(v: np.ndarray, dtype) -> np.ndarray:
    """The four bytes of each int32 of v, on a new last axis (byte 0 first)."""
    return np.ascontiguousarray(v).view(dtype).reshape(*v.shape, 4)


def dp4a_model(a, b, c) -> np.ndarray:
    a, b, c = np.broadcast_arrays(np.asarray(a, np.int32), np.asarray(b, np.int32), np.asarray(c, np.int32))
    products = (_bytes(a, np.int8).astype(np.int64) * _bytes(b, np.int8)).sum(axis=-1)
    v = c.astype(np.int64) + products
    return ((v + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32)


def pack16_model(lo, hi) -> np.ndarray:
    w = np.asarray(lo, np.uint16).astype(np.uint32) | (np.asarray(hi, np.uint16).astype(np.uint32) << 16)
    return w.view(np.int32)


def prmt_selects(sel) -> np.ndarray:
    """The byte each result byte takes, on a new last axis: (sel >> 4i) & 0xF."""
    return (np.asarray(sel, np.int64)[..., None] >> (4 * np.arange(4))) & 0xF


def prmt_model(a, b, sel) -> np.ndarray:
    a, b, sel = np.broadcast_arrays(np.asarray(a, np.int32), np.asarray(b, np.int32), np.asarray(sel, np.int64))
    eight = np.concatenate([_bytes(a, np.uint8), _bytes(b, np.uint8)], axis=-1)
    idx = prmt_selects(sel)
    assert not (idx & 8).any(), "the model covers selector nibbles with bit 3 clear only"
    return np.ascontiguousarray(np.take_along_axis(eight, idx, axis=-1)).view(np.int32)[..., 0]
