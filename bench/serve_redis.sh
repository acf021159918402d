#!/usr/bin/env bash
# Two kvtc-server replicas sharing a Redis tier behind a round-robin client
# (issue 13): no shared tier, raw f16 in Redis, kvtc 16x in Redis ->
# bench/results/serve-redis.{md,json}.
# Usage: bench/serve_redis.sh [NAME] [bench/serve_redis.py options...]   (default NAME: serve-redis)
# Needs make (kvtc-server, redis-server) and a calibration (as bench/serve.sh).
# ~30 min on 2 cores with the defaults (16 sessions x 3 turns, 1K-4K tokens).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
name=serve-redis
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then name=$1; shift; fi
cal=$("$top/scripts/default_calib.sh" "$kvtc")
model="$top/.deps/models/SmolLM2-135M-Instruct.Q4_1.gguf"
work="$top/out/bench-serve-redis"
rm -rf "$work" && mkdir -p "$work"
PYTHONPATH="$top/.deps/py" python3 "$top/bench/serve_redis.py" --server "$top/build/kvtc-server" --model "$model" --calib "$cal" \
  --corpus "$top/.deps/corpus" --work "$work" --out-json "$res/$name.json.part" "$@"
{
  echo "# kvtc-server: two replicas sharing a Redis tier"
  echo
  echo "- command: \`bench/serve_redis.sh $name $*\`"
  echo "- commit: $(result_commit)"
  echo "- machine: $(result_cpu), $(nproc) threads, $(uname -sr); Redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/') on loopback"
  echo "- model: SmolLM2-135M-Instruct Q4_1 (23,040 bytes of f16 K+V per token); calibration: $(basename "$cal")"
  echo
  python3 "$top/bench/serve_redis_report.py" "$res/$name.json.part"
} >"$res/$name.md.part"
mv "$res/$name.md.part" "$res/$name.md"
mv "$res/$name.json.part" "$res/$name.json"
echo "wrote $res/$name.md"
