#!/usr/bin/env python3
"""bench/results/serve-redis.json -> the markdown table and a reading
computed from it (bench/serve_redis.sh puts the command, commit and machine
above)."""
import json
import sys


def main():
    j = json.load(open(sys.argv[1]))
    w, rows = j["workload"], j["rows"]
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
    print("\n".join(out))


if __name__ == "__main__":
    main()
