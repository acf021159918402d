#!/usr/bin/env bash
# Issue 30 item 4: llama.cpp's prefill speed by the ggml CPU variant it runs
# on. The bootstrap builds llama.cpp once with ggml's run-time CPU dispatch:
# one loadable module per variant (build/bin/libggml-cpu-<variant>.so), the
# best this CPU runs chosen at start. Here one build/kvtc runs each named
# variant in turn (KVTC_GGML_CPU=<variant>; "auto" is ggml's own choice,
# shown with the variant it loaded) and `kvtc capture` prints its prefill
# tokens/s on the same prompts:
#   haswell  x86-64-v3 (AVX2/FMA/F16C/BMI2): what kvtc shipped alone before
#   x64      the fallback for any x86-64 CPU
#   auto     ggml's choice (zen4 on an AVX-512/VNNI/BF16 CPU)
# A variant this CPU cannot run is skipped (said in the result).
# -> bench/results/prefill-isa.md. Usage: bench/prefill_isa.sh [REPS [VARIANT...]]
# (~12 min on 2 cores with Qwen fetched, 3 runs of 3 variants).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
reps=${1:-3}
shift || true
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(haswell x64 auto)
deps="$top/.deps"
[ -x "$kvtc" ] || { echo "run make build first" >&2; exit 1; }

models=(smollm2)
[ -f "$deps/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" ] && models+=(qwen)
text=$(python3 - "$deps/corpus" <<'EOF'
import json, os, sys
m = json.load(open(os.path.join(sys.argv[1], "manifest.json")))
d = next(d for d in m["documents"] if d["split"] == "eval" and d["kind"] == "prose" and d["tokens"] >= 4096)
print(os.path.join(sys.argv[1], d["file"]))
EOF
)
# What each name loads here ("auto" -> ggml's pick); a variant this CPU
# cannot run makes kvtc exit with the reason: skipped.
declare -A loads=()
skipped=()
run=()
for v in "${variants[@]}"; do
  if got=$(KVTC_GGML_CPU=$v "$kvtc" info --json 2>&1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["llama_cpp_cpu"])' 2>/dev/null); then
    loads[$v]=$got
    run+=("$v")
  else
    skipped+=("$v ($(KVTC_GGML_CPU=$v "$kvtc" info 2>&1 | tail -1))")
  fi
done
ref=${run[0]}
declare -A crashed=() slow=()
slow_said=()
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rows=()
for model in "${models[@]}"; do
  for n in 512 2048; do
    declare -A runs=()
    for r in $(seq 1 "$reps"); do
      for v in "${run[@]}"; do  # interleaved: a slow minute hits every variant alike
        [ -z "${crashed[$v]:-}" ] || continue
        [ -z "${slow[$model $v]:-}" ] || continue
        rc=0
        out=$(KVTC_GGML_CPU=$v KVTC_MODEL=$model "$kvtc" capture --text "$text" --max-tokens "$n" --ctx $((n + 64)) -o "$tmp/c.safetensors" 2>&1) || rc=$?
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
    for v in "${run[@]}"; do
      [ -z "${runs[$v]:-}" ] || rows+=("$model|$n|$v|${loads[$v]}|${runs[$v]}|${runs[$ref]}")
      # Under a quarter of the reference's speed (x64 on Qwen: ~3 tokens/s, a
      # 2K-token run would take 11 min): not run at the longer prompt.
      if [ -n "${runs[$v]:-}" ] && python3 -c 'import statistics,sys; a,b=(statistics.median(map(float,x.split())) for x in sys.argv[1:]); sys.exit(0 if a < b / 4 else 1)' "${runs[$v]}" "${runs[$ref]}"; then
        slow[$model $v]=1
        slow_said+=("$v on $model past $n tokens (under a quarter of $ref's speed)")
      fi
    done
    unset runs
  done
done
{
  echo "# Prefill tokens/s by the ggml CPU variant llama.cpp runs on (issue 30, item 4)"
  echo
  echo "- command: \`bench/prefill_isa.sh $reps ${variants[*]}\`"
  echo "- commit: $(result_commit)"
  echo "- machine: $(result_cpu), $(nproc) threads, $(uname -sr)"
  echo "- what: \`kvtc capture --max-tokens N\` (llama.cpp's prefill of N tokens of one evaluation prose text in one context, the whole prompt in batches of 512; tokens/s as capture prints it), one build/kvtc with \`KVTC_GGML_CPU=<variant>\` (auto: ggml's own choice among the variants built, scripts/bootstrap.sh); the variants interleaved run by run"
  [ ${#skipped[@]} -eq 0 ] || { printf -- "- not run: %s" "${skipped[0]}"; printf "; %s" "${skipped[@]:1}"; echo; }
  [ ${#slow_said[@]} -eq 0 ] || { printf -- "- not run: %s" "${slow_said[0]}"; printf "; %s" "${slow_said[@]:1}"; echo; }
  for v in "${!crashed[@]}"; do echo "- **$v crashed**: ${crashed[$v]}"; done
  echo
  echo "| model | tokens | KVTC_GGML_CPU | loaded | runs (tokens/s) | median | vs $ref |"
  echo "|---|---:|---|---|---|---:|---:|"
  for row in "${rows[@]}"; do
    IFS='|' read -r model n v got runs refruns <<<"$row"
    python3 - "$model" "$n" "$v" "$got" "$runs" "$refruns" <<'EOF'
import statistics, sys
model, n, v, got, runs, ref = sys.argv[1:]
r = [float(x) for x in runs.split()]
b = [float(x) for x in ref.split()]
print(f"| {model} | {n} | {v} | {got} | {', '.join(f'{x:.0f}' for x in r)} | {statistics.median(r):.0f} | {statistics.median(r) / statistics.median(b):.2f}x |")
EOF
  done
} >"$res/prefill-isa.md.part"
mv "$res/prefill-isa.md.part" "$res/prefill-isa.md"
echo "wrote $res/prefill-isa.md"
