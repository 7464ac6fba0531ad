"""Reading the kernels without a GPU: compiled for sm_90, gfx942 or another target
(TARGET_SPECS), their machine code
read (static.py: registers, spills, instructions a weight, load widths, matrix
instructions), and a model's launches recorded and compiled for a target (launches.py).
Nothing here runs a kernel."""

# The ops and targets by name, without importing triton: the command line's flags and their
# help list them (static.py builds its targets from these).
OPS = ("dequant", "gemv", "gemm", "moe_gate_up", "moe_down", "ple_gather", "moe_dot_gate_up", "moe_dot_down")
# gfx1100: RDNA3 (Radeon PRO W7900, RX 7900), 32-lane waves, no TF32 in Triton's backend
TARGET_SPECS = {  # name -> triton's GPUTarget(backend, arch, warp size)
    "sm_80": ("cuda", 80, 32),
    "sm_89": ("cuda", 89, 32),
    "sm_90": ("cuda", 90, 32),
    "gfx942": ("hip", "gfx942", 64),
    "gfx1100": ("hip", "gfx1100", 32),
}
# The shared memory (LDS on AMD) one program may ask for on each target, in bytes: CUDA's
# "maximum shared memory per thread block" with the opt-in (compute capability 8.0: 163 KB,
# 8.9: 99 KB, 9.0: 227 KB) and the 64 KB of LDS a workgroup on CDNA3 and RDNA3. A kernel
# over it compiles, then fails its first launch (Triton's OutOfResources), so the compile
# checks hold it.
SHARED_LIMITS = {"sm_80": 163 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024, "gfx942": 64 * 1024,
                 "gfx1100": 64 * 1024}


def problems(target: str, spill_bytes: int, shared_bytes: int, error: str = "", ok: bool = True) -> str:
    """Why a kernel would not run as compiled for `target` ("" when it would): the
    compile's error, spilled registers, or more shared memory than a program gets."""
    if not ok:
        return error or "not compiled"
    found = []
    if spill_bytes:
        found.append(f"{spill_bytes} B spilled")
    if shared_bytes > SHARED_LIMITS[target]:
        found.append(f"{shared_bytes} B of shared memory, over the {SHARED_LIMITS[target]} B a program gets")
    return "; ".join(found)
