#!/bin/bash
# Time the GGUF kernel's row tiles alone (see tile_time.cpp), pinned to one core:
#   [TILE_FLAGS=...] scripts/gguf_tile_time/tile_time.sh [KERNEL.cpp] [TYPE IN OUT COPIES SECONDS]
# The AVX2 build by default; TILE_FLAGS adds compiler flags, e.g. the VNNI build's
# "-mavx512f -mavx512vl -mavx512vnni -mprefer-vector-width=256" (kernel_build.gguf_flags).
# KERNEL.cpp ("" or none) defaults to the package's specdecode/models/csrc/linear_gguf.cpp; the rest to a Q4_K
# matrix of 1536 inputs and 128 outputs held in L2 (12 1536 128 1 3). To compare, run it again with
# another copy of the kernel (say, main's, from git show); it reads the package's headers (lanes.h).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
csrc="$here/../../specdecode/models/csrc"
kernel=$(realpath "${1:-$csrc/linear_gguf.cpp}")
shift || true
args=("${@:-12 1536 128 1 3}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
end=$(grep -n "^void output_rows" "$kernel" | head -1 | cut -d: -f1)
{
    echo '#include <cstdint>'
    echo 'namespace at { template <class F> void parallel_for(int64_t b, int64_t e, int64_t, F f) { f(b, e); } }'
    sed -n "/^#include <omp.h>/,$((end - 1))p" "$kernel" | grep -v -e '#include "attention.h"' -e '#include "segments.h"'
    echo '}  // namespace'
    echo '#endif'
} > "$work/kernel.inc"
g++ -O3 -std=c++20 -ffp-contract=off -mavx2 -mfma -mf16c ${TILE_FLAGS:-} -fopenmp -I"$csrc" -DKERNEL="\"$work/kernel.inc\"" \
    "$here/tile_time.cpp" -o "$work/tile_time"
taskset -c "$(($(nproc) - 1))" "$work/tile_time" ${args[@]}
