#!/usr/bin/env python3
"""The multi-user chat replay through kvtc-server's HTTP API (issue 12),
mode by mode at the same prompt-cache budget:

  none     --cache-ram 0: no prompt cache, every turn recomputes its history
  raw      upstream's cache: raw state blobs in --cache-ram B
  kvtc16   kvtc, 16x, in --cache-ram B
  kvtc32d  kvtc, 32x, in --cache-ram B, plus a disk tier

Workload: S sessions x T turns over documents of the evaluation corpus
(histories of lo..hi tokens at turn 1), sent by two concurrent clients to a
two-slot server, turns interleaved (all sessions' turn 1, then turn 2, ...)
so a session leaves the slots between its turns. The first mode run ("none")
fixes the assistant turns: every other mode replays exactly its history, and
each reply is compared with the reference reply to the same input.

Per mode: turns whose history came back from the cache (hit: cache_n covers
the previous turn's prompt), prompt tokens recomputed, time to first token
(client side, streaming) p50/p95/mean, wall time, the cache's bytes and
prompts (kvtc: /metrics; raw: llama-server's own trace line), the time the
server loop was held by prompt-cache updates (llama-server's "prompt cache
update took" lines; kvtc also splits saves and restores), and the share of
replies equal to the reference. Writes JSON (every request) and markdown.
"""
import argparse
import json
import os
import re
import statistics
import sys
import threading
import time

import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from serverlib import Server  # noqa: E402

QUESTIONS = [
    "Summarise the document above in two sentences.",
    "Which person, place or thing does it mention first?",
    "What is the tone of the text?",
    "Give the text a short title.",
    "What would a reader ask next about it?",
]


def workload(corpus, sessions, lo, hi):
    """[(session id, first user message)] with histories spread over lo..hi tokens."""
    with open(os.path.join(corpus, "manifest.json")) as f:
        m = json.load(f)
    docs = [d for d in m["documents"] if d["split"] == "eval" and d["tokens"] >= hi + 200]
    kinds = ["prose", "docs", "code", "math"]
    picked = []
    for i in range(sessions):  # round-robin over kinds, in manifest order
        pool = [d for d in docs if d["kind"] == kinds[i % len(kinds)] and d not in picked] or [d for d in docs if d not in picked]
        picked.append(pool[0])
    out = []
    for i, d in enumerate(picked):
        want = lo + (hi - lo) * i // max(1, sessions - 1)
        with open(os.path.join(corpus, d["file"]), errors="replace") as f:
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


def run_mode(name, args, a, sessions, reference, log_dir):
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


def add_workload_args(ap):
    """The options every serving benchmark shares: the server, model,
    calibration, corpus and the chat workload."""
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs=2, default=[1000, 4000], metavar=("LO", "HI"))
    ap.add_argument("--max-tokens", type=int, default=24)


def summarise(name, budget, records, info, turns):
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 512], help="--cache-ram MiB")
    ap.add_argument("--modes", nargs="+", default=["none", "raw", "kvtc16", "kvtc32d"])
    ap.add_argument("--ctx", type=int, default=16384, help="tokens in all (two slots)")
    ap.add_argument("--work", required=True, help="logs and the disk tier")
    ap.add_argument("--out-json", required=True)
    args = ap.parse_args()
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
        recs, info = run_mode(f"{name}-{budget}", flags, args, sessions, reference, args.work)
        if reference is None:
            reference = {(r["session"], r["turn"]): r["reply"] for r in recs}
        row = summarise(name, budget, recs, info, args.turns)
        print(f"[serve bench]   hit {row['hit_rate']:.2f}, ttft mean {row['ttft_mean_s']:.2f} s, wall {row['wall_s']:.0f} s", file=sys.stderr)
        rows.append(row)
        records += recs
    with open(args.out_json, "w") as f:
        json.dump({"workload": {"sessions": args.sessions, "turns": args.turns, "tokens": args.tokens, "max_tokens": args.max_tokens,
                                "ctx": args.ctx, "parallel": 2, "docs": [d for _, d, _ in sessions]},
                   "rows": rows, "requests": records}, f, indent=1)


if __name__ == "__main__":
    main()
