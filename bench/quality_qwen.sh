#!/usr/bin/env bash
# Quality on Qwen2.5-Coder-1.5B-Instruct (issue 14): `kvtc-lab eval
# --records`, so the hours it takes spread over runs and sessions — every
# finished prompt is kept, a rerun computes only what the records lack —
# then the tables are rebuilt from all records:
#   bench/results/quality-qwen.records.jsonl   (the data: one line per prompt and method)
#   bench/results/quality-qwen.{md,json}       (bench/quality_records.py)
#   bench/results/quality-tradeoff.png         (with SmolLM2's bench/results/quality.json)
# Usage: bench/quality_qwen.sh [PART ...]       (no PART: the report only)
# Needs make models-large and make calibrate-qwen. PARTs, in the order that
# answers the 1-point question first (times on 2 EPYC cores: ~50 s per 4K prefill):
#   paired-4k  vanilla, kvtc-16x, kvtc-32x on niah, kvr, code: 100 prompts each (~5 h)
#   tasks-4k   every method on niah, vt, kvr, code: 8 prompts each (~7 min a prompt: ~3.7 h)
#   text-4k    every method on ppl, kld, agree: 8 prompts (~10 min a prompt)
#   8k         every method on every task: 4 prompts each (~24 min a task prompt: ~8 h for 20 prompts)
#   16k        vanilla, kvtc-16x, kvtc-32x on niah, kvr and text (no code: the evaluation split's longest
#              Python file part is under 16K tokens): 2 prompts each (timed in
#              bench/quality-qwen-16k-notes.md); its own record set, quality-qwen-16k
#              (records made later with another calibration file need not wait for the first's)
#   ecsq-4k    issue 32 item 5: vanilla, the DP at 16x and 32x and the entropy-coded mode at the ratios of
#              equal error (23.2x, 47.3x: bench/results/entropy.md's Qwen rows) on niah, kvr, code, 100 prompts
#              each, the same prompts as paired-4k; its own record set, quality-qwen-ecsq, made with the
#              calibration of an Intel Xeon with AVX-512 and AMX (.deps/calib/qwen-avx512-160k.safetensors: the
#              first set's file was made on another CPU and is not here)
#   ecsq-4k-epyc  the same prompts and methods, a second set, quality-qwen-ecsq-epyc, keyed by the calibration
#              the project's AMD EPYC machines reproduce (id b0fa59e2…, also quality-qwen-16k's: made again on a
#              Zen 3 with AVX2 only, .deps/calib/qwen-epyc-160k.safetensors); a session on either kind of CPU
#              adds to the set whose calibration it reproduces (bench/quality-qwen-ecsq-epyc-notes.md)
#   ecsq-text-4k, ecsq-text-4k-epyc  item 5's text KL: the same five methods on ppl, kld, agree, 8 prompts,
#              into the set of ecsq-4k and ecsq-4k-epyc respectively (~4 min a prompt on 2 Zen 3 cores)
# KVTC_QWEN_PAIRED=N sets paired-4k's count, KVTC_QWEN_SAMPLES=N the other
# parts' (the same prompts, first N: a later, larger run adds the rest).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
# The calibration of a record set (KVTC_QWEN_CALIB=FILE overrides it for all).
calib_of() {
  case $1 in
    quality-qwen-ecsq) echo "${KVTC_QWEN_CALIB:-$top/.deps/calib/qwen-avx512-160k.safetensors}" ;;
    quality-qwen-ecsq-epyc) echo "${KVTC_QWEN_CALIB:-$top/.deps/calib/qwen-epyc-160k.safetensors}" ;;
    *) echo "${KVTC_QWEN_CALIB:-$top/.deps/calib/qwen-160k.safetensors}" ;;
  esac
}
all=(vanilla kvtc-8x kvtc-16x kvtc-32x kvtc-64x fp8 kivi-4 kivi-2 q8_0 q4_0 streaming-8x svd-16x)
part_args() {
  case $1 in
    paired-4k) echo "--context 4096 --samples ${KVTC_QWEN_PAIRED:-100} --tasks niah kvr code --methods vanilla kvtc-16x kvtc-32x" ;;
    tasks-4k) echo "--context 4096 --samples ${KVTC_QWEN_SAMPLES:-8} --tasks niah vt kvr code --methods ${all[*]}" ;;
    text-4k) echo "--context 4096 --samples ${KVTC_QWEN_SAMPLES:-8} --tasks ppl kld agree --methods ${all[*]}" ;;
    8k) echo "--context 8192 --samples ${KVTC_QWEN_SAMPLES:-4} --tasks ppl kld agree niah vt kvr code --methods ${all[*]}" ;;
    ecsq-4k) echo "--context 4096 --samples ${KVTC_QWEN_PAIRED:-100} --tasks niah kvr code --methods vanilla kvtc-16x kvtc-32x kvtc-23.2x-ecsq kvtc-47.3x-ecsq" ;;
    ecsq-text-4k) echo "--context 4096 --samples ${KVTC_QWEN_SAMPLES:-8} --tasks ppl kld agree --methods vanilla kvtc-16x kvtc-32x kvtc-23.2x-ecsq kvtc-47.3x-ecsq" ;;
    # The EPYC set pins the projection to f32, what auto was on its AVX2 EPYC when it began
    # (auto is int8 there now, bench/results/quality-int8.md): one decoder across the set.
    ecsq-4k-epyc) echo "--context 4096 --samples ${KVTC_QWEN_PAIRED:-100} --tasks niah kvr code --precision f32 --methods vanilla kvtc-16x kvtc-32x kvtc-23.2x-ecsq kvtc-47.3x-ecsq" ;;
    ecsq-text-4k-epyc) echo "--context 4096 --samples ${KVTC_QWEN_SAMPLES:-8} --tasks ppl kld agree --precision f32 --methods vanilla kvtc-16x kvtc-32x kvtc-23.2x-ecsq kvtc-47.3x-ecsq kvtc-19.2x-ecsq kvtc-40.2x-ecsq" ;;
    16k) echo "--context 16384 --samples ${KVTC_QWEN_SAMPLES:-2} --tasks niah kvr ppl kld agree --methods vanilla kvtc-16x kvtc-32x" ;;
    *) echo "bench/quality_qwen.sh: unknown part '$1' (paired-4k, tasks-4k, text-4k, 8k, 16k, ecsq-4k, ecsq-4k-epyc, ecsq-text-4k, ecsq-text-4k-epyc)" >&2; return 2 ;;
  esac
}
# The record set a part writes: one set is one calibration file.
set_of() { case $1 in 16k) echo quality-qwen-16k ;; ecsq-4k | ecsq-text-4k) echo quality-qwen-ecsq ;; ecsq-4k-epyc | ecsq-text-4k-epyc) echo quality-qwen-ecsq-epyc ;; *) echo quality-qwen ;; esac; }
parts_of() { for p in paired-4k tasks-4k text-4k 8k 16k ecsq-4k ecsq-4k-epyc ecsq-text-4k ecsq-text-4k-epyc; do [ "$(set_of $p)" != "$1" ] || printf '%s ' "$p"; done; }
for part in "$@"; do part_args "$part" >/dev/null; done  # all names checked before hours of work
for part in "$@"; do
  calib=$(calib_of "$(set_of "$part")")
  [ -f "$calib" ] || { echo "bench/quality_qwen.sh: $calib missing (part $part): run make calibrate-qwen, or see the part's notes" >&2; exit 2; }
done
# The records are keyed by the calibration's id (a hash of its means and bases):
# a calibration made again with other bits (another BLAS kernel, a summation
# order changed) would silently start a second set, which the report then
# refuses to mix with the first, hours later. Checked before any work.
for name in $(for part in "$@"; do set_of "$part"; done | sort -u); do
  rec="$res/$name.records.jsonl"
  [ ! -s "$rec" ] || python3 "$top/bench/quality_records.py" "$name" "$rec" --check-calib "$(calib_of "$name")" || exit 2
done
tag=$(record_tag)
for part in "$@"; do
  # shellcheck disable=SC2046  # the part's arguments are words
  "$lab" eval --model qwen --calib "$(calib_of "$(set_of "$part")")" --records "$res/$(set_of "$part").records.jsonl" --record-tag "$tag" $(part_args "$part") >/dev/null
done
[ -s "$res/quality-qwen.records.jsonl" ] || { echo "bench/quality_qwen.sh: no records yet ($res/quality-qwen.records.jsonl)" >&2; exit 2; }
for name in quality-qwen quality-qwen-16k quality-qwen-ecsq quality-qwen-ecsq-epyc; do
  rec="$res/$name.records.jsonl"
  [ -s "$rec" ] || continue
  {
    echo "- command: \`bench/quality_qwen.sh PART ...\` (records appended by every run; this report rebuilt from all of them)"
    echo "- model: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (make models-large), 28 layers, 2 KV heads x 128; p = 7,168 features for K and for V"
    case $name in
      quality-qwen-ecsq) how="\`kvtc calibrate --model qwen --doc-tokens 8192\` on the Intel Xeon of bench/results/entropy.md (.deps/calib/qwen-avx512-160k.safetensors, what make calibrate-qwen runs)" ;;
      quality-qwen-ecsq-epyc) how="\`kvtc calibrate --model qwen --doc-tokens 8192\` on an AMD EPYC (Zen 3, AVX2 only; .deps/calib/qwen-epyc-160k.safetensors, what make calibrate-qwen runs; the id of quality-qwen-16k's records too; made again with the same id on a Zen 4 EPYC with AVX-512 and on an Intel Xeon with AMX)" ;;
      *) how="make calibrate-qwen" ;;
    esac
    echo "- calibration: $how (160K tokens, documents cut at 8,192 tokens); its id, in every record: $(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["calibration_id"][:16])' "$rec")…"
    echo "- parts (at their full counts; the prompts each context holds so far are counted below): $(for p in $(parts_of $name); do printf '%s = `%s`; ' "$p" "$(unset KVTC_QWEN_PAIRED KVTC_QWEN_SAMPLES; part_args $p)"; done)"
    echo "- commit and machine of each run: the \"run\" field of every record, listed under each context below"
  } >"$res/$name.header.part"
  notes=()
  [ -f "$top/bench/$name-notes.md" ] && notes=(--notes "$top/bench/$name-notes.md")
  # The entropy-coded mode against the DP at the ratio of equal error (issue 32 item 5).
  pairs=()
  case $name in quality-qwen-ecsq*) pairs=(--pair kvtc-16x:kvtc-23.2x-ecsq --pair kvtc-32x:kvtc-47.3x-ecsq) ;; esac
  # The EPYC set's text part also has the ratios whose KL its prompts put at
  # the DP's (19.2x, 40.2x: interpolated from the pair above, KL ~ ratio^1.5).
  [ "$name" != quality-qwen-ecsq-epyc ] || pairs+=(--pair kvtc-16x:kvtc-19.2x-ecsq --pair kvtc-32x:kvtc-40.2x-ecsq)
  python3 "$top/bench/quality_records.py" "$name" "$rec" --header "$res/$name.header.part" "${notes[@]}" "${pairs[@]}"
  rm -f "$res/$name.header.part"
done
# The figure: both models, at the context each has most prompts at.
python3 "$top/bench/plots.py" tradeoff "$res/quality-tradeoff.png" "SmolLM2-135M=$res/quality.json@2048" "Qwen2.5-Coder-1.5B=$res/quality-qwen.json@4096"
