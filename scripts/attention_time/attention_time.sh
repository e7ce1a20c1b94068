#!/bin/bash
# Time one row's attention (attention_time.cpp) in the AVX2 build and, where the CPU has it, the
# AVX-512 one (the int4 draft's and the GGUF kernel's VNNI flags give 32 registers), pinned to one core:
#   scripts/attention_time/attention_time.sh [ATTENTION.h [GROUP D LEN]]
# ATTENTION.h defaults to the package's specdecode/models/csrc/attention.h (it reads the package's
# lanes.h); the rest to the int4 0.5B draft's shape: 7 heads of 64 per kv head, 300 keys. To
# compare, run it again with another copy (say, main's, from git show).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
csrc="$here/../../specdecode/models/csrc"
header=$(realpath "${1:-$csrc/attention.h}")
shift || true
if (($#)); then args=("$@"); else args=(7 64 300); fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$header" "$work/attention.h"
cp "$csrc/lanes.h" "$work/"
common=(-O3 -std=c++20 -ffp-contract=off -I"$work" -DATTENTION='"attention.h"')
g++ "${common[@]}" -mavx2 -mfma -mf16c "$here/attention_time.cpp" -o "$work/avx2"
echo -n "avx2:    "; taskset -c "$(($(nproc) - 1))" "$work/avx2" "${args[@]}"
if grep -q avx512vl /proc/cpuinfo; then
    g++ "${common[@]}" -mavx2 -mfma -mf16c -mavx512f -mavx512vl -mavx512bw -mavx512dq "$here/attention_time.cpp" -o "$work/avx512"
    echo -n "avx512:  "; taskset -c "$(($(nproc) - 1))" "$work/avx512" "${args[@]}"
fi
