#!/usr/bin/env python3
"""The serving benchmarks through kvtc-server's HTTP API, on one chat
workload: the multi-user chat replay (issue 12) and, with --redis, two
replicas sharing a Redis tier (issue 13). bench/serve.sh runs them and
bench/serve_report.py writes the markdown.

Workload: S sessions x T turns over documents of the evaluation corpus
(histories of lo..hi tokens at turn 1), all sessions' turn t before turn
t+1, so a session leaves the server's slots between its turns. The first
mode run fixes the assistant turns: every other mode replays exactly its
history, and each reply is compared with the reference reply to the same
input.

Chat replay (default), mode by mode at the same prompt-cache budget:

  none     --cache-ram 0: no prompt cache, every turn recomputes its history
  raw      upstream's cache: raw state blobs in --cache-ram B
  kvtc16   kvtc, 16x, in --cache-ram B
  kvtc32d  kvtc, 32x, in --cache-ram B, plus a disk tier

sent by two concurrent clients to a two-slot server. Per mode: turns whose
history came back from the cache (hit: cache_n covers the previous turn's
prompt), prompt tokens recomputed, time to first token (client side,
streaming) p50/p95/mean, wall time, the cache's bytes and prompts (kvtc:
/metrics; raw: llama-server's own trace line), the time the server loop was
held by prompt-cache updates (llama-server's "prompt cache update took"
lines; kvtc also splits saves and restores), and the share of replies equal
to the reference.

--redis: two kvtc-server replicas behind a round-robin client: every turn
of a conversation lands on the other replica, the worst case for
per-replica caches and what a load balancer without session affinity does.
Three modes, each with a fresh Redis (no maxmemory: what is stored is
measured, not evicted):

  local        kvtc 16x in each replica's RAM only: no shared tier
  raw-redis    raw f16 pieces (--kvtc-raw) in Redis, the same keys and tiers
  kvtc16-redis kvtc 16x pieces in Redis

sent by one client; turn t of session s goes to replica (s + t) mod 2. Per
mode: time to first token (client side, streaming) p50/p95 over all
requests and over turns 2.., hit rate (turns whose whole previous prompt came
back), prompt tokens computed, Redis bytes (values, and Redis's used_memory),
per restore from Redis the two pipelined round trips (p50/p99 ms) and the
bytes they moved, the restore's whole time on the server loop, and the
break-even prefix length (a linear fit of restore time against tokens
restored, and of prefill time against tokens computed).

Writes JSON (every request).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import corpus  # noqa: E402
from serverlib import Redis, Server, add_server_args  # noqa: E402

QUESTIONS = [
    "Summarise the document above in two sentences.",
    "Which person, place or thing does it mention first?",
    "What is the tone of the text?",
    "Give the text a short title.",
    "What would a reader ask next about it?",
]


# ---- the workload, shared by both benchmarks --------------------------------

def workload(root, sessions, lo, hi):
    """[(session id, first user message)] with histories spread over lo..hi tokens."""
    docs = corpus.documents("eval", min_tokens=hi + 200, root=root)
    kinds = ["prose", "docs", "code", "math"]
    picked = []
    for i in range(sessions):  # round-robin over kinds, in manifest order
        pool = [d for d in docs if d["kind"] == kinds[i % len(kinds)] and d not in picked] or [d for d in docs if d not in picked]
        picked.append(pool[0])
    out = []
    for i, d in enumerate(picked):
        want = lo + (hi - lo) * i // max(1, sessions - 1)
        with open(corpus.path(d, root), errors="replace") as f:
            text = f.read()
        chars = int(len(text) * want / d["tokens"])
        out.append((i, d["id"], f"Read this document ({d['id']}).\n\n{text[:chars]}\n\n{QUESTIONS[0]}"))
    return out


def stream_chat(url, messages, max_tokens):
    """(reply, ttft seconds, timings) of a greedy streaming chat completion."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}, "timings_per_token": False}
    t0 = time.perf_counter()
    ttft, parts, timings = None, [], {}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("timings"):
                timings = ev["timings"]
            for ch in ev.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(piece)
    return "".join(parts), (ttft if ttft is not None else time.perf_counter() - t0), timings


def hit_rate(records):
    """The share of turns 2.. whose previous turn's prompt (its whole history,
    90% of it at least) came back from a cache."""
    later = [r for r in records if r["turn"] > 0]
    prev = {(r["session"], r["turn"]): r for r in records}
    hits = 0
    for r in later:
        p = prev[(r["session"], r["turn"] - 1)]
        if (r["cache_n"] or 0) >= 0.9 * (p["prompt_n"] + (p["cache_n"] or 0)):
            hits += 1
    return hits / len(later) if later else 0.0


# ---- the chat replay: one two-slot server, two clients ------------------------

def run_chat_mode(name, args, a, sessions, reference, log_dir):
    srv = Server(a.server, a.model, ["--parallel", "2", "-lv", "4", *args], os.path.join(log_dir, f"serve-{name}.log"), ctx=a.ctx)
    if not srv.wait_ready():
        raise SystemExit(f"{name}: kvtc-server did not start; see {srv.log_path}")
    records, lock, peak = [], threading.Lock(), {"kvtc:ram_prompts": 0, "kvtc:ram_bytes": 0}
    kvtc = any(x.startswith("--kvtc-calib") for x in args)

    def client(mine):
        hist = {s: [{"role": "user", "content": first}] for s, _, first in mine}
        for turn in range(a.turns):
            for s, doc, _ in mine:
                msgs = hist[s]
                reply, ttft, tm = stream_chat(srv.url, msgs, a.max_tokens)
                ref = reference.get((s, turn)) if reference is not None else reply
                rec = {"mode": name, "session": s, "doc": doc, "turn": turn, "ttft_s": ttft, "prompt_n": tm.get("prompt_n"),
                       "cache_n": tm.get("cache_n"), "prompt_ms": tm.get("prompt_ms"), "reply": reply, "equal_reference": reply == ref}
                # Every mode continues with the reference's reply: identical inputs.
                hist[s] = msgs + [{"role": "assistant", "content": ref},
                                  {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]
                with lock:
                    records.append(rec)
                    if kvtc:
                        m = srv.metrics()
                        for k in peak:
                            peak[k] = max(peak[k], m.get(k, 0))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(sessions[c::2],)) for c in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    metrics = srv.wait_saved() if kvtc else srv.metrics()
    srv.stop()
    log = srv.log()
    updates = [float(x) for x in re.findall(r"prompt cache update took ([\d.]+) ms", log)]
    states = re.findall(r"cache state: (\d+) prompts, ([\d.]+) MiB", log)
    raw_peak = max((int(n) for n, _ in states), default=0), max((float(b) for _, b in states), default=0.0)
    per = [float(b) / int(n) for n, b in states if int(n) > 0]
    return records, {"wall_s": wall, "metrics": {k: v for k, v in metrics.items() if k.startswith("kvtc:")},
                     "cache_update_ms": updates, "raw_cache_peak": {"prompts": raw_peak[0], "mib": raw_peak[1]},
                     "raw_mib_per_prompt": statistics.fmean(per) if per else 0.0, "kvtc_peak": peak}


def summarise_chat(name, budget, records, info, turns):
    later = [r for r in records if r["turn"] > 0]
    ttft = sorted(r["ttft_s"] for r in records)
    ttft_later = sorted(r["ttft_s"] for r in later)
    m = info["metrics"]
    upd = info["cache_update_ms"]
    row = {
        "mode": name, "budget_mib": budget, "requests": len(records),
        "hit_rate": hit_rate(records),
        "prompt_tokens_recomputed": sum(r["prompt_n"] or 0 for r in records),
        "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": ttft[int(0.95 * (len(ttft) - 1))], "ttft_mean_s": statistics.fmean(ttft),
        "ttft_later_mean_s": statistics.fmean(ttft_later) if ttft_later else 0.0,
        "wall_s": info["wall_s"],
        "equal_reference": sum(r["equal_reference"] for r in records) / len(records),
        "cache_update_ms_sum": sum(upd), "cache_update_ms_max": max(upd, default=0.0),
    }
    if m:
        row.update({"prompts_held": int(m.get("kvtc:ram_prompts", 0)), "prompts_held_peak": int(info["kvtc_peak"]["kvtc:ram_prompts"]),
                    "ram_mib": m.get("kvtc:ram_bytes", 0) / 2**20, "disk_mib": m.get("kvtc:disk_bytes", 0) / 2**20,
                    "disk_prompts": int(m.get("kvtc:disk_prompts", 0)),
                    "loop_save_ms_sum": 1e3 * m.get("kvtc:loop_save_seconds_total", 0), "loop_save_ms_max": 1e3 * m.get("kvtc:loop_save_seconds_max", 0),
                    "loop_restore_ms_sum": 1e3 * m.get("kvtc:loop_restore_seconds_total", 0),
                    "loop_restore_ms_max": 1e3 * m.get("kvtc:loop_restore_seconds_max", 0),
                    "restores": int(m.get("kvtc:loop_restores_total", 0)), "compress_s": m.get("kvtc:compress_seconds_total", 0),
                    "hits_disk": int(m.get('kvtc:hits_total{tier="disk"}', 0))})
        held = m.get("kvtc:ram_prompts", 0)
        row["mib_per_prompt"] = m.get("kvtc:ram_bytes", 0) / 2**20 / held if held else 0.0
    else:
        row.update({"prompts_held_peak": info["raw_cache_peak"]["prompts"], "ram_mib": info["raw_cache_peak"]["mib"], "disk_mib": 0.0,
                    "mib_per_prompt": info["raw_mib_per_prompt"]})
    # How many prompts of this workload's mean stored size the budget holds
    # (not capped by the workload's session count, as prompts held is).
    row["capacity_prompts"] = budget / row["mib_per_prompt"] if budget and row["mib_per_prompt"] else 0.0
    return row


def chat_main(args):
    os.makedirs(args.work, exist_ok=True)
    sessions = workload(args.corpus, args.sessions, *args.tokens)
    rows, records, reference = [], [], None
    plan = [("none", 0, ["--cache-ram", "0"])] if "none" in args.modes else []
    for b in args.budgets:
        if "raw" in args.modes:
            plan.append(("raw", b, ["--cache-ram", str(b)]))
        if "kvtc16" in args.modes:
            plan.append(("kvtc16", b, ["--cache-ram", str(b), "--kvtc-calib", args.calib, "--kvtc-ratio", "16"]))
        if "kvtc32d" in args.modes:
            disk = os.path.join(args.work, f"store-{b}")
            if os.path.isdir(disk):
                import shutil
                shutil.rmtree(disk)
            plan.append(("kvtc32d", b, ["--cache-ram", str(b), "--kvtc-calib", args.calib, "--kvtc-ratio", "32", "--kvtc-disk", disk]))
    for name, budget, flags in plan:
        print(f"[serve bench] {name} at {budget} MiB ...", file=sys.stderr, flush=True)
        recs, info = run_chat_mode(f"{name}-{budget}", flags, args, sessions, reference, args.work)
        if reference is None:
            reference = {(r["session"], r["turn"]): r["reply"] for r in recs}
        row = summarise_chat(name, budget, recs, info, args.turns)
        print(f"[serve bench]   hit {row['hit_rate']:.2f}, ttft mean {row['ttft_mean_s']:.2f} s, wall {row['wall_s']:.0f} s", file=sys.stderr)
        rows.append(row)
        records += recs
    with open(args.out_json, "w") as f:
        json.dump({"workload": {"sessions": args.sessions, "turns": args.turns, "tokens": args.tokens, "max_tokens": args.max_tokens,
                                "ctx": args.ctx, "parallel": 2, "docs": [d for _, d, _ in sessions]},
                   "rows": rows, "requests": records}, f, indent=1)


# ---- --redis: two one-slot replicas sharing a Redis tier, one client -----------

RESTORE = re.compile(r"kvtc: restored (\d+) tokens \(common prefix\) from the (\w+) tier in ([\d.]+) ms"
                     r"(?: \(Redis round trips ([\d.]+) ms, ([\d.]+) MiB\))?")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else 0.0


def fit(points, nonnegative_intercept=False):
    """(intercept, slope) of a least-squares line through (x, y) points; with
    nonnegative_intercept, a line through the origin when the free fit's
    intercept is negative (prefill is not linear in the tokens: attention
    grows with them, which pulls the intercept below zero)."""
    if len(points) < 2:
        return None
    if nonnegative_intercept:
        f = fit(points)
        if f and f[0] < 0:
            return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
        return f
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def redis_value_bytes(r):
    keys = r.cli("KEYS", "kvtc:*").split()
    if not keys:
        return 0, 0
    cmds = "".join(f"STRLEN {k}\n" for k in keys if ":x:" not in k)
    out = subprocess.run(["redis-cli", "-p", str(r.port), "--raw"], input=cmds, capture_output=True, text=True, timeout=120).stdout
    return len(keys), sum(int(x) for x in out.split() if x.lstrip("-").isdigit())


def run_redis_mode(name, flags, a, sessions, reference):
    r = Redis(os.path.join(a.work, f"redis-{name}"))
    base = int(r.info("memory")["used_memory"])
    tier = ["--kvtc-redis", r.url] if "redis" in name else []
    common = ["--parallel", "1", "--cache-ram", str(a.cache_ram), "--kvtc-calib", a.calib, "--kvtc-ratio", "16", *flags, *tier]
    reps = [Server(a.server, a.model, common, os.path.join(a.work, f"{name}-{i}.log"), ctx=a.ctx) for i in range(2)]
    for s in reps:
        if not s.wait_ready():
            raise SystemExit(f"{name}: kvtc-server did not start; see {s.log_path}")
    records = []
    hist = {s: [{"role": "user", "content": first}] for s, _, first in sessions}
    t0 = time.perf_counter()
    for turn in range(a.turns):
        for s, doc, _ in sessions:
            rep = (s + turn) % 2  # no waiting for the other replica's write: a session's previous turn was S requests ago
            msgs = hist[s]
            reply, ttft, tm = stream_chat(reps[rep].url, msgs, a.max_tokens)
            ref = reference.get((s, turn)) if reference is not None else reply
            records.append({"mode": name, "session": s, "doc": doc, "turn": turn, "replica": rep, "ttft_s": ttft,
                            "prompt_n": tm.get("prompt_n"), "cache_n": tm.get("cache_n"), "prompt_ms": tm.get("prompt_ms"),
                            "reply": reply, "equal_reference": reply == ref})
            hist[s] = msgs + [{"role": "assistant", "content": ref}, {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]
    wall = time.perf_counter() - t0
    metrics = [s.wait_saved() for s in reps]
    nkeys, value_bytes = redis_value_bytes(r) if "redis" in name else (0, 0)
    used = int(r.info("memory")["used_memory"]) - base
    for s in reps:
        s.stop()
    r.stop()
    restores = []
    for s in reps:
        for m in RESTORE.finditer(s.log()):
            restores.append({"tokens": int(m[1]), "tier": m[2], "ms": float(m[3]),
                             "redis_ms": float(m[4]) if m[4] else None, "redis_mib": float(m[5]) if m[5] else None})
    keep = ("redis_", "hits_total", "loop_", "ram_bytes", "saves_total", "misses_total", "dropped_damaged_total", "restore_failures_total")
    return records, {"wall_s": wall, "redis_keys": nkeys, "redis_value_bytes": value_bytes, "redis_used_memory": used,
                     "restores": restores,
                     "metrics": [{k: v for k, v in m.items() if k.startswith("kvtc:") and any(x in k for x in keep)} for m in metrics]}


def summarise_redis(name, records, info):
    later = [r for r in records if r["turn"] > 0]
    ttft = [r["ttft_s"] for r in records]
    ttft_later = [r["ttft_s"] for r in later]
    red = [x for x in info["restores"] if x["tier"] == "redis"]
    rt = [x["redis_ms"] for x in red]
    moved = sum(x["redis_mib"] for x in red)
    return {
        "mode": name, "requests": len(records), "hit_rate": hit_rate(records),
        "prompt_tokens_computed": sum(r["prompt_n"] or 0 for r in records),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95), "ttft_later_p50_s": pct(ttft_later, 0.5),
        "ttft_later_p95_s": pct(ttft_later, 0.95), "wall_s": info["wall_s"],
        "redis_keys": info["redis_keys"], "redis_value_mib": info["redis_value_bytes"] / 2**20,
        "redis_used_mib": info["redis_used_memory"] / 2**20,
        "redis_restores": len(red), "redis_tokens_restored": sum(x["tokens"] for x in red),
        "redis_rt_p50_ms": pct(rt, 0.5), "redis_rt_p99_ms": pct(rt, 0.99),
        "redis_mib_per_restore": moved / len(red) if red else 0.0,
        "redis_mib_per_s": moved / (sum(rt) / 1e3) if rt and sum(rt) > 0 else 0.0,
        "restore_ms_p50": pct([x["ms"] for x in red], 0.5),
        "restores_other_tiers": len(info["restores"]) - len(red),
        "equal_reference": sum(r["equal_reference"] for r in records) / len(records),
        "redis_errors": sum(m.get("kvtc:redis_errors_total", 0) for m in info["metrics"]),
        "restore_failures": sum(m.get("kvtc:restore_failures_total", 0) for m in info["metrics"]),
    }


def redis_main(a):
    os.makedirs(a.work, exist_ok=True)
    sessions = workload(a.corpus, a.sessions, *a.tokens)
    flags = {"local": [], "raw-redis": ["--kvtc-raw"], "kvtc16-redis": []}
    rows, records, reference, infos = [], [], None, {}
    for name in a.modes:
        print(f"[serve-redis bench] {name} ...", file=sys.stderr, flush=True)
        recs, info = run_redis_mode(name, flags[name], a, sessions, reference)
        if reference is None:
            reference = {(r["session"], r["turn"]): r["reply"] for r in recs}
        row = summarise_redis(name, recs, info)
        print(f"[serve-redis bench]   hit {row['hit_rate']:.2f}, ttft p50 {row['ttft_p50_s']:.2f} s, wall {row['wall_s']:.0f} s", file=sys.stderr)
        rows.append(row)
        records += recs
        infos[name] = info
    # Break-even: restore time (whole, on the loop) against tokens restored,
    # per Redis mode; prefill time against tokens computed (every request).
    prefill = fit([(r["prompt_n"], r["prompt_ms"]) for r in records if r["prompt_n"] and r["prompt_ms"] and r["prompt_n"] >= 64], True)
    breakeven = {}
    for name, info in infos.items():
        f = fit([(x["tokens"], x["ms"]) for x in info["restores"] if x["tier"] == "redis"])
        if f and prefill:
            (ar, br), (ap_, bp) = f, prefill
            n = (ar - ap_) / (bp - br) if bp > br else None
            breakeven[name] = {"restore_fit_ms": [ar, br], "tokens": n}
    with open(a.out_json, "w") as f:
        json.dump({"workload": {"sessions": a.sessions, "turns": a.turns, "tokens": a.tokens, "max_tokens": a.max_tokens, "ctx": a.ctx,
                                "cache_ram_mib": a.cache_ram, "replicas": 2, "parallel": 1, "docs": [d for _, d, _ in sessions]},
                   "rows": rows, "prefill_fit_ms": prefill, "breakeven": breakeven, "requests": records,
                   "restores": {k: v["restores"] for k, v in infos.items()}, "metrics": {k: v["metrics"] for k, v in infos.items()}}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", action="store_true", help="two replicas sharing a Redis tier instead of the chat replay")
    add_server_args(ap)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs=2, default=[1000, 4000], metavar=("LO", "HI"))
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--modes", nargs="+", help="default: none raw kvtc16 kvtc32d; --redis: local raw-redis kvtc16-redis")
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 512], help="--cache-ram MiB (chat replay)")
    ap.add_argument("--cache-ram", type=int, default=512, help="each replica's RAM tier, MiB (--redis)")
    ap.add_argument("--ctx", type=int, help="default: 16384 tokens in all (two slots); --redis: 8192 tokens per replica (one slot)")
    ap.add_argument("--work", required=True, help="logs, the disk tier, Redis' files")
    ap.add_argument("--out-json", required=True)
    a = ap.parse_args()
    if a.modes is None:
        a.modes = ["local", "raw-redis", "kvtc16-redis"] if a.redis else ["none", "raw", "kvtc16", "kvtc32d"]
    if a.ctx is None:
        a.ctx = 8192 if a.redis else 16384
    (redis_main if a.redis else chat_main)(a)


if __name__ == "__main__":
    main()
