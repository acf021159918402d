#!/usr/bin/env python3
"""How many calibration tokens are enough (issue 30, item 3): each
calibration's reconstruction error on the same evaluation caches at several
nominal ratios, and the bytes it needs to reach the reference calibration's
error at 16x and at 32x (the DP, container version 1).

    python3 bench/calib_curve.py --model qwen --ref .deps/calib/qwen-160k.safetensors \
        --calib .deps/calib/qwen-8k.safetensors .deps/calib/qwen-16k.safetensors ... [--name calibration-qwen-curve]

Bytes at equal error: for each kind (K, V) the error of a calibration is
measured at ratios around the target and interpolated linearly in
log(error) over log(ratio) to the ratio r at which it equals the
reference's error at the target ratio T; it needs T / r as many bytes as the
reference (more than 1: worse). The captures are the evaluation documents
of bench/ratio.py (the first --docs-per-kind of each kind, first --tokens
tokens), made once under --work and shared by every calibration. Each
calibration's time comes from the `kvtc calibrate --json` summary kept
beside it (CAL.json), when there is one.

Writes bench/results/NAME.{md,json}. Only the standard library.
"""
import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import provenance  # noqa: E402
from provenance import safetensors_meta  # noqa: E402

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Ratios measured per calibration: around 16x and 32x, so that the ratio of
# equal error is interpolated between neighbours, not extrapolated.
RATIOS = [10, 12, 14, 16, 20, 24, 28, 32, 40]
TARGETS = [16, 32]


def run(kvtc, *args):
    p = subprocess.run([kvtc, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"kvtc {' '.join(args)} failed:\n{p.stderr}")
    return p.stdout


def errors(kvtc, calib, caps, work, coding="dp"):
    """{ratio: {"k": error, "v": error, "ratio": measured ratio on coded tokens}}: the mean of
    the captures' relative errors (equal token counts), and their bytes together."""
    out = {}
    for r in RATIOS:
        ek, ev, f16, stored = [], [], 0, 0
        for cap in caps:
            cont = os.path.join(work, "curve.kvtc")
            c = json.loads(run(kvtc, "compress", cap, "--calib", calib, "-r", str(r), "--coding", coding, "-o", cont, "--json"))
            e = json.loads(run(kvtc, "decompress", cont, "--calib", calib, "--reference", cap, "--json"))
            ek.append(e["rel_error_k"])
            ev.append(e["rel_error_v"])
            f16 += c["f16_bytes_compressed"]
            stored += c["stored_bytes_compressed"]
        out[r] = {"k": sum(ek) / len(ek), "v": sum(ev) / len(ev), "ratio": f16 / stored}
    return out


def ratio_at(curve, kind, target_err):
    """The nominal ratio at which `curve` reaches target_err for `kind`
    (log-log interpolation between the two measured ratios around it), or
    None outside the measured range."""
    pts = sorted((r, curve[r][kind]) for r in curve)
    for (r0, e0), (r1, e1) in zip(pts, pts[1:]):
        if min(e0, e1) <= target_err <= max(e0, e1) and e0 > 0 and e1 > 0 and e0 != e1:
            t = (math.log(target_err) - math.log(e0)) / (math.log(e1) - math.log(e0))
            return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvtc", default=os.path.join(TOP, "build", "kvtc"))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ref", required=True, help="the reference calibration (the full 160K-token one)")
    ap.add_argument("--calib", nargs="+", required=True, help="the calibrations to compare with it")
    ap.add_argument("--name", default="calibration-curve")
    ap.add_argument("--docs-per-kind", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--coding", choices=["dp", "ecsq"], default="dp", help="dp (container version 1) or the entropy-coded mode (version 2)")
    ap.add_argument("--work", default=os.path.join(TOP, "out", "bench-calib-curve"))
    ap.add_argument("--results", default=os.path.join(TOP, "bench", "results"))
    a = ap.parse_args()
    work = os.path.join(a.work, a.model)
    os.makedirs(work, exist_ok=True)
    docs = corpus.per_kind(a.docs_per_kind, a.tokens)
    caps = []
    for d in docs:
        cap = os.path.join(work, os.path.basename(d["file"]) + f".{a.tokens}.safetensors")
        if not os.path.exists(cap):
            print(f"[curve] capturing {d['id']}", file=sys.stderr, flush=True)
            run(a.kvtc, "capture", "--model", a.model, "--text", corpus.path(d), "--max-tokens", str(a.tokens), "-o", cap + ".part")
            os.replace(cap + ".part", cap)
        caps.append(cap)
    info = json.loads(run(a.kvtc, "info", "--json"))
    rows = []
    for calib in [a.ref] + a.calib:
        meta = safetensors_meta(calib)
        summary = os.path.splitext(calib)[0] + ".json"
        secs = None
        if os.path.exists(summary):
            with open(summary) as f:
                j = json.load(f)
            secs = {"total": j.get("seconds"), **(j.get("stage_seconds") or {})}
        print(f"[curve] {os.path.basename(calib)}", file=sys.stderr, flush=True)
        # A calibration's curve is kept under --work by its id, the coding,
        # the ratios and the captures: a rerun with one more calibration
        # measures only that one.
        key = json.dumps([meta.get("calibration_id"), a.coding, RATIOS, [os.path.basename(c) for c in caps], os.path.abspath(a.kvtc)])
        kept = os.path.join(work, "curve-" + hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
        if os.path.exists(kept):
            with open(kept) as f:
                curve = {int(r): v for r, v in json.load(f).items()}
        else:
            curve = errors(a.kvtc, calib, caps, work, a.coding)
            with open(kept + ".tmp", "w") as f:
                json.dump(curve, f)
            os.replace(kept + ".tmp", kept)
        rows.append({"calib": os.path.relpath(calib, TOP), "calibration_id": meta.get("calibration_id"),
                     "calib_tokens": int(meta.get("calib_tokens", 0)), "seconds": secs, "curve": curve})
    ref = rows[0]
    for row in rows:
        row["bytes_vs_ref"] = {}
        for t in TARGETS:
            for kind in ("k", "v"):
                r = ratio_at(row["curve"], kind, ref["curve"][t][kind])
                row["bytes_vs_ref"][f"{kind}@{t}"] = (t / r) if r else None
    cmd = (f"python3 bench/calib_curve.py --model {a.model} --ref {os.path.relpath(a.ref, TOP)} --calib "
           + " ".join(os.path.relpath(c, TOP) for c in a.calib) + f" --name {a.name}"
           + (f" --docs-per-kind {a.docs_per_kind}" if a.docs_per_kind != 1 else "") + (f" --tokens {a.tokens}" if a.tokens != 4096 else "") + (f" --coding {a.coding}" if a.coding != "dp" else "")
           + (f" --kvtc {os.path.relpath(a.kvtc, TOP)}" if os.path.abspath(a.kvtc) != os.path.join(TOP, "build", "kvtc") else ""))
    result = {"command": cmd, "commit": provenance.result_commit(TOP),
              "machine": f"{info['cpu']['brand']}, {os.cpu_count()} threads, {platform.system()} {platform.release()}; "
                         f"llama.cpp {info['llama_cpp_commit']} built for {info.get('llama_cpp_cpu', 'x86-64-v3')}",
              "documents": [d["id"] for d in docs], "tokens_per_document": a.tokens, "coding": a.coding, "ratios": RATIOS, "rows": rows}
    out = os.path.join(a.results, a.name)
    with open(out + ".json.tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(out + ".json.tmp", out + ".json")

    def pct(x):
        return "—" if x is None else f"{100 * (x - 1):+.1f}%"

    def mins(s):
        return "—" if not s or not s.get("total") else f"{s['total'] / 60:.1f} (prefill {s.get('prefill', 0) / 60:.1f})"

    L = ["# How many calibration tokens are enough: " + a.model, "",
         f"- command: `{cmd}`", f"- commit: {result['commit']}", f"- machine: {result['machine']}",
         f"- data: {len(docs)} evaluation documents (first {a.tokens} tokens each: "
         + ", ".join(d["id"] for d in docs) + "); "
         + ("the DP (container version 1), DEFLATE 6" if a.coding == "dp" else "the entropy-coded mode (container version 2, rANS, rate-controlled to each ratio)")
         + ", sink 4 and window 128 raw",
         f"- reference: {os.path.basename(a.ref)} ({ref['calib_tokens']:,} tokens, id {str(ref['calibration_id'])[:16]}…)", "",
         "Relative squared error on the coded tokens (K as stored, with RoPE and bias; V), mean over the documents, "
         "at nominal 16x and 32x; bytes at equal error: the bytes a calibration needs for the reference's error "
         "at 16x (32x), as a change from the reference's (log-log interpolation over the ratios "
         + ", ".join(map(str, RATIOS)) + "); minutes: the calibration's run on this machine (CAL.json).", "",
         "| calibration | tokens | minutes | K err 16x | V err 16x | K err 32x | V err 32x | bytes, K @16x | bytes, V @16x | bytes, K @32x | bytes, V @32x |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda x: x["calib_tokens"]):
        c, b = row["curve"], row["bytes_vs_ref"]
        L.append(f"| {os.path.basename(row['calib'])} | {row['calib_tokens']:,} | {mins(row['seconds'])} | {c[16]['k']:.5f} | {c[16]['v']:.4f} | "
                 f"{c[32]['k']:.5f} | {c[32]['v']:.4f} | {pct(b['k@16'])} | {pct(b['v@16'])} | {pct(b['k@32'])} | {pct(b['v@32'])} |")
    with open(out + ".md.tmp", "w") as f:
        f.write("\n".join(L) + "\n")
    os.replace(out + ".md.tmp", out + ".md")
    print(f"wrote {out}.md", file=sys.stderr)


if __name__ == "__main__":
    main()
