#!/usr/bin/env python3
"""Markdown of the scored serving benchmark (bench/serve.py) from its
records: accuracy per task on the turns a prompt cache serves, paired with
the exact restore's answers to the same questions; then hits, latency,
restore speed and storage per mode and budget.

Usage: serve_report.py RECORDS.jsonl   (markdown on stdout; the JSON summary
with --json FILE)
"""
import argparse
import json
import math
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quality_records import upper95  # noqa: E402

# Two-sided 95% Student t quantiles by degrees of freedom (a normal 1.96 is
# too narrow below ~30 questions: 2.26 at 9 degrees of freedom).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179,
        13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 22: 2.074, 24: 2.064, 26: 2.056,
        28: 2.048, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df):
    if df in T975:
        return T975[df]
    if df > 120:
        return 1.96
    below = max(k for k in T975 if k < df)
    above = min(k for k in T975 if k > df)
    return T975[below] + (T975[above] - T975[below]) * (df - below) / (above - below)


def mean_half(xs):
    """(mean, 95% half-width with Student's t, n)."""
    n = len(xs)
    if n == 0:
        return None, None, 0
    m = statistics.fmean(xs)
    if n < 2:
        return m, None, n
    return m, t975(n - 1) * statistics.stdev(xs) / math.sqrt(n), n


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else None


def f(v, spec=".2f", none="—"):
    return none if v is None else format(v, spec)


def load(path):
    recs = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                recs.append(json.loads(line))
    return recs


def key_of(r):
    return r["mode"], r["budget"]


def label(mode, budget, also):
    if mode == "none":
        return "none"
    return f"{mode} @ {budget} MiB" + "".join(f", = @ {b} MiB" for b in also)


def build(recs):
    runs = [r for r in recs if r["type"] == "run"]
    if not runs:
        raise SystemExit("serve_report: no finished run in the records")
    sets = {(r["bench"], r["model"], r["calib_id"], json.dumps(r["workload"], sort_keys=True)) for r in runs}
    if len(sets) > 1:
        raise SystemExit("serve_report: the records mix settings (bench, model, calibration, workload): " + "; ".join(map(str, sorted(sets))))
    bench = runs[0]["bench"]
    ref_mode = "exact" if bench == "serve" else "raw-redis"
    reqs = [r for r in recs if r["type"] == "request"]
    by_run = defaultdict(list)
    for r in reqs:
        by_run[(r["mode"], r["budget"], r["block"])].append(r)
    # A run recorded as the same as a smaller budget's: its requests are that run's.
    for r in runs:
        if r.get("same_as_budget"):
            by_run[(r["mode"], r["budget"], r["block"])] = by_run[(r["mode"], r["same_as_budget"], r["block"])]
    run_of = {(r["mode"], r["budget"], r["block"]): r for r in runs}
    blocks = sorted({r["block"] for r in runs})
    ref_blocks = {b for (m, _, b) in run_of if m == ref_mode}
    ref = {}
    for (m, _, b), rs in by_run.items():
        if m == ref_mode:
            for r in rs:
                ref[(b, r["session"], r["turn"])] = r
    # A budget run as the same as a smaller one on every block is a row of
    # its own only where some block ran it.
    also = defaultdict(set)
    for r in runs:
        if r.get("same_as_budget"):
            also[(r["mode"], r["same_as_budget"])].add(r["budget"])
    ran = {key_of(r) for r in runs if not r.get("same_as_budget")}
    also = {k: sorted(b for b in v if (k[0], b) not in ran) for k, v in also.items()}
    configs = sorted(ran, key=lambda k: (MODE_ORDER.index(k[0]) if k[0] in MODE_ORDER else 99, k[1]))
    out = {"bench": bench, "reference": ref_mode, "model": runs[0]["model"], "calib_id": runs[0]["calib_id"],
           "workload": runs[0]["workload"], "blocks": blocks, "reference_blocks": sorted(ref_blocks),
           "runs": sorted({(r["run"]["commit"], r["run"]["machine"], r["run"].get("args", "")) for r in runs}), "rows": []}
    for mode, budget in configs:
        mine = [run_of[(mode, budget, b)] for b in blocks if (mode, budget, b) in run_of]
        rq = [r for b in blocks for r in by_run.get((mode, budget, b), [])]
        real = [x for x in mine if not x.get("same_as_budget")] or [run_of[(mode, x["same_as_budget"], x["block"])] for x in mine]
        row = {"mode": mode, "budget": budget, "label": label(mode, budget, also.get((mode, budget), [])), "blocks": [x["block"] for x in mine],
               "sessions": len({(r["block"], r["session"]) for r in rq}), "tasks": {}}
        later = [r for r in rq if r["turn"] > 0]
        for task in ("niah", "kvr", "code"):
            t = [r for r in later if r["task"] == task]
            acc = mean_half([100 * r["score"] for r in t])
            cell = {"acc": acc}
            if task == "code":
                cell["edit"] = mean_half([100 * r["edit_sim"] for r in t])
            paired = [(r, ref[(r["block"], r["session"], r["turn"])]) for r in t if (r["block"], r["session"], r["turn"]) in ref]
            if paired and mode != ref_mode:
                d = [100 * (r["score"] - q["score"]) for r, q in paired]
                worse = sum(1 for r, q in paired if r["score"] < q["score"])
                better = sum(1 for r, q in paired if r["score"] > q["score"])
                cell["delta"] = mean_half(d)
                cell["worse"], cell["better"], cell["n_paired"] = worse, better, len(paired)
                cell["worse_bound"] = 100 * upper95(worse, len(paired))
                cell["same_reply"] = sum(1 for r, q in paired if r["reply"] == q["reply"])
            row["tasks"][task] = cell
        first = [r for r in rq if r["turn"] == 0]
        row["turn1_acc"] = mean_half([100 * r["score"] for r in first])
        row["turn1_same_as_reference"] = [sum(1 for r in first if (r["block"], r["session"], 0) in ref
                                              and r["reply"] == ref[(r["block"], r["session"], 0)]["reply"]),
                                          sum(1 for r in first if (r["block"], r["session"], 0) in ref)]
        # Hits: a later turn whose previous turn's prompt came back (90% of it at least).
        prev = {(r["block"], r["session"], r["turn"]): r for r in rq}
        tiers = defaultdict(int)
        hits = 0
        for r in later:
            p = prev.get((r["block"], r["session"], r["turn"] - 1))
            hist = (p["prompt_n"] or 0) + (p["cache_n"] or 0) if p else 0
            if p and (r["cache_n"] or 0) >= 0.9 * hist:
                hits += 1
                tiers[r["restore"]["tier"] if r["restore"] else ("slot" if mode in ("none",) else "upstream")] += 1
        row["later_turns"], row["hits"], row["hits_by_tier"] = len(later), hits, dict(tiers)
        row["later_prompt_tokens_computed"] = sum(r["prompt_n"] or 0 for r in later)
        row["history_tokens_mean"] = statistics.fmean([(r["prompt_n"] or 0) + (r["cache_n"] or 0) for r in rq]) if rq else None
        row["ttft_later_p50"] = pct([r["ttft_s"] for r in later], 0.5)
        row["ttft_later_p95"] = pct([r["ttft_s"] for r in later], 0.95)
        row["ttft_mean"] = statistics.fmean([r["ttft_s"] for r in rq]) if rq else None
        rest = [r["restore"] for r in rq if r["restore"]]
        kvb = real[0].get("model_kv_bytes_per_token") if real else None
        row["restores"] = len(rest)
        row["restore_ms_p50"] = pct([x["ms"] for x in rest], 0.5)
        row["restore_tokens_mean"] = statistics.fmean([x["tokens"] for x in rest]) if rest else None
        row["restore_ms_per_1k"] = statistics.fmean([1000 * x["ms"] / x["tokens"] for x in rest if x["tokens"]]) if rest else None
        row["restore_ms_per_mib"] = (statistics.fmean([x["ms"] / (x["tokens"] * kvb / 2**20) for x in rest if x["tokens"]])
                                     if rest and kvb else None)
        # Every "prompt cache update" (llama-server's line: a save and a
        # restore when there is one, on the loop), in every mode, and every
        # save's own hold (with Redis the release saves, outside an update;
        # records before 2026-12-03 lack it).
        loops = [u for r in rq for u in r["cache_update_ms"] + r.get("save_hold_ms", [])]
        row["loop_hold_max_ms"] = max(loops) if loops else None
        moved = [x["redis_mib"] for x in rest if x["redis_mib"] is not None]
        row["redis_mib_per_restore"] = statistics.fmean(moved) if moved else None
        row["redis_rt_p50_ms"] = pct([x["redis_ms"] for x in rest if x["redis_ms"] is not None], 0.5)
        row["redis_rt_p99_ms"] = pct([x["redis_ms"] for x in rest if x["redis_ms"] is not None], 0.99)
        # Storage at the end of each run, per conversation of the block.
        per = []
        for x in real:
            n = len({r["session"] for r in by_run[(x["mode"], x["budget"], x["block"])]})
            ms = x.get("metrics") or []
            if ms and any("kvtc:ram_bytes" in m for m in ms):
                b = sum(m.get("kvtc:ram_bytes", 0) for m in ms)
                entries = sum(m.get("kvtc:ram_prompts", 0) for m in ms)
                per.append({"mib": b / 2**20, "entries": entries, "sessions": n, "redis_mib": (x.get("redis") or {}).get("value_bytes", 0) / 2**20})
            elif x.get("raw_cache_last"):
                c = x["raw_cache_last"]
                per.append({"mib": c["mib"], "entries": c["prompts"], "sessions": n, "redis_mib": 0.0})
        if per:
            row["store_mib_end"] = statistics.fmean(p["mib"] for p in per)
            row["store_entries_end"] = statistics.fmean(p["entries"] for p in per)
            row["redis_mib_end"] = statistics.fmean(p["redis_mib"] for p in per)
            # Upstream stores every turn whole: a conversation is its newest
            # entry. kvtc shares chunks: the store over the conversations it
            # holds, when every later turn restored from RAM (serve.py's
            # all_later_hit_ram, the rule that also skips a larger budget).
            if mode == "raw":
                row["mib_per_conversation"] = statistics.fmean(p["mib"] / p["entries"] for p in per if p["entries"])
            elif all(x.get("all_later_hit_ram") for x in real):
                row["mib_per_conversation"] = statistics.fmean((p["mib"] + p["redis_mib"]) / p["sessions"] for p in per)
        if kvb and row["history_tokens_mean"]:
            row["f16_mib_per_conversation"] = row["history_tokens_mean"] * kvb / 2**20
        row["wall_s"] = sum(x.get("wall_s", 0) for x in real)
        out["rows"].append(row)
    return out


MODE_ORDER = ["none", "raw", "exact", "kvtc16", "kvtc32", "ecsq", "local", "raw-redis", "kvtc16-redis"]


def acc_cell(c, binary=True):
    m, h, n = c["acc"]
    if m is None:
        return "—"
    s = f"{m:.1f} ± {f(h, '.1f', '–')} (n {n})"
    if "delta" in c:
        dm, dh, _ = c["delta"]
        s += f" [Δ {dm:+.1f} ± {f(dh, '.1f', '0')}; worse {c['worse']}, better {c['better']}; worse ≤ {c['worse_bound']:.1f}]"
    return s


def markdown(s):
    L = []
    w = s["workload"]
    ref = s["reference"]
    L.append(f"Blocks {', '.join(map(str, s['blocks']))} of {w['block_sessions']} sessions each (niah, kvr and code in turn), "
             f"{w['turns']} turns, turn 1's history aimed at {w['tokens'][0]}–{w['tokens'][1]} tokens, seed {w['seed']}; "
             f"the reference (`{ref}`) ran on blocks {', '.join(map(str, s['reference_blocks'])) or 'none'}.")
    L.append("")
    L.append("Runs: " + "; ".join(f"`bench/serve.sh ... {a}` at commit {c} on {m}" for c, m, a in s["runs"]) + ".")
    L.append("")
    L.append(f"### Answers on the turns a cache serves (turns 2–{w['turns']})")
    L.append("")
    L.append(f"Accuracy in percent, mean ± 95% half-width (Student's t) over the questions (n); in brackets the paired difference "
             f"from `{ref}` on the same questions ± its half-width, the questions answered worse and better than it, and the one-sided "
             f"95% Clopper-Pearson bound on the share answered worse (with none worse: 1 − 0.05^(1/n), about 300/n points).")
    L.append("")
    L.append("`= @ B MiB`: the same at budget B, not run there: at the smaller budget every later turn hit RAM, and with one slot and "
             "one client a larger store that evicts nothing is sent the same requests and serves them from the same entries.")
    L.append("")
    L.append("| mode | niah (pass keys) | kvr (key-value) | code (exact line) | code (edit sim.) | turn 1: accuracy, replies = reference's |")
    L.append("|---|---|---|---|---|---|")
    for r in s["rows"]:
        t = r["tasks"]
        es = t["code"].get("edit")
        esc = f"{es[0]:.1f} ± {f(es[1], '.1f', '–')}" if es and es[0] is not None else "—"
        a1 = r["turn1_acc"]
        same = r["turn1_same_as_reference"]
        L.append(f"| {r['label']} | {acc_cell(t['niah'])} | {acc_cell(t['kvr'])} | {acc_cell(t['code'])} | {esc} | "
                 f"{f(a1[0], '.1f')} (n {a1[2]}), {same[0]}/{same[1]} |")
    L.append("")
    L.append("### Serving")
    L.append("")
    L.append("Hits: later turns whose previous turn's whole prompt (90% at least) came back, by the tier it came from (`upstream`: "
             "llama-server's own RAM cache). TTFT: time to the first streamed token at the client. Restore: the whole restore as "
             "the server logs it (lookup, fetch, decode, state load; prefetched restores wait off the loop); loop hold: the longest "
             "llama-server's `prompt cache update` held the server loop (a save, and the restore's state load when there is one), or a save on a slot's release (with Redis). Storage: at the end of a block; per "
             "conversation: upstream's mean entry (each holds one conversation to one turn, whole); kvtc's store (chunks shared "
             "between turns counted once) over the block's conversations, given only where every later turn restored from RAM.")
    L.append("")
    L.append("| mode | hits (later turns) | later-turn tokens computed | TTFT later p50 / p95 s | TTFT mean, all turns s | restores | "
             "restore ms p50 | ms per 1K tokens | ms per MiB f16 | loop hold max ms | stored MiB (entries) | MiB per conversation (f16) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in s["rows"]:
        tiers = ", ".join(f"{k} {v}" for k, v in sorted(r["hits_by_tier"].items()))
        stored = f"{f(r.get('store_mib_end'), '.1f')} ({f(r.get('store_entries_end'), '.0f')})" if "store_mib_end" in r else "—"
        if r.get("redis_mib_end"):
            stored += f" + Redis {r['redis_mib_end']:.1f}"
        L.append(f"| {r['label']} | {r['hits']}/{r['later_turns']}{' (' + tiers + ')' if tiers else ''} | "
                 f"{r['later_prompt_tokens_computed']:,} | {f(r['ttft_later_p50'])} / {f(r['ttft_later_p95'])} | {f(r['ttft_mean'])} | "
                 f"{r['restores']} | {f(r['restore_ms_p50'], '.0f')} | {f(r['restore_ms_per_1k'], '.0f')} | "
                 f"{f(r['restore_ms_per_mib'], '.1f')} | {f(r['loop_hold_max_ms'], '.1f')} | {stored} | "
                 f"{f(r.get('mib_per_conversation'), '.1f')} ({f(r.get('f16_mib_per_conversation'), '.1f')}) |")
    if any(r.get("redis_mib_per_restore") for r in s["rows"]):
        L.append("")
        L.append("| mode | MiB fetched per Redis restore | Redis round trips p50 / p99 ms |")
        L.append("|---|---|---|")
        for r in s["rows"]:
            if r.get("redis_mib_per_restore"):
                L.append(f"| {r['label']} | {r['redis_mib_per_restore']:.2f} | {f(r['redis_rt_p50_ms'], '.1f')} / {f(r['redis_rt_p99_ms'], '.1f')} |")
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records")
    ap.add_argument("--json")
    a = ap.parse_args()
    s = build(load(a.records))
    if a.json:
        with open(a.json + ".part", "w") as fh:
            json.dump(s, fh, indent=1)
        os.replace(a.json + ".part", a.json)
    print(markdown(s))


if __name__ == "__main__":
    main()
