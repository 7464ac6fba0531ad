#!/usr/bin/env bash
# Packs what a lent GPU machine lacks for scripts/gpu_check.sh, on this side, before the
# device time starts. That machine is offline, its Python lacks gguf, transformers 5.23 (it
# has 5.17, without qwen4_exp: `strata synth flash-tiny` needs it) and fla-core, and a call
# carries at most 64 MiB: the working tree and the paths it names.
#
#   scripts/gpu_prepare.sh          # .whl/ (the wheels) and .gpu/smollm2.part1, part2
#
# It prints the two calls that carry them. SmolLM2's GGUF (94 MB) does not fit one call
# beside the wheels, so the first call brings part1 (and gguf's wheel) and runs the steps
# that need neither SmolLM2 nor transformers, the issues' acceptance first: Flash-Next's
# real shape (9, never run on a device), the kernels against the copy (2), then ncu (10).
# part1 stays on the warm machine (an ignored path); the second call brings part2 and the
# wheels, and runs flash-tiny's and SmolLM2's benches (6), the device properties (1, the
# decode steps under set_sync_debug_mode("error") among them), the real shape held to a
# 24 GiB card (11), then the rest; gpu_check.sh joins the parts and writes each step's
# seconds to steps.txt. Each call stops at the 10-minute cap with what it wrote so far, in
# the order the issues need it.
# PIP=... names the pip to download with; DEST=DIR writes .whl/ and .gpu/ there instead
# of the repository's root (where a call's carry paths start).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.}
PIP=${PIP:-python3 -m pip}  # the Python that runs it must import strata (the README's install)
WHEELS="gguf==0.19.0 transformers==5.23.0 fla-core==0.6.0"  # einops, tokenizers 0.23, hub 1.33: there
LIMIT=$((64 * 1024 * 1024))
SLACK=$((2 * 1024 * 1024))  # room for what the tree gains before the calls (logs, notes)

whl=$DEST/.whl gpu=$DEST/.gpu
rm -rf "$whl" && mkdir -p "$whl"
# pip matches a manylinux tag exactly; these wheels are pure Python, so `any` takes them
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$whl" $WHEELS

smol=$(python3 -c "from strata.hub import pull_smollm2; print(pull_smollm2())")  # fetched if absent
size=$(stat -c %s "$smol")
[[ $size == 98362432 ]] || { echo "$smol is $size bytes, not 98362432" >&2; exit 1; }

# the tree that travels with every call: tracked files and untracked ones git does not ignore
tree=$( (git ls-files -z; git ls-files -z -o --exclude-standard) | xargs -0 stat -c %s 2>/dev/null \
        | awk '{s += $1} END {print s + 0}')
wheels=$(du -cb "$whl"/*.whl | tail -1 | cut -f1)
part2=$((LIMIT - SLACK - tree - wheels))
part1=$((size - part2))
if (( part1 > LIMIT - SLACK - tree )); then
    echo "the tree ($tree bytes) and the wheels ($wheels) leave too little room for SmolLM2 in two calls" >&2
    exit 1
fi
rm -rf "$gpu" && mkdir -p "$gpu"
head -c "$part1" "$smol" > "$gpu/smollm2.part1"
tail -c "+$((part1 + 1))" "$smol" > "$gpu/smollm2.part2"
cat "$gpu/smollm2.part1" "$gpu/smollm2.part2" | cmp -s - "$smol" || { echo "split failed" >&2; exit 1; }

mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
cat <<EOF
tree $(mib "$tree"), wheels $(mib "$wheels") ($(ls "$whl" | tr '\n' ' ')), SmolLM2 in two parts: $(mib "$part1") + $(mib "$part2")
call 1: carry [".gpu/smollm2.part1", ".whl/$(cd "$whl" && ls gguf-*.whl)"]  ($(mib $((tree + part1))))
        command: STEPS=9,2,10 scripts/gpu_check.sh
call 2: carry [".gpu/smollm2.part2", ".whl"]  ($(mib $((tree + part2 + wheels))))
        command: STEPS=6,1,11,5,7,8,3,4 scripts/gpu_check.sh
EOF
