"""The one error `strata convert` raises for bad input."""


class ConvertError(ValueError):
    """A checkpoint, output path or flag `strata convert` cannot use; the message names the
    file, tensor or flag, and what to do."""
