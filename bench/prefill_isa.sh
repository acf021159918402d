#!/usr/bin/env bash
# Issue 30 item 4, measured before it is built: how much faster does
# llama.cpp prefill when ggml is compiled for this CPU's wider instructions
# than the x86-64-v3 (AVX2) build kvtc ships? The same pinned llama.cpp
# source built twice more beside the bootstrap's, kvtc's `capture` linked
# against each, and its prefill tokens/s compared on the same prompts:
#   v3      the bootstrap's build (-DGGML_NATIVE=OFF, AVX2/FMA/F16C/BMI2)
#   avx512  + AVX-512 F/BW/DQ/VL, VBMI, VNNI, BF16 (ggml's "zen4" CPU
#           variant's flags: what an AVX-512 machine without AMX gets)
#   native  -march=native (on a Xeon with AMX, ggml's AMX path too)
# A variant the CPU cannot run is skipped (said in the result).
# -> bench/results/prefill-isa.md. Usage: bench/prefill_isa.sh [REPS]
# (~10 min on 2 cores: two llama.cpp builds, then the runs).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
reps=${1:-3}
deps="$top/.deps"
base="$deps/llama.cpp-4df29be4f"
[ -f "$base/build/src/libllama.a" ] || { echo "run make build first" >&2; exit 1; }
[ "$(cat "$deps/stamps/llama-cpu" 2>/dev/null || echo v3)" = v3 ] || { echo "the v3 row is build/kvtc: make build LLAMA_CPU=v3 first" >&2; exit 1; }
# The bootstrap's flags, less its instruction-set choice.
common="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON -DCMAKE_POSITION_INDEPENDENT_CODE=ON"
v3="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
declare -A flags=(
  [avx512]="$v3 -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
  [native]="-DGGML_NATIVE=ON"
)
declare -A needs=([avx512]="avx512f avx512bw avx512dq avx512vl avx512vbmi avx512_vnni avx512_bf16" [native]="")
cpuflags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
declare -A bin=([v3]="$top/build/kvtc")
skipped=()
for v in avx512 native; do
  miss=""
  for f in ${needs[$v]}; do [[ "$cpuflags" == *" $f "* ]] || miss="$miss $f"; done
  if [ -n "$miss" ]; then
    skipped+=("$v (this CPU lacks$miss)")
    continue
  fi
  dir="$deps/llama.cpp-4df29be4f-$v"
  if [ ! -f "$dir/build/src/libllama.a" ]; then
    echo "building llama.cpp ($v) in $dir" >&2
    mkdir -p "$dir"
    ln -sfn "$base/src" "$dir/src"
    # shellcheck disable=SC2086
    cmake -S "$dir/src" -B "$dir/build" $common ${flags[$v]} >"$dir/configure.log" 2>&1
    cmake --build "$dir/build" --target llama -j"$(nproc)" >"$dir/build.log" 2>&1
  fi
  mkdir -p "$top/build-$v"
  cmake -S "$top" -B "$top/build-$v" -DCMAKE_BUILD_TYPE=Release -DKVTC_LLAMA_DIR="$dir" >"$top/build-$v/configure.log" 2>&1
  cmake --build "$top/build-$v" --target kvtc -j"$(nproc)" >"$top/build-$v/build.log" 2>&1
  bin[$v]="$top/build-$v/kvtc"
done

models=(smollm2)
[ -f "$deps/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" ] && models+=(qwen)
text=$(python3 - "$deps/corpus" <<'EOF'
import json, os, sys
m = json.load(open(os.path.join(sys.argv[1], "manifest.json")))
d = next(d for d in m["documents"] if d["split"] == "eval" and d["kind"] == "prose" and d["tokens"] >= 4096)
print(os.path.join(sys.argv[1], d["file"]))
EOF
)
variants=(v3 "${!bin[@]}")
variants=($(printf '%s\n' "${variants[@]}" | awk '!seen[$0]++'))
declare -A crashed=()
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rows=()
for model in "${models[@]}"; do
  for n in 512 2048; do
    declare -A runs=()
    for r in $(seq 1 "$reps"); do
      for v in "${variants[@]}"; do  # interleaved: a slow minute hits every variant alike
        [ -z "${crashed[$v]:-}" ] || continue
        rc=0
        out=$(KVTC_MODEL=$model "${bin[$v]}" capture --text "$text" --max-tokens "$n" --ctx $((n + 64)) -o "$tmp/c.safetensors" 2>&1) || rc=$?
        if [ "$rc" -gt 128 ]; then  # a crash is a result too: the variant is not run again
          crashed[$v]="killed by signal $((rc - 128)) on $model (run $r)"
          echo "$v: ${crashed[$v]}" >&2
          continue
        fi
        tps=$(sed -n 's/.*prefill .*(\([0-9.]*\) tokens\/s.*/\1/p' <<<"$out")
        [ -n "$tps" ] || { echo "no prefill figure from $v (exit $rc): $out" >&2; exit 1; }
        runs[$v]="${runs[$v]:-} $tps"
        echo "$model $n $v run $r: $tps tokens/s" >&2
      done
    done
    for v in "${variants[@]}"; do
      [ -z "${runs[$v]:-}" ] || rows+=("$model|$n|$v|${runs[$v]}|${runs[v3]}")
    done
    unset runs
  done
done
{
  echo "# Prefill tokens/s by the instruction set ggml is built for (issue 30, item 4)"
  echo
  echo "- command: \`bench/prefill_isa.sh $reps\`"
  echo "- commit: $(result_commit)"
  echo "- machine: $(result_cpu), $(nproc) threads, $(uname -sr)"
  echo "- what: \`kvtc capture --max-tokens N\` (llama.cpp's prefill of N tokens of one evaluation prose text in one context, the whole prompt in batches of 512; tokens/s as capture prints it), each variant's kvtc linked against llama.cpp 4df29be4f built with its flags; the variants interleaved run by run"
  [ ${#skipped[@]} -eq 0 ] || echo "- not run: ${skipped[*]}"
  for v in "${!crashed[@]}"; do echo "- **$v crashed**: ${crashed[$v]}"; done
  echo
  echo "| model | tokens | build | runs (tokens/s) | median | vs v3 |"
  echo "|---|---:|---|---|---:|---:|"
  for row in "${rows[@]}"; do
    IFS='|' read -r model n v runs ref <<<"$row"
    python3 - "$model" "$n" "$v" "$runs" "$ref" <<'EOF'
import statistics, sys
model, n, v, runs, ref = sys.argv[1:]
r = [float(x) for x in runs.split()]
b = [float(x) for x in ref.split()]
print(f"| {model} | {n} | {v} | {', '.join(f'{x:.0f}' for x in r)} | {statistics.median(r):.0f} | {statistics.median(r) / statistics.median(b):.2f}x |")
EOF
  done
} >"$res/prefill-isa.md.part"
mv "$res/prefill-isa.md.part" "$res/prefill-isa.md"
echo "wrote $res/prefill-isa.md"
