"""The CPU's compiled torch paths (torch.compile, Inductor; no Triton): the Compiled wrapper
and when it compiles (compiled.py), the int8-code matmul (codes.py), the one-pass dequant
of Q8_0, Q4_0 and IQ4_NL (dequant_compiled.py)."""
