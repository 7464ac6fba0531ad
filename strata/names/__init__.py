"""Tensor names of each GGUF architecture, one module an architecture (the names every
architecture shares, here): the loaders in strata.load read them, and strata.convert
writes them with the Hugging Face names they come from, where Strata converts that
architecture."""

# llama.cpp's names for every architecture
TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"  # absent where the output is tied to TOKEN_EMBD
