#!/usr/bin/env bash
# Does a restore stall the other slots? kvtc-server with two slots: one
# streams while the other resumes a stored ~1.8K-token conversation, by
# mode (kvtc restored off the loop, the same on the loop, raw f16,
# recompute, the stream alone) -> bench/results/restore-stall.{md,json}.
# bench/restore_stall.py's docstring says what each mode is. ~4 min.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
. "$top/bench/lib.sh"
server_bench restore_stall.py restore-stall "$@"
{
  echo "# Restores and the other slots"
  echo
  echo "- command: \`bench/restore_stall.sh $*\`"
  echo "- commit: $(result_commit)"
  echo "- machine: $(result_cpu), $(nproc) threads, $(uname -sr)"
  echo "- model: SmolLM2-135M-Instruct Q4_1; calibration: $(basename "$cal"); kvtc 16x, --cache-ram 512, --parallel 2, greedy"
  echo
  python3 - "$res/restore-stall.json.part" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print(f"Slot X streams {j['stream_tokens']} tokens; once 20 have arrived, a client resumes a stored ~1.8K-token conversation")
print("(turn 1 stored, then evicted from both slots) on the other slot, asking for one token. Gaps: between the stream's")
print("tokens, those overlapping the resuming request, pooled over the trials (one conversation each, the same documents")
print(f"in every mode; {j['trials']} trials). \"stream alone\": the same stream with no second request, 0.5 s of it.")
print()
print("| mode | largest gap (s) | largest per trial (s) | median gap (s) | p99 gap (s) | gaps | resuming request (s) | loop held by a restore, max (s) | restore wait off the loop, max (s) |")
print("|---|---|---|---|---|---|---|---|---|")
for name, r in j["modes"].items():
    t = ", ".join(f"{x:.2f}" for x in r["turn2_time_s"]) or "–"
    per = ", ".join(f"{x:.2f}" for x in r["per_trial_largest_gap_s"])
    print(f"| {name} | {r['largest_gap_s']:.3f} | {per} | {r['median_gap_s']:.3f} | {r['p99_gap_s']:.3f} | {r['gaps']} | {t} | {r['loop_restore_max_s']:.3f} | {r['restore_wait_max_s']:.3f} |")
print()
print(f"{j['seconds']:.0f} s.")
PY
} >"$res/restore-stall.md.part"
finish_result restore-stall
