#!/usr/bin/env python3
"""The Python package's benchmark (issue 15): bench/results/python.{md,json}.

    make bench-python      (= .deps/venv/bin/python bench/python_bench.py --calib CAL)

1. The binding's overhead: kvtc.Calibration.compress / decompress on an
   8K-token SmolLM2 cache (the evaluation split's longest document, as
   `kvtc-lab bench` takes it), best of --repeat in one process, against the
   C++ codec on the same text measured by `kvtc-lab bench` the same way.
2. KvtcCache against llama-cpp-python's LlamaRAMCache at the same byte
   budget: --chats conversations of one evaluation document each take
   --turns turns round-robin through one Llama (as on a server with one
   slot); each turn extends its conversation. Time to first token (streamed)
   per turn, hits, entries held, RAM held; and the same workload with no cache.
A hit is a restored state that keeps at least 25% of the prompt (the rule
KvtcCache's store applies; LlamaRAMCache answers any shared first token).
Run it on an otherwise idle machine: the figures are wall times.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TOP, "bench"))
import corpus  # noqa: E402
import provenance  # noqa: E402

os.environ.setdefault("LLAMA_CPP_LIB_PATH", os.path.join(TOP, ".deps", "llama-shared"))
import numpy as np  # noqa: E402
import llama_cpp  # noqa: E402
import llama_cpp.llama_cache  # noqa: E402

import kvtc  # noqa: E402
from kvtc.llama_cpp import KvtcCache  # noqa: E402

SMOL = os.path.join(TOP, ".deps", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def run(*cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    return p.stdout


def read_capture(path):
    import struct
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    data = raw[8 + n:]

    def tensor(name, dtype):
        b, e = head[name]["data_offsets"]
        return np.frombuffer(data[b:e], dtype=dtype).reshape(head[name]["shape"])

    return tensor("k", np.float16), tensor("v", np.float16), tensor("pos", np.int32)


def best_ms(n, fn):
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def overhead(a, work):
    longest = max(corpus.documents("eval"), key=lambda d: d["tokens"])
    cap = os.path.join(work, f"longest.{a.tokens}.safetensors")
    if not os.path.exists(cap):
        run(os.path.join(TOP, "build", "kvtc"), "capture", "-m", SMOL, "--text", corpus.path(longest), "--max-tokens",
            str(a.tokens), "--ctx", str(a.tokens + 16), "-o", cap)
    cpp = json.loads(run(os.path.join(TOP, "build", "kvtc-lab"), "bench", "--calib", a.calib, "--context", str(a.tokens), "-r", "16",
                         "--repeat", str(a.repeat), "--json"))
    row = next(r for r in cpp["contexts"][0]["ratios"] if r["nominal_ratio"] == 16)
    cal = kvtc.Calibration.load(a.calib)
    k, v, pos = read_capture(cap)
    kf, vf = k.astype(np.float32), v.astype(np.float32)
    out = {}
    data = cal.compress(k, v, pos)  # warm: allocation table, thread pools, oneDNN kernels
    out["py_compress_ms"] = best_ms(a.repeat, lambda: cal.compress(k, v, pos))
    out["py_compress_f32_ms"] = best_ms(a.repeat, lambda: cal.compress(kf, vf, pos))
    held = [None]

    def dec():
        held[0] = None  # free the previous output first, as kvtc-lab bench does
        held[0] = cal.decompress(data)

    out["py_decompress_ms"] = best_ms(a.repeat, dec)
    held[0] = None
    out["py_decompress_f32_ms"] = best_ms(a.repeat, lambda: cal.decompress(data, dtype="float32"))
    out["cpp_compress_ms"] = row["compress_ms"]
    out["cpp_decompress_ms"] = row["decompress_ms"]
    out["precision"] = row["precision"]
    out["document"] = longest["id"]
    out["tokens"] = a.tokens
    out["repeat"] = a.repeat
    out["raw_mb"] = k.nbytes * 2 / 1e6
    out["container_mb"] = len(data) / 1e6
    return out


class CountingRAMCache(llama_cpp.llama_cache.LlamaRAMCache):
    """LlamaRAMCache with its lookups counted. It answers any lookup that
    shares a first token with a stored prompt (BOS alone); a hit here is a
    state that keeps at least 25% of the prompt, KvtcCache's rule, and the
    tokens it keeps are counted."""

    def __init__(self, capacity_bytes):
        super().__init__(capacity_bytes)
        self.hits = self.misses = self.tokens_restored = 0

    def __getitem__(self, key):
        try:
            v = super().__getitem__(key)
        except KeyError:
            self.misses += 1
            raise
        kept = llama_cpp.Llama.longest_token_prefix(v.input_ids[: v.n_tokens].tolist(), list(key))
        if kept >= len(key) / 4:
            self.hits += 1
            self.tokens_restored += kept
        else:
            self.misses += 1
        return v


def workload(a, kind, budget):
    llm = llama_cpp.Llama(SMOL, n_ctx=a.n_ctx, n_threads=a.threads or os.cpu_count(), seed=1, verbose=False)
    cache = None
    if kind == "kvtc":
        cache = KvtcCache(a.calib, llm, capacity_bytes=budget, ratio=16, entropy_coded=False)  # the DP, as python.md measured
    elif kind == "ram":
        cache = CountingRAMCache(budget)
    if cache is not None:
        llm.set_cache(cache)
    docs = corpus.documents("eval", min_tokens=a.doc_tokens + 600)[: a.chats]
    chats = []
    for d in docs:
        with open(corpus.path(d)) as f:
            text = f.read()
        ids = llm.tokenize(text.encode())[: a.doc_tokens]
        chats.append(llm.detokenize(ids).decode(errors="ignore") + "\n\nQuestion: What is this text about?\nAnswer:")
    ttft = {t: [] for t in range(a.turns)}
    t_all = time.perf_counter()
    for turn in range(a.turns):
        for i in range(len(chats)):
            t = time.perf_counter()
            first = None
            text = ""
            for chunk in llm(chats[i], max_tokens=a.answer_tokens, temperature=0, stream=True):
                if first is None:
                    first = time.perf_counter() - t
                text += chunk["choices"][0]["text"]
            ttft[turn].append(first * 1e3)
            chats[i] += text + "\nQuestion: And then?\nAnswer:"
    wall = time.perf_counter() - t_all
    r = {"cache": kind, "budget_mb": budget / 2**20 if budget else None, "wall_s": wall,
         "ttft_ms_turn1": statistics.median(ttft[0]), "ttft_ms_later": statistics.median([x for t in range(1, a.turns) for x in ttft[t]]),
         "ttft_ms_later_mean": statistics.mean([x for t in range(1, a.turns) for x in ttft[t]])}
    if kind == "kvtc":
        cache.flush()
        s = cache.stats()
        r.update(entries=s["entries"], hits=s["hits_ram"] + s["hits_pending"], misses=s["misses"], held_mb=s["ram_bytes"] / 2**20,
                 restore_ms_total=s["restore_ms"], tokens_restored=s["tokens_restored"])
        cache.close()
    elif kind == "ram":
        r.update(entries=len(cache.cache_state), hits=cache.hits, misses=cache.misses, held_mb=cache.cache_size / 2**20,
                 tokens_restored=cache.tokens_restored)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--budgets-mb", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--work", default=os.path.join(TOP, "out", "bench-python"))
    ap.add_argument("--results", default=os.path.join(TOP, "bench", "results"))
    ap.add_argument("--parts", nargs="+", choices=["overhead", "workload"], default=["overhead", "workload"],
                    help="what to measure; a part not measured is kept from the existing python.json, with its own command and commit")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    cmd = (f".deps/venv/bin/python bench/python_bench.py --calib {os.path.relpath(a.calib, TOP)} --tokens {a.tokens} --repeat {a.repeat} "
           f"--chats {a.chats} --turns {a.turns} --doc-tokens {a.doc_tokens} --budgets-mb {' '.join(map(str, a.budgets_mb))}")
    info = kvtc.library_info()
    res = {"command": cmd, "commit": provenance.result_commit(TOP),
           "machine": f"{info['cpu']}, {os.cpu_count()} threads, {platform.system()} {platform.release()}",
           "python": platform.python_version(), "numpy": np.__version__, "llama_cpp_python": llama_cpp.__version__}
    old = {}
    if os.path.exists(os.path.join(a.results, "python.json")):
        with open(os.path.join(a.results, "python.json")) as f:
            old = json.load(f)
    run_of = {"command": cmd + (" --parts " + " ".join(a.parts) if a.parts != ["overhead", "workload"] else ""), "commit": res["commit"]}
    for part in ("overhead", "workload"):
        if part in a.parts:
            continue
        if part not in old:
            sys.exit(f"bench/python_bench.py: no {part} in {a.results}/python.json to keep; measure it (--parts {part})")
        res[part] = old[part]
        res[part + "_run"] = old.get(part + "_run", {"command": old["command"], "commit": old["commit"]})
    if "overhead" in a.parts:
        res["overhead"] = overhead(a, a.work)
        res["overhead_run"] = run_of
        print("[python-bench] overhead done", file=sys.stderr)
    if "workload" in a.parts:
        res["workload"] = [workload(a, "none", 0)]
        for mb in a.budgets_mb:
            for kind in ("ram", "kvtc"):
                res["workload"].append(workload(a, kind, mb << 20))
                print(f"[python-bench] {kind} {mb} MB done", file=sys.stderr)
        res["workload_run"] = run_of

    o = res["overhead"]
    md = ["# The Python package: binding overhead, and KvtcCache against LlamaRAMCache", "",
          f"- commands: binding overhead `{res['overhead_run']['command']}` at commit {res['overhead_run']['commit']}; "
          f"workload `{res['workload_run']['command']}` at commit {res['workload_run']['commit']}", f"- machine: {res['machine']}",
          f"- Python {res['python']}, numpy {res['numpy']}, llama-cpp-python {res['llama_cpp_python']} (over the pinned llama.cpp), "
          f"SmolLM2-135M-Instruct Q4_1, calibration `{os.path.basename(a.calib)}`", "",
          f"## Binding overhead ({o['tokens']} tokens of `{o['document']}`, {o['raw_mb']:.1f} MB of f16 K+V, 16x, {o['precision']} projection, "
          f"best of {o.get('repeat', 5)})", "",
          "| | C++ (`kvtc-lab bench`) ms | Python ms | overhead |", "|---|---|---|---|"]
    for op in ("compress", "decompress"):
        c, p = o[f"cpp_{op}_ms"], o[f"py_{op}_ms"]
        md.append(f"| {op} (f16 arrays) | {c:.0f} | {p:.0f} | {100 * (p / c - 1):+.1f}% |")
        p32 = o[f"py_{op}_f32_ms"]
        md.append(f"| {op} (f32 arrays) | {c:.0f} | {p32:.0f} | {100 * (p32 / c - 1):+.1f}% |")
    md += ["", "Python times include reading the arrays into the library's layout (f32 input: narrowing to f16) and making the "
           "bytes or the numpy arrays; the C++ times are `kvtc::compress` / `kvtc::decompress` alone.", "",
           "## KvtcCache against LlamaRAMCache (conversations of one evaluation document each, taking turns round-robin through one "
           "Llama; sizes in the workload command)", "",
           "| cache | budget MiB | entries held | held MiB | hits | misses | tokens restored | TTFT turn 1 (median ms) | TTFT later turns (median / mean ms) | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["workload"]:
        name = {"none": "none", "ram": "LlamaRAMCache", "kvtc": "KvtcCache (16x)"}[r["cache"]]
        held = (f"{r['budget_mb']} | {r['entries']} | {r['held_mb']:.1f} | {r['hits']} | {r['misses']} | {r['tokens_restored']}"
                if "hits" in r else "- | - | - | - | - | -")  # no cache: nothing held
        md.append(f"| {name} | {held} | {r['ttft_ms_turn1']:.0f} | {r['ttft_ms_later']:.0f} / {r['ttft_ms_later_mean']:.0f} | {r['wall_s']:.1f} |")
    with open(os.path.join(a.results, "python.json"), "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    notes = os.path.join(TOP, "bench", "python-notes.md")  # the reading, written by hand after a run
    if os.path.exists(notes):
        with open(notes) as f:
            md += ["", f.read().rstrip()]
    with open(os.path.join(a.results, "python.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {os.path.join(a.results, 'python.md')}")


if __name__ == "__main__":
    main()
