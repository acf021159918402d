#!/usr/bin/env bash
# Issue 32 item 3 at equal model KL: the 2-run layer-grouped calibration holds
# the DP's KL at DP-16x's squared error (bench/results/grouped-quality.md), so
# its decode speed there is the item's figure at equal KL. kvtc-lab bench on
# SmolLM2's 8K cache (entropy-coded, auto's int8 decode, window at 8 bits) at
# the ratios around that error, in 2 rounds (each row its fastest), then the
# point at one PCA's DP-16x error interpolated as bench/grouped_report.py does
# (the DP row from .deps/grouped-bench/one.json, make bench-grouped).
# Usage: [KVTC_REPORT_ONLY=1] bench/grouped_kl_speed.sh [G2_CALIB]. Prints the rows and the point.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
calib=${1:-$top/.deps/calib/smollm2-160k-g2.safetensors}
out="$top/.deps/encoder-bench/g2kl"
mkdir -p "$out"
for r in 1 2; do
  [ -z "${KVTC_REPORT_ONLY:-}" ] || break  # reread the runs already there
  "$lab" bench --calib "$calib" --context 8192 --window-bits 8 --repeat 3 --precision int8 --coding ecsq --ratio 18 20 22.8 \
    --out-json "$out/run$r.json" >/dev/null
done
python3 "$top/bench/grouped_kl_speed.py" "$out/run1.json" "$out/run2.json" --dp "$top/.deps/grouped-bench/one.json"
