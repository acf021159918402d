#!/usr/bin/env bash
# ThreadSanitizer over kvtc's threaded code: the codec's OpenMP workers
# (encode/decode/calibration parallel_for), the prompt store's async writer
# and its Redis tier, in the unit tests that drive them (api, codec, store,
# store_redis). Built with clang against LLVM's libomp, whose Archer tool
# tells TSan about OpenMP's barriers: with g++ and libgomp, which TSan cannot
# see into, the store tests alone gave ~1,000 reports, all inside or around
# OpenMP regions (OMP_THREAD_LIMIT=1 left none). Uninstrumented libraries
# (OpenBLAS's threads, libomp itself) are ignored.
#
# Usage: scripts/tsan.sh   (make tsan)  -> build-tsan/, exit 1 on any report
# Needs clang and libomp-14-dev (Debian), installed by the bootstrap when missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log() { echo "[tsan] $*" >&2; }
die() { echo "[tsan] error: $*" >&2; exit 1; }

# clang and LLVM's libomp (with Archer), through the bootstrap's Debian step.
KVTC_APT_EXTRA="clang libomp-14-dev" scripts/bootstrap.sh
archer=/usr/lib/llvm-14/lib/libarcher.so
[ -f "$archer" ] || die "$archer missing after installing libomp-14-dev"

tests=(api codec store store_redis)
mkdir -p build-tsan
CC=clang CXX=clang++ cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVTC_CUDA=OFF \
  -DCMAKE_C_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" >build-tsan/configure.log 2>&1 || { cat build-tsan/configure.log; die "configure failed"; }
log "building ${tests[*]/#/kvtc_tests_} with -fsanitize=thread (~2 min on 2 cores)"
cmake --build build-tsan -j"$(nproc)" --target "${tests[@]/#/kvtc_tests_}" >build-tsan/build.log 2>&1 \
  || { tail -30 build-tsan/build.log; die "build failed; see build-tsan/build.log"; }

export TSAN_OPTIONS="ignore_noninstrumented_modules=1 halt_on_error=0 exitcode=66 history_size=4"
export OMP_TOOL_LIBRARIES="$archer"
bad=0
for t in "${tests[@]}"; do
  out="build-tsan/tsan-$t.log"
  log "kvtc_tests_$t"
  # Run from the tests' folder: store_redis starts redis-server processes and keeps their files there.
  (cd build-tsan/tests && ./kvtc_tests_"$t") >"$out" 2>&1 && rc=0 || rc=$?
  n=$(grep -c "WARNING: ThreadSanitizer" "$out" || true)
  echo "kvtc_tests_$t: exit $rc, $n ThreadSanitizer reports ($(grep -E '^\[  (PASSED|FAILED) ' "$out" | tr '\n' ' '))"
  if [ "$rc" -ne 0 ] || [ "$n" -ne 0 ]; then
    bad=1
    grep -A30 -m1 "WARNING: ThreadSanitizer" "$out" || tail -30 "$out"
  fi
done
[ "$bad" -eq 0 ] || die "reports or failures above; logs in build-tsan/tsan-*.log"
log "no ThreadSanitizer reports"
