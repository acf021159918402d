#!/usr/bin/env python3
"""The serving benchmarks through kvtc-server's HTTP API, scored by answers
(issue 29): sessions whose every turn asks a question with a known answer
about the session's own history (bench/serve_tasks.py: planted pass keys, a
key-value lookup, next-line code completion), in blocks of sessions, each
block a fresh server per mode. bench/serve.sh runs it; bench/serve_report.py
writes the markdown from the records.

A chat's assistant turns are the reference mode's replies (it runs first
on each block), so every mode sends the same requests and a question's
answers pair across modes. Every turn of every session is scored; turns 2.. are the ones a prompt
cache serves (the session left the slot between its turns: all sessions'
turn t before any turn t+1). Deterministic control: one slot, greedy
decoding, one client, requests one after another, so a mode's answers
differ from another's only by what its cache restored.

Single server (default), modes (each at each --budgets MiB of prompt cache):

  none    --cache-ram 0: every turn recomputes its history
  raw     upstream llama-server's cache: raw state blobs in --cache-ram B
  exact   kvtc-server --kvtc-raw: raw f16 pieces through kvtc's store, the
          same lookup and restore path as the coded modes: the reference the
          others' answers are paired with (run at the largest budget only)
  kvtc16  kvtc 16x (DP + DEFLATE)
  kvtc32  kvtc 32x
  ecsq    entropy-coded at --ecsq-ratio (the ratio on coded tokens whose error
          equals DP-32x's in bench/results/entropy.md: 50 on both models)

A mode that hit every later turn from RAM at a smaller budget is not run at
a larger one: one slot and one client send it the same requests and it
would serve them from the same entries (recorded as "same as" the smaller).

--redis: two one-slot replicas behind a round-robin client (turn t of
session s goes to replica (s + t) mod 2: every later turn lands on the
replica that did not serve the one before), each with --cache-ram
--cache-ram MiB, modes

  local         kvtc 16x in each replica's RAM only: no shared tier
  raw-redis     raw f16 pieces (--kvtc-raw) in a shared Redis: the reference
  kvtc16-redis  kvtc 16x pieces in the shared Redis

Records (one JSON line per request, one per run of a mode on a block) are
appended to --records once a run has finished: a rerun skips the runs the
file holds for the same model, calibration and workload, so the benchmark
spreads over several invocations (`--blocks 0-3`, then `--blocks 4-7`).
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import serve_tasks  # noqa: E402
from provenance import result_commit, safetensors_meta  # noqa: E402
from serverlib import Redis, Server, add_server_args  # noqa: E402

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESTORE = re.compile(r"kvtc: restored (\d+) tokens \(common prefix\) from the (\w+) tier in ([\d.]+) ms"
                     r"(?: \(Redis round trips ([\d.]+) ms, ([\d.]+) MiB\))?(?:; decoded off the loop, which it held ([\d.]+) ms)?")
UPDATE = re.compile(r"prompt cache update took ([\d.]+) ms")
# A save on release (with a Redis tier: each slot's prompt is saved when the
# slot is released, outside the cache update) holds the loop too.
SAVE_ON_RELEASE = re.compile(r"saving a \d+-token prompt \([\d.]+ MiB raw\) held the loop ([\d.]+) ms")
SERVE_MODES = ("none", "raw", "exact", "kvtc16", "kvtc32", "ecsq")
REDIS_MODES = ("local", "raw-redis", "kvtc16-redis")
REFERENCE = {"serve": "exact", "redis": "raw-redis"}


def mode_flags(mode, budget, a):
    cal = ["--kvtc-calib", a.calib]
    return {
        "none": ["--cache-ram", "0"],
        "raw": ["--cache-ram", str(budget)],
        "exact": ["--cache-ram", str(budget), *cal, "--kvtc-raw"],
        # kvtc16/kvtc32 are the paper's DP (what the committed records
        # measured), pinned now that kvtc-server's default is entropy-coded;
        # "ecsq" is that default at --ecsq-ratio.
        "kvtc16": ["--cache-ram", str(budget), *cal, "--kvtc-dp", "--kvtc-ratio", "16"],
        "kvtc32": ["--cache-ram", str(budget), *cal, "--kvtc-dp", "--kvtc-ratio", "32"],
        "ecsq": ["--cache-ram", str(budget), *cal, "--kvtc-ecsq", "--kvtc-ratio", str(a.ecsq_ratio)],
        "local": ["--cache-ram", str(budget), *cal, "--kvtc-dp", "--kvtc-ratio", "16"],
        "raw-redis": ["--cache-ram", str(budget), *cal, "--kvtc-ratio", "16", "--kvtc-raw"],
        "kvtc16-redis": ["--cache-ram", str(budget), *cal, "--kvtc-dp", "--kvtc-ratio", "16"],
    }[mode]


# ---- one request -------------------------------------------------------------

def request_body(sess, turn, replies):
    """(path, JSON body) of session `sess`'s turn `turn` (0-based): the same
    for every mode. A chat's earlier assistant turns are the reference
    mode's replies (`replies[(session, turn)]`): as in a real chat, a turn's
    prompt then contains the last turn's prompt and reply, and a store drops
    the last turn's entry as contained in the new one wherever a mode
    replied as the reference did."""
    q = sess["turns"][turn]
    if sess["kind"] == "completion":
        return "/completion", {"prompt": q["prompt"], "n_predict": q["max_tokens"], "temperature": 0, "seed": 1, "stream": True,
                               "cache_prompt": True}
    msgs = [{"role": "user", "content": sess["context"] + "\n\n" + sess["turns"][0]["question"]}]
    for k in range(turn):
        msgs += [{"role": "assistant", "content": replies[(sess["id"], k)]}, {"role": "user", "content": sess["turns"][k + 1]["question"]}]
    return "/v1/chat/completions", {"messages": msgs, "max_tokens": q["max_tokens"], "temperature": 0, "seed": 1, "stream": True,
                                    "stream_options": {"include_usage": True}}


def send(url, path, body):
    """(reply, ttft s, total s, timings) of a streaming greedy request."""
    t0 = time.perf_counter()
    ttft, parts, timings = None, [], {}
    with requests.post(url + path, json=body, stream=True, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("timings"):
                timings = ev["timings"]
            if "choices" in ev:
                piece = "".join((ch.get("delta") or {}).get("content") or "" for ch in ev["choices"])
            else:
                piece = ev.get("content") or ""
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(piece)
    total = time.perf_counter() - t0
    return "".join(parts), (ttft if ttft is not None else total), total, timings


class LogTail:
    """The lines a server logged since the last call (one client, requests in
    turn: what a request's wait logged is between its start and its end)."""

    def __init__(self, srv):
        self.srv, self.at = srv, 0

    def new(self):
        with open(self.srv.log_path, errors="replace") as f:
            f.seek(self.at)
            text = f.read()
            self.at = f.tell()
        return text


def restore_of(text):
    m = None
    for m in RESTORE.finditer(text):
        pass
    if not m:
        return None
    return {"tokens": int(m[1]), "tier": m[2], "ms": float(m[3]), "redis_ms": float(m[4]) if m[4] else None,
            "redis_mib": float(m[5]) if m[5] else None, "loop_ms": float(m[6]) if m[6] else float(m[3])}


# ---- one run: a mode on a block ---------------------------------------------------

def run(bench, mode, budget, block, sessions, a, ident, replies):
    """Request and run records of one mode at one budget on one block.
    `replies`: the reference's, {(session, turn): text}; the reference
    itself fills it as it goes."""
    is_ref = mode == REFERENCE[bench]
    tag = f"{mode}-{budget}-b{block}"
    redis = None
    flags = mode_flags(mode, budget, a)
    if bench == "redis":
        if mode != "local":
            redis = Redis(os.path.join(a.work, f"redis-{tag}"))
            flags += ["--kvtc-redis", redis.url]
        n = 2
    else:
        n = 1
    servers = [Server(a.server, a.model, ["--parallel", "1", "-lv", "4", *a.server_arg, *flags], os.path.join(a.work, f"{tag}-{i}.log"), ctx=a.ctx)
               for i in range(n)]
    try:
        for s in servers:
            if not s.wait_ready(600):
                raise SystemExit(f"{tag}: kvtc-server did not start; see {s.log_path}")
        tails = [LogTail(s) for s in servers]
        for t in tails:
            t.new()
        recs = []
        t0 = time.perf_counter()
        for turn in range(a.turns):
            for sess in sessions:
                rep = (sess["id"] + turn) % n
                path, body = request_body(sess, turn, replies)
                reply, ttft, total, tm = send(servers[rep].url, path, body)
                if is_ref:
                    replies[(sess["id"], turn)] = reply
                log = tails[rep].new()
                q = sess["turns"][turn]
                sc, es = serve_tasks.score(sess["task"], q["answers"], reply)
                recs.append({"type": "request", **ident, "mode": mode, "budget": budget, "block": block, "session": sess["id"],
                             "task": sess["task"], "doc": sess["doc"], "turn": turn, "replica": rep, "answers": q["answers"],
                             "reply": reply, "score": sc, "edit_sim": es, "ttft_s": ttft, "total_s": total,
                             "prompt_n": tm.get("prompt_n"), "cache_n": tm.get("cache_n"), "prompt_ms": tm.get("prompt_ms"),
                             "restore": restore_of(log), "cache_update_ms": [float(x) for x in UPDATE.findall(log)],
                             "save_hold_ms": [float(x) for x in SAVE_ON_RELEASE.findall(log)]})
                print(f"[serve] {tag} s{sess['id']} t{turn} {sess['task']}: score {sc:.0f} ttft {ttft:.2f} s"
                      f" cache_n {tm.get('cache_n')} prompt_n {tm.get('prompt_n')}", file=sys.stderr, flush=True)
        wall = time.perf_counter() - t0
        kvtc = "--kvtc-calib" in flags
        metrics = [s.wait_saved() if kvtc else s.metrics() for s in servers]
        redis_info = {}
        if redis:
            keys = redis.cli("KEYS", "kvtc:*").split()
            cmds = "".join(f"STRLEN {k}\n" for k in keys if ":x:" not in k)
            out = subprocess.run(["redis-cli", "-p", str(redis.port), "--raw"], input=cmds, capture_output=True, text=True,
                                 timeout=120).stdout if cmds else ""
            redis_info = {"keys": len(keys), "value_bytes": sum(int(x) for x in out.split() if x.lstrip("-").isdigit()),
                          "used_memory": int(redis.info("memory")["used_memory"])}
    finally:
        for s in servers:
            s.stop()
        if redis:
            redis.stop()
    logs = [s.log() for s in servers]
    states = [m for lg in logs for m in re.findall(r"cache state: (\d+) prompts, ([\d.]+) MiB", lg)]
    summary = {"type": "run", **ident, "mode": mode, "budget": budget, "block": block, "wall_s": wall, "servers": n,
               "metrics": [{k: v for k, v in m.items() if k.startswith("kvtc:")} for m in metrics],
               "raw_cache_last": {"prompts": int(states[-1][0]), "mib": float(states[-1][1])} if states else None,
               "raw_cache_peak_mib": max((float(b) for _, b in states), default=0.0), "redis": redis_info,
               "model_kv_bytes_per_token": a.kv_bytes_per_token}
    return recs, summary


# ---- the plan, resumable ------------------------------------------------------

def load_records(path):
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for i, line in enumerate(f, 1):
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"{path}:{i}: not a JSON record ({e}); remove the line or the file")
    return out


def same_set(r, ident):
    return all(r.get(k) == v for k, v in ident.items() if k != "run")


def blocks_arg(text):
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", action="store_true", help="two replicas sharing a Redis tier")
    add_server_args(ap)
    ap.add_argument("--records", required=True, help="JSON lines, appended run by run; the runs it holds are skipped")
    ap.add_argument("--blocks", type=blocks_arg, default=[0], help="block numbers, N or N-M (default 0)")
    ap.add_argument("--block-sessions", type=int, default=12, help="sessions per block (niah, kvr, code in turn)")
    ap.add_argument("--turns", type=int, default=6, help="turns per session: every turn after the first one more paired question for one prefill")
    ap.add_argument("--tokens", type=int, nargs=2, default=[1000, 2000], metavar=("LO", "HI"), help="turn 1's history, aimed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", nargs="+")
    ap.add_argument("--budgets", type=int, nargs="+", default=[192, 1024], help="--cache-ram MiB (single server)")
    ap.add_argument("--cache-ram", type=int, default=1024, help="each replica's RAM tier, MiB (--redis)")
    ap.add_argument("--ecsq-ratio", type=float, default=50)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--work", required=True, help="logs and Redis' files")
    ap.add_argument("--server-arg", action="append", default=[], help="one more kvtc-server argument, every mode, in order (a flag and its value: twice, --server-arg=--chat-template-file --server-arg=F)")
    a = ap.parse_args()
    bench = "redis" if a.redis else "serve"
    a.modes = a.modes or list(REDIS_MODES if a.redis else SERVE_MODES)
    bad = [m for m in a.modes if m not in (REDIS_MODES if a.redis else SERVE_MODES)]
    if bad:
        raise SystemExit(f"serve.py: unknown mode(s) {bad} for the {bench} benchmark")
    os.makedirs(a.work, exist_ok=True)
    cal = safetensors_meta(a.calib)
    # f16 K+V bytes per token, from the calibration's geometry (the model's).
    a.kv_bytes_per_token = int(cal["n_layer"]) * int(cal["n_head_kv"]) * int(cal["head_dim"]) * 2 * 2
    ident = {"bench": bench, "model": os.path.basename(a.model), "calib_id": cal.get("calibration_id") or cal.get("id"),
             "workload": {"history": "reference replies", "block_sessions": a.block_sessions, "turns": a.turns, "tokens": a.tokens, "seed": a.seed,
                          "ecsq_ratio": a.ecsq_ratio, "ctx": a.ctx, **({"cache_ram": a.cache_ram} if a.redis else {})},
             "run": {"commit": result_commit(TOP), "machine": f"{cpu_name()}, {os.cpu_count()} threads, {platform.system()} {platform.release()}",
                     "date": time.strftime("%Y-%m-%d"), "args": run_args(sys.argv[1:])}}
    have = load_records(a.records)
    done = {(r["mode"], r["budget"], r["block"]): r for r in have if r.get("type") == "run" and same_set(r, ident)}
    budgets = sorted(a.budgets) if not a.redis else [a.cache_ram]
    ref_mode = REFERENCE[bench]
    # The reference runs first on each block: the others' chats carry its replies.
    a.modes = sorted(a.modes, key=lambda m: m != ref_mode)
    for block in a.blocks:
        sessions = serve_tasks.sessions(a.corpus, block * a.block_sessions, a.block_sessions, *a.tokens, a.turns, a.seed)
        replies = {(r["session"], r["turn"]): r["reply"] for r in have
                   if r.get("type") == "request" and r["mode"] == ref_mode and r["block"] == block and same_set(r, ident)}
        if not replies and ref_mode not in a.modes:
            raise SystemExit(f"serve.py: block {block} has no {ref_mode} run yet (its replies are every mode's history): add --modes {ref_mode}")
        for mode in a.modes:
            for i, budget in enumerate(budgets):
                if mode == "none" and i > 0:
                    continue  # no cache: no budget
                if mode == "exact" and budget != budgets[-1]:
                    continue
                if (mode, budget, block) in done:
                    continue
                smaller = [done.get((mode, b, block)) for b in budgets[:i]]
                full = [s for s in smaller if s and s.get("all_later_hit_ram")]
                if full:
                    summary = {"type": "run", **ident, "mode": mode, "budget": budget, "block": block, "same_as_budget": full[0]["budget"]}
                    append(a.records, [summary])
                    done[(mode, budget, block)] = summary
                    print(f"[serve] {mode} at {budget} MiB, block {block}: as at {full[0]['budget']} MiB (every later turn hit RAM there)",
                          file=sys.stderr)
                    continue
                print(f"[serve] {mode} at {budget} MiB, block {block} ...", file=sys.stderr, flush=True)
                recs, summary = run(bench, mode, budget, block, sessions, a, ident, replies)
                later = [r for r in recs if r["turn"] > 0]
                summary["all_later_hit_ram"] = bool(later) and all(r["restore"] and r["restore"]["tier"] == "ram" for r in later)
                append(a.records, recs + [summary])
                have += recs
                done[(mode, budget, block)] = summary


def append(path, recs):
    """Appends whole lines and syncs: a run is in the file entirely or not at all
    (a partial last line from a crash is reported by load_records)."""
    with open(path, "a") as f:
        f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs))
        f.flush()
        os.fsync(f.fileno())


def run_args(argv):
    """The options of this invocation without the paths (which name this checkout)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--server", "--model", "--calib", "--corpus", "--work", "--records"):
            skip = True
        else:
            out.append(x)
    return " ".join(out)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
