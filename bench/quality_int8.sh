#!/usr/bin/env bash
# The integer projection (--precision int8, issue 32 item 3) scored on the
# model, not only on reconstruction error: the entropy-coded mode decoded
# with the float GEMM (-f32: what auto was on a CPU without native bf16) and
# with the integer one (-int8), the same bytes at rest, paired prompt by
# prompt on SmolLM2 at 2K on text: KL from vanilla, perplexity, greedy
# agreement (the retrieval tasks would need hundreds of prompts to resolve
# a difference this small; ~45 s a text prompt on 2 cores). Records kept, so a rerun with a larger
# KVTC_INT8_SAMPLES adds prompts:
#   bench/results/quality-int8.records.jsonl, quality-int8.{md,json}
# Usage: bench/quality_int8.sh   (needs make calibrate: .deps/calib/smollm2-160k.safetensors)
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
calib=${KVTC_INT8_CALIB:-$top/.deps/calib/smollm2-160k.safetensors}
[ -f "$calib" ] || { echo "bench/quality_int8.sh: $calib missing: run make calibrate" >&2; exit 2; }
rec="$res/quality-int8.records.jsonl"
[ ! -s "$rec" ] || python3 "$top/bench/quality_records.py" quality-int8 "$rec" --check-calib "$calib" || exit 2
args="--context 2048 --samples ${KVTC_INT8_SAMPLES:-8} --tasks ppl kld agree --methods vanilla kvtc-16x-ecsq-f32 kvtc-16x-ecsq-int8 kvtc-32x-ecsq-f32 kvtc-32x-ecsq-int8"
# shellcheck disable=SC2086  # the arguments are words
"$lab" eval --calib "$calib" --records "$rec" --record-tag "$(record_tag)" $args >/dev/null
{
  echo "- command: \`bench/quality_int8.sh\` (\`kvtc-lab eval --calib ${calib#"$top"/} $args\`; records appended by every run, this report rebuilt from all of them)"
  echo "- model: SmolLM2-135M-Instruct (the default); the bytes at rest are the same for -f32 and -int8 (the encoder runs as auto); only the decoder's projection differs"
  echo "- commit and machine of each run: the \"run\" field of every record, listed below"
} >"$res/quality-int8.header.part"
python3 "$top/bench/quality_records.py" quality-int8 "$rec" --header "$res/quality-int8.header.part" --notes "$top/bench/quality-int8-notes.md" \
  --pair kvtc-16x-ecsq-f32:kvtc-16x-ecsq-int8 --pair kvtc-32x-ecsq-f32:kvtc-32x-ecsq-int8
rm -f "$res/quality-int8.header.part"
