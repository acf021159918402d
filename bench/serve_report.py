#!/usr/bin/env python3
"""A serving benchmark's JSON (bench/serve.py) -> the markdown table and a
reading computed from it; bench/serve.sh puts the command, commit and
machine above. The chat replay (bench/results/serve.json) and the Redis
replay (serve-redis.json, bench/serve.py --redis: two replicas) each have
their own table, told apart by the workload's replicas."""
import json
import sys


def chat_report(j, w, rows):
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
    return out


def redis_report(j, w, rows):
    out = [f"Workload: {w['sessions']} sessions x {w['turns']} turns, histories of {w['tokens'][0]}-{w['tokens'][1]} tokens at turn 1, "
           f"replies of up to {w['max_tokens']} tokens; two replicas (one slot each, {w['ctx']} tokens, --cache-ram {w['cache_ram_mib']} MiB "
           f"each), one client, turn t of session s on replica (s + t) mod 2 (every turn on the other replica), all sessions' turn t "
           f"before turn t+1. The first mode fixes the assistant turns; the others replay them.\n",
           "| mode | hit rate | prompt tokens computed | TTFT p50 s | TTFT p95 s | turns 2.. TTFT p50 s | turns 2.. p95 s | wall s "
           "| Redis keys | Redis values MiB | Redis used_memory MiB | restores from Redis | Redis round trips p50 / p99 ms "
           "| MiB per restore | MiB/s moved | restore on the loop p50 ms | replies = first mode | Redis errors |",
           "|" + "---|" * 18]
    for r in rows:
        out.append(f"| {r['mode']} | {r['hit_rate']:.2f} | {r['prompt_tokens_computed']} | {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} "
                   f"| {r['ttft_later_p50_s']:.2f} | {r['ttft_later_p95_s']:.2f} | {r['wall_s']:.0f} | {r['redis_keys']} "
                   f"| {r['redis_value_mib']:.1f} | {r['redis_used_mib']:.1f} | {r['redis_restores']} "
                   f"| {r['redis_rt_p50_ms']:.2f} / {r['redis_rt_p99_ms']:.2f} | {r['redis_mib_per_restore']:.2f} | {r['redis_mib_per_s']:.0f} "
                   f"| {r['restore_ms_p50']:.1f} | {r['equal_reference']:.2f} | {r['redis_errors']:.0f} |")
    out.append("")
    out.append("Columns: hit rate = turns 2.. whose whole previous prompt came back from a cache (`timings.cache_n`); TTFT = client-side "
               "time to the first streamed token; Redis values = the bytes of the stored strings (chunks and entries; the index hashes "
               "not counted), used_memory = Redis's own growth over the run; round trips = per restore from Redis, the two pipelined "
               "exchanges (find the longest prefix, fetch it), from the server's log; MiB/s moved = bytes fetched / round-trip time; "
               "restore on the loop = the whole restore (round trips, decoding, loading the state into the slot).\n")
    pf = j.get("prefill_fit_ms")
    if pf:
        out.append(f"Prefill on this machine (all requests of >= 64 tokens computed, least squares; through the origin when the free fit's "
                   f"intercept is negative): {pf[0]:.0f} ms + {pf[1]:.2f} ms per token computed. Restore: the restores from Redis, "
                   f"their whole time on the loop against the tokens restored. Break-even = where the two lines cross.\n")
    for name, b in j.get("breakeven", {}).items():
        a, s = b["restore_fit_ms"]
        n = b["tokens"]
        verdict = ("from the first token (the fixed cost is below prefill's)" if n is not None and n <= 0 else
                   f"from ~{n:.0f} tokens" if n is not None else "never (restoring a token costs more than computing it)")
        out.append(f"- {name}: restore from Redis {a:.1f} ms + {s:.3f} ms per token restored; beats recomputing {verdict}.")
    out.append("\n## Reading\n")
    by = {r["mode"]: r for r in rows}
    loc, raw, k16 = by.get("local"), by.get("raw-redis"), by.get("kvtc16-redis")
    if loc and k16:
        out.append(f"- Without a shared tier, turns 2.. landed on a replica that had not seen the previous turn: hit rate "
                   f"{loc['hit_rate']:.2f}, turns 2.. TTFT p50 {loc['ttft_later_p50_s']:.2f} s. With kvtc 16x in Redis: hit rate "
                   f"{k16['hit_rate']:.2f}, turns 2.. TTFT p50 {k16['ttft_later_p50_s']:.2f} s "
                   f"({loc['ttft_later_p50_s'] / max(1e-9, k16['ttft_later_p50_s']):.1f}x), prompt tokens computed "
                   f"{k16['prompt_tokens_computed']} against {loc['prompt_tokens_computed']}.")
    if raw and k16:
        out.append(f"- Raw f16 in Redis stores {raw['redis_value_mib']:.0f} MiB (used_memory {raw['redis_used_mib']:.0f} MiB) against "
                   f"{k16['redis_value_mib']:.0f} MiB ({k16['redis_used_mib']:.0f}) for kvtc 16x: "
                   f"{raw['redis_value_mib'] / max(1e-9, k16['redis_value_mib']):.1f}x less memory for the same sessions (the raw "
                   f"128-token window of each entry is in both). Per restore kvtc moves {k16['redis_mib_per_restore']:.1f} MiB against "
                   f"{raw['redis_mib_per_restore']:.1f}; round trips p50 {k16['redis_rt_p50_ms']:.1f} ms against "
                   f"{raw['redis_rt_p50_ms']:.1f} ms on loopback; the whole restore p50 {k16['restore_ms_p50']:.0f} ms against "
                   f"{raw['restore_ms_p50']:.0f} ms (kvtc decodes; raw only copies). Turns 2.. TTFT p50 {k16['ttft_later_p50_s']:.2f} s "
                   f"against {raw['ttft_later_p50_s']:.2f} s.")
    return out


def main():
    j = json.load(open(sys.argv[1]))
    w, rows = j["workload"], j["rows"]
    out = (redis_report if "replicas" in w else chat_report)(j, w, rows)
    print("\n".join(out))


if __name__ == "__main__":
    main()
