#!/usr/bin/env bash
# The layer-grouped calibrations' model quality against one PCA at equal
# reconstruction error (bench/results/grouped.md's matched points): SmolLM2,
# 2K tokens, 8 prompts of real text, teacher-forced ppl / KL and greedy
# agreement after compress -> restore (kvtc-lab eval, docs/eval.md).
# Nominal ratios: one PCA's DP at 16x; the entropy-coded modes at the
# nominal ratio whose error equals it (one PCA ~23x, 2 runs ~21x, 3 runs
# ~19x), and 3 runs at two lower ratios.
# Usage: bench/grouped_quality.sh ONE_CALIB G2_CALIB G3_CALIB. Writes bench/results/grouped-quality.md, .json.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
[ $# -eq 3 ] || { echo "usage: bench/grouped_quality.sh ONE_CALIB G2_CALIB G3_CALIB" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$lab" eval --calib "$1" --calib-extra g2="$2" g3="$3" --tasks ppl kld agree \
  --methods vanilla kvtc-16x kvtc-23x-ecsq kvtc-21x-ecsq@g2 kvtc-19x-ecsq@g3 kvtc-16x-ecsq@g3 kvtc-14x-ecsq@g3 \
  --context 2048 --samples 8 --out-json "$tmp/q.json" --out-md "$tmp/q.md" >/dev/null
{
  echo "# Layer-grouped PCA: model quality at equal reconstruction error (SmolLM2, 2K tokens, 8 prompts)"
  echo
  echo "- command: \`bench/grouped_quality.sh $*\` (make bench-grouped-quality)"
  echo "- commit: $(result_commit)"
  echo "- machine: $(result_cpu), $(nproc) threads, $(uname -sr)"
  echo "- calibrations: one PCA \`$1\`; g2 = \`$2\` (2 runs of 15 layers); g3 = \`$3\` (3 runs of 10)"
  echo "- nominal ratios from grouped.md: the entropy-coded modes at the error of one PCA's DP at 16x (one PCA 23x, 2 runs 21x, 3 runs 19x)"
  echo
  cat "$tmp/q.md"
  [ ! -f "$res/grouped-quality-reading.md" ] || cat "$res/grouped-quality-reading.md"
} >"$res/grouped-quality.md.part"
cp "$tmp/q.json" "$res/grouped-quality.json"
mv "$res/grouped-quality.md.part" "$res/grouped-quality.md"
echo "wrote $res/grouped-quality.md"
