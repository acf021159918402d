#!/usr/bin/env bash
# Faults injected into running kvtc-servers (issue 28) -> bench/results/faults.{md,json}:
#   bench/faults.sh [--only disk|redis]
# Each row: one fault with real processes (kvtc-server on SmolLM2, redis-server,
# a byte-trickling TCP proxy, the server's disk directory) and a real HTTP
# client; columns and their goals in bench/faults.py. Needs make (kvtc-server,
# redis-server) and a calibration (scripts/default_calib.sh). ~6 min on 2 cores.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
server_bench faults.py faults "$@"
{
  echo "# kvtc-server under faults"
  echo
  echo "- command: \`bench/faults.sh $*\`"
  echo "- commit: $(result_commit)"
  echo "- machine: $(result_cpu), $(nproc) threads, $(uname -sr); Redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/') on loopback"
  echo "- model: SmolLM2-135M-Instruct Q4_1; calibration: $(basename "$cal"); kvtc 16x, --cache-ram 64, one slot unless said"
  echo
  python3 - "$res/faults.json.part" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print("Goals: no client error, no wrong or foreign KV served, no good entry lost, and Redis holding the loop at most its")
print("lookup deadline (0.1 s) per lookup; the loop hold column also counts decoding a restore (~0.1-0.2 s for the ~600-token")
print("conversations here). Columns: bench/faults.py's docstring. A restore counts as wrong when its greedy")
print(f"reply strays from a recompute's by more than {j['max_drift']} (mean |logprob difference|), or when nothing valid was left to restore.")
print()
print("| fault | loop hold (s) | stream gap, control / fault (s) | client errors | wrong KV served | good entries lost | restores | notes |")
print("|---|---|---|---|---|---|---|---|")
for r in j["rows"]:
    gap = " / ".join(f"{g:.2f}" for g in r["stream_gap_s"]) if r["stream_gap_s"] else "–"
    notes = "; ".join(n for n in r["notes"] if n).replace("|", "/")
    print(f"| {r['fault']} | {r['loop_hold_s']:.3f} | {gap} | {r['client_errors']} | {r['wrong_kv_served']} | {r['good_entries_lost']} | {r['restores']} | {notes} |")
print()
print(f"{len(j['rows'])} rows in {j['seconds']:.0f} s.")
PY
} >"$res/faults.md.part"
finish_result faults
