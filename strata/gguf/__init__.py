"""GGUF files: read (zero-copy, through the `gguf` package) and write."""
from .reader import GGUFError, GGUFFile, open_gguf
from .writer import write_gguf

__all__ = ["GGUFError", "GGUFFile", "open_gguf", "write_gguf"]
