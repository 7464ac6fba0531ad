"""Strata's Triton kernels, each with a torch implementation beside it.

Not OpenAI's package of the same import name: `__strata__` marks this one, and `strata`
refuses to start when `import triton_kernels` finds another.

The ops below are imported at their first use (`from triton_kernels import qmatmul`, or
`triton_kernels.dequantize`): importing the package alone, as `strata`'s check does, loads
neither torch nor triton (seconds).
"""
import importlib as _importlib
import sys as _sys
import types as _types

__strata__ = True

# each op -> the module that defines it
_OPS = {
    "dequantize": "dequant", "dequantize_torch": "dequant",
    "qmatmul": "qmatmul", "qmatmul_torch": "qmatmul",
    "moe": "moe", "moe_torch": "moe", "route": "moe",
    "moe_align_block_size": "moe_align", "moe_align_block_size_torch": "moe_align",
    "ngram_ids": "ple", "ngram_ids_torch": "ple", "ple_gather": "ple", "ple_gather_torch": "ple",
}

__all__ = ["dequantize", "dequantize_torch", "qmatmul", "qmatmul_torch",
           "moe", "moe_torch", "route", "moe_align_block_size", "moe_align_block_size_torch",
           "ngram_ids", "ngram_ids_torch", "ple_gather", "ple_gather_torch"]


def __getattr__(name: str):
    module = _OPS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    op = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    if name not in _SHADOWED:
        globals()[name] = op  # found directly from now on
    return op


# `moe` and `qmatmul` are the names of a module and of the op in it. The package's attribute
# is the op (as it was when this file imported them all), even after `import
# triton_kernels.moe` anywhere, whose import would otherwise set the attribute to the module.
_SHADOWED = ("moe", "qmatmul")


class _Package(_types.ModuleType):
    moe = property(lambda self: __getattr__("moe"), lambda self, value: None)
    qmatmul = property(lambda self: __getattr__("qmatmul"), lambda self, value: None)


_sys.modules[__name__].__class__ = _Package
