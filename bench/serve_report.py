#!/usr/bin/env python3
"""bench/results/serve.json -> the markdown table and a reading computed
from it (bench/serve.sh puts the command, commit and machine above)."""
import json
import sys


def fmt(x, d=2):
    return f"{x:.{d}f}" if isinstance(x, float) else str(x)


def main():
    j = json.load(open(sys.argv[1]))
    w, rows = j["workload"], j["rows"]
    out = []
    out.append(f"Workload: {w['sessions']} sessions x {w['turns']} turns, histories of {w['tokens'][0]}-{w['tokens'][1]} tokens at turn 1 "
               f"(documents of the evaluation corpus: {', '.join(sorted(set(d.split('/')[0] for d in w['docs'])))}), replies of up to "
               f"{w['max_tokens']} tokens, two clients on a two-slot server (--parallel 2, {w['ctx']} tokens in all), all sessions' turn t "
               f"before any turn t+1. Every mode replays the histories of the first (no-cache) run.\n")
    out.append("| mode | budget MiB | prompts held (peak) | cache MiB | MiB per prompt | capacity (prompts) | disk MiB | hit rate | prompt tokens computed | TTFT p50 s | TTFT p95 s "
               "| TTFT mean s | later turns TTFT mean s | wall s | cache updates: loop ms sum / max | kvtc loop ms: saves sum / max, restores sum / max "
               "| replies = no-cache |")
    out.append("|" + "---|" * 17)
    for r in rows:
        kv = (f"{r['loop_save_ms_sum']:.0f} / {r['loop_save_ms_max']:.0f}, {r['loop_restore_ms_sum']:.0f} / {r['loop_restore_ms_max']:.0f}"
              if "loop_save_ms_sum" in r else "-")
        out.append(f"| {r['mode']} | {r['budget_mib'] or '-'} | {r.get('prompts_held_peak', '-')} | {r['ram_mib']:.1f} | {r.get('mib_per_prompt', 0):.2f} "
                   f"| {r.get('capacity_prompts', 0):.0f} | {r['disk_mib']:.1f} "
                   f"| {r['hit_rate']:.2f} | {r['prompt_tokens_recomputed']} | {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | {r['ttft_mean_s']:.2f} "
                   f"| {r['ttft_later_mean_s']:.2f} | {r['wall_s']:.0f} | {r['cache_update_ms_sum']:.0f} / {r['cache_update_ms_max']:.0f} | {kv} "
                   f"| {r['equal_reference']:.2f} |")
    out.append("")
    out.append("Columns: prompts held = prompts in the host cache at its peak (raw: llama-server's own `cache state` trace; kvtc: "
               "`kvtc:ram_prompts`), cache MiB = its bytes at that peak (raw) or at the end (kvtc RAM tier); MiB per prompt = the mean stored size of one prompt; "
               "capacity = budget / MiB per prompt, the prompts of this size the budget holds (prompts held is capped by the workload's "
               "session count); hit rate = turns 2.. whose "
               "whole previous prompt came back from a cache (`timings.cache_n`); TTFT = client-side time to the first streamed token; "
               "cache updates = llama-server's `prompt cache update took` (save + load on slot selection, the server loop held); "
               "replies = no-cache: share of replies identical to the no-cache run's for the same history.\n")
    out.append("## Reading\n")
    by = {(r["mode"], r["budget_mib"]): r for r in rows}
    for b in sorted({r["budget_mib"] for r in rows if r["budget_mib"]}):
        raw, k16, k32 = by.get(("raw", b)), by.get(("kvtc16", b)), by.get(("kvtc32d", b))
        if not raw:
            continue
        for k in (k16, k32):
            if not k:
                continue
            cap = k.get("capacity_prompts", 0) / max(1e-9, raw.get("capacity_prompts", 0))
            ttft = raw["ttft_mean_s"] / max(1e-9, k["ttft_mean_s"])
            later = raw["ttft_later_mean_s"] / max(1e-9, k["ttft_later_mean_s"])
            out.append(f"- {b} MiB, {k['mode']} against raw: {k.get('mib_per_prompt', 0):.2f} MiB per stored prompt against "
                       f"{raw.get('mib_per_prompt', 0):.2f}, so the budget holds {cap:.1f}x as many (the claim: >= 10x) — "
                       f"{'met' if cap >= 10 else 'not met'}; held at the peak {k.get('prompts_held_peak', 0)} against "
                       f"{raw.get('prompts_held_peak', 0)}; hit rate {k['hit_rate']:.2f} against {raw['hit_rate']:.2f}; mean TTFT "
                       f"{k['ttft_mean_s']:.2f} s against {raw['ttft_mean_s']:.2f} s ({ttft:.1f}x; the claim: >= 5x) — "
                       f"{'met' if ttft >= 5 else 'not met'}; on turns 2.. alone {later:.1f}x; replies equal to no-cache "
                       f"{k['equal_reference']:.2f} against {raw['equal_reference']:.2f} (raw is lossless: its own share is the "
                       f"run-to-run noise of batching).")
    print("\n".join(out))


if __name__ == "__main__":
    main()
