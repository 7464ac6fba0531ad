#!/usr/bin/env bash
# Everything a lent GPU should run (steps 1-8 took about 5 minutes on an H200; steps 9-11,
# the real shape and ncu, are not yet timed on a device: give 9 and 11 a call each):
#   1. the kernel properties on the device (pytest -m cuda: the compiled kernels, inline
#      PTX included, against the numpy references, with device tensors), and SmolLM2 on
#      the GPU against the torch path on the CPU (tests/strata/test_gpu_models.py);
#   2. `strata bench kernels`: the decode GEMV of a 4096 x 14336 weight per format and the
#      MoE decode at Flash-Next's shape, GB/s against the device copy, the static
#      prediction beside it; the MoE with its ten experts missed, staged into VRAM or read in
#      place from pinned host memory, against the pinned copy; a 512 x 2560 GEMV with K split and not; the 512-row prefill
#      GEMM against torch's bf16 matmul; a DeltaNet decode token at Flash-Next's heads, one
#      launch against the three it replaced (fla-core's recurrence among them where its
#      wheel came); a decode graph's choice of QSA blocks, one launch against the stable
#      sort it replaced; in the device layout, then again in GGUF order (STRATA_LAYOUT=gguf);
#   3. `strata bench dequant --device cuda` for the formats of the decode path;
#   4. the static table for sm_90, to set beside the measured one;
#   5. the engine on the GPU: `strata generate --device cuda` for SmolLM2 (when its GGUF
#      is in the cache, or .gpu/ holds it split in parts: see below) and flash-tiny (built
#      there: `strata synth`, which needs transformers 5.23 from .whl/);
#   6. `strata bench model --device cuda`: pp512, tg128, and the decode step's weight bytes
#      over its time against the device's copy bandwidth;
#   7. flash-tiny with --experts cache:8:host: hit rate and PCIe MiB a token
#      (STRATA_DECODE_TIMING=1 lines);
#   8. `strata bench kernels --tune` for the IQ3 formats and Q8_0: the GEMV tiles that run
#      fastest here at three weight heights, and the MoE decode's, written to
#      triton_kernels/configs/<device>.json (copied to $OUT);
#   9. Flash-Next's real shape built in memory on the GPU: 4 layers with a small PLE table
#      first (the first capture of its decode graph on a device, a minute), then
#      `-m flash-shape` (48 layers): pp512 and tg128 with every part the placement fits in
#      VRAM (all of it on an H200; on an 80 GB H100 the 26.8 GiB PLE table stays in host
#      RAM, read over PCIe), with the launches a step;
#  10. `strata bench kernels --ncu`: step 2's kernels under Nsight Compute, their DRAM GB/s,
#      share of the DRAM peak and sectors per load request from the hardware counters;
#  11. flash-shape held to a 24 GiB card (--gpu-mem 24: the experts in a cache over pinned
#      host RAM), with the PCIe MiB and the expert hit rate a token.
# Steps 9 and 11 make 50 GiB of random expert blocks each on the host (every core), and
# need about 80 GiB of host RAM; each takes one call of its own, under the 10-minute cap.
# Results go to $OUT (or ./gpu_check.out) as logs and JSON, each step's seconds to steps.txt.
# STEPS=5,7,1 runs those, in that order.
#
# A bare machine lacks gguf (strata's GGUF reader), transformers 5.23 (step 5's synth) and
# fla-core: scripts/gpu_prepare.sh, run first on the machine that sends the calls, puts
# their wheels in .whl/ and SmolLM2's GGUF in parts in .gpu/, and prints which call carries
# what. Wheels in .whl/ are installed first into /tmp/site; with fla-core's, step 1 runs
# fla's DeltaNet kernels on the device against Strata's (tests/triton_kernels/
# test_deltanet_fla.py) and the engine's DeltaNet layers take them for prompts.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STRATA_TEST_DEVICE=cuda
unset TRITON_INTERPRET
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
fi
[[ -d /tmp/site ]] && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export STRATA_CACHE=${STRATA_CACHE:-$PWD/.gpu/cache}
FORMATS=Q8_0,Q4_0,Q4_K,IQ4_NL,IQ3_S,IQ3_XXS
STEPS=${STEPS:-1,2,10,3,4,5,6,7,9,11}
status=0
THREADS=$(nproc)  # bench model's host threads in steps 9 and 11: the blocks' making and repacking
# SIGINT first, not timeout's SIGTERM: Python then runs its finally blocks, and a bench
# prints the rows it measured before its time ran out; SIGKILL 10 s later
T() { timeout -s INT -k 10 "$@"; }
# SmolLM2's GGUF (94 MB) may arrive in parts (.gpu/smollm2.part*, joined in name order)
SMOL="$STRATA_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ ! -f "$SMOL" ]] && compgen -G ".gpu/smollm2.part*" > /dev/null; then
    mkdir -p "$(dirname "$SMOL")" && cat .gpu/smollm2.part* > "$SMOL"
    [[ $(stat -c %s "$SMOL") == 98362432 ]] || { echo "SmolLM2 parts incomplete"; rm -f "$SMOL"; }
fi

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"

s1() {
echo "== 1. kernel properties on the device"
MODELS=$([[ -f "$SMOL" ]] && echo tests/strata/test_gpu_models.py)  # SmolLM2 on the GPU against the CPU
WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # pytest-xdist where the machine has it
T ${PYTEST_TIMEOUT:-240} python3 -m pytest -m cuda -q $WORKERS -p no:cacheprovider tests/triton_kernels $MODELS \
    2>&1 | tee "$OUT/pytest_cuda.log" || status=1
}

s2() {
echo "== 2. decode GEMV, 4096 x 14336, GB/s against the device copy"
T 200 python3 -m strata bench kernels --formats "$FORMATS" --json 2> "$OUT/bench_kernels.err" \
    | tee "$OUT/bench_kernels.json" || status=1
STRATA_LAYOUT=gguf T 200 python3 -m strata bench kernels --formats "$FORMATS" --json \
    2> "$OUT/bench_kernels_gguf.err" | tee "$OUT/bench_kernels_gguf.json" || status=1
}

s3() {
echo "== 3. dequant on the device"
T 90 python3 -m strata bench dequant --device cuda --formats "$FORMATS" --no-peer --mib 256 \
    2>&1 | tee "$OUT/bench_dequant.log" || status=1
}

s4() {
echo "== 4. static prediction (sm_90)"
T 120 python3 -m strata bench kernels --static --target sm_90 --formats "$FORMATS" --ops gemv,dequant,moe_gate_up,moe_down,moe_dot_gate_up,moe_dot_down \
    2>/dev/null | tee "$OUT/static_sm90.md" || status=1
}

s5() {
echo "== 5. the engine on the GPU: strata generate --device cuda"
if [[ -f "$SMOL" ]]; then
    T 120 python3 -m strata generate --device cuda -m smollm2 --temperature 0 -n 48 \
        "Write one sentence about the sea." 2>&1 | tee "$OUT/generate_smollm2.log" || status=1
else
    echo "no SmolLM2 GGUF here: skipped" | tee "$OUT/generate_smollm2.log"
fi
T 240 python3 -m strata synth flash-tiny 2>&1 | tail -3 | tee "$OUT/synth.log" || status=1
T 120 python3 -m strata generate --device cuda -m flash-tiny --temperature 0 -n 32 --raw \
    "The sea is" 2>&1 | tee "$OUT/generate_flash_tiny.log" || status=1
}

s6() {
echo "== 6. strata bench model --device cuda (pp512, tg128, decode bytes against the copy roof)"
for m in smollm2 flash-tiny; do
    [[ $m == smollm2 && ! -f "$SMOL" ]] && continue
    T 180 python3 -m strata bench model --device cuda -m $m -r 3 --json 2> "$OUT/bench_model_$m.err" \
        | tee "$OUT/bench_model_$m.json" || status=1
    if [[ $m == smollm2 ]]; then  # what the decode graph buys: the same without it
        STRATA_CUDA_GRAPHS=0 T 120 python3 -m strata bench model --device cuda -m $m -r 2 -p 64 \
            2>&1 | tee "$OUT/bench_model_${m}_nographs.md" || status=1
    fi
done
}

s7() {
echo "== 7. flash-tiny, experts in a cache of 8 slots a layer filled from pinned host RAM"
STRATA_DECODE_TIMING=1 T 120 python3 -m strata generate --device cuda -m flash-tiny \
    --experts cache:8:host --temperature 0 -n 24 --raw "The sea is" 2>&1 \
    | tee "$OUT/experts_cache.log" | grep -v "^strata: step" || status=1
grep "^strata: step" "$OUT/experts_cache.log" | tail -3
}

s8() {
echo "== 8. GEMV tiles tuned on this device"
if T 300 python3 -m strata bench kernels --tune --formats Q8_0,IQ3_S,IQ3_XXS 2>&1 | tee "$OUT/tune.log"; then
    cp triton_kernels/configs/NVIDIA_*.json "$OUT/" 2>/dev/null
else
    status=1
fi
}

s9() {
echo "== 9. flash-shape (built in memory on the GPU): 4 layers first, then 48 resident"
# a short run first: the first capture of Flash-Next's decode graph on a device, its kernels compiled
T 120 python3 -m strata bench model --device cuda -m flash-shape:4 --rows 65536 -t $THREADS -r 1 -p 64 -n 8 \
    2>&1 | tee "$OUT/bench_flash_shape_4.log" || status=1
T 300 python3 -m strata bench model --device cuda -m flash-shape -t $THREADS -r 2 --json \
    2> "$OUT/bench_flash_shape.err" | tee "$OUT/bench_flash_shape.json" || status=1
}

s11() {
echo "== 11. flash-shape (48 layers) held to a 24 GiB card: the experts in a cache over pinned host RAM"
# the bench prints the expert hit rate and PCIe MiB a token itself (STRATA_DECODE_TIMING's
# per-step lines would read the device's counters inside the timed tokens)
T 300 python3 -m strata bench model --device cuda -m flash-shape --gpu-mem 24 -t $THREADS -r 2 \
    2>&1 | tee "$OUT/bench_flash_shape_24g.log" || status=1
}

s10() {
echo "== 10. the kernels' hardware counters (ncu)"
T 240 python3 -m strata bench kernels --ncu --formats "$FORMATS" --json 2> "$OUT/bench_kernels_ncu.err" \
    | tee "$OUT/bench_kernels_ncu.json" || status=1
}

for s in ${STEPS//,/ }; do  # each step's seconds, for planning the next run's calls
    t0=$SECONDS; "s$s"; echo "step $s: $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
done
exit $status
