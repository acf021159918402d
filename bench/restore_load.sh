#!/usr/bin/env bash
# The restore's state load alone (kvtc restore's restore_ms: the llama.cpp
# state built from a capture and loaded into a fresh context), this build
# against another kvtc binary, alternating runs -> bench/results/NAME.md:
#   bench/restore_load.sh NAME CAPTURE BASELINE_KVTC [RUNS]
# CAPTURE: a `kvtc capture` file (e.g. build/kvtc capture -t TEXT -o c8k.safetensors
# --max-tokens 8192); BASELINE_KVTC: a kvtc binary built from another commit
# (the row it makes names it). RUNS pairs (default 10); min, median and max of each.
# Nothing else should run meanwhile: the figure is a few tens of ms.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
[ $# -ge 3 ] || { sed -n 2,9p "$0" >&2; exit 2; }
name=$1 capture=$2 base=$3 runs=${4:-10}
[ -f "$capture" ] || { echo "bench/restore_load.sh: $capture: no such capture" >&2; exit 2; }
[ -x "$base" ] || { echo "bench/restore_load.sh: $base: not an executable kvtc" >&2; exit 2; }
tokens=$(python3 -c '
import json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]
print(json.loads(f.read(n))["__metadata__"]["n_tokens"])' "$capture")
ctx=$((tokens + 64))  # the one token restore generates must fit
one() { "$1" restore "$capture" -n 1 --ctx "$ctx" --json 2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["restore_ms"])'; }
: > "$res/$name.runs.part"
for _ in $(seq "$runs"); do
  echo "base $(one "$base")" >> "$res/$name.runs.part"
  echo "this $(one "$kvtc")" >> "$res/$name.runs.part"
done
{
  echo "# The restore's state load: this build against a baseline"
  echo
  echo "- command: \`bench/restore_load.sh $*\`"
  echo "- commit: $(result_commit); baseline: $base"
  echo "- machine: $(result_cpu), $(nproc) threads, $(uname -sr)"
  echo "- capture: $(basename "$capture"), $tokens tokens; \`kvtc restore -n 1 --ctx $ctx --json\`'s restore_ms (state built + loaded), $runs runs each, alternating"
  echo
  echo "| build | min ms | median ms | max ms |"
  echo "|---|---|---|---|"
  python3 - "$res/$name.runs.part" <<'PY'
import statistics, sys
d = {}
for line in open(sys.argv[1]):
    who, ms = line.split()
    d.setdefault(who, []).append(float(ms))
for who in ("base", "this"):
    v = d[who]
    print(f"| {'baseline' if who == 'base' else 'this build'} | {min(v):.1f} | {statistics.median(v):.1f} | {max(v):.1f} |")
PY
} > "$res/$name.md"
rm -f "$res/$name.runs.part"
cat "$res/$name.md"
