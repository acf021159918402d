#!/usr/bin/env bash
# The serving benchmarks through kvtc-server -> bench/results/NAME.{md,json}:
#   bench/serve.sh [NAME] [options...]          the multi-user chat replay (issue 12): four modes at
#                                               the same prompt-cache budgets (default NAME: serve)
#   bench/serve.sh --redis [NAME] [options...]  two replicas sharing a Redis tier behind a round-robin
#                                               client (issue 13): no shared tier, raw f16 in Redis,
#                                               kvtc 16x in Redis (default NAME: serve-redis)
# options: bench/serve.py's. Needs make (kvtc-server; --redis also redis-server)
# and a calibration (the default one: make calibrate, or the quick one
# scripts/default_calib.sh fits). With the defaults (16 sessions x 3 turns,
# 1K-4K tokens; the chat replay at budgets 128 and 512 MiB) ~40 min on 2
# cores, ~30 min with --redis.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
redis=
if [ "${1-}" = --redis ]; then redis=--redis; shift; fi
name=serve${redis:+-redis}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then name=$1; shift; fi
cal=$("$top/scripts/default_calib.sh" "$kvtc")
model="$top/.deps/models/SmolLM2-135M-Instruct.Q4_1.gguf"
work="$top/out/bench-serve${redis:+-redis}"
rm -rf "$work" && mkdir -p "$work"
PYTHONPATH="$top/.deps/py" python3 "$top/bench/serve.py" ${redis:+"$redis"} --server "$top/build/kvtc-server" --model "$model" --calib "$cal" \
  --corpus "$top/.deps/corpus" --work "$work" --out-json "$res/$name.json.part" "$@"
if [ -n "$redis" ]; then
  title="two replicas sharing a Redis tier"
  machine="$(result_cpu), $(nproc) threads, $(uname -sr); Redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/') on loopback"
else
  title="multi-user chat replay"
  machine="$(result_cpu), $(nproc) threads, $(uname -sr)"
fi
{
  echo "# kvtc-server: $title"
  echo
  echo "- command: \`bench/serve.sh ${redis:+--redis }$name $*\`"
  echo "- commit: $(result_commit)"
  echo "- machine: $machine"
  echo "- model: SmolLM2-135M-Instruct Q4_1 (23,040 bytes of f16 K+V per token); calibration: $(basename "$cal")"
  echo
  python3 "$top/bench/serve_report.py" "$res/$name.json.part"
} >"$res/$name.md.part"
mv "$res/$name.md.part" "$res/$name.md"
mv "$res/$name.json.part" "$res/$name.json"
echo "wrote $res/$name.md"
