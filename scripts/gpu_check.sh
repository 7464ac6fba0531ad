#!/usr/bin/env bash
# Everything a lent GPU should run, in one command (about 5 minutes on an H200):
#   1. the kernel properties on the device (pytest -m cuda: the compiled kernels, inline
#      PTX included, against the numpy references, with device tensors);
#   2. `strata bench kernels`: the decode GEMV of a 4096 x 14336 weight per format, GB/s
#      against the device copy, the static prediction beside it;
#   3. `strata bench dequant --device cuda` for the formats of the decode path;
#   4. the static table for sm_90, to set beside the measured one.
# Results go to $OUT (or ./gpu_check.out) as logs and JSON.
#
# A bare machine lacks gguf (strata's GGUF reader needs it): where .whl/ holds wheels
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.17.1`),
# they are installed first into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STRATA_TEST_DEVICE=cuda
unset TRITON_INTERPRET
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
FORMATS=Q8_0,Q4_0,Q4_K,IQ4_NL,IQ3_S,IQ3_XXS
status=0

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"

echo "== 1. kernel properties on the device"
timeout 240 python3 -m pytest -m cuda -q -x -p no:cacheprovider tests/triton_kernels \
    2>&1 | tee "$OUT/pytest_cuda.log" || status=1

echo "== 2. decode GEMV, 4096 x 14336, GB/s against the device copy"
timeout 150 python3 -m strata bench kernels --formats "$FORMATS" --json 2> "$OUT/bench_kernels.err" \
    | tee "$OUT/bench_kernels.json" || status=1

echo "== 3. dequant on the device"
timeout 90 python3 -m strata bench dequant --device cuda --formats "$FORMATS" --no-peer --mib 256 \
    2>&1 | tee "$OUT/bench_dequant.log" || status=1

echo "== 4. static prediction (sm_90)"
timeout 120 python3 -m strata bench kernels --static --target sm_90 --formats "$FORMATS" --ops gemv,dequant,moe_gate_up,moe_down \
    2>/dev/null | tee "$OUT/static_sm90.md" || status=1
exit $status
