"""GGUF tensor names of the `llama` architecture (llama.cpp's LLM_ARCH_LLAMA)."""
from __future__ import annotations

from strata.names import OUTPUT, TOKEN_EMBD  # noqa: F401  (OUTPUT absent: tied to TOKEN_EMBD)
OUTPUT_NORM = "output_norm.weight"

# blk.N.<name>
ATTN_NORM = "attn_norm.weight"
ATTN_Q, ATTN_K, ATTN_V = "attn_q.weight", "attn_k.weight", "attn_v.weight"
ATTN_OUT = "attn_output.weight"
FFN_NORM = "ffn_norm.weight"
FFN_GATE, FFN_UP, FFN_DOWN = "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"


def blk(i: int, name: str) -> str:
    return f"blk.{i}.{name}"
