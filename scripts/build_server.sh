#!/usr/bin/env bash
# kvtc-server: the pinned llama.cpp's own llama-server, with
# server/llama-server.patch (hooks only) and server/kvtc_server.cpp (the
# prompt cache on kvtc's PromptStore), linked with this build's kvtc
# library. Usage: scripts/build_server.sh BUILD_DIR  ->  BUILD_DIR/kvtc-server
#
# Idempotent: the server sources are re-extracted and patched only when the
# patch changes; the llama.cpp build directory the bootstrap made is
# reconfigured with the server on (its libllama is not rebuilt), so a first
# build compiles llama.cpp's common, mtmd and server (~4 min on 2 cores) and
# later ones only what changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-build}" && pwd)
llama_dir="$root/.deps/llama.cpp-4df29be4f"
sdist="$root/.deps/dl/llama_cpp_python-0.3.35.tar.gz"
patch_file="$root/server/llama-server.patch"
log() { echo "[build_server] $*" >&2; }
die() { echo "[build_server] error: $*" >&2; exit 1; }
[ -f "$llama_dir/build/bin/libllama.so" ] || die "no llama.cpp build in $llama_dir (run scripts/bootstrap.sh first)"

# The kvtc package (libkvtc.a, libkvtc_llama.a, headers, find_package files)
# where the server's CMake finds it.
prefix="$build/kvtc-prefix"
cmake --install "$build" --prefix "$prefix" >"$build/kvtc-prefix.log" 2>&1 || die "cmake --install failed; see $build/kvtc-prefix.log"

want=$(sha256sum "$patch_file" | cut -d' ' -f1)
stamp="$llama_dir/server-patch.sha256"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "patching tools/server of the pinned llama.cpp ($patch_file)"
  rm -f "$stamp"
  rm -rf "$llama_dir/src/tools/server"
  tar -xzf "$sdist" -C "$llama_dir/src" --strip-components=3 llama_cpp_python-0.3.35/vendor/llama.cpp/tools/server
  patch -d "$llama_dir/src" -p1 --forward --quiet <"$patch_file" || die "the patch does not apply to the pinned source"
  echo "$want" >"$stamp"
fi

log "building kvtc-server (a first build ~4 min on 2 cores, then only what changed)"
cmake -S "$llama_dir/src" -B "$llama_dir/build" -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -Dkvtc_DIR="$prefix/lib/cmake/kvtc" -DKVTC_SERVER_DIR="$root/server" \
  >"$build/kvtc-server.configure.log" 2>&1 || die "configure failed; see $build/kvtc-server.configure.log"
cmake --build "$llama_dir/build" --target llama-server -j"$(nproc)" >"$build/kvtc-server.build.log" 2>&1 \
  || { tail -30 "$build/kvtc-server.build.log" >&2; die "build failed; see $build/kvtc-server.build.log"; }
cp -f "$llama_dir/build/bin/kvtc-server" "$build/kvtc-server.tmp" && mv -f "$build/kvtc-server.tmp" "$build/kvtc-server"
log "ready: $build/kvtc-server"
