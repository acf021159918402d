#!/usr/bin/env bash
# The paper's evidence on our model (`kvtc-lab analyze`), with the command,
# commit and machine on top. Usage: bench/analyze.sh [kvtc-lab analyze options…]
# Writes bench/results/analyze/: analyze.json (kvtc-lab analyze), the PNGs
# (bench/plots.py, matplotlib, from analyze.json) and README.md.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
out="$top/bench/results/analyze"
mkdir -p "$out"
body="$out/README.body.part"
trap 'rm -f "$body" "$out/README.md.part"' EXIT
start=$(date +%s)
"$lab" analyze "$@" -o "$out" --out-md "$body" >/dev/null
python3 "$top/bench/plots.py" analyze "$out"
commit=$(result_commit)
cpu=$(result_cpu)
model=$(python3 -c 'import json,os,sys; print(os.path.basename(json.load(open(sys.argv[1]))["model"]))' "$out/analyze.json")
{
  echo "# kvtc-lab analyze: the paper's evidence on $model"
  echo
  echo "- command: \`make analyze\`, i.e. \`bench/analyze.sh $*\`"
  echo "- commit: $commit"
  echo "- machine: $cpu, $(nproc) threads, $(uname -sr); $(( $(date +%s) - start )) s"
  echo "- all numbers: [analyze.json](analyze.json); errors are ||x - x'||^2 / ||x||^2 over the coded tokens (the first 4 and"
  echo "  the last 128 tokens of a cache are stored raw), pooled over the evaluation captures, keys as llama.cpp stores them"
  cat "$body"
} >"$out/README.md.part"
mv "$out/README.md.part" "$out/README.md"
echo "wrote $out/README.md"
