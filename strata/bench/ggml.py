"""ggml's own C dequantizers, `to_float` in its type traits, called through ctypes in the
libggml-base.so that llama-cpp-python bundles: the peer of `strata bench dequant --peer ggml`.

    void to_float(const void * x, float * y, int64_t k)     (ggml.h: struct ggml_type_traits)

It writes k floats into the caller's buffer on the calling thread, one pass, no allocation.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

import quant

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _Traits(ctypes.Structure):
    # ggml.h of llama-cpp-python 0.3.36 (ggml 0.25): struct ggml_type_traits
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", _TO_FLOAT), ("from_float_ref", ctypes.c_void_p)]


def library_path() -> Path:
    """libggml-base.so of the importable llama_cpp package; ValueError saying what to do."""
    try:
        import llama_cpp
    except ImportError:
        raise ValueError("--peer ggml: llama-cpp-python is not importable here; build it as the README "
                         "says (or put it on PYTHONPATH), or use --peer gguf-py") from None
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not path.exists():
        raise ValueError(f"--peer ggml: {path} is missing; this llama-cpp-python has no libggml-base.so")
    return path


class Ggml:
    def __init__(self, path: Path | None = None):
        self.lib = ctypes.CDLL(str(path or library_path()))
        self.lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        self.lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.lib.ggml_version.restype = ctypes.c_char_p
        self.version = f"ggml {self.lib.ggml_version().decode()}"

    def to_float(self, fmt: quant.Format):
        """ggml's to_float for `fmt`, or None where ggml has none or its block differs
        (a format of Strata's own, or a different type id)."""
        if fmt.type_id is None:
            return None
        tr = self.lib.ggml_get_type_traits(fmt.type_id).contents
        if not tr.to_float or tr.blck_size != fmt.block_elems or tr.type_size != fmt.block_bytes:
            return None
        return tr.to_float

    def dequantize(self, fn, raw: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Run to_float `fn` over the contiguous blocks `raw` into the float32 array `out`."""
        if not (raw.flags.c_contiguous and out.flags.c_contiguous and out.dtype == np.float32):
            raise ValueError("ggml to_float: contiguous blocks and a contiguous float32 output, please")
        fn(raw.ctypes.data, out.ctypes.data, out.size)
        return out
