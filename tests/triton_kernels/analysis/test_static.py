"""The static GPU check (triton_kernels.analysis.static), with no GPU: every kernel compiles for
sm_90, gfx942 and gfx1100 at the engine's configuration with no spills, the decode kernels stay
within llama.cpp's instructions per weight, the machine-code reader finds main loops and
reads their global loads' widths, and the GEMM's tl.dot reaches the matrix units.

The bounds are llama.cpp's `mul_mat_vec_q` compiled for sm_90 and counted the same way
(shared/REFERENCE.md section 6): main loop Q8_0 3.66, Q4_0 2.72, IQ4_NL 4.75, IQ3_S 5.84,
IQ3_XXS 5.66 (Q4_K: 5.0), and the whole kernel over a 4096 x 14336 weight 4.8, 3.6, 5.5,
6.7, 6.5. Instruction counts depend on the Triton release (its LLVM and ptxas); the
suite pins none, so a new release that costs more fails here, which is the point.
"""
import pytest

import quant
from triton_kernels.analysis import SHARED_LIMITS, problems, static
from triton_kernels.decode import UNITS
from triton_kernels.layout.split import has_split

LOOP_BOUND = {"Q8_0": 3.66, "Q4_0": 2.72, "IQ4_NL": 4.75, "IQ3_S": 5.84, "IQ3_XXS": 5.66, "Q4_K": 5.0}
# main-loop instructions a weight of the decode kernels on GGUF bytes with 16-bit loads,
# before the device layout and its 8-byte loads (triton_kernels.layout), which must not
# cost more; per (gemv, moe_gate_up, moe_down)
BEFORE_LAYOUT = {"Q8_0": (1.84, 1.44, 1.62), "Q4_0": (2.16, 1.56, 1.78), "Q4_K": (2.38, 2.36, 2.77),
                 "IQ4_NL": (3.25, 3.21, 3.33), "IQ3_S": (5.25, 4.71, 5.12), "IQ3_XXS": (4.22, 3.65, 3.94)}
# the least share of the main loop's global-load bytes moved by loads of 8 bytes or more
# a lane: IQ3's grid look-ups are 4-byte gathers
WIDE_SHARE = {"IQ3_S": 0.25, "IQ3_XXS": 0.25}
# instructions a weight of dequant and the PLE gather (bf16 out) before the device layout,
# which must not cost more: per (dequant, ple_gather)
BEFORE_LAYOUT_STORES = {"Q8_0": (5.81, 6.41), "Q4_0": (7.91, 8.47), "Q4_K": (8.31, 8.41),
                        "IQ4_NL": (7.44, 7.97), "IQ3_S": (9.16, 9.28), "IQ3_XXS": (8.22, 8.34)}
WHOLE_BOUND = {"Q8_0": 4.8, "Q4_0": 3.6, "IQ4_NL": 5.5, "IQ3_S": 6.7, "IQ3_XXS": 6.5, "Q4_K": 5.0}
# the other formats with int8 units (Q4_1, Q5_0, Q5_1, IQ4_XS, the K-quants but Q4_K, the IQ2
# and IQ1 formats; Q5_0, Q3_K and Q6_K in the split layout): the most main-loop
# instructions a weight of each decode kernel, where their per-weight decode took 13.7
# (IQ1_S's GEMV) to 89.0 (IQ1_M's MoE down); and at least half their bytes in 8-byte loads,
# but for Q4_1 (20-byte blocks: its nibbles are 4-byte aligned, int32 words)
OTHER_UNIT_BOUND = 4.0
# their dequant and PLE gather (bf16 out) with the per-weight decode, which the units must
# not cost more than (Q4_1 took units first: the budget alone holds it)
PER_WEIGHT_STORES = {"Q5_0": (44.0, 45.5), "Q5_1": (51.25, 49.25), "IQ4_XS": (78.75, 27.75),
                     "Q2_K": (53.62, 21.25), "Q3_K": (85.5, 35.84), "Q5_K": (85.5, 28.69),
                     "Q6_K": (69.38, 36.31), "IQ2_XXS": (64.12, 31.47), "IQ2_XS": (61.38, 21.09),
                     "IQ2_S": (61.12, 20.53), "IQ1_S": (53.12, 19.31), "IQ1_M": (83.75, 21.28)}
FORMATS = [f.name for f in quant.FORMATS.values()]
OTHER_UNITS = [f for f in UNITS if f not in LOOP_BOUND]
# the MoE prefill on units (triton_kernels.moe_units) at 16 slots: the most main-loop
# instructions a weight of gate/up and down, where the per-weight kernels spent 27.2 (Q4_0's
# gate/up) to 86.1 (IQ3_XXS's down) in the six formats above; Q3_K's down is the costliest
# unit format, 24.0 (26.4 with float32 h and the widths unspecialized)
MOE_DOT_BOUND = {**{f: 18.0 for f in LOOP_BOUND}, **{f: 27.0 for f in OTHER_UNITS}}


# each a child process (importing torch and triton costs seconds), so that the suite's
# workers share the compiles: sm_90's GEMMs, its decode kernels, its dequant and gather;
# gfx942's and gfx1100's decode kernels, the rest
AMD_GROUPS = [("gemv", "moe_gate_up", "moe_down"), ("dequant", "ple_gather", "gemm"),
              ("moe_dot_gate_up", "moe_dot_down")]
GROUPS = {"sm_90": [("gemm",), ("gemv", "moe_gate_up", "moe_down"), ("dequant", "ple_gather"),
                    ("moe_dot_gate_up", "moe_dot_down")],
          "gfx942": AMD_GROUPS, "gfx1100": AMD_GROUPS}
# the matrix instructions of the GEMM (64-row tiles) and of the MoE prefill (16-slot blocks:
# sm_90's warpgroup MMA needs 64 rows) on each target
GEMM_MMA = {"sm_90": "HGMMA", "gfx942": "MFMA", "gfx1100": "WMMA"}
MOE_DOT_MMA = {"sm_90": "HMMA", "gfx942": "MFMA", "gfx1100": "WMMA"}
# On RDNA3's 32-lane waves the prompt's tl.dot kernels (the GEMM, the MoE prefill) sit at
# the 256-register edge at NVIDIA's and CDNA's tiles: which of them spill moves with the
# launch's specialization and the Triton release, and the k-quants' unit MoE prefill spills
# at every tile and warp count tried (triton_kernels/NOTES.md). Their tiles want such a
# card's timings: there they are compiled and read, their spills left; the rest is held.
RDNA_PROMPT_OPS = ("gemm", "moe_dot_gate_up", "moe_dot_down")


@pytest.mark.slow
@pytest.mark.parametrize("target, ops", [(t, ops) for t, groups in GROUPS.items() for ops in groups],
                         ids=lambda v: v if isinstance(v, str) else "+".join(v))
def test_every_kernel_compiles_without_spills(target, ops):
    """Every op x every format for a target (the groups cover static.OPS): about 180
    compiles a target, about 3 minutes of one core for sm_90 (ptxas), 2.5 for gfx942 and
    gfx1100 (RDNA3: configs' "rdna" family; its prompt kernels compiled and read, their
    spills left: RDNA_PROMPT_OPS). On sm_90 the decode kernels are then held to
    llama.cpp's counts, dequant and the PLE gather to the H200's budget, and the MoE
    prefill on units to MOE_DOT_BOUND."""
    assert sorted(o for g in GROUPS[target] for o in g) == sorted(static.OPS)
    # the MoE prefill of the other formats is moe_gate_up's and moe_down's kernel, compiled there
    formats = list(UNITS) if "moe_dot_gate_up" in ops else FORMATS
    rows = static.rows(ops, formats, [target])
    assert [(r.op, r.format) for r in rows] == [(op, f) for op in ops for f in formats]
    for row in rows:
        op, fmt = row.op, row.format
        assert row.instructions > 0, (op, fmt, target)
        found = problems(target, row.spill_bytes, row.shared_bytes)
        if target == "gfx1100" and op in RDNA_PROMPT_OPS:
            found = problems(target, 0, row.shared_bytes)  # compiled and read, spills left
        assert not found, f"{op} {fmt} {target}: {found}"
        if op in ("gemv", "gemm", "moe_gate_up", "moe_down", "moe_dot_gate_up", "moe_dot_down"):
            assert row.loop_instructions > 0, f"{op} {fmt} {target}: no main loop found"
        loads_are_read(row)
    if "gemm" in ops:  # tl.dot on the matrix units
        assert {r.mma for r in rows if r.op == "gemm"} == {GEMM_MMA[target]}
    if "moe_dot_gate_up" in ops:
        assert {r.mma for r in rows} == {MOE_DOT_MMA[target]}
        moe_prefill_on_units(rows, check_counts=target == "sm_90")
    if target == "sm_90":
        by = {(r.op, r.format): r for r in rows}
        for fmt in LOOP_BOUND:
            if "gemv" in ops:
                decode_kernels_within_llama_cpps_counts(fmt, by)
            if "dequant" in ops:
                dequant_and_gather_within_the_h200_budget(fmt, by, BEFORE_LAYOUT_STORES[fmt])
        for fmt in OTHER_UNITS:
            if "gemv" in ops:
                decode_kernels_on_units(fmt, by)
            if "dequant" in ops:
                dequant_and_gather_within_the_h200_budget(fmt, by, PER_WEIGHT_STORES.get(fmt, (None, None)))


def test_the_decode_kernels_compile_within_llama_cpps_counts_for_one_format():
    """The quick tier's share of the check above: Q4_0's decode kernels on sm_90."""
    rows = static.rows(("gemv", "moe_gate_up", "moe_down"), ["Q4_0"], ["sm_90"])
    assert all(r.spill_bytes == 0 and r.loop_instructions > 0 for r in rows)
    decode_kernels_within_llama_cpps_counts("Q4_0", {(r.op, r.format): r for r in rows})


def test_the_k_quants_decode_kernels_run_on_int8_units():
    """The quick tier's share for the formats with 16-weight scales: Q6_K's decode kernels
    on sm_90 (a 128-weight unit a lane, the x sums of each 16 by dp4a)."""
    rows = static.rows(("gemv", "moe_gate_up", "moe_down"), ["Q6_K"], ["sm_90"])
    assert all(r.spill_bytes == 0 and r.loop_instructions > 0 for r in rows)
    decode_kernels_on_units("Q6_K", {(r.op, r.format): r for r in rows})


def test_the_moe_prefill_decodes_units_for_one_format():
    """The quick tier's share of the MoE prefill's check: Q4_0's gate/up and down on sm_90."""
    rows = static.rows(("moe_dot_gate_up", "moe_dot_down"), ["Q4_0"], ["sm_90"])
    assert all(r.spill_bytes == 0 and r.loop_instructions > 0 and r.mma == "HMMA" for r in rows)
    moe_prefill_on_units(rows, check_counts=True)


def moe_prefill_on_units(rows, check_counts: bool):
    """The MoE prefill kernels of unit formats: on units (within MOE_DOT_BOUND on sm_90)."""
    for r in rows:
        assert r.kernel.endswith("_units_kernel"), (r.op, r.format, r.kernel)
        if check_counts:
            assert r.instr_per_weight <= MOE_DOT_BOUND[r.format], (r.op, r.format, r.instr_per_weight, r.mix)


def decode_kernels_on_units(fmt, by):
    for op in ("gemv", "moe_gate_up", "moe_down"):
        row = by[op, fmt]
        assert row.kernel.endswith("_dp4a_kernel"), (op, fmt, row.kernel)
        assert row.layout == ("split" if has_split(quant.get(fmt)) else "gguf"), (op, fmt, row.layout)
        assert row.instr_per_weight <= OTHER_UNIT_BOUND, (op, fmt, row.instr_per_weight, row.mix)
        if fmt != "Q4_1":
            assert row.wide_load_share >= 0.5, (op, fmt, row.wide_load_share)


def test_the_float_gemv_reads_float_weights_in_wide_words():
    """The float GEMV of F32, F16 and BF16 weights on sm_90 (a released file's routers and
    QSA indexer rows, F32 beside the quantized ones: 330 MB a token at Flash-Next's shape),
    compiled as a launch specializes it (16-byte aligned pointers, K a multiple of 16): at
    least 90% of its main loop's bytes in loads of 8 bytes or more a lane, at most 8
    instructions a weight. Each weight assembled from byte loads took 31 (F32), 1-byte
    loads, 167 registers."""
    rows = static.rows(("gemv",), ["F32", "F16", "BF16"], ["sm_90"])
    for r in rows:
        assert r.kernel == "_gemv_kernel" and r.spill_bytes == 0, (r.format, r.kernel, r.spill_bytes)
        assert r.wide_load_share >= 0.9 and r.bytes_per_load >= 8, (r.format, r.wide_load_share, r.bytes_per_load)
        assert r.instr_per_weight <= 8, (r.format, r.instr_per_weight, r.mix)


def loads_are_read(row):
    """Every kernel reads global memory: at least one load in its main loop (or in all),
    1 to 16 bytes a lane, and at least one issued before the first use."""
    where = (row.op, row.format, row.target)
    assert 1 <= row.bytes_per_load <= 16, (*where, row.bytes_per_load)
    assert 0 <= row.wide_load_share <= 1, (*where, row.wide_load_share)
    assert row.loads_in_flight >= 1, where
    if row.kernel.endswith("_dp4a_kernel"):  # integer dot products, no matrix unit
        assert row.mma == "none", (*where, row.mma)


def decode_kernels_within_llama_cpps_counts(fmt, by):
    """Within llama.cpp's counts and the counts before the device layout, with wide loads:
    the weights in the layout a GPU holds them in (split, or Q4_K's GGUF order, already
    16-byte aligned) and x's codes as 8-byte words."""
    gemv = by["gemv", fmt]
    assert gemv.kernel == "_gemv_dp4a_kernel"
    assert gemv.instr_per_weight_whole <= WHOLE_BOUND[fmt], (fmt, gemv.instr_per_weight_whole)
    for op, before in zip(("gemv", "moe_gate_up", "moe_down"), BEFORE_LAYOUT[fmt]):
        row = by[op, fmt]
        assert row.layout == ("gguf" if fmt == "Q4_K" else "split"), (op, fmt, row.layout)
        assert row.instr_per_weight <= min(LOOP_BOUND[fmt], before), (op, fmt, row.instr_per_weight, row.mix)
        assert row.wide_load_share >= WIDE_SHARE.get(fmt, 0.5), (op, fmt, row.wide_load_share)


def dequant_and_gather_within_the_h200_budget(fmt, by, befores):
    f = quant.get(fmt)
    h200 = next(g for g in static.GPUS if g.name == "H200")
    for op, before in zip(("dequant", "ple_gather"), befores):
        row = by[op, fmt]
        # input bits plus the 16 bits of each bf16 value written
        assert row.instr_per_weight <= static.budget(h200, f.block_bytes * 8 / f.block_elems + 16), (op, fmt)
        assert row.pred_bw["H200"] == 1.0
        assert before is None or row.instr_per_weight <= before, (op, fmt, row.instr_per_weight, before)
        assert 0 < 4 * row.mix.get("STG", 0) <= row.weights_per_iter, (op, fmt, row.mix)  # 4 values a store


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_90", "gfx942", "gfx1100"])
def test_qsa_kernels_compile_without_spills(target):
    """The QSA kernels (triton_kernels.qsa: scores, attention, a graph's block keys) at
    Flash-Next's shapes, keys in float32, bfloat16 and int8 codes, the first position given
    or read from the device (a decode graph's), the attention's output gated or not, in
    child processes (about 20 s a target):
    no spills; the attention's loop over the token slots found."""
    rows = static.rows(static.QSA_OPS, ["F32", "BF16"], [target])
    assert [(r.op, r.format) for r in rows] == [(op, f) for op in static.QSA_OPS for f in ("F32", "BF16")]
    # the int8 cache: codes read in place, a bfloat16 scale a row
    int8 = static.rows(["qsa_attention"], ["BF16"], [target], {"scaled": True})
    assert int8[0].config["SCALED"] is True and all(r.config.get("SCALED") is not True for r in rows)
    graph = static.rows(["qsa_scores", "qsa_attention"], ["F32"], [target], {"start_ptr": True})
    assert all(r.config.get("START_PTR") is True for r in graph) and not any(r.config.get("START_PTR") for r in rows)
    # a graph's attention before a dp4a output projection: gated, and written as int8 too
    gated = static.rows(["qsa_attention"], ["F32"], [target], {"start_ptr": True, "gate": True})
    assert gated[0].config["GATE"] is True and not any(r.config.get("GATE") for r in rows + int8 + graph)
    for row in rows + int8 + graph + gated:
        assert row.instructions > 0, (row.op, row.format, target)
        assert row.spill_bytes == 0, f"{row.op} {row.format} {target}: {row.spill_bytes} bytes spilled"
        if row.op == "qsa_attention":
            assert row.loop_instructions > 0, f"{row.op} {row.format} {target}: no main loop found"


def test_a_config_override_changes_the_kernel_compiled():
    row = static.analyse("gemv", "Q8_0", "sm_90", {"block_n": 16, "block_u": 16})
    assert row.config["BLOCK_N"] == 16 and row.config["BLOCK_U"] == 16
    # two units a thread share their x loads: fewer instructions a weight than one
    assert row.instr_per_weight < static.analyse("gemv", "Q8_0", "sm_90").instr_per_weight


@pytest.mark.parametrize("target", ["sm_90", "gfx942"])
def test_split_k_compiles_without_spills_and_keeps_the_main_loop(target):
    """The split GEMV's reduction (a counter, a barrier, the partials read past L1) sits
    after the loop; the loop's bounds are no longer 0 and K, which costs it 3-5
    instructions an iteration (137 against 132 on sm_90, 113 against 110 on gfx942)."""
    split = static.analyse("gemv", "IQ3_XXS", target, {"split_k": 4})
    whole = static.analyse("gemv", "IQ3_XXS", target)
    assert (split.config["SPLIT"], whole.config["SPLIT"]) == (4, 1)
    assert split.spill_bytes == 0 and split.loop_instructions > 0
    assert whole.loop_instructions <= split.loop_instructions <= 1.05 * whole.loop_instructions
    assert split.instructions > whole.instructions


def test_budget_formula_matches_the_reference_figures():
    h200 = next(g for g in static.GPUS if g.name == "H200")
    # REFERENCE.md: 2.7 at IQ3_XXS (3.0625 bpw), 3.0 at IQ3_S, 3.9 at 4.5 bpw, 7.4 at Q8_0
    for bpw, want in ((3.0625, 2.7), (3.4375, 3.0), (4.5, 3.9), (8.5, 7.4)):
        assert abs(static.budget(h200, bpw) - want) < 0.05
    assert static.pred_bw(h200, 3.0625, 2 * static.budget(h200, 3.0625)) == pytest.approx(0.5)
    assert static.pred_bw(h200, 8.5, 1.0) == 1.0


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0020*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0030*/                   IDP.4A.S8.S8 R3, R2, R5, R3 ;
        /*0040*/                   IADD3 R4, P0, R4, 0x4, RZ ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        /*0060*/                   STG.E desc[UR4][R6.64], R3 ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
        /*0090*/                   NOP;
"""

GCN = """
_kernel:
	s_load_dwordx2 s[0:1], s[0:1], 0x0
.LBB0_1:                                ; =>This Inner Loop Header: Depth=1
	global_load_dword v1, v[2:3], off
	v_dot4_i32_i8 v4, v1, v5, v4
	s_add_i32 s2, s2, 1
	s_cmp_lt_i32 s2, s3
	s_cbranch_scc1 .LBB0_1
	global_store_dword v[6:7], v4, off
	s_endpgm
.Lfunc_end0:
"""


def test_one_disassembler_run_lists_each_kernel_as_its_own_cubin_does():
    """rows() disassembles a target's kernels in one nvdisasm run over their joined code
    (static._disassemble: a run's start-up, about 0.4 s, was half of an sm_90 compile).
    Each kernel's part parses to its own cubin's listing: the same instructions (branch,
    call and return targets aside: addresses in the stream, labels in the cubin) and the
    same main loop, for a GEMM with HGMMA and a MoE prefill kernel (two dots a step).
    Compiled in a child process (the suite runs the interpreter)."""
    import os
    import subprocess
    import sys
    code = """
import os, re, subprocess, tempfile
from triton_kernels.analysis import static
built = [static._build("gemm", "Q8_0", "sm_90", None), static._build("moe_dot_gate_up", "Q4_0", "sm_90", None)]
target = re.compile(r"`\\([^)]*\\)|\\.L_x_\\d+|0x[0-9a-f]+(?= ?$)")
def norm(i):
    return target.sub("T", i) if static._opcode(i) in ("BRA", "CALL", "RET", "BSSY") else i
for b, joined in zip(built, static._disassemble([b.kernel.asm["cubin"] for b in built], "sm_90")):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        open(path, "wb").write(b.kernel.asm["cubin"])
        own = subprocess.run([static._nvidia_bin("nvdisasm"), "-c", path], capture_output=True, text=True,
                             check=True).stdout
    (a, la), (o, lo) = static._parse_sass(joined), static._parse_sass(own)
    assert la == lo and la is not None, (b.op, la, lo)
    assert [norm(i) for i in a] == [norm(i) for i in o], b.op
    print(b.op, len(a), static.mma_kind(a))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (gemm, n_gemm, mma), (moe, n_moe, mma_moe) = (line.split() for line in done.stdout.split("\n")[:2])
    assert (gemm, mma, moe, mma_moe) == ("gemm", "HGMMA", "moe_dot_gate_up", "HMMA"), done.stdout
    assert int(n_gemm) > 100 and int(n_moe) > 100, done.stdout


def test_the_readers_find_the_loop_and_drop_the_padding():
    ins, loop = static._parse_sass(SASS)
    assert len(ins) == 8  # the self-branch and NOP after EXIT are padding
    assert loop == (2, 5) and ins[3].startswith("IDP.4A")
    ins, loop = static._parse_gcn(GCN)
    assert ins[loop[0]] == "global_load_dword v1, v[2:3], off" and ins[loop[1]].startswith("s_cbranch_scc1")
    assert loop[1] - loop[0] + 1 == 5 and ins[-1] == "s_endpgm"

    # AMD's cold blocks after s_endpgm branch back into the kernel: no loop header, no loop
    ins, loop = static._parse_gcn(GCN_COLD)
    assert loop is None and ins[2] == "s_endpgm"


def test_amd_scratch_counts_as_a_spill_unless_it_is_a_calls_frame_alone():
    """gfx942's scratch is spilled registers, except where a kernel calls a function,
    nothing is marked spilled and it is no more than a frame of a few arguments (past the
    VGPRs the calling convention passes them in), as the router's noinline routing over an
    expert cache takes (tests/strata/test_trace.py compiles it)."""
    meta = "; NumVgprs: 86\n; ScratchSize: 12\n    .vgpr_spill_count: {n}\n    .group_segment_fixed_size: 1024\n"
    frame = "\tscratch_store_dword off, v1, s32\n\ts_swappc_b64 s[30:31], s[0:1]\n" + meta.format(n=0)
    assert static._gcn_resources(frame) == {"regs": 86, "spill": 0, "shared": 1024}
    marked = "\tscratch_store_dword off, v3, off offset:12 ; 4-byte Folded Spill\n\ts_swappc_b64 s[30:31], s[0:1]\n"
    assert static._gcn_resources(marked + meta.format(n=0))["spill"] == 12
    assert static._gcn_resources(frame.replace(": 0", ": 3"))["spill"] == 12  # counted spills
    no_call = "\tscratch_store_dword off, v1, off\n" + meta.format(n=0)  # a private array: memory all the same
    assert static._gcn_resources(no_call)["spill"] == 12
    # a callee's function info comes first in the listing: the kernel's descriptor holds the
    # kernel's scratch, its callees' included
    callee_first = ("; Function info:\n; ScratchSize: 0\n\ts_swappc_b64 s[30:31], s[0:1]\n"
                    "\t\t.amdhsa_private_segment_fixed_size 320\n    .vgpr_spill_count: 77\n")
    assert static._gcn_resources(callee_first)["spill"] == 320
    big = frame.replace("ScratchSize: 12", f"ScratchSize: {static.CALL_FRAME + 4}")  # more than a frame of arguments
    assert static._gcn_resources(big)["spill"] == static.CALL_FRAME + 4


GCN_COLD = """
_kernel:
	global_load_ubyte v1, v[2:3], off
.LBB0_1:
	global_store_short v[4:5], v1, off
	s_endpgm
.LBB0_2:
	v_mov_b32_e32 v1, 0
	s_branch .LBB0_1
.Lfunc_end0:
"""


# a main loop's body: three 16-bit weight loads, two 32-bit activation words, a 16-byte
# load of a register quad; the first use (PRMT of R15) comes after five loads
SASS_LOADS = """
LDG.E.U16 R15, desc[UR12][R4.64+-0xe]
LDG.E.U16 R18, desc[UR12][R4.64+-0xc]
PRMT R20, RZ, 0x7610, R20
LDG.E R21, desc[UR12][R2.64+-0x1c]
@P1 LDG.E.U16 R20, desc[UR12][R4.64+-0xa]
LDG.E.128 R24, desc[UR12][R2.64]
PRMT R15, R15, 0x5410, R18
LDG.E.64 R8, desc[UR12][R24.64]
IDP.4A.S8.S8 R7, R27, R21, R7
""".strip().splitlines()
GCN_LOADS = """
global_load_dwordx4 v[14:17], v[4:5], off offset:-16
global_load_ushort v13, v[4:5], off
buffer_load_dword v8, v11, s[4:7], 0 offen
s_waitcnt vmcnt(2)
v_perm_b32 v15, v15, v16, s19
global_load_ubyte v9, v[6:7], off
""".strip().splitlines()


def test_the_readers_see_load_widths_and_loads_in_flight():
    assert [static.load_width(i) for i in SASS_LOADS] == [2, 2, 0, 4, 2, 16, 0, 8, 0]
    sass = static.loads(SASS_LOADS)
    # (2 + 2 + 4 + 2 + 16 + 8) / 6 loads; 24 of the 34 bytes in loads of >= 8 bytes
    assert sass == static.Loads(bytes_per_load=round(34 / 6, 3), wide_load_share=round(24 / 34, 3),
                                loads_in_flight=5)
    # a gather whose address is a loaded register is a use: it waits for the load
    assert static.loads(SASS_LOADS[5:]).loads_in_flight == 1
    assert [static.load_width(i) for i in GCN_LOADS] == [16, 2, 4, 0, 0, 1]
    gcn = static.loads(GCN_LOADS)
    assert gcn == static.Loads(bytes_per_load=round(23 / 4, 3), wide_load_share=round(16 / 23, 3),
                               loads_in_flight=3)
    assert static.loads(["IADD3 R4, R4, 0x1, RZ"]) == static.Loads(0.0, 0.0, 0)
    # RDNA3 (gfx1100) names its loads by bits
    rdna = ["global_load_b128 v[4:7], v[0:1], off", "buffer_load_b32 v8, v9, s[8:11], 0 offen",
            "global_load_u16 v10, v[0:1], off", "global_load_b64 v[12:13], v[2:3], off"]
    assert [static.load_width(i) for i in rdna] == [16, 4, 2, 8]


def test_the_reader_names_the_matrix_instructions():
    assert static.mma_kind(["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0", "WARPGROUP.ARRIVE"]) == "HGMMA"
    assert static.mma_kind(["HMMA.16816.F32.BF16 R4, R8, R12, R4"]) == "HMMA"
    assert static.mma_kind(["v_mfma_f32_32x32x8_bf16 a[0:15], v[2:3], v[4:5], a[0:15]"]) == "MFMA"
    assert static.mma_kind(["v_wmma_f32_16x16x16_bf16 v[0:7], v[8:15], v[16:23], v[0:7]"]) == "WMMA"
    assert static.mma_kind(SASS_LOADS) == static.mma_kind(GCN_LOADS) == "none"


def test_dequant_without_the_paired_cvt_compiles():
    """Before sm_80 NVIDIA has no cvt.rn.bf16x2/f16x2 (asm.cvt_pairs): dequant and the PLE
    gather then pack their pairs by plain conversions, which compile without spilling
    (in a child process without the interpreter, as static.rows compiles)."""
    import os
    import subprocess
    import sys
    from triton_kernels.asm import cvt_pairs
    assert cvt_pairs("cpu")  # a trace's or a replay's tensors compile as a Hopper's
    code = """
import quant
from triton_kernels.analysis import static
for op in ("dequant", "ple_gather"):
    spec = static._spec(op, quant.get("Q4_K"), "sm_90")
    cx = {**spec.constexprs, "CVT": False}
    k = static._compile(spec.kernel, tuple(spec.signature.items()), tuple(cx.items()), "sm_90",
                        spec.num_warps, tuple(spec.options.items()))
    print(op, static._nvidia_usage(k.asm["cubin"])["spill"])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["dequant", "0", "ple_gather", "0"], done.stdout


def test_a_compiled_kernel_names_what_would_stop_its_launch():
    """Compiled.problems, which the compile checks of a model's launches assert empty: the
    compile's error, spilled registers, more shared memory than the target gives a program
    (Triton would raise OutOfResources at the first launch, not at the compile)."""
    from dataclasses import replace

    from triton_kernels.analysis.launches import Compiled
    fits = Compiled(op="qsa_select", kernel="_select_kernel", target="sm_89", signature="{}", constexprs="{}",
                    num_warps=8, ok=True, regs=95, shared_bytes=SHARED_LIMITS["sm_89"])
    assert fits.problems == ""
    over = replace(fits, spill_bytes=8, shared_bytes=SHARED_LIMITS["sm_89"] + 1)
    assert over.problems == "8 B spilled; 101377 B of shared memory, over the 101376 B a program gets"
    assert replace(fits, target="sm_90", shared_bytes=101377).problems == ""  # Hopper gives 227 KB
    assert replace(fits, ok=False, error="CompilationError: x").problems == "CompilationError: x"
    assert replace(fits, ok=False).problems == "not compiled"
    assert SHARED_LIMITS.keys() == static.TARGETS.keys()  # every target has its limit


@pytest.mark.slow
def test_the_prefill_kernels_compile_for_an_rdna3_card():
    """`strata bench kernels --static --target gfx1100`: the GEMM and the MoE prefill
    (tl.dot) for an RDNA3 card (Radeon PRO W7900, RX 7900) compile, on WMMA (Triton's AMD
    backend takes input_precision "tf32" on gfx942 alone: a 16-bit dot that asked for it
    failed to compile there; the launchers' choice is qmatmul.dot_types, which
    tests/strata/test_trace.py compiles a model's launches with). Spills are not held
    here: with 32-lane waves the k-quants' unit tiles spill (NOTES.md)."""
    rows = static.rows(["gemm", "moe_dot_gate_up", "moe_dot_down"], ["Q8_0", "Q4_0", "IQ3_XXS", "F16"], ["gfx1100"])
    assert len(rows) == 12 and all(r.instructions > 0 for r in rows), rows
    assert {r.mma for r in rows} == {"WMMA"}, [(r.op, r.format, r.mma) for r in rows]
