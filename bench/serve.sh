#!/usr/bin/env bash
# The multi-user chat replay through kvtc-server (issue 12): four modes at
# the same prompt-cache budgets -> bench/results/serve.{md,json}.
# Usage: bench/serve.sh [NAME] [bench/serve.py options...]   (default NAME: serve)
# Needs make (kvtc-server) and a calibration (the default one: make calibrate,
# or the quick one scripts/default_calib.sh fits). ~40 min on 2 cores with
# the defaults (16 sessions x 3 turns, 1K-4K tokens, budgets 128 and 512 MiB).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
name=serve
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then name=$1; shift; fi
cal=$("$top/scripts/default_calib.sh" "$kvtc")
model="$top/.deps/models/SmolLM2-135M-Instruct.Q4_1.gguf"
work="$top/out/bench-serve"
rm -rf "$work" && mkdir -p "$work"
PYTHONPATH="$top/.deps/py" python3 "$top/bench/serve.py" --server "$top/build/kvtc-server" --model "$model" --calib "$cal" \
  --corpus "$top/.deps/corpus" --work "$work" --out-json "$res/$name.json.part" "$@"
{
  echo "# kvtc-server: multi-user chat replay"
  echo
  echo "- command: \`bench/serve.sh $name $*\`"
  echo "- commit: $(result_commit)"
  echo "- machine: $(result_cpu), $(nproc) threads, $(uname -sr)"
  echo "- model: SmolLM2-135M-Instruct Q4_1 (23,040 bytes of f16 K+V per token); calibration: $(basename "$cal")"
  echo
  python3 "$top/bench/serve_report.py" "$res/$name.json.part"
} >"$res/$name.md.part"
mv "$res/$name.md.part" "$res/$name.md"
mv "$res/$name.json.part" "$res/$name.json"
echo "wrote $res/$name.md"
