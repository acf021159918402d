#!/usr/bin/env bash
# The GPU check of issue 6, in one run on a bare GPU machine (an H200 with
# nvcc, cmake and a C++ compiler; no package registry):
#   1. says what is there and what is missing (tools, headers, libraries);
#   2. builds the reduced project bench/gpu (the codec library,
#      kvtc_cuda, the GPU test and bench/gpu/kvtc_gpu_bench);
#   3. runs the GPU tests (kernels vs the CPU reference, containers both ways);
#   4. runs the benchmark at 8K and 32K tokens, batch 1 and 8, GEMM f32 / tf32 /
#      bf16, on SYNTHETIC caches generated on the device (SmolLM2-135M geometry,
#      measured spectrum; see bench/gpu/kvtc_gpu_bench.cpp), the DP at 16x and
#      the entropy-coded mode (CPU-encoded, GPU-decoded) at 22.8x, the ratio of
#      equal error on SmolLM2 (bench/results/entropy.md), plus an nvCOMP
#      algorithm sweep at 8 x 32K.
# Results go to $OUT (default out/gpu): machine.txt, build.log, tests.log,
# tests.json, bench.md, bench.json, bench.log, algo.md.
#
# Prepare on the build machine (once): scripts/bootstrap.sh (fetches nvCOMP
# into .deps/nvcomp) and bench/gpu/prepare_carry.sh (.deps/gpu-sysroot).
# Run through the device tool from the repository root:
#   command: bash bench/gpu/run_device.sh
#   carry:   [".deps/nvcomp", ".deps/gpu-sysroot"]
#   timeout_s: 420 (the script bounds each step; ~4-6 min in all)
# `bash bench/gpu/run_device.sh --check-only` stops after step 1 (no build).
set -uo pipefail
command -v nvcc >/dev/null 2>&1 || export PATH="$PATH:/usr/local/cuda/bin"
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"
out="${OUT:-$top/out/gpu}"
mkdir -p "$out"
bld="$top/build-gpu"
jobs=$(nproc 2>/dev/null || echo 8)
t0=$(date +%s)
say() { printf '[run_device %3ds] %s\n' "$(($(date +%s) - t0))" "$*"; }

# ---------------------------------------------------------------- 1. machine
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | grep -q . && echo '(with uncommitted changes)')"
  echo "os: $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-?}"); cpus: $jobs"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo missing)"
  echo "cmake: $(cmake --version 2>/dev/null | head -1 || echo missing)"
  echo "c++: $(c++ --version 2>/dev/null | head -1 || echo missing)"
  echo "ninja: $(ninja --version 2>/dev/null || echo missing)"
} | tee "$out/machine.txt"

missing=()
for tool in nvcc cmake; do command -v "$tool" >/dev/null 2>&1 || missing+=("tool:$tool"); done
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || missing+=("tool:c++")
sys=.deps/gpu-sysroot
have_hdr() { [ -f "$sys/include/$1" ] || [ -f "/usr/include/$1" ] || [ -f "/usr/local/include/$1" ]; }
have_lib() { [ -f "$sys/lib/$1.a" ] || ls /usr/lib/x86_64-linux-gnu/"$1".* /usr/lib64/"$1".* /usr/local/lib/"$1".* >/dev/null 2>&1; }
for h in nlohmann/json.hpp gtest/gtest.h openssl/evp.h libdeflate.h xxhash.h; do
  have_hdr "$h" && echo "header $h: ok" || { echo "header $h: MISSING"; missing+=("header:$h"); }
done
for l in libdeflate libxxhash libcrypto libgtest libgtest_main; do
  have_lib "$l" && echo "library $l: ok" || { echo "library $l: MISSING"; missing+=("lib:$l"); }
done
cuda_root=$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")
cublas_lib=no cublas_hdr=no
# One ls per place: ls over several paths fails when any one is absent (an
# H200 image had it only under targets/x86_64-linux/lib).
for d in lib64 lib targets/x86_64-linux/lib; do ls "$cuda_root/$d"/libcublas.so* >/dev/null 2>&1 && cublas_lib=yes; done
{ [ -f "$cuda_root/include/cublas_v2.h" ] || [ -f "$cuda_root/targets/x86_64-linux/include/cublas_v2.h" ]; } && cublas_hdr=yes
if [ $cublas_lib = yes ] && [ $cublas_hdr = yes ]; then
  echo "cuBLAS: ok ($cuda_root)"
else
  echo "cuBLAS: MISSING under $cuda_root"; missing+=("cublas")
fi
if [ -f .deps/nvcomp/lib64/libnvcomp.so.6 ] && [ -f .deps/nvcomp/include/nvcomp/deflate.h ]; then
  echo "nvCOMP: ok (.deps/nvcomp)"; nvcomp=AUTO
else
  echo "nvCOMP: missing (.deps/nvcomp not carried) -> DEFLATE on the host"; nvcomp=OFF
fi
{ echo "missing: ${missing[*]:-none}"; } | tee -a "$out/machine.txt"
[ "${1:-}" = "--check-only" ] && exit $((${#missing[@]} > 0 ? 2 : 0))
if [ ${#missing[@]} -gt 0 ]; then
  say "cannot build: ${missing[*]} (carry .deps/gpu-sysroot made by bench/gpu/prepare_carry.sh)"
  exit 2
fi

# ---------------------------------------------------------------- 2. build
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
say "configure + build (-j$jobs)"
if ! timeout 300 bash -c "cmake -S bench/gpu -B '$bld' ${gen[*]} -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DKVTC_NVCOMP=$nvcomp \
      && cmake --build '$bld' -j$jobs --target kvtc_tests_cuda kvtc_gpu_bench" >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  say "build failed (see build.log)"
  exit 3
fi
grep -E "kvtc: GPU path" "$out/build.log" | tee -a "$out/machine.txt"
say "built"

# ---------------------------------------------------------------- 3. tests
say "GPU tests"
timeout 150 "$bld/tests/kvtc_tests_cuda" --gtest_output=json:"$out/tests.json" >"$out/tests.log" 2>&1
trc=$?
grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|^\[  (PASSED|FAILED) |projection|rel. error" "$out/tests.log"
[ $trc -eq 0 ] || { say "tests FAILED (rc $trc): tail of tests.log"; grep -B2 -A12 "Failure" "$out/tests.log" | head -80; }

# ---------------------------------------------------------------- 4. benchmark
say "benchmark: 8K and 32K tokens, batch 1 and 8 (synthetic caches made on the device)"
timeout 220 "$bld/kvtc_gpu_bench" --tokens 8192,32768 --batch 1,8 --gemm f32,tf32,bf16 --ecsq 22.8 --reps 5 --check \
  --json "$out/bench.json" --md "$out/bench.md" 2>&1 | tee "$out/bench.log"
brc=${PIPESTATUS[0]}
say "nvCOMP algorithm sweep at 8 x 32K, bf16"
{
  echo "nvCOMP Deflate algorithm sweep (8 x 32768 tokens, bf16 GEMM, synthetic caches):"
  for a in 0 1 2 4; do
    echo "algorithm $a:"
    timeout 60 "$bld/kvtc_gpu_bench" --tokens 32768 --batch 8 --gemm bf16 --reps 3 --algo "$a" 2>/dev/null | tail -1
  done
} | tee "$out/algo.md"
say "done (tests rc $trc, bench rc $brc); results in $out"
[ $trc -eq 0 ] && [ $brc -eq 0 ]
