"""Model building blocks; the matmuls go through triton_kernels."""
from . import kv
from .attention import Attention, KVCache
from .linear import QuantLinear
from .norm import RMSNorm
from .rope import Rope, RopeScaling

__all__ = ["Attention", "KVCache", "QuantLinear", "RMSNorm", "Rope", "RopeScaling", "kv"]
