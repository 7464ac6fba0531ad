#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 (the peer of `strata bench model --peer llama.cpp` and the
# golden-data scripts) with the GGML CPU features this machine has, read from /proc/cpuinfo.
# A native build (GGML_NATIVE) enables AMX, whose matmul crashes on some machines, and a
# build with a feature the CPU lacks dies with "Illegal instruction" (AVX-VNNI on an AMD
# EPYC with AVX-512 VNNI but no AVX-VNNI): so every feature is named, AMX always off.
#
#   scripts/build_llama_cpp.sh            # pip install into the active environment
#   scripts/build_llama_cpp.sh --wheel D  # build a wheel into D instead
#   scripts/build_llama_cpp.sh --tools D  # llama.cpp's own tools from the same sdist, into D
#   scripts/build_llama_cpp.sh --print    # print the CMAKE_ARGS and stop
# CPUINFO=FILE reads another machine's flags (for checking the choice).
#
# --tools D: the sdist's vendor/llama.cpp (the llama.cpp these Python bindings wrap) is
# unpacked into D/llama.cpp (pip download, once; SDIST=FILE takes a downloaded one) and
# llama-perplexity, llama-imatrix and llama-quantize are built, statically linked, into
# D/build/bin, for scripts/golden_llama_tools.py. D/llama.cpp also holds the
# convert_hf_to_gguf.py and gguf-py of that same llama.cpp. JOBS=N (default 2) for make.
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

VERSION=0.3.36
TOOLS="llama-perplexity llama-imatrix llama-quantize"

tools() {
  local dir="$1" src="$1/llama.cpp"
  mkdir -p "$dir"
  if [[ ! -f "$src/CMakeLists.txt" ]]; then
    local sdist="${SDIST:-}"
    if [[ -z "$sdist" ]]; then
      # the source only: --no-binary, and no build of it (pip download never builds an sdist)
      python -m pip download --no-deps --no-binary llama-cpp-python --quiet -d "$dir" "llama-cpp-python==$VERSION"
      sdist="$dir/llama_cpp_python-$VERSION.tar.gz"
    fi
    rm -rf "$src.partial" && mkdir -p "$src.partial"
    tar -xzf "$sdist" -C "$src.partial" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
    mv "$src.partial" "$src"
  fi
  # shellcheck disable=SC2086  # $args is a list of -D flags
  cmake -S "$src" -B "$dir/build" $args -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF
  # shellcheck disable=SC2086
  cmake --build "$dir/build" -j "${JOBS:-2}" --target $TOOLS
  for t in $TOOLS; do echo "$dir/build/bin/$t"; done
}

case "${1:-}" in
  --print) echo "$args" ;;
  --wheel) CMAKE_ARGS="$args" pip wheel --no-deps --no-cache-dir -w "${2:?--wheel DIR}" "llama-cpp-python==$VERSION" ;;
  --tools) tools "${2:?--tools DIR}" ;;
  "") CMAKE_ARGS="$args" pip install --no-cache-dir "llama-cpp-python==$VERSION" ;;
  *) echo "usage: $0 [--print | --wheel DIR | --tools DIR]" >&2; exit 2 ;;
esac
