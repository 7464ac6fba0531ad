"""`strata quantize`: numpy and the GGUF reader alone, so that it starts in a fraction of a
second (torch, which every other command imports, takes seconds)."""
from __future__ import annotations

import sys

from strata.gguf import GGUFError
from strata.quantize import QuantizeError, quantize_model


def quantize(args) -> int:
    """`strata quantize IN.gguf OUT.gguf TYPE`; a bad type, flag or file: exit status 2."""
    try:
        quantize_model(args.input, args.output, args.type, imatrix=args.imatrix,
                       tensor_types=args.tensor_type or [], pure=args.pure,
                       threads=args.threads or 1)
    except (QuantizeError, GGUFError, ValueError) as e:  # bad input or file, named
        print(f"strata quantize: {e}", file=sys.stderr)
        return 2
    return 0
