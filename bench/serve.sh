#!/usr/bin/env bash
# The serving benchmarks through kvtc-server, scored by answers (issue 29):
#   bench/serve.sh [--redis] [--model qwen|smollm2] [--calib FILE] [NAME] [bench/serve.py options...]
# Records are appended to bench/results/NAME.records.jsonl run by run (a rerun
# computes only the runs they lack: `--blocks 1-3` adds blocks), then
# bench/results/NAME.{md,json} are rebuilt from all of them.
#   NAME default: serve (Qwen), serve-smollm2, serve-redis, serve-redis-smollm2
#   --model qwen (default): Qwen2.5-Coder-1.5B-Instruct Q4_K_M, its calibration
#     .deps/calib/qwen-160k.safetensors (make models-large calibrate-qwen)
#   --model smollm2: SmolLM2-135M-Instruct, the default calibration (the quick
#     variant; make calibrate for the full one)
#   --model gemma3: Gemma 3 270M (sliding-window layers), the calibration
#     .deps/calib/gemma3-32k.safetensors (kvtc calibrate -m gemma3 --tokens 32768
#     --heldout 2048 --doc-tokens 4096 -o FILE: ~2 min); not the ecsq mode
#   --calib FILE: another calibration of the model (the report names it); one
#     records file holds one calibration (serve_report refuses a mix): give
#     such runs their own NAME
# Time on 2 EPYC cores, one block (12 sessions x 6 turns, 1K-2K tokens): SmolLM2
# ~12 min for the single server's 10 runs, Qwen ~1 h (see the result files).
# With no serve.py option but NAME, only the report is rebuilt.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
redis=
model=qwen
calib=
extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --redis) redis=--redis; shift ;;
    --model) model=$2; shift 2 ;;
    --calib) calib=$2; shift 2 ;;
    *) break ;;
  esac
done
case $model in
  qwen) gguf="$top/.deps/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"; cal="$top/.deps/calib/qwen-160k.safetensors"
        desc="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (28,672 bytes of f16 K+V per token)"; suffix= ;;
  smollm2) gguf="$top/.deps/models/SmolLM2-135M-Instruct.Q4_1.gguf"; cal=$("$top/scripts/default_calib.sh" "$kvtc")
           desc="SmolLM2-135M-Instruct Q4_1 (23,040 bytes of f16 K+V per token)"; suffix=-smollm2 ;;
  # A sliding-window model (docs/store.md "Sliding-window models"); its GGUF has no chat template.
  gemma3) gguf="$top/.deps/models/gemma-3-270m-q4_k_m.gguf"; cal="$top/.deps/calib/gemma3-32k.safetensors"
          desc="Gemma 3 270M Q4_K_M (3,072 bytes of f16 K+V per token in its 3 global layers, 15,360 in its 15 window layers for the last 512)"
          suffix=-gemma3; extra=(--server-arg=--chat-template-file --server-arg="$top/scripts/gemma-chat.jinja") ;;
  *) echo "bench/serve.sh: --model qwen, smollm2 or gemma3, not '$model'" >&2; exit 2 ;;
esac
[ -z "$calib" ] || cal=$calib
name=serve${redis:+-redis}$suffix
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then name=$1; shift; fi
rec="$res/$name.records.jsonl"
if [ $# -gt 0 ]; then
  [ -f "$gguf" ] || { echo "bench/serve.sh: $gguf missing: make models-large" >&2; exit 2; }
  [ -f "$cal" ] || { echo "bench/serve.sh: $cal missing: make calibrate-qwen (or make calibrate)" >&2; exit 2; }
  work="$top/out/bench-$name"
  rm -rf "$work" && mkdir -p "$work"
  PYTHONPATH="$top/.deps/py" python3 "$top/bench/serve.py" ${redis:+"$redis"} --server "$top/build/kvtc-server" --model "$gguf" \
    --calib "$cal" --corpus "$top/.deps/corpus" --work "$work" --records "$rec" ${extra[@]+"${extra[@]}"} "$@"
fi
[ -s "$rec" ] || { echo "bench/serve.sh: no records in $rec yet: pass the runs to make (e.g. --blocks 0)" >&2; exit 2; }
if [ -n "$redis" ]; then
  title="two replicas sharing a Redis tier, scored by answers"
  where="; Redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/') on loopback"
else
  title="the prompt cache, scored by answers"
  where=
fi
{
  echo "# kvtc-server: $title"
  echo
  echo "- command: \`bench/serve.sh ${redis:+--redis }--model $model ${calib:+--calib $calib }$name [options]\` (each run's options and commit below; records: \`bench/results/$name.records.jsonl\`)"
  echo "- model: $desc; calibration: $(basename "$cal")$where"
  echo
  python3 "$top/bench/serve_report.py" "$rec" --json "$res/$name.json"
} >"$res/$name.md.part"
mv "$res/$name.md.part" "$res/$name.md"
echo "wrote $res/$name.md"
