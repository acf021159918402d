#!/usr/bin/env bash
# Container version 4's 32-lane rANS against version 2's 4 lanes (kvtc-lab
# bench --ecsq-lanes 4: the same codes, only the stream layout differs) on
# SmolLM2's 8K cache with the 3-run layer-grouped calibration (make
# calibrate-grouped), entropy-coded, auto's int8 decode, back to back.
# Usage: bench/rans_lanes.sh [CALIB] (default .deps/calib/smollm2-160k-g3.safetensors).
# Prints kvtc-lab's table rows; the JSONs stay in .deps/grouped-bench/.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
calib=${1:-$top/.deps/calib/smollm2-160k-g3.safetensors}
mkdir -p "$top/.deps/grouped-bench"
for lanes in 32 4; do
  "$lab" bench --calib "$calib" --context 8192 --window-bits 8 --repeat 3 --ratio 14 16 --coding ecsq --precision int8 \
    --ecsq-lanes "$lanes" --out-json "$top/.deps/grouped-bench/g3_l$lanes.json" | grep "^| 8192 | 188"
done
