"""Strata: a Triton-kernel research engine for huge quantized mixture-of-experts models."""
from __future__ import annotations

__version__ = "0.1.0"


def _check_kernels_package() -> None:
    # OpenAI ships a package imported as `triton_kernels` too (vLLM and transformers pull it
    # in); when it shadows ours, fail here with a remedy rather than deep inside a kernel.
    import triton_kernels
    if not getattr(triton_kernels, "__strata__", False):
        where = getattr(triton_kernels, "__file__", None) or list(getattr(triton_kernels, "__path__", []))
        raise ImportError(
            f"strata: `import triton_kernels` found another package of that name at {where}, "
            "not Strata's kernels (OpenAI's triton_kernels, installed with vLLM or transformers, "
            "uses the same import name). Uninstall it (`pip uninstall triton_kernels`) or run "
            "Strata in its own virtual environment.")


_check_kernels_package()
