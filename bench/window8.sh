#!/usr/bin/env bash
# The raw window at 8 bits against f16 (issue 32 item 4): SmolLM2-135M with
# the 160K-token calibration, the entropy-coded 16x default with and without
# --window-bits 8, paired prompt by prompt with vanilla at 2K, 4K and 8K
# tokens (kvtc-lab eval --records, so a stopped run resumes), then
#   bench/results/window8.records.jsonl   (the data: one line per prompt and method)
#   bench/results/window8.{md,json}       (bench/quality_records.py, with the paired
#                                          difference 8-bit minus f16 window)
# Usage: bench/window8.sh   (~45 min on 2 cores; KVTC_WINDOW8_SAMPLES="16 8 4"
# sets the prompts per task at 2K, 4K and 8K)
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
calib=${KVTC_WINDOW8_CALIB:-$top/.deps/calib/smollm2-160k.safetensors}
[ -f "$calib" ] || { echo "bench/window8.sh: $calib missing: run make calibrate" >&2; exit 2; }
rec="$res/window8.records.jsonl"
tag=$(record_tag)
# shellcheck disable=SC2086  # the counts are words
"$lab" eval --calib "$calib" --records "$rec" --record-tag "$tag" --context 2048 4096 8192 --samples ${KVTC_WINDOW8_SAMPLES:-16 8 4} \
  --tasks ppl kld agree niah kvr --methods vanilla kvtc-16x-ecsq kvtc-16x-ecsq-w8 >/dev/null
{
  echo "- command: \`bench/window8.sh\` (records appended by every run; this report rebuilt from all of them)"
  echo "- model: SmolLM2-135M-Instruct Q4_1 (the default), calibration $(basename "$calib") (make calibrate); methods: vanilla, the entropy-coded 16x"
  echo "  default with the 128-token window f16 (kvtc-16x-ecsq) and at 8 bits (kvtc-16x-ecsq-w8, container version 3); the 4-token sink f16 in both"
  echo "- commit and machine of each run: the \"run\" field of every record, listed under each context below"
} >"$res/window8.header.part"
python3 "$top/bench/quality_records.py" window8 "$rec" --header "$res/window8.header.part" --notes "$top/bench/window8-notes.md" \
  --pair kvtc-16x-ecsq:kvtc-16x-ecsq-w8
rm -f "$res/window8.header.part"
