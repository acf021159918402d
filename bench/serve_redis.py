#!/usr/bin/env python3
"""Two kvtc-server replicas behind a round-robin client (issue 13): every
turn of a conversation lands on the other replica, the worst case for
per-replica caches and what a load balancer without session affinity does.
Three modes, each with a fresh Redis (no maxmemory: what is stored is
measured, not evicted):

  local        kvtc 16x in each replica's RAM only: no shared tier
  raw-redis    raw f16 pieces (--kvtc-raw) in Redis, the same keys and tiers
  kvtc16-redis kvtc 16x pieces in Redis

Workload: bench/serve.py's (S sessions x T turns over evaluation documents,
histories of lo..hi tokens at turn 1, all sessions' turn t before turn t+1),
sent by one client; turn t of session s goes to replica (s + t) mod 2. The
first mode fixes the assistant turns; the others replay its histories.

Per mode: time to first token (client side, streaming) p50/p95 over all
requests and over turns 2.., hit rate (turns whose whole previous prompt came
back), prompt tokens computed, Redis bytes (values, and Redis's used_memory),
per restore from Redis the two pipelined round trips (p50/p99 ms) and the
bytes they moved, the restore's whole time on the server loop, and the
break-even prefix length (a linear fit of restore time against tokens
restored, and of prefill time against tokens computed).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from serve import QUESTIONS, add_workload_args, hit_rate, stream_chat, workload  # noqa: E402
from serverlib import Redis, Server  # noqa: E402

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


def run_mode(name, flags, a, sessions, reference):
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


def summarise(name, records, info):
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--modes", nargs="+", default=["local", "raw-redis", "kvtc16-redis"])
    ap.add_argument("--cache-ram", type=int, default=512, help="each replica's RAM tier, MiB")
    ap.add_argument("--ctx", type=int, default=8192, help="tokens per replica (one slot)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out-json", required=True)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    sessions = workload(a.corpus, a.sessions, *a.tokens)
    flags = {"local": [], "raw-redis": ["--kvtc-raw"], "kvtc16-redis": []}
    rows, records, reference, infos = [], [], None, {}
    for name in a.modes:
        print(f"[serve-redis bench] {name} ...", file=sys.stderr, flush=True)
        recs, info = run_mode(name, flags[name], a, sessions, reference)
        if reference is None:
            reference = {(r["session"], r["turn"]): r["reply"] for r in recs}
        row = summarise(name, recs, info)
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


if __name__ == "__main__":
    main()
