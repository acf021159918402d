#!/usr/bin/env bash
# Is llama.cpp's q4_0 cache collapse on Qwen2.5-Coder-1.5B real or the
# harness's (issue 14)? Native q8_0 / q4_0 caches, on both sides and on the
# keys or the values alone, against vanilla on the same prompts
# -> bench/results/quality-qwen-native.{md,json}. Needs make models-large.
# Usage: bench/native_qwen.sh [kvtc-lab eval options...]  (~10 min on 2 cores)
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
name=quality-qwen-native
args=(--model qwen --context 2048 --samples 2 --tasks ppl kld agree niah --methods vanilla q8_0 q4_0 q4_0-k q4_0-v "$@")
lab_result "$name" eval "${args[@]}"
{
  echo "# llama.cpp's native quantized caches on Qwen2.5-Coder-1.5B-Instruct"
  echo
  echo "- command: \`bench/native_qwen.sh $*\` (kvtc-lab eval ${args[*]})"
  echo "- commit: $(result_commit)"
  echo "- machine: $(result_cpu), $(nproc) threads, $(uname -sr)"
  echo "- model: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (make models-large); q4_0-k: keys q4_0, values f16; q4_0-v: values q4_0, keys f16"
  echo
  cat "$res/$name.body.part"
} >"$res/$name.md.part"
finish_result "$name"
