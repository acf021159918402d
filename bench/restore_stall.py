#!/usr/bin/env python3
"""Does a restore stall the other slots? (bench/restore_stall.sh)

kvtc-server with two slots: slot X streams a long greedy reply while a
client resumes a stored conversation (~1.8K tokens, evicted from both slots
beforehand) on the other slot. The figure is the stream's gaps between
tokens while the resuming request is in flight, by mode:

- kvtc: 16x, restored off the loop (the request's thread looks it up and
  decodes it; the loop only writes the state);
- kvtc-on-loop: the same with --kvtc-no-prefetch (the decode on the loop,
  as before: every slot pauses);
- raw: --kvtc-raw (exact f16, no decoding: the issue's reference);
- recompute: the same turn with cache_prompt false (prefill of the whole
  conversation in the other slot: what a miss costs the stream);
- stream alone: no second request (the gaps' floor).

The resuming request's own time to its first token is reported beside.
One trial = one conversation (a distinct document); every mode runs the
same documents in the same order.
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from serverlib import Server, add_server_args  # noqa: E402

MODES = {  # name: (server flags, turn 2's extra request fields)
    "kvtc": ([], {}),
    "kvtc-on-loop": (["--kvtc-no-prefetch"], {}),
    "raw": (["--kvtc-raw"], {}),
    "recompute": ([], {"cache_prompt": False}),
    "stream alone": ([], None),
}


def conv(doc):
    return [{"role": "user", "content": "Here is a document.\n\n" + doc + "\n\nSummarise it in one sentence."}]


def trial(s, doc, i, extra, stream_tokens):
    """Turn 1, evicted from both slots, then turn 2 while slot X streams.
    Returns (gaps during turn 2 in s, turn 2's time to first token in s or None)."""
    a1, t1, _ = s.chat(conv(doc))
    for k in range(2):  # both slots take something else: turn 1 is saved to the store and leaves them
        s.chat([{"role": "user", "content": f"Say hello to number {i}-{k}."}], max_tokens=4)
    s.wait_saved()
    arrivals = []

    def stream():
        body = {"messages": [{"role": "user", "content": f"Write a long story about a lighthouse keeper, number {i}."}],
                "max_tokens": stream_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        with requests.post(s.url + "/v1/chat/completions", json=body, stream=True, timeout=300) as q:
            q.raise_for_status()
            for line in q.iter_lines():
                if line.startswith(b"data: ") and b'"content"' in line:
                    arrivals.append(time.monotonic())

    th = threading.Thread(target=stream)
    th.start()
    while len(arrivals) < 20:  # the stream at its pace
        time.sleep(0.01)
    t0 = time.monotonic()
    ttft = None
    if extra is not None:
        msgs = conv(doc) + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Name one person or place it mentions."}]
        body = {"messages": msgs, "max_tokens": 1, "temperature": 0, **extra}
        j = requests.post(s.url + "/v1/chat/completions", json=body, timeout=300).json()
        ttft = time.monotonic() - t0
        if extra.get("cache_prompt", True) and j["timings"].get("cache_n", 0) < t1["prompt_n"]:
            raise RuntimeError(f"turn 2 was not restored: {j['timings']}")
    else:
        time.sleep(0.5)
    t1_ = time.monotonic()
    th.join()
    # The gaps that overlap [t0, t1_]: the stream's tokens around the request.
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= t0 and a <= t1_]
    return gaps, ttft


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(ap)
    ap.add_argument("--work", required=True)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--out-json", required=True)
    a = ap.parse_args()
    with open(os.path.join(a.corpus, "manifest.json")) as f:
        m = json.load(f)
    docs = []
    for d in [d for d in m["documents"] if d["split"] == "eval" and d["kind"] == "prose" and d["tokens"] >= 1500][:a.trials]:
        with open(os.path.join(a.corpus, d["file"]), errors="replace") as f:
            docs.append(f.read()[:6000])  # ~1.7K tokens with the chat template
    out = {"trials": len(docs), "stream_tokens": a.stream_tokens, "modes": {}}
    t_start = time.time()
    for name, (flags, extra) in MODES.items():
        s = Server(a.server, a.model, ["--kvtc-calib", a.calib, "--cache-ram", "512", "--parallel", "2", *flags],
                   os.path.join(a.work, name.replace(" ", "-") + ".log"))
        if not s.wait_ready():
            raise RuntimeError(f"{name}: the server did not start:\n{s.log()[-3000:]}")
        try:
            gaps, ttfts, worst = [], [], []
            for i, doc in enumerate(docs):
                g, t = trial(s, doc, i, extra, a.stream_tokens)
                gaps += g
                worst.append(max(g))
                if t is not None:
                    ttfts.append(t)
            met = s.metrics()
        finally:
            s.stop()
        gs = sorted(gaps)
        r = {"largest_gap_s": max(gs), "per_trial_largest_gap_s": [round(x, 4) for x in worst], "median_gap_s": statistics.median(gs),
             "p99_gap_s": gs[min(len(gs) - 1, int(0.99 * len(gs)))], "gaps": len(gs),
             "turn2_time_s": [round(x, 4) for x in ttfts],
             "loop_restore_max_s": met.get("kvtc:loop_restore_seconds_max", 0.0), "restore_wait_max_s": met.get("kvtc:restore_wait_seconds_max", 0.0),
             "prefetch_used": met.get("kvtc:prefetch_used_total", 0.0), "restores": met.get("kvtc:loop_restores_total", 0.0)}
        out["modes"][name] = r
        print(f"{name}: largest gap {r['largest_gap_s']:.3f} s (per trial {r['per_trial_largest_gap_s']}), median {r['median_gap_s']:.3f}, "
              f"p99 {r['p99_gap_s']:.3f} over {r['gaps']}; turn 2 {r['turn2_time_s']}; loop restore max {r['loop_restore_max_s']:.3f} s, "
              f"wait max {r['restore_wait_max_s']:.3f} s", flush=True)
    out["seconds"] = round(time.time() - t_start, 1)
    with open(a.out_json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
