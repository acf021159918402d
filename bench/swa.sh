#!/usr/bin/env bash
# Gemma 3 270M, the sliding-window (iSWA) model (issue 31), measured three
# ways; bench/results/swa.md reads the results:
#   1. quality by cache block (kvtc-lab eval: text KL, needle, key-value
#      retrieval at 2K and 4K; kvtc-<R>x-global / -window code one block and
#      keep the other f16) -> bench/results/swa-eval.{md,json}, resumable
#      (swa-eval.records.jsonl: a rerun computes only what is missing)
#   2. codec speed, restore vs recompute (kvtc-lab bench) -> swa-speed.{md,json}
#   3. the serving benchmark's quick variant (bench/serve.sh --model gemma3,
#      one block) -> serve-gemma3.{md,json}
# Usage: bench/swa.sh [eval|speed|serve]... (default: all three). ~1.5 h on 2 cores.
# Needs .deps/calib/gemma3-32k.safetensors (make calibrate-gemma3).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
cal="$top/.deps/calib/gemma3-32k.safetensors"
[ -f "$cal" ] || { echo "bench/swa.sh: $cal missing: make calibrate-gemma3" >&2; exit 2; }
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(eval speed serve)
commit=$(result_commit)
cpu=$(result_cpu)
model="Gemma 3 270M Q4_K_M: 3 global layers (every token) + 15 sliding-window layers (the last 512 positions), 1 KV head x 256 dims each"
for part in "${parts[@]}"; do
  case $part in
    eval)
      args=(-m gemma3 --calib "$cal" --tasks kld niah kvr --methods vanilla kvtc-8x kvtc-16x kvtc-32x kvtc-8x-global kvtc-16x-global
            kvtc-16x-window kvtc-32x-window kvtc-2x-global kvtc-4x-global kvtc-16x-all-window --context 2048 4096 --samples 8)
      lab_result swa-eval eval "${args[@]}" --records "$res/swa-eval.records.jsonl" --record-tag "$commit, $cpu"
      {
        echo "# Gemma 3 270M: quality by cache block"
        echo
        echo "- command: \`bench/swa.sh eval\` (kvtc-lab eval ${args[*]/#$top\//})"
        echo "- commit: $commit (records: each names its own run)"
        echo "- machine: $cpu, $(nproc) threads"
        echo "- model: $model; calibration .deps/calib/gemma3-32k.safetensors (make calibrate-gemma3)"
        echo "- kvtc-<R>x-global: block 0 (global layers) coded at R, block 1 (the window) f16; -window: the reverse;"
        echo "  -all-window: the window with no raw tokens (its sink and last 128 coded too)"
        cat "$res/swa-eval.body.part"
      } >"$res/swa-eval.md.part"
      finish_result swa-eval
      ;;
    speed)
      SPEED_MODEL="$model" "$top/bench/speed.sh" swa-speed -m gemma3 --calib "$cal" --context 1024 2048 4096 8192 -r 8 16 32
      ;;
    serve)
      "$top/bench/serve.sh" --model gemma3 --blocks 0 --modes exact none raw kvtc16 kvtc32
      ;;
    *) echo "bench/swa.sh: eval, speed or serve, not '$part'" >&2; exit 2 ;;
  esac
done
