"""Strata's Triton kernels, each with a torch implementation beside it.

Not OpenAI's package of the same import name: `__strata__` marks this one, and `strata`
refuses to start when `import triton_kernels` finds another.
"""
__strata__ = True

from .dequant import dequantize, dequantize_torch  # noqa: E402
from .moe import moe, moe_align_block_size, moe_torch, route  # noqa: E402
from .ple import ngram_ids, ngram_ids_torch, ple_gather, ple_gather_torch  # noqa: E402
from .qmatmul import qmatmul, qmatmul_torch  # noqa: E402

__all__ = ["dequantize", "dequantize_torch", "qmatmul", "qmatmul_torch",
           "moe", "moe_torch", "route", "moe_align_block_size",
           "ngram_ids", "ngram_ids_torch", "ple_gather", "ple_gather_torch"]
