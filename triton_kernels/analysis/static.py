"""What a kernel costs on a GPU, read from its machine code, with no GPU.

    analyse(op, fmt, target) -> Row      one kernel, compiled as the engine launches it
    rows(ops, formats, targets) -> list[Row]
    toolchain(target) -> str             the Triton and ptxas releases that compiled them

Triton compiles for any target on any machine (`triton.compile(ASTSource(...),
target=GPUTarget(...))`); ptxas, cuobjdump and nvdisasm ship with it. From the cubin
(NVIDIA) or the AMDGCN text (AMD) this module reads the registers, the spilled bytes, the
shared memory and the instructions, finds the main loop (the longest span closed by a
backward branch) and divides its instructions by the weights one thread (lane) handles in
an iteration: **instructions per weight**. Kernels without a loop (dequant, the PLE
gather) divide the whole kernel's count.

A GPU streaming weights at its memory bandwidth B (bytes/s) at `bpw` bits a weight (plus
16 for the bf16 values that dequant and the PLE gather write) must
issue B * 8 / bpw * ipw lane-instructions a second; it can issue units * lanes * clock
(SMs x 4 schedulers x 32 lanes on NVIDIA, CUs x 4 SIMDs x 16 lanes on AMD CDNA3). The
predicted fraction of bandwidth is the smaller of 1 and their ratio:

    pred_bw = min(1, units * lanes * clock / (B * 8 / bpw * ipw))

It bounds from above: memory latency, occupancy, the integer pipe's narrower width on
Hopper and L1 traffic for table look-ups all cost more. It says which kernels cannot be
memory-bound, and how far a change moves them, in seconds on a laptop.

Few instructions are not enough: a memory-bound kernel must also keep enough bytes in
flight. So each row also reads the main loop's global loads (`loads`): the bytes a lane
per load instruction (from the opcode: LDG.E.U16 2, LDG.E 4, LDG.E.128 16;
global_load_ushort 2, global_load_dwordx4 16), the share of bytes moved by loads of 8
bytes or more a lane, and the loads issued before the first use of one; and which matrix
instructions the kernel holds (`mma_kind`: HGMMA, HMMA, MFMA or none).
"""
from __future__ import annotations

import bisect
import functools
import importlib
import itertools
import os
import re
import struct
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import quant

from .. import configs, moe_units
from ..backend import interpreter_on
from .. import layout
from . import OPS, TARGET_SPECS, child
from ..decode import decoder, launch_args, unit

# the MoE's prefill ("dot" path) at the real shape's pp512: about ten slots an expert, one
# 16-row block (moe._default_tiles); moe_gate_up and moe_down are its decode kernels
MOE_DOT_BLOCK_M = 16
# QSA's kernels; their "format" is the dtype of the keys they read (F32, BF16, F16)
QSA_OPS = ("qsa_scores", "qsa_attention", "qsa_pool")
TARGETS = {name: GPUTarget(*spec) for name, spec in TARGET_SPECS.items()}
# The weight of the whole-kernel count: a Llama-3-8B ffn_down, W (N, K) = (4096, 14336).
WHOLE_N, WHOLE_K = 4096, 14336


@dataclass(frozen=True)
class GPU:
    """Published figures: compute units, lanes issued a unit a clock, boost clock, bandwidth."""
    name: str
    target: str
    units: int
    lanes: int
    clock_hz: float
    bandwidth: float   # bytes/s

    @property
    def issue(self) -> float:
        return self.units * self.lanes * self.clock_hz


GPUS = (
    GPU("A100", "sm_80", 108, 4 * 32, 1.41e9, 2.039e12),
    GPU("H100", "sm_90", 132, 4 * 32, 1.98e9, 3.35e12),
    GPU("H200", "sm_90", 132, 4 * 32, 1.98e9, 4.8e12),
    GPU("RTX 4090", "sm_89", 128, 4 * 32, 2.52e9, 1.008e12),
    GPU("MI300X", "gfx942", 304, 4 * 16, 2.1e9, 5.3e12),
    GPU("W7900", "gfx1100", 96, 2 * 32, 2.495e9, 0.864e12),  # RDNA3: two SIMD32 a CU (no dual issue counted)
)


def gpus_for(target: str) -> list[GPU]:
    """The GPUs a target's code predicts for: every NVIDIA GPU for an NVIDIA target (one
    SASS family stands for them), the target's own AMD GPUs (CDNA and RDNA differ in lanes
    and wave width)."""
    if TARGETS[target].backend == "hip":
        return [g for g in GPUS if g.target == target]
    return [g for g in GPUS if TARGETS[g.target].backend != "hip"]


def budget(gpu: GPU, bpw: float) -> float:
    """Instructions a weight that `gpu` can issue while streaming weights at full bandwidth."""
    return gpu.issue / (gpu.bandwidth * 8 / bpw)


def pred_bw(gpu: GPU, bpw: float, ipw: float) -> float:
    return min(1.0, budget(gpu, bpw) / ipw) if ipw > 0 else 1.0


@dataclass
class Row:
    op: str
    format: str
    target: str
    kernel: str
    config: dict
    regs: int
    spill_bytes: int
    shared_bytes: int
    instructions: int          # the whole kernel, as compiled
    loop_instructions: int     # the main loop's body (0: no loop)
    weights_per_iter: float    # weights a thread (lane) handles an iteration (or in all)
    instr_per_weight: float
    instr_per_weight_whole: float  # prologue + iterations + epilogue for WHOLE_N x WHOLE_K
    mix: dict = field(default_factory=dict)
    pred_bw: dict = field(default_factory=dict)
    # the main loop's global loads (the whole kernel's without a loop): see loads()
    bytes_per_load: float = 0.0    # bytes a lane per load instruction, averaged over them
    wide_load_share: float = 0.0   # share of their bytes moved by loads of >= 8 bytes a lane
    loads_in_flight: int = 0       # issued before the first use of any of them
    mma: str = "none"              # the kernel's matrix instructions: HGMMA, HMMA, MFMA, ...
    layout: str = "gguf"           # the weight's bytes as the kernel reads them (triton_kernels.layout)

    def as_dict(self) -> dict:
        return asdict(self)


# --- what the engine launches --------------------------------------------------------------

@dataclass
class Spec:
    """One kernel as launched: the function, signature, constexprs, options, and the
    weights one thread covers per main-loop iteration (or in all, without a loop), and
    per program how many iterations a WHOLE_N x WHOLE_K weight takes and how many programs."""
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int
    weights_per_iter_per_program: int
    iters: int
    programs: int
    options: dict = field(default_factory=dict)
    # integer arguments that a launch at the real shapes passes as multiples of 16, which
    # Triton then specializes (_aligned)
    ints16: tuple = ()


def _sig(names_types: str, **constexprs) -> tuple[dict, dict]:
    """(signature, constexprs) of "name:type,..." in the kernel's order, then `constexprs`.
    "name=1" is an integer a launch passes as 1, which Triton takes as a constant (a
    contiguous row's stride)."""
    sig, fixed = {}, {}
    for item in names_types.split(","):
        name, _, ty = item.strip().partition(":")
        if "=" in name:
            name, value = name.split("=")
            sig[name], fixed[name] = "constexpr", int(value)
        else:
            sig[name] = ty
    for k in constexprs:
        sig[k] = "constexpr"
    return sig, fixed | constexprs


def _family(target: str) -> str:
    """The target's configuration family (configs.family's answer on its device)."""
    return configs.family_of(TARGETS[target].backend, TARGETS[target].warp_size)


def _qsa_spec(op: str, fmt: quant.Format, config: dict | None, target: str = "sm_90") -> Spec:
    """Flash-Next's shapes: indexer 4 heads x 128, budget 64 in blocks of 4; attention
    head_dim 256, 2 query heads a kv head; at 131072 tokens of context, a decode step."""
    qsa = importlib.import_module("triton_kernels.qsa")
    kv = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}.get(fmt.name)
    if kv is None:
        raise ValueError(f"{op}: keys are float32, bfloat16 or float16, not {fmt.name}")
    cfg = config or {}
    # config {"start_ptr": True}: the first position read from the device (a decode graph's)
    start_ptr = bool(cfg.get("start_ptr", False))
    start = "start:*i64" if start_ptr else "start:i32"
    if op == "qsa_scores":
        bn, nb = cfg.get("block_n", qsa.SCORES_BLOCK_N), 131072 // 4
        sig, cx = _sig(f"q_ptr:*fp32,blk_ptr:*{kv},out_ptr:*fp32,T:i32,NB:i32,{start},ratio:i32,"
                       "sqrt_d:fp32,stride_qh:i32,stride_qt:i32,stride_bn:i32,stride_ot:i32",
                       N_IDX=4, NI_P2=4, D=128, D_P2=128, BLOCK_N=bn, START_PTR=start_ptr)
        # no loop: the block-key values of a program
        warps = cfg.get("num_warps", configs.pick("qsa_scores", "", family=_family(target))["num_warps"])
        return Spec(qsa._qsa_scores_kernel, sig, cx, warps, bn * 128, 1, -(-nb // bn))
    if op == "qsa_pool":  # a decode graph's block keys: a program a position, 4 rows of 128
        scaled = bool(cfg.get("scaled", False))
        sig, cx = _sig(f"idx_ptr:*{'i8' if scaled else kv},scale_ptr:*{kv},pos_ptr:*i64,w_ptr:*fp32,cos_ptr:*fp32,"
                       "sin_ptr:*fp32,blocks_ptr:*fp32,C:i32,D:i32,R:i32,ratio:i32,eps:fp32,stride_i:i32,"
                       "stride_s:i32,stride_b:i32", BD=128, SCALED=scaled)
        return Spec(qsa._qsa_pool_kernel, sig, cx, cfg.get("num_warps", 4), 4 * 128, 4, 1)
    bs, slots = cfg.get("block_s", qsa.ATTN_BLOCK_S), 64 + 4 - 1
    # config {"scaled": True}: the int8 cache (strata.nn.kv), codes read in place with one
    # scale a row in `fmt` (BF16); otherwise float keys, and the scale pointers are passed
    # but not read
    # config {"gate": True}: the output gated and written as int8 too (qsa_attention(gate=),
    # a graph's step before a dp4a output projection)
    scaled, gated = bool(cfg.get("scaled", False)), bool(cfg.get("gate", False))
    codes = "i8" if scaled else kv
    sig, cx = _sig(f"q_ptr:*fp32,k_ptr:*{codes},v_ptr:*{codes},sel_ptr:*i64,out_ptr:*fp32,ks_ptr:*{kv},vs_ptr:*{kv},"
                   "gate_ptr:*fp32,x8q_ptr:*i32,x8d_ptr:*fp32,x8s_ptr:*fp32,"
                   f"{start},ratio:i32,keep:i32,sm_scale:fp32,stride_qh:i32,stride_qt:i32,stride_kh:i32,"
                   "stride_kn:i32,stride_vh:i32,stride_vn:i32,stride_st:i32,stride_oh:i32,stride_ot:i32,"
                   "stride_sh:i32,stride_sn:i32,stride_gt:i32",
                   G=2, D=256, D_P2=256, BLOCK_S=bs, SCALED=scaled, START_PTR=start_ptr, GATE=gated, QUANT=gated)
    # K and V elements an iteration; a program a query head
    return Spec(qsa._qsa_attention_kernel, sig, cx, cfg.get("num_warps", 4), 2 * bs * 256, -(-slots // bs), 4)


def _spec(op: str, fmt: quant.Format, target: str = "sm_90", config: dict | None = None) -> Spec:
    if op in QSA_OPS:
        return _qsa_spec(op, fmt, config, target)
    backend = TARGETS[target].backend  # its instruction set:
    asm = "gcn" if backend == "hip" else "ptx"
    # by module path: the package re-exports functions under the names moe and ple
    dequant, int8, moe, ple, qmatmul = (importlib.import_module(f"triton_kernels.{m}") for m in
                                        ("dequant", "int8", "moe", "ple", "qmatmul"))
    u = unit(fmt)
    cfg = configs.pick(op.replace("_dot", ""), fmt.name, family=_family(target)) | (config or {})
    nw = cfg.get("num_warps", 4)
    N, K = WHOLE_N, WHOLE_K
    if op == "dequant":
        if u is not None:
            block = dequant.DEQUANT_UNITS_BLOCK
            sig, cx = _sig("q_ptr:*u16,tab_ptr:*i32,out_ptr:*i16,n_units:i32",
                           **launch_args(fmt, u), BLOCK=block, OUT="bf16", ASM=asm, CVT=True)
            return Spec(dequant._dequant_units_kernel, sig, cx, nw, block * u.weights, 1,
                        N * K // (block * u.weights), {"enable_fp_fusion": False})
        block = 1024
        sig, cx = _sig("q_ptr:*u8,tab_ptr:*u8,out_ptr:*i16,n_elements:i32",
                       DECODE=decoder(fmt), QK=fmt.block_elems, BLOCK=block, OUT_BF16=True)
        return Spec(dequant._dequant_kernel, sig, cx, nw, block, 1, N * K // block,
                    {"enable_fp_fusion": False})
    if op == "gemv":
        if u is not None:
            bn, bu = cfg["block_n"], cfg["block_u"]
            sig, cx = _sig("xq_ptr:*i32,xd_ptr:*fp32,xs_ptr:*fp32,q_ptr:*u16,tab_ptr:*i32,"
                           "out_ptr:*fp32,part_ptr:*fp32,count_ptr:*i32,N:i32,K:i32,stride_om:i32",
                           **launch_args(fmt, u), BLOCK_N=bn, BLOCK_U=bu, MASK=False,
                           SPLIT=cfg["split_k"] if isinstance(cfg.get("split_k"), int) else 1, ASM=asm)
            step = bu * u.weights
            return Spec(int8._gemv_dp4a_kernel, sig, cx, nw, bn * step, -(-K // step), -(-N // bn))
        bm, bn, bk = 1, *qmatmul.GEMV_TILES[1:]
        nw = configs.float_warps(cfg)
        sig, cx = _sig("x_ptr:*bf16,q_ptr:*u8,tab_ptr:*u8,out_ptr:*bf16,M:i32,N:i32,K:i32,"
                       "stride_xm:i32,stride_xk:i32,stride_om:i32",
                       DECODE=decoder(fmt), QK=fmt.block_elems, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        return Spec(qmatmul._gemv_kernel, sig, cx, nw, bn * bk, -(-K // bk), -(-N // bn))
    if op == "gemm":
        if u is not None:
            bm, bn = qmatmul.gemm_unit_tiles(u)
            sig, cx = _sig("x_ptr:*bf16,q_ptr:*u16,tab_ptr:*i32,out_ptr:*bf16,M:i32,N:i32,K:i32,"
                           "stride_xm:i32,stride_xk=1,stride_om:i32", **launch_args(fmt, u),
                           BLOCK_M=bm, BLOCK_N=bn, DOT_DTYPE=tl.bfloat16,
                           INPUT_PRECISION=qmatmul.dot_precision(tl.bfloat16, backend), ASM=asm)
            return Spec(qmatmul._gemm_units_kernel, sig, cx, cfg.get("unit_num_warps", 4), bn * u.weights,
                        K // u.weights, -(-N // bn), ints16=GEMM_INTS16)
        bm, bn, bk = qmatmul.GEMM_TILES
        sig, cx = _sig("x_ptr:*bf16,q_ptr:*u8,tab_ptr:*u8,out_ptr:*bf16,M:i32,N:i32,K:i32,"
                       "stride_xm:i32,stride_xk=1,stride_om:i32",
                       DECODE=decoder(fmt), QK=fmt.block_elems, BLOCK_M=bm, BLOCK_N=bn,
                       BLOCK_K=bk, DOT_DTYPE=tl.bfloat16,
                       INPUT_PRECISION=qmatmul.dot_precision(tl.bfloat16, backend))
        return Spec(qmatmul._gemm_kernel, sig, cx, nw, bn * bk, -(-K // bk), -(-N // bn), ints16=GEMM_INTS16)
    if op in ("moe_gate_up", "moe_down"):
        if u is not None:
            bn, bk = cfg["block_n"], cfg["block_k"]
            if op == "moe_gate_up":
                sig, cx = _sig("xq_ptr:*i32,xd_ptr:*fp32,xs_ptr:*fp32,wg_ptr:*u16,wu_ptr:*u16,"
                               "tab_g_ptr:*i32,tab_u_ptr:*i32,h_ptr:*fp32,hq_ptr:*i32,hd_ptr:*fp32,"
                               "hs_ptr:*fp32,ids_ptr:*i32,top_k:i32,"
                               "E:i32,I:i32,H:i32,gate_se:i32,gate_sr:i32,up_se:i32,up_sr:i32,"
                               "stride_h:i32",
                               **moe_units.suffixed(launch_args(fmt, u), "_G"),
                               **moe_units.suffixed(launch_args(fmt, u), "_U"),
                               BLOCK_N=bn, BLOCK_K=bk, MASK=False, QUANT=bn % 32 == 0, ASM=asm)
                return Spec(moe._gate_up_dp4a_kernel, sig, cx, nw, 2 * bn * bk, -(-K // bk),
                            -(-N // bn))
            sig, cx = _sig("hq_ptr:*i32,hd_ptr:*fp32,hs_ptr:*fp32,wd_ptr:*u16,tab_ptr:*i32,"
                           "rw_ptr:*fp32,out_ptr:*fp32,ids_ptr:*i32,E:i32,H:i32,I:i32,"
                           "down_se:i32,down_sr:i32,stride_o:i32,xq2_ptr:*i32,xd2_ptr:*fp32,xs2_ptr:*fp32,"
                           "q2_ptr:*u16,tab2_ptr:*i32,out2_ptr:*fp32,N2:i32,K2:i32,n_slots:i32",
                           **launch_args(fmt, u), BLOCK_N=bn, BLOCK_K=bk, MASK=False, ASM=asm,
                           **moe._NO_DOWN_PAIR)  # the routed experts alone
            return Spec(moe._down_dp4a_kernel, sig, cx, nw, bn * bk, -(-K // bk), -(-N // bn))
        return _moe_dot_spec(op.replace("moe_", ""), fmt, None, cfg, target)
    if op in ("moe_dot_gate_up", "moe_dot_down"):
        return _moe_dot_spec(op.replace("moe_dot_", ""), fmt, u, cfg, target)
    if op == "ple_gather":
        dim, rows = 160, ple.PLE_BLOCK_ROWS  # the real table's rows: 160 values
        if dim % fmt.block_elems:
            dim = fmt.block_elems
        if u is not None:
            block = ple.PLE_UNITS_BLOCK
            sig, cx = _sig("q_ptr:*u16,tab_ptr:*i32,ids_ptr:*i64,scale_ptr:*fp32,out_ptr:*i16,"
                           "n_units:i32,heads:i32,id_st:i32,id_sh:i32", **launch_args(fmt, u), ROW_UNITS=dim // u.weights,
                           BLOCK=block, HAS_SCALE=False, OUT="bf16", ASM=asm, CVT=True, STRIDED=False)
            return Spec(ple._ple_gather_units_kernel, sig, cx, nw, block * u.weights, 1, 1,
                        {"enable_fp_fusion": False})
        p2 = triton.next_power_of_2(dim)
        sig, cx = _sig("q_ptr:*u8,tab_ptr:*u8,ids_ptr:*i64,scale_ptr:*fp32,out_ptr:*i16,n_rows:i32,"
                       "heads:i32,id_st:i32,id_sh:i32",
                       DECODE=decoder(fmt), QK=fmt.block_elems, ROW_BLOCKS=dim // fmt.block_elems,
                       ROW_DIM=dim, DIM_P2=p2, BLOCK_ROWS=rows, HAS_SCALE=False, OUT_BF16=True, STRIDED=False)
        # counted over the padded tile: the lanes past ROW_DIM are masked, not free
        return Spec(ple._ple_gather_kernel, sig, cx, nw, rows * dim, 1, 1,
                    {"enable_fp_fusion": False})
    raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}")


# a prompt's GEMM: its rows (pp512's 512) and row strides, multiples of 16 as a launch at a
# real shape passes them (and x's column stride 1: "stride_xk=1"), which Triton specializes
GEMM_INTS16 = ("M", "stride_xm", "stride_om")
# the MoE prefill's widths and row strides, multiples of 16 at a real MoE's shapes (Flash-Next's
# hidden 2560 and experts' 640; WHOLE_N and WHOLE_K too): a launch specializes them, which lets
# the compiler prove a row's runs aligned (the SwiGLU product's bf16 rows then load through
# cp.async on sm_90, as float32 rows did without it). A launch may specialize more (the
# slots' count, an expert's stride where they are multiples of 16).
MOE_GATE_UP_INTS16 = ("H", "I", "stride_xt", "stride_h")
MOE_DOWN_INTS16 = ("H", "I", "stride_h", "stride_o")


def _moe_dot_spec(which: str, fmt: quant.Format, u, cfg: dict, target: str) -> Spec:
    """The MoE prefill kernel ("gate_up" or "down") that moe() launches for `fmt`: on
    units where the format has them (triton_kernels.moe_units), else the per-weight one."""
    moe, qmatmul = (importlib.import_module(f"triton_kernels.{m}") for m in ("moe", "qmatmul"))
    N, K = WHOLE_N, WHOLE_K
    bm = MOE_DOT_BLOCK_M
    # constexprs in the kernels' order: a bf16 model's, as qmatmul.dot_types picks them (x and
    # the SwiGLU product h in bf16: moe's dtype)
    backend = TARGETS[target].backend
    asm = "gcn" if backend == "hip" else "ptx"
    dot = dict(DOT_DTYPE=tl.bfloat16, INPUT_PRECISION=qmatmul.dot_precision(tl.bfloat16, backend))
    if u is not None:
        bn = moe_units.unit_tiles(u)
        if which == "gate_up":
            sig, cx = _sig("x_ptr:*bf16,wg_ptr:*u16,wu_ptr:*u16,tab_g_ptr:*i32,tab_u_ptr:*i32,"
                           "h_ptr:*bf16,sorted_ptr:*i32,expert_ids_ptr:*i32,n_post_ptr:*i32,"
                           "n_slots:i32,top_k:i32,I:i32,H:i32,stride_xt:i32,stride_xh=1,"
                           "gate_se:i32,gate_sr:i32,up_se:i32,up_sr:i32,stride_h:i32",
                           **moe_units.suffixed(launch_args(fmt, u), "_G"),
                           **moe_units.suffixed(launch_args(fmt, u), "_U"),
                           STEP=u.weights, BLOCK_M=bm, BLOCK_N=bn, **dot, ASM=asm)
            return Spec(moe_units._gate_up_units_kernel, sig, cx, moe_units.UNIT_WARPS, 2 * bn * u.weights,
                        K // u.weights, -(-N // bn), {"num_stages": moe_units.UNIT_STAGES}, ints16=MOE_GATE_UP_INTS16)
        sig, cx = _sig("h_ptr:*bf16,wd_ptr:*u16,tab_ptr:*i32,rw_ptr:*fp32,out_ptr:*fp32,"
                       "sorted_ptr:*i32,expert_ids_ptr:*i32,n_post_ptr:*i32,n_slots:i32,H:i32,"
                       "I:i32,stride_h:i32,down_se:i32,down_sr:i32,stride_o:i32",
                       **launch_args(fmt, u), STEP=u.weights, BLOCK_M=bm, BLOCK_N=bn, **dot, ASM=asm)
        return Spec(moe_units._down_units_kernel, sig, cx, moe_units.UNIT_WARPS, bn * u.weights,
                    K // u.weights, -(-N // bn), {"num_stages": moe_units.UNIT_STAGES}, ints16=MOE_DOWN_INTS16)
    bn, bk = moe.BLOCK_N_DEFAULT, moe.BLOCK_K_DEFAULT
    nw = cfg.get("dot_num_warps", 4)
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **dot)
    if which == "gate_up":
        sig, cx = _sig("x_ptr:*bf16,wg_ptr:*u8,wu_ptr:*u8,tab_g_ptr:*u8,tab_u_ptr:*u8,"
                       "h_ptr:*bf16,sorted_ptr:*i32,expert_ids_ptr:*i32,n_post_ptr:*i32,"
                       "n_slots:i32,top_k:i32,I:i32,H:i32,stride_xt:i32,stride_xh=1,"
                       "gate_se:i32,gate_sr:i32,up_se:i32,up_sr:i32,stride_h:i32",
                       DECODE_G=decoder(fmt), QK_G=fmt.block_elems, DECODE_U=decoder(fmt),
                       QK_U=fmt.block_elems, **common)
        return Spec(moe._gate_up_kernel, sig, cx, nw, 2 * bn * bk, -(-K // bk), -(-N // bn), ints16=MOE_GATE_UP_INTS16)
    sig, cx = _sig("h_ptr:*bf16,wd_ptr:*u8,tab_ptr:*u8,rw_ptr:*fp32,out_ptr:*fp32,"
                   "sorted_ptr:*i32,expert_ids_ptr:*i32,n_post_ptr:*i32,n_slots:i32,H:i32,"
                   "I:i32,stride_h:i32,down_se:i32,down_sr:i32,stride_o:i32,g2_ptr:*fp32,u2_ptr:*fp32,"
                   "q2_ptr:*u8,tab2_ptr:*u8,out2_ptr:*fp32,N2:i32,K2:i32,blocks:i32",
                   DECODE=decoder(fmt), QK=fmt.block_elems, **common,
                   **moe._NO_FLOAT_PAIR)  # the routed experts alone
    return Spec(moe._down_kernel, sig, cx, nw, bn * bk, -(-K // bk), -(-N // bn), ints16=MOE_DOWN_INTS16)


# --- compiling and reading machine code ----------------------------------------------------

def _nvidia_bin(tool: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


@functools.lru_cache(maxsize=None)
def _compile(kernel, sig_items, cx_items, target: str, num_warps: int, opt_items, aligned: tuple = ()):
    """`aligned`: the arguments a launch would tell the compiler are multiples of 16 (a
    pointer 16-byte aligned, an integer divisible by 16: Triton's specialization of the
    arguments it is given), which lets it prove contiguous runs aligned and widen loads."""
    sig = dict(sig_items)
    names = list(sig)
    cx = {(names.index(k),): v for k, v in cx_items}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in aligned}
    src = ASTSource(kernel, sig, cx, attrs)
    return triton.compile(src, target=TARGETS[target],
                          options={"num_warps": num_warps, **dict(opt_items)})


_NV_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_NV_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
# a branch's target: a label (an ELF cubin's listing) or an address (a raw code stream's)
_NV_BRANCH = re.compile(r"\bBRA\s+(?:\S+\s+)?`?\(?(\.L_x_\d+|0x[0-9a-f]+)\b")
_GCN_INSTR = re.compile(r"^\s+([a-z_][a-z0-9_]*(?:_[a-z0-9]+)*)\b(.*)$")
_GCN_LABEL = re.compile(r"^(\.LBB\d+_\d+):")
_GCN_BRANCH = re.compile(r"^s_(?:cbranch_\w+|branch)$")


def _opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", text)  # predicate guard
    return text.split()[0].split(".")[0]


def _parse_sass(sass: str) -> tuple[list[str], tuple[int, int] | None]:
    ins, labels, branches = [], {}, []
    for line in sass.splitlines():
        m = _NV_LABEL.match(line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = _NV_INSTR.match(line)
        if m:
            labels[hex(int(m.group(1), 16))] = len(ins)  # the instruction's address
            text = m.group(2)
            b = _NV_BRANCH.search(text)
            if b:
                t = b.group(1)
                branches.append((len(ins), hex(int(t, 16)) if t.startswith("0x") else t))
            ins.append(text)
    # drop the padding after the last EXIT: the self-branch and NOPs that align the code
    while ins and (_opcode(ins[-1]) in ("NOP", "BRA")):
        ins.pop()
    return ins, _main_loop(ins, labels, branches, "EXIT")


def _main_loop(ins, labels, branches, end: str) -> tuple[int, int] | None:
    """The longest span closed by a backward branch, of those that hold no unconditional
    end of the program (`end`): code placed after the exit that branches back into the
    kernel is no loop."""
    loops = [(labels[t], i) for i, t in branches if t in labels and labels[t] < i < len(ins)
             and end not in ins[labels[t]:i]]
    return max(loops, key=lambda lo_hi: lo_hi[1] - lo_hi[0]) if loops else None


def _parse_gcn(text: str) -> tuple[list[str], tuple[int, int] | None]:
    ins, labels, branches = [], {}, []
    in_code = False
    for line in text.splitlines():
        if re.match(r"^[A-Za-z_][\w.]*:\s*(;.*)?$", line) and not line.startswith(".L"):
            in_code = True  # the kernel's entry label
            continue
        if line.strip().startswith(".Lfunc_end"):
            in_code = False
        if not in_code:
            continue
        m = _GCN_LABEL.match(line)
        if m:
            # LLVM marks a loop's blocks ("; =>This Inner Loop Header", ";   in Loop:"):
            # a backward branch to any other block is the layout's, not a loop's
            if "Loop Header" in line or "in Loop:" in line:
                labels[m.group(1)] = len(ins)
            continue
        m = _GCN_INSTR.match(line)
        if m and not m.group(1).startswith("."):
            op, operands = m.group(1), m.group(2).split(";")[0].strip()
            if _GCN_BRANCH.match(op):
                t = re.search(r"(\.LBB\d+_\d+)", operands)
                if t:
                    branches.append((len(ins), t.group(1)))
            ins.append(f"{op} {operands}".strip())
    return ins, _main_loop(ins, labels, branches, "s_endpgm")


def _nvidia_usage(cubin: bytes) -> dict:
    """Registers, spilled bytes and shared memory of a cubin's kernel (cuobjdump)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([_nvidia_bin("cuobjdump"), "--dump-resource-usage", path],
                               capture_output=True, text=True, check=True).stdout

    def field_(name):
        m = re.search(rf"\b{name}:(\d+)", usage)
        return int(m.group(1)) if m else 0
    # registers that do not fit spill to the thread's stack frame (STACK; LOCAL counts
    # local arrays): either is memory traffic the kernel was not written to make
    return {"regs": field_("REG"), "spill": field_("STACK") + field_("LOCAL"), "shared": field_("SHARED")}


def _code(cubin: bytes) -> bytes:
    """The machine code of an ELF cubin: its code sections (.text.*) in file order."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    # (name, type, flags, addr, offset, size, ...) of each Elf64_Shdr
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    code = b""
    for name, _, _, _, offset, size in headers:
        if cubin[names + name:cubin.index(b"\0", names + name)].startswith(b".text."):
            code += cubin[offset:offset + size]
    return code


def _disassemble(cubins: list[bytes], target: str) -> list[str]:
    """Each cubin's SASS, from one nvdisasm run for them all: a run costs about 0.4 s of
    start-up whatever the kernel (0.43 s for a one-store kernel, 0.43 s for an IQ3_S GEMV,
    2 AVX2 cores), which was half of an sm_90 compile's time. The cubins' code is joined
    into one raw instruction stream (`nvdisasm -b SM90a`) and the listing cut back at their
    offsets: the same instructions as each cubin's own listing, with branch targets as
    addresses in the stream instead of labels (tests/triton_kernels/analysis/test_static.py
    checks both agree)."""
    codes = [_code(c) for c in cubins]
    if not codes:
        return []
    cap = TARGETS[target].arch
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "code.bin")
        with open(path, "wb") as f:
            f.write(b"".join(codes))
        # sm_90a: Hopper's warpgroup instructions (HGMMA) decode only as the "a" variant;
        # -ndf: no data-flow pass (it only annotates the branch stack), a quarter faster
        listing = subprocess.run([_nvidia_bin("nvdisasm"), "-b", f"SM{cap}{'a' if cap == 90 else ''}", "-ndf",
                                  path], capture_output=True, text=True, check=True).stdout
    starts = list(itertools.accumulate((len(c) for c in codes[:-1]), initial=0))
    parts = [[] for _ in codes]
    for line in listing.splitlines():
        m = _NV_INSTR.match(line)
        if m:
            parts[bisect.bisect_right(starts, int(m.group(1), 16)) - 1].append(line)
    return ["\n".join(p) for p in parts]


def _gcn_resources(text: str) -> dict:
    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0
    # spills are scratch memory (bytes a lane: the kernel descriptor's private segment, which
    # holds its callees' too; a function's own "; ScratchSize" comes before the kernel's in
    # the listing); SGPRs parked in VGPR lanes (".sgpr_spill_count") touch no memory and are
    # not counted. A kernel that calls a function (a noinline @triton.jit: s_swappc) may
    # hold a little scratch for the call's frame alone, its arguments past the VGPRs that
    # AMDGPU's calling convention passes them in: with no spilled VGPR (".vgpr_spill_count")
    # and no instruction that LLVM marks a spill or its reload, up to CALL_FRAME bytes are
    # that frame, written once a call, and not counted
    scratch = num(r"\.amdhsa_private_segment_fixed_size\s+(\d+)") or num(r"ScratchSize:\s+(\d+)")
    frame_only = ("s_swappc_b64" in text and scratch <= CALL_FRAME and not num(r"\.vgpr_spill_count:\s+(\d+)")
                  and not re.search(r"Folded (Spill|Reload)|-byte (Spill|Reload)", text))
    return {"regs": num(r"\.vgpr_count:\s+(\d+)") or num(r"NumVgprs:\s+(\d+)"),
            "spill": 0 if frame_only else scratch,
            "shared": num(r"\.group_segment_fixed_size:\s+(\d+)")}


# a call's frame of a few arguments (the router's routing over an expert cache: 12 bytes)
CALL_FRAME = 32


def usage(k, target: str) -> dict:
    """Registers, spilled bytes and shared memory (bytes, LDS on AMD) of compiled kernel `k`
    on `target`. Shared memory is what Triton asks of the launch (its staging buffers and
    layout conversions: metadata.shared), which the device checks against its limit
    (analysis.SHARED_LIMITS), plus what the code object declares itself: none in Triton's
    kernels, but cuobjdump counts sm_90's 1 KB the driver reserves a block, which the limit
    already leaves out (so sm_90's sums are 1 KB high: a margin, not a miss)."""
    res = _gcn_resources(k.asm["amdgcn"]) if TARGETS[target].backend == "hip" else _nvidia_usage(k.asm["cubin"])
    return {**res, "shared": res["shared"] + int(k.metadata.shared)}


def _mix(ins: list[str]) -> dict:
    return dict(Counter(_opcode(i) for i in ins).most_common(12))


# --- global loads: how wide, how many in flight ------------------------------------------

# SASS: a load's width is an opcode modifier (LDG.E.U16, LDG.E.128); none means 32 bits.
# LDGSTS copies global memory to shared memory without a register (Ampere's cp.async).
_NV_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16, "256": 32}
_NV_LOADS = ("LDG", "LDGSTS")
_NV_STORES = ("ST", "STG", "STS", "STL", "RED", "LDGSTS")  # no register written
# AMDGCN: the width ends the opcode (global_load_dwordx4, buffer_load_ushort, ..._d16_hi)
_GCN_LOAD = re.compile(r"^(?:global|buffer)_load_(?:lds_)?(\w+)")
_GCN_WIDTH = {"ubyte": 1, "sbyte": 1, "ushort": 2, "sshort": 2, "short": 2, "dword": 4,
              "dwordx2": 8, "dwordx3": 12, "dwordx4": 16,
              # RDNA3's names (gfx11): by bits
              "u8": 1, "i8": 1, "u16": 2, "i16": 2, "b32": 4, "b64": 8, "b96": 12, "b128": 16}
_MMA = ("HGMMA", "HMMA", "IGMMA", "IMMA", "QGMMA", "MFMA", "SMFMAC", "WMMA")


def load_width(ins: str) -> int:
    """Bytes a lane that one instruction loads from global memory; 0 if it loads none."""
    op = _opcode(ins)
    if op in _NV_LOADS:
        mods = re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[1:]
        return next((_NV_WIDTH[m] for m in mods if m in _NV_WIDTH), 4)
    m = _GCN_LOAD.match(op)
    if m:
        return _GCN_WIDTH.get(m.group(1).split("_")[0], 4)
    return 0


def _registers(operand: str) -> set:
    """The registers an operand names: R4, R4.64 (R4 and R5), v7, v[8:11], a[0:3]."""
    regs = set()
    for n, wide in re.findall(r"(?<![A-Za-z0-9_])R(\d+)(\.64)?", operand):
        regs.update(("R", int(n) + i) for i in range(2 if wide else 1))
    for kind, n in re.findall(r"(?<![A-Za-z0-9_])([va])(\d+)(?![\w:])", operand):
        regs.add((kind, int(n)))
    for kind, lo, hi in re.findall(r"(?<![A-Za-z0-9_])([va])\[(\d+):(\d+)\]", operand):
        regs.update((kind, i) for i in range(int(lo), int(hi) + 1))
    return regs


def _operands(ins: str) -> tuple[set, set]:
    """(registers written, registers read) by one instruction: the first operand that is
    not a predicate is the destination, except for stores and for SASS's wide loads, whose
    destination spans the registers the width needs."""
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    head, _, rest = ins.partition(" ")
    ops = [o.strip() for o in rest.split(",") if o.strip()]
    op = _opcode(head)
    if op in _NV_STORES or "_store" in op or op.startswith("ds_write") or op.startswith("s_"):
        return set(), set().union(*map(_registers, ops)) if ops else set()
    i = next((j for j, o in enumerate(ops) if not re.fullmatch(r"!?U?P(?:T|\d+)", o)), len(ops))
    dest = _registers(ops[i]) if i < len(ops) else set()
    if op in _NV_LOADS and dest:
        base = min(dest)
        dest = {("R", base[1] + j) for j in range(max(1, load_width(ins) // 4))}
    return dest, set().union(*map(_registers, ops[i + 1:])) if ops[i + 1:] else set()


@dataclass(frozen=True)
class Loads:
    bytes_per_load: float
    wide_load_share: float
    loads_in_flight: int


def loads(body: list[str]) -> Loads:
    """The global loads of a main loop's body (SASS or AMDGCN lines, in program order).

    bytes_per_load: the bytes a lane moves per global-load instruction (LDG, LDGSTS;
    global_load_*, buffer_load_*), averaged over them: their summed widths / their count.
    wide_load_share: the part of those bytes moved by loads of 8 bytes or more a lane.
    loads_in_flight: reading the body once from its top, the loads issued before the
    first instruction that reads a register one of them wrote (or, for LDGSTS, which
    writes shared memory, before the first DEPBAR that waits for the copies). It is what
    one iteration can have outstanding before it must wait. It sees neither loads left in
    flight across the back edge by software pipelining nor a consumer's place on a
    branch not taken, and it counts instructions, not the bytes they carry.
    """
    widths, loaded, in_flight, async_copies = [], set(), None, 0
    for ins in body:
        w = load_width(ins)
        dest, read = _operands(ins)
        if in_flight is None and ((read & loaded) or (async_copies and _opcode(ins) == "DEPBAR")):
            in_flight = len(widths)
        if w:
            widths.append(w)
            loaded |= dest
            async_copies += _opcode(ins) == "LDGSTS"
        else:
            loaded -= dest  # a register written again no longer holds a load's result
    total = sum(widths)
    return Loads(bytes_per_load=round(total / len(widths), 3) if widths else 0.0,
                 wide_load_share=round(sum(w for w in widths if w >= 8) / total, 3) if total else 0.0,
                 loads_in_flight=len(widths) if in_flight is None else in_flight)


def mma_kind(ins: list[str]) -> str:
    """The matrix instructions a kernel holds: HGMMA (Hopper's warpgroup MMA), HMMA (the
    warp-level tensor-core MMA), IMMA / IGMMA (integer), MFMA (AMD CDNA), WMMA (AMD RDNA3),
    joined by "+"; "none" without any."""
    found = {_opcode(i).upper() for i in ins}
    found = {"MFMA" if f.startswith("V_MFMA") else "SMFMAC" if f.startswith("V_SMFMAC")
             else "WMMA" if f.startswith("V_WMMA") else f for f in found}
    return "+".join(k for k in _MMA if k in found) or "none"


def analyse(op: str, fmt: str | quant.Format, target: str = "sm_90",
            config: dict | None = None) -> Row:
    """Compile `op` for `fmt` at the engine's configuration for `target` (with `config`'s
    entries, e.g. {"block_n": 4, "block_u": 32}, over it) and read its machine code."""
    return rows([op], [quant.get(fmt).name], [target], config)[0]


def rows(ops=OPS, formats=None, targets=("sm_90",), config: dict | None = None) -> list[Row]:
    """analyse() for every target x op x format. Under the Triton interpreter (the tests
    and notebooks set TRITON_INTERPRET=1, which makes every kernel an interpreted
    function) the compiling runs in a child process without it."""
    formats = formats or [f.name for f in quant.FORMATS.values()]
    for t in targets:
        if t not in TARGETS:
            raise ValueError(f"unknown target {t!r}; targets: {', '.join(TARGETS)}")
    if interpreter_on():
        return _rows_in_child(list(ops), list(formats), list(targets), config)
    built = [_build(op, f, t, config) for t in targets for op in ops for f in formats]
    sass = {}  # index in built -> SASS, from one disassembler run a target
    for t in targets:
        mine = [i for i, b in enumerate(built) if b.target == t and not b.amd]
        sass.update(zip(mine, _disassemble([built[i].kernel.asm["cubin"] for i in mine], t)))
    return [_row(b, sass.get(i)) for i, b in enumerate(built)]


def toolchain(target: str) -> str:
    """The compiler behind a target's rows: Triton's release and, on NVIDIA, the ptxas it
    runs. Registers, spills and counts move between releases (Triton 3.6 ships ptxas 12.8,
    3.9 ptxas 13.4: triton_kernels/NOTES.md), so a table names the one that made it."""
    spec = TARGETS[target]
    if spec.backend == "hip":
        return f"Triton {triton.__version__}, LLVM's AMDGPU backend"
    from triton.backends.nvidia.compiler import get_ptxas
    return f"Triton {triton.__version__}, ptxas {get_ptxas(spec.arch).version}"


def _rows_in_child(ops, formats, targets, config) -> list[Row]:
    reply = child.call(__name__, {"ops": ops, "formats": formats, "targets": targets, "config": config})
    return [Row(**r) for r in reply["rows"]]


def serve(request: dict) -> dict:
    """rows() for a request of _rows_in_child, in the child process (analysis.child)."""
    out = rows(request["ops"], request["formats"], request["targets"], request["config"])
    return {"rows": [r.as_dict() for r in out]}


def _aligned(spec: Spec) -> tuple:
    """What a launch of the spec's kernel specializes as multiples of 16: every pointer (a
    torch allocation, or the launchers' aligned views of one) and the shape's N and K
    where the signature takes them (WHOLE_N, WHOLE_K), and the spec's ints16."""
    unknown = set(spec.ints16) - set(spec.signature)
    assert not unknown, f"{spec.kernel.__name__} takes no {sorted(unknown)}"
    return tuple(k for k, t in spec.signature.items()
                 if t.startswith("*") or k in spec.ints16 or (k in ("N", "K") and t.startswith("i") and
                                                              {"N": WHOLE_N, "K": WHOLE_K}[k] % 16 == 0))


@dataclass
class _Built:
    """One kernel compiled as the engine launches it, before its machine code is read."""
    op: str
    fmt: quant.Format
    target: str
    held: quant.Format
    spec: Spec
    kernel: object
    amd: bool


def _build(op: str, fmt: str | quant.Format, target: str, config: dict | None) -> _Built:
    fmt = quant.get(fmt)
    amd = TARGETS[target].backend == "hip"
    # a weight in the layout a GPU holds it in (STRATA_LAYOUT=gguf: GGUF order); the PLE
    # table and the QSA keys are read as stored
    held = fmt if op in QSA_OPS or op == "ple_gather" else layout.choose(fmt, "cuda", layout.TILE_BLOCKS)
    spec = _spec(op, held, target, config)
    k = _compile(spec.kernel, tuple(spec.signature.items()), tuple(spec.constexprs.items()),
                 target, spec.num_warps, tuple(spec.options.items()), _aligned(spec))
    return _Built(op, fmt, target, held, spec, k, amd)


def _row(b: _Built, sass: str | None) -> Row:
    """The row of a built kernel; `sass`: its SASS (NVIDIA), from _disassemble."""
    op, fmt, target, held, spec, k, amd = b.op, b.fmt, b.target, b.held, b.spec, b.kernel, b.amd
    if amd:
        ins, loop = _parse_gcn(k.asm["amdgcn"])
    else:
        ins, loop = _parse_sass(sass)
    res = usage(k, target)
    threads = spec.num_warps * TARGETS[target].warp_size
    per_thread = spec.weights_per_iter_per_program / threads
    body = (loop[1] - loop[0] + 1) if loop else 0
    ipw = (body if loop else len(ins)) / per_thread
    dynamic = len(ins) - body + body * spec.iters
    whole = dynamic * threads * spec.programs / (spec.weights_per_iter_per_program * spec.iters
                                                  * spec.programs)
    bpw = fmt.block_bytes * 8 / fmt.block_elems
    if op in ("dequant", "ple_gather"):
        bpw += 16  # the bf16 values written move through the same memory
    row = Row(op=op, format=fmt.name, target=target, kernel=spec.kernel.__name__,
              config={k_: v for k_, v in spec.constexprs.items()
                      if k_.startswith("BLOCK") or k_ in ("MASK", "SCALED", "SPLIT", "START_PTR", "QUANT", "GATE")}
              | {"num_warps": spec.num_warps},
              regs=res["regs"], spill_bytes=res["spill"], shared_bytes=res["shared"],
              instructions=len(ins), loop_instructions=body, weights_per_iter=per_thread,
              instr_per_weight=round(ipw, 3), instr_per_weight_whole=round(whole, 3),
              mix=_mix(ins[loop[0]:loop[1] + 1] if loop else ins),
              mma=mma_kind(ins), layout=held.layout,
              **asdict(loads(ins[loop[0]:loop[1] + 1] if loop else ins)))
    row.pred_bw = {g.name: round(pred_bw(g, bpw, ipw), 3) for g in gpus_for(target)}
    return row
