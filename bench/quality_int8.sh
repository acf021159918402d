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
# Usage: bench/quality_int8.sh [vnni]   (needs make calibrate: .deps/calib/smollm2-160k.safetensors)
#   vnni: on a CPU with native bf16 and AVX-512 VNNI (where auto chose bf16
#   before 2026-12-05), int8 against -bf16 instead of -f32, a set of its own:
#   bench/results/quality-int8-vnni.*
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
calib=${KVTC_INT8_CALIB:-$top/.deps/calib/smollm2-160k.safetensors}
[ -f "$calib" ] || { echo "bench/quality_int8.sh: $calib missing: run make calibrate" >&2; exit 2; }
name=quality-int8
float=f32
if [ "${1:-}" = vnni ]; then
  name=quality-int8-vnni
  float=bf16
elif [ -n "${1:-}" ]; then
  echo "bench/quality_int8.sh: unknown set '$1' (none, or vnni)" >&2
  exit 2
fi
rec="$res/$name.records.jsonl"
[ ! -s "$rec" ] || python3 "$top/bench/quality_records.py" "$name" "$rec" --check-calib "$calib" || exit 2
args="--context 2048 --samples ${KVTC_INT8_SAMPLES:-8} --tasks ppl kld agree --methods vanilla kvtc-16x-ecsq-$float kvtc-16x-ecsq-int8 kvtc-32x-ecsq-$float kvtc-32x-ecsq-int8"
# shellcheck disable=SC2086  # the arguments are words
"$lab" eval --calib "$calib" --records "$rec" --record-tag "$(record_tag)" $args >/dev/null
{
  echo "- command: \`bench/quality_int8.sh${1:+ $1}\` (\`kvtc-lab eval --calib ${calib#"$top"/} $args\`; records appended by every run, this report rebuilt from all of them)"
  echo "- model: SmolLM2-135M-Instruct (the default); the bytes at rest are the same for -$float and -int8 (the encoder runs as auto); only the decoder's projection differs"
  echo "- commit and machine of each run: the \"run\" field of every record, listed below"
} >"$res/$name.header.part"
python3 "$top/bench/quality_records.py" "$name" "$rec" --header "$res/$name.header.part" --notes "$top/bench/$name-notes.md" \
  --pair kvtc-16x-ecsq-$float:kvtc-16x-ecsq-int8 --pair kvtc-32x-ecsq-$float:kvtc-32x-ecsq-int8
rm -f "$res/$name.header.part"
