#!/usr/bin/env bash
# The layer-grouped PCA in the codec (kvtc calibrate --layer-groups N) against
# one PCA, on SmolLM2's 8K cache: kvtc-lab bench on this machine, one run
# after another — one PCA (make calibrate), each grouped calibration
# (make calibrate-grouped: 2 and 3 runs of layers), the first grouped one
# multiplied as one dense GEMM over its zeros (--dense: the same bytes and
# error, only the GEMM's layout differs) and the last one with the
# decoder's conversions in their scalar forms (--scalar-kernels: the same
# bits, only those kernels differ) — then bench/grouped_report.py matches
# them at equal error.
# Usage: bench/grouped.sh ONE_CALIB GROUPED_CALIB [GROUPED_CALIB ...].
# Writes bench/results/grouped.md, .json; the bench JSONs stay in .deps/grouped-bench/.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
[ $# -ge 2 ] || { echo "usage: bench/grouped.sh ONE_CALIB GROUPED_CALIB [GROUPED_CALIB ...]" >&2; exit 2; }
one=$1
shift
out="$top/.deps/grouped-bench"
mkdir -p "$out"
common=(--context 8192 --window-bits 8 --repeat 3)
# One PCA's entropy-coded mode reaches DP-32x's error near 48-52x.
"$lab" bench --calib "$one" "${common[@]}" --ratio 16 22.8 32 45.3 52 --coding dp ecsq --precision bf16 int8 --out-json "$out/one.json" >/dev/null
args=()
i=0
for g in "$@"; do
  i=$((i + 1))
  # Grouped DP below 16x: its error at 16x is above one PCA's DP.
  "$lab" bench --calib "$g" "${common[@]}" --ratio 12 14 16 18 20 22.8 32 36 40 45.3 --coding dp ecsq --precision bf16 int8 \
    --out-json "$out/grouped$i.json" >/dev/null
  args+=(--grouped "$out/grouped$i.json")
done
"$lab" bench --calib "$1" "${common[@]}" --dense --ratio 16 20 32 40 --coding dp ecsq --precision int8 --out-json "$out/dense.json" >/dev/null
"$lab" bench --calib "${!#}" "${common[@]}" --scalar-kernels --ratio 16 20 32 40 --coding dp ecsq --precision int8 --out-json "$out/scalar.json" >/dev/null
python3 "$top/bench/grouped_report.py" --one "$out/one.json" "${args[@]}" --dense "$out/dense.json" --scalar "$out/scalar.json" \
  --command "bench/grouped.sh $*" --commit "$(result_commit)" --machine "$(result_cpu features), $(nproc) threads, $(uname -sr)" \
  --out-md "$res/grouped.md.part" --out-json "$res/grouped.json.part"
[ ! -f "$res/grouped-reading.md" ] || cat "$res/grouped-reading.md" >>"$res/grouped.md.part"
mv "$res/grouped.json.part" "$res/grouped.json"
mv "$res/grouped.md.part" "$res/grouped.md"
echo "wrote $res/grouped.md"
