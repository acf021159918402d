#!/usr/bin/env bash
# Quality after compress -> restore -> continue, with the command, commit and
# machine on top. Usage: bench/quality.sh NAME [kvtc-lab eval options…]
# Writes bench/results/NAME.md and NAME.json.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
name=$1
shift
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
lab_result "$name" eval "$@"
commit=$(result_commit)
cpu=$(result_cpu)
{
  echo "# kvtc quality: $name"
  echo
  echo "- command: \`bench/quality.sh $name $*\`"
  echo "- commit: $commit"
  echo "- machine: $cpu, $(nproc) threads, $(uname -sr)"
  echo "- scores (docs/eval.md): ppl = perplexity of the continuation (teacher-forced), kld = mean next-token KL divergence from vanilla (nats),"
  echo "  agree = greedy tokens equal to vanilla before the first difference; niah, vt, kvr = retrieval scores in percent;"
  echo "  ± = 95% half-width over samples; [Δ …] = paired difference from vanilla with its half-width;"
  echo "  ratio = f16 K+V bytes of the whole cache over bytes at rest (sink and window raw, all metadata)"
  cat "$res/$name.body.part"
} >"$res/$name.md.part"
finish_result "$name"
