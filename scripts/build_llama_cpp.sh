#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 (the peer of `strata bench model --peer llama.cpp` and the
# golden-data scripts) with the GGML CPU features this machine has, read from /proc/cpuinfo.
# A native build (GGML_NATIVE) enables AMX, whose matmul crashes on some machines, and a
# build with a feature the CPU lacks dies with "Illegal instruction" (AVX-VNNI on an AMD
# EPYC with AVX-512 VNNI but no AVX-VNNI): so every feature is named, AMX always off.
#
#   scripts/build_llama_cpp.sh            # pip install into the active environment
#   scripts/build_llama_cpp.sh --wheel D  # build a wheel into D instead
#   scripts/build_llama_cpp.sh --print    # print the CMAKE_ARGS and stop
# CPUINFO=FILE reads another machine's flags (for checking the choice).
set -euo pipefail
cpuinfo="${CPUINFO:-/proc/cpuinfo}"
flags=" $(grep -m1 '^flags' "$cpuinfo" | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }

args="-DGGML_NATIVE=OFF"
args+=" -DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2) -DGGML_FMA=$(onoff fma)"
args+=" -DGGML_F16C=$(onoff f16c) -DGGML_BMI2=$(onoff bmi2)"
args+=" -DGGML_AVX512=$(onoff avx512f) -DGGML_AVX512_VBMI=$(onoff avx512vbmi)"
args+=" -DGGML_AVX512_VNNI=$(onoff avx512_vnni) -DGGML_AVX512_BF16=$(onoff avx512_bf16)"
args+=" -DGGML_AVX_VNNI=$(onoff avx_vnni)"
args+=" -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF"

case "${1:-}" in
  --print) echo "$args" ;;
  --wheel) CMAKE_ARGS="$args" pip wheel --no-deps --no-cache-dir -w "${2:?--wheel DIR}" llama-cpp-python==0.3.36 ;;
  "") CMAKE_ARGS="$args" pip install --no-cache-dir llama-cpp-python==0.3.36 ;;
  *) echo "usage: $0 [--print | --wheel DIR]" >&2; exit 2 ;;
esac
