#!/usr/bin/env python3
"""kvtc under a context's own RoPE settings (--rope-freq-base, YaRN): the KL
of the next-token distributions over a teacher-forced continuation, restored
cache against the uncompressed one, with the keys' rotation removed as the
GGUF states it (kv_settings=None: what kvtc did before) and as the context
applies it (kv_settings=context_kv_settings(llm)). One context per setting,
the same state coded both ways: the two rows differ only by the RoPE removed.

With --fit-tokens N, the other question: does a calibration fitted under
the context's settings (`kvtc calibrate --rope-*`) code its keys better
than one fitted under the GGUF's? Two calibrations of N tokens each per
setting, fitted alike but for the flags; the context's RoPE removed in
both: the rows differ only by the RoPE the calibration's keys had.

Usage: .deps/venv/bin/python bench/rope_settings.py [--docs N] [--out bench/results/rope-settings]
       .deps/venv/bin/python bench/rope_settings.py --fit-tokens 16000   (-> bench/results/rope-settings-calib)
(make python first; LLAMA_CPP_LIB_PATH=.deps/llama-shared as scripts/python_env.sh sets it)."""
import argparse, json, os, platform, subprocess, sys, time
import numpy as np
import kvtc, llama_cpp
from kvtc.llama_cpp import context_kv_settings

ap = argparse.ArgumentParser()
ap.add_argument("--docs", type=int, default=4)
ap.add_argument("--prefix", type=int, default=2048)
ap.add_argument("--cont", type=int, default=128)
ap.add_argument("--calib", default=".deps/calib/smollm2-160k.safetensors")
ap.add_argument("--model", default=".deps/models/SmolLM2-135M-Instruct.Q4_1.gguf")
ap.add_argument("--out", default=None)
ap.add_argument("--fit-tokens", type=int, default=0, help="fit calibrations of N tokens per setting (kvtc calibrate) instead")
ap.add_argument("--kvtc", default="build/kvtc")
a = ap.parse_args()
a.out = a.out or ("bench/results/rope-settings-calib" if a.fit_tokens else "bench/results/rope-settings")
# (label, llama-cpp-python's arguments, kvtc calibrate's flags: the same settings)
SETTINGS = [("the GGUF's (none)", {}, []),
            ("--rope-freq-base 20000", dict(rope_freq_base=20000), ["--rope-freq-base", "20000"]),
            ("--rope-scaling yarn --rope-scale 2 --yarn-orig-ctx 2048",
             dict(rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN, rope_freq_scale=0.5, yarn_orig_ctx=2048),
             ["--rope-scaling", "yarn", "--rope-scale", "2", "--yarn-orig-ctx", "2048"])]


def fitted(flags):
    """A calibration of --fit-tokens tokens fitted under `flags` (cached in .deps/calib/)."""
    slug = "-".join(f.strip("-") for f in flags) or "gguf"
    path = f".deps/calib/rope-{slug}-{a.fit_tokens}.safetensors"
    if not os.path.exists(path):
        subprocess.run([a.kvtc, "calibrate", "-m", a.model, "--tokens", str(a.fit_tokens), "--heldout", "2048", "--doc-tokens", "2048",
                        *flags, "-o", path], check=True, stdout=subprocess.DEVNULL)
    return path


if a.fit_tokens:  # per setting: (label, calibration, kv_settings of the context or None), the context's RoPE removed in both
    plain = fitted([])
    CODINGS = {label: [("fitted under the GGUF's RoPE", plain, True), ("fitted under the context's", fitted(flags), True)]
               for label, _, flags in SETTINGS}
else:  # one calibration, the GGUF's RoPE removed (kvtc before) or the context's
    CODINGS = {label: [("GGUF's", a.calib, False), ("context's", a.calib, True)] for label, _, _ in SETTINGS}
cals = {p: kvtc.Calibration.load(p) for c in CODINGS.values() for _, p, _ in c}
docs = []
for kind in ("prose", "docs", "code", "math"):  # one evaluation document per kind, long enough
    for p in sorted(os.listdir(f".deps/corpus/eval/{kind}")):
        path = f".deps/corpus/eval/{kind}/{p}"
        if os.path.getsize(path) > 6 * (a.prefix + a.cont):
            docs.append(path)
            break
docs = docs[:a.docs]

def lsm(x):
    x = x - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))

rows = []
t0 = time.time()
for label, kw, _ in SETTINGS:
    llm = llama_cpp.Llama(a.model, n_ctx=4096, n_batch=512, logits_all=True, verbose=False, n_threads=os.cpu_count(), **kw)
    ks = context_kv_settings(llm)
    for path in docs:
        toks = llm.tokenize(open(path).read().encode())[:a.prefix + a.cont]
        pre, cont = toks[:a.prefix], toks[a.prefix:]
        llm.reset(); llm.eval(pre); st = llm.save_state()
        llm.eval(cont); ref = lsm(np.array(llm.scores[a.prefix:a.prefix + len(cont)], dtype=np.float64))
        for removed, cal_path, context in CODINGS[label]:
            cal = cals[cal_path]
            for ratio in (16, 32):
                data = cal.compress_state(st.llama_state, ratio=ratio, kv_settings=ks if context else None)
                blob = cal.decompress_state(data)
                llm.load_state(llama_cpp.LlamaState(st.input_ids, st.scores, st.n_tokens, bytes(blob), len(blob), st.seed))
                llm.eval(cont)
                got = lsm(np.array(llm.scores[a.prefix:a.prefix + len(cont)], dtype=np.float64))
                kl = float((np.exp(ref) * (ref - got)).sum(1).mean())
                rows.append(dict(setting=label, removed=removed, ratio=ratio, doc=os.path.basename(path), kl=kl, bytes=len(data)))
                print(f"{label:58s} {removed:9s} {ratio}x {os.path.basename(path)[:32]:32s} KL {kl:.4f}", flush=True)
    del llm

commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
run = f"commit {commit}{' (with uncommitted changes)' if dirty else ''}, {cpu}, {os.cpu_count()} threads"
cmd = "LLAMA_CPP_LIB_PATH=.deps/llama-shared .deps/venv/bin/python bench/rope_settings.py" + (f" --docs {a.docs}" if a.docs != 4 else "") + \
    (f" --fit-tokens {a.fit_tokens}" if a.fit_tokens else "")
json.dump(dict(command=cmd, run=run, docs=[os.path.basename(d) for d in docs], prefix=a.prefix, continuation=a.cont, rows=rows,
               calibrations={label: [(name, p) for name, p, _ in c] for label, c in CODINGS.items()}),
          open(a.out + ".json", "w"), indent=1)
L = [f"# kvtc under a context's RoPE settings" + (": a calibration fitted under them" if a.fit_tokens else ""), "",
     f"- command: `{cmd}` ({time.time() - t0:.0f} s)", f"- run: {run}"]
if a.fit_tokens:
    L += [f"- model: SmolLM2-135M-Instruct Q4_1; per setting two calibrations of {a.fit_tokens} tokens (held out 2048, documents of at most "
          f"2048 tokens, `kvtc calibrate` at this commit): one fitted under the GGUF's RoPE (the same file for every setting), one with the "
          f"context's flags (`kvtc calibrate --rope-*`); the context's RoPE removed in both (what kvtc does now)"]
else:
    L += [f"- model: SmolLM2-135M-Instruct Q4_1, calibration `{a.calib}` (fitted under the GGUF's RoPE)"]
L += [f"- {len(docs)} evaluation documents (one per corpus kind): {', '.join(os.path.basename(d) for d in docs)}; "
      f"{a.prefix}-token prefix coded, KL (nats per token) of the next {a.cont} tokens teacher-forced, against the same context uncompressed"]
if not a.fit_tokens:
    L += ["- RoPE removed: the GGUF's (kvtc before: the geometry from the model file) or the context's (kvtc::geometry_with_settings "
          "of the context's resolved settings, what kvtc-server, KvtcCache and kvtc capture do now); the same state coded both ways"]
first, second = (("calibration fitted under the GGUF's RoPE", "fitted under the context's") if a.fit_tokens
                 else ("GGUF's RoPE removed", "context's RoPE removed"))
L += ["", f"| context's RoPE | ratio | KL, {first} | KL, {second} | per document (first / second) |", "|---|---|---|---|---|"]
for label, _, _ in SETTINGS:
    n1, n2 = (c[0] for c in CODINGS[label])
    for ratio in (16, 32):
        g = [r["kl"] for r in rows if r["setting"] == label and r["ratio"] == ratio and r["removed"] == n1]
        c = [r["kl"] for r in rows if r["setting"] == label and r["ratio"] == ratio and r["removed"] == n2]
        per = ", ".join(f"{x:.4f} / {y:.4f}" for x, y in zip(g, c))
        L.append(f"| {label} | {ratio}x | {np.mean(g):.4f} | {np.mean(c):.4f} | {per} |")
open(a.out + ".md", "w").write("\n".join(L) + "\n")
print("\n".join(L))
