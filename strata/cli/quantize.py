"""`strata quantize`: numpy and the GGUF reader alone, so that it starts in a fraction of a
second (torch, which every other command imports, takes seconds)."""
from __future__ import annotations

import ctypes
import sys

from strata.gguf import GGUFError
from strata.quantize import QuantizeError, quantize_model

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _reuse_freed_memory() -> None:
    """Keep numpy's freed temporaries in the heap for the next ones. By default glibc maps
    each block over its mmap threshold afresh and hands freed heap back to the system, so
    every megabyte-sized temporary of the quantizers faults its pages in again: a quarter
    of a million page faults, 0.3 s of SmolLM2's 2 s. Blocks up to 32 MiB (glibc's largest
    threshold) now come from the heap, which is never trimmed. Not glibc: nothing to do."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)


def quantize(args) -> int:
    """`strata quantize IN.gguf OUT.gguf TYPE`; a bad type, flag or file: exit status 2."""
    _reuse_freed_memory()
    try:
        quantize_model(args.input, args.output, args.type, imatrix=args.imatrix,
                       tensor_types=args.tensor_type or [], pure=args.pure,
                       threads=args.threads or 1)
    except (QuantizeError, GGUFError, ValueError) as e:  # bad input or file, named
        print(f"strata quantize: {e}", file=sys.stderr)
        return 2
    return 0
