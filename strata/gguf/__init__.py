"""GGUF files: read (zero-copy, through the `gguf` package) and write; a GGUF held in memory."""
from .memory import MemoryGGUF
from .reader import GGUFError, GGUFFile, open_gguf
from .writer import write_gguf

__all__ = ["GGUFError", "GGUFFile", "MemoryGGUF", "open_gguf", "write_gguf"]
