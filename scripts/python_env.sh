#!/usr/bin/env bash
# The Python package's environment (issue 15; make python), idempotent:
#   .deps/venv            a venv of Debian's python3 (3.11) with the pinned
#                         wheels of scripts/deps.lock, installed without an index
#   .deps/llama-shared    libllama.so for llama-cpp-python: a link to the
#                         bootstrap's shared llama.cpp, no second build
#   llama-cpp-python      0.3.35 from the sdist the bootstrap already has, its
#                         own llama.cpp build switched off (LLAMA_BUILD=OFF);
#                         it loads .deps/llama-shared/libllama.so through
#                         LLAMA_CPP_LIB_PATH
#   kvtc                  python/ (scikit-build-core + nanobind) against the
#                         libkvtc.a the CLI links (BUILD/kvtc-prefix), built in
#                         BUILD/python so a rebuild is incremental
# Usage: scripts/python_env.sh [BUILD]     (after the C++ build: make python)
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$top" && realpath -m "${1:-build}")
deps="$top/.deps"
venv="$deps/venv"
py=/usr/bin/python3  # Debian's: python3-venv and python3-dev come from the bootstrap
log() { printf '[python] %s\n' "$*" >&2; }
die() { printf '[python] error: %s\n' "$*" >&2; exit 1; }
stamp_ok() { [ -f "$deps/stamps/$1" ] && [ "$(cat "$deps/stamps/$1")" = "$2" ]; }
stamp_set() { printf '%s' "$2" >"$deps/stamps/$1"; }
[ -x "$py" ] || die "$py missing: run scripts/bootstrap.sh (Debian's python3, python3-venv, python3-dev)"
[ -f "$build/kvtc-prefix/lib/libkvtc.a" ] || die "$build/kvtc-prefix/lib/libkvtc.a missing: build the library first (make build)"

# The wheels, by name, as the bootstrap downloaded them into .deps/dl.
declare -A FILE SHA
while IFS='|' read -r name ver file sha url; do
  case "$name" in ''|\#*) continue ;; esac
  FILE[$name]=$file
  SHA[$name]=$sha
done <"$top/scripts/deps.lock"
wheels=(scikit-build-core packaging pathspec nanobind numpy typing-extensions diskcache jinja2 markupsafe pytest pluggy iniconfig pygments)
pin="$($py --version 2>&1)"
paths=()
for w in "${wheels[@]}"; do
  [ -f "$deps/dl/${FILE[$w]}" ] || die "$deps/dl/${FILE[$w]} missing: run scripts/bootstrap.sh"
  pin="$pin ${SHA[$w]}"
  paths+=("$deps/dl/${FILE[$w]}")
done
if ! stamp_ok venv "$pin" || [ ! -x "$venv/bin/python" ]; then
  log "creating $venv (Debian's python3, ${#wheels[@]} pinned wheels)"
  rm -rf "$venv"
  "$py" -m venv "$venv" >"$deps/venv.log" 2>&1 || die "python3 -m venv failed; see $deps/venv.log"
  "$venv/bin/python" -m pip install -q --no-index --no-deps "${paths[@]}" >>"$deps/venv.log" 2>&1 \
    || die "installing the pinned wheels failed; see $deps/venv.log"
  stamp_set venv "$pin"
  rm -f "$deps/stamps/llama-cpp-python"
fi

# LLAMA_CPP_LIB_PATH=.deps/llama-shared: a link to the bootstrap's shared
# llama.cpp (libllama, libggml, libggml-base, and the CPU variants ggml loads
# at run time from the same folder), so Python runs the same build as kvtc.
lb="$deps/llama.cpp-4df29be4f/build/bin"
shared="$deps/llama-shared"
[ -f "$lb/libllama.so" ] || die "$lb/libllama.so missing: run scripts/bootstrap.sh"
if [ "$(readlink "$shared" 2>/dev/null)" != "$lb" ]; then
  log "$shared -> $lb"
  rm -rf "$shared"
  ln -s "$lb" "$shared"
fi

sdist="$deps/dl/${FILE[llama-cpp-python]}"
if ! stamp_ok llama-cpp-python "${SHA[llama-cpp-python]}"; then
  log "installing llama-cpp-python 0.3.35 (Python part; llama.cpp is .deps/llama-shared)"
  "$venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation \
    --config-settings=cmake.define.LLAMA_BUILD=OFF --config-settings=cmake.define.LLAVA_BUILD=OFF "$sdist" >"$deps/llama-cpp-python.log" 2>&1 \
    || die "installing llama-cpp-python failed; see $deps/llama-cpp-python.log"
  stamp_set llama-cpp-python "${SHA[llama-cpp-python]}"
fi

# kvtc: rebuilt when its sources or the library changed.
kpin=$( (cd "$top" && find python -type f -not -path '*/__pycache__/*' -not -path 'python/tests/*' | LC_ALL=C sort | xargs cat;
         cat "$build/kvtc-prefix/lib/libkvtc.a" "$build"/kvtc-prefix/include/kvtc/*.h) | sha256sum | cut -d' ' -f1)
if ! stamp_ok kvtc-python "$kpin" || ! "$venv/bin/python" -c 'import kvtc' 2>/dev/null; then
  log "building and installing the kvtc package (python/) against $build/kvtc-prefix"
  "$venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation \
    --config-settings=build-dir="$build/python" --config-settings=cmake.define.kvtc_DIR="$build/kvtc-prefix/lib/cmake/kvtc" "$top/python" >"$build/python.log" 2>&1 \
    || { tail -30 "$build/python.log" >&2; die "building the kvtc package failed; see $build/python.log"; }
  stamp_set kvtc-python "$kpin"
fi
log "ready: $venv/bin/python (import kvtc, llama_cpp; LLAMA_CPP_LIB_PATH=$shared)"
