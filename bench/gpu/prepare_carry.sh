#!/usr/bin/env bash
# Run HERE (the Debian 12 build machine), not on the GPU machine: copies the
# headers and static libraries the reduced GPU build needs into
# .deps/gpu-sysroot, so that a bare GPU machine (no package registry) can
# build without our Debian -dev packages. Carry it with .deps/nvcomp:
#   carry: [".deps/nvcomp", ".deps/gpu-sysroot"]   (~40 MB with the tree; limit 64 MiB)
# Idempotent; needs scripts/bootstrap.sh to have run (for .deps/nvcomp).
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
out="$top/.deps/gpu-sysroot"
lib=/usr/lib/x86_64-linux-gnu
rm -rf "$out.tmp"
mkdir -p "$out.tmp/include" "$out.tmp/lib"
cp -r /usr/include/nlohmann /usr/include/gtest "$out.tmp/include/"
cp /usr/include/libdeflate.h /usr/include/xxhash.h "$out.tmp/include/"
cp -r /usr/include/openssl "$out.tmp/include/"
cp /usr/include/x86_64-linux-gnu/openssl/*.h "$out.tmp/include/openssl/"   # Debian keeps the arch-specific ones apart
cp "$lib/libdeflate.a" "$lib/libxxhash.a" "$lib/libcrypto.a" "$lib/libgtest.a" "$lib/libgtest_main.a" "$out.tmp/lib/"
{
  echo "copied $(date -u +%FT%TZ) from $(. /etc/os-release; echo "$PRETTY_NAME")"
  dpkg-query -W -f='${Package} ${Version}\n' libdeflate-dev libxxhash-dev libssl-dev libgtest-dev nlohmann-json3-dev 2>/dev/null
} >"$out.tmp/SOURCES"
rm -rf "$out"
mv "$out.tmp" "$out"
[ -f "$top/.deps/nvcomp/lib64/libnvcomp.so.6" ] || echo "warning: .deps/nvcomp missing (run scripts/bootstrap.sh on a machine with nvcc)" >&2
du -sh "$out" "$top/.deps/nvcomp" 2>/dev/null
