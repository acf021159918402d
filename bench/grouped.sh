#!/usr/bin/env bash
# The layer-grouped PCA in the codec (kvtc calibrate --layer-groups 2) against
# one PCA, on SmolLM2's 8K cache: kvtc-lab bench three times on this machine,
# one after another — one PCA (make calibrate), 2 runs of 15 layers
# (make calibrate-grouped), and the grouped basis multiplied as one dense GEMM
# over its zeros (--dense: the same bytes and error, only the GEMM's layout
# differs) — then bench/grouped_report.py matches them at equal error.
# Usage: bench/grouped.sh ONE_CALIB GROUPED_CALIB. Writes bench/results/grouped.md, .json.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
one=$1
grouped=$2
common=(--context 8192 --window-bits 8 --repeat 3)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$lab" bench --calib "$one" "${common[@]}" --ratio 16 22.8 32 45.3 --coding dp ecsq --precision bf16 int8 --out-json "$tmp/one.json" >/dev/null
"$lab" bench --calib "$grouped" "${common[@]}" --ratio 16 18 20 22.8 32 36 40 45.3 --coding dp ecsq --precision bf16 int8 \
  --out-json "$tmp/grouped.json" >/dev/null
"$lab" bench --calib "$grouped" "${common[@]}" --dense --ratio 16 20 32 40 --coding dp ecsq --precision int8 --out-json "$tmp/dense.json" >/dev/null
python3 "$top/bench/grouped_report.py" --one "$tmp/one.json" --grouped "$tmp/grouped.json" --dense "$tmp/dense.json" \
  --command "bench/grouped.sh $*" --commit "$(result_commit)" --machine "$(result_cpu features), $(nproc) threads, $(uname -sr)" \
  --out-md "$res/grouped.md.part" --out-json "$res/grouped.json.part"
[ ! -f "$res/grouped-reading.md" ] || cat "$res/grouped-reading.md" >>"$res/grouped.md.part"
mv "$res/grouped.json.part" "$res/grouped.json"
mv "$res/grouped.md.part" "$res/grouped.md"
echo "wrote $res/grouped.md"
