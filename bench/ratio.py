#!/usr/bin/env python3
"""Compression ratio and reconstruction error of kvtc on evaluation-corpus
caches, and the bits-per-component plots (the paper's Figure 6).

    python3 bench/ratio.py --calib CAL.safetensors [--docs-per-kind 2] [--tokens 4096]
                           [--model NAME_OR_GGUF] [--name ratio]

Writes bench/results/NAME.md, bench/results/NAME.json (with the
calibration's bits per component, `bits_per_component`) and
bench/results/bits_per_component_{keys,values}.png (NAME ratio) or
NAME_bits_{keys,values}.png. Only the standard
library here; the PNGs are drawn from ratio.json by bench/plots.py
(matplotlib), which this script runs.
"""
import argparse
import json
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import provenance  # noqa: E402
from provenance import safetensors_meta  # noqa: E402

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIOS = [8, 16, 32, 64]


def run(kvtc, *args):
    p = subprocess.run([kvtc, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"kvtc {' '.join(args)} failed:\n{p.stderr}")
    return p.stdout


QTYPES = {1: ("int2", 2), 2: ("int4", 4), 3: ("fp8", 8)}  # table block type -> (name, code bits); 0: dropped


def bit_runs(table):
    """The coded components of a DP table as runs of one type:
    [{from, to, type, bits_per_component}] (as `kvtc-lab analyze` writes them)."""
    runs = []
    for start, size, typ in sorted(table["blocks"]):
        if typ == 0:
            continue
        name, bits = QTYPES[typ]
        if runs and runs[-1]["type"] == name and runs[-1]["to"] == start:
            runs[-1]["to"] = start + size
        else:
            runs.append({"from": start, "to": start + size, "type": name, "bits_per_component": bits})
    return runs


def bits_per_component(cal_meta):
    """ratio.json's bits_per_component: per kind, the calibration's DP table
    for each nominal ratio it holds, as runs (bench/plots.py bits draws them)."""
    out = {"source": "the calibration's DP tables ({k,v}.info tables)"}
    for kind, name in (("k", "keys"), ("v", "values")):
        cinfo = json.loads(cal_meta[f"{kind}.info"])
        out[name] = {"components": cinfo["r"],
                     "ratios": {str(r): bit_runs(cinfo["tables"][str(r)]) for r in RATIOS if str(r) in cinfo["tables"]}}
    return out


def calib_summary(calib):
    """The `kvtc calibrate --json` summary the make targets keep beside a calibration (CAL.json), or None."""
    path = os.path.splitext(calib)[0] + ".json"
    try:
        with open(path) as f:
            return path, json.load(f)
    except (OSError, ValueError):
        return path, None


def calib_heldout(calib):
    """{nominal: (K error, V error)} held-out, block 0, from CAL.json."""
    _, j = calib_summary(calib)
    out = {}
    for b in (j or {}).get("blocks", []):
        if b.get("block") == 0:
            for r, x in b.get("ratios", {}).items():
                out.setdefault(r, [None, None])[0 if b["kind"] == "keys" else 1] = x["heldout_relative_error"]
    return {r: v for r, v in out.items() if None not in v}


def calib_run_lines(calib):
    """How long the calibration took, from the `kvtc calibrate --json` summary
    the make targets keep beside it (CAL.json), when there is one."""
    path, j = calib_summary(calib)
    if not j:
        return []
    st = j.get("stage_seconds") or {}
    total = j.get("seconds")
    if not total:
        return []
    parts = ", ".join(f"{k} {v / 60:.1f} min ({100 * v / total:.0f}%)" for k, v in sorted(st.items(), key=lambda kv: -kv[1]))
    return [f"- calibration run ({os.path.relpath(path, TOP)}): {total / 60:.1f} min" + (f": {parts}" if parts else "")
            + " — prefill is the model's forward pass over the documents, stream the covariance updates, pca the eigendecompositions, held-out errors and DP tables"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvtc", default=os.path.join(TOP, "build", "kvtc"))
    ap.add_argument("--calib", required=True)
    ap.add_argument("--model", default="smollm2", help="GGUF model: a path or a name (smollm2, gemma3, qwen); the calibration's")
    ap.add_argument("--name", default="ratio", help="result name: bench/results/NAME.{md,json}")
    ap.add_argument("--docs-per-kind", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--work", default=os.path.join(TOP, "out", "bench-ratio"))
    ap.add_argument("--results", default=os.path.join(TOP, "bench", "results"))
    a = ap.parse_args()
    if a.name != "ratio":
        a.work = os.path.join(a.work, a.name)
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.results, exist_ok=True)
    docs = corpus.per_kind(a.docs_per_kind, a.tokens)
    info = json.loads(run(a.kvtc, "info", "--json"))
    cal_meta = safetensors_meta(a.calib)
    bits = bits_per_component(cal_meta)
    rows = {r: {"f16_coded": 0, "stored_coded": 0, "payload_coded": 0, "f16_all": 0, "file": 0, "ek": [], "ev": [], "per_kind": {}} for r in RATIOS}
    for d in docs:
        cap = os.path.join(a.work, os.path.basename(d["file"]) + f".{a.tokens}.safetensors")
        if not os.path.exists(cap):
            run(a.kvtc, "capture", "--model", a.model, "--text", corpus.path(d), "--max-tokens", str(a.tokens), "-o", cap)
        for r in RATIOS:
            out = os.path.join(a.work, f"c{r}.kvtc")
            c = json.loads(run(a.kvtc, "compress", cap, "--calib", a.calib, "-r", str(r), "-o", out, "--json"))
            e = json.loads(run(a.kvtc, "decompress", out, "--calib", a.calib, "--reference", cap, "--json"))
            row = rows[r]
            row["f16_coded"] += c["f16_bytes_compressed"]
            row["stored_coded"] += c["stored_bytes_compressed"]
            row["payload_coded"] += c["payload_bytes_compressed"]
            row["file"] += c["bytes"]
            row["f16_all"] += c["f16_bytes_all"]
            row["ek"].append(e["rel_error_k"])
            row["ev"].append(e["rel_error_v"])
            row["per_kind"].setdefault(d["kind"], []).append(c["ratio_compressed_tokens"])
            row.setdefault("per_kind_err", {}).setdefault(d["kind"], []).append((e["rel_error_k"], e["rel_error_v"]))
        print(f"[ratio] {d['id']}: done", file=sys.stderr)

    # DEFLATE level: size and encode time at 16x on the first document.
    levels = []
    cap0 = os.path.join(a.work, os.path.basename(docs[0]["file"]) + f".{a.tokens}.safetensors")
    for lv in (0, 1, 3, 6, 9, 12):
        c = json.loads(run(a.kvtc, "compress", cap0, "--calib", a.calib, "-r", "16", "--level", str(lv), "-o", os.path.join(a.work, "lv.kvtc"), "--json"))
        levels.append({"level": lv, "ratio_compressed_tokens": c["ratio_compressed_tokens"], "encode_ms": c["encode_ms"]})

    cmd = "python3 bench/ratio.py --calib " + os.path.relpath(a.calib, TOP) + f" --docs-per-kind {a.docs_per_kind} --tokens {a.tokens}"
    if a.model != "smollm2" or a.name != "ratio":
        cmd += f" --model {a.model} --name {a.name}"
    result = {"command": cmd, "commit": provenance.result_commit(TOP), "machine": f"{info['cpu']['brand']}, {os.cpu_count()} threads, {platform.system()} {platform.release()}",
              "calibration_id": cal_meta.get("calibration_id"), "calib_tokens": cal_meta.get("calib_tokens"), "documents": [d["id"] for d in docs],
              "tokens_per_document": a.tokens, "deflate_levels": levels, "ratios": []}
    for r in RATIOS:
        row = rows[r]
        result["ratios"].append({
            "nominal": r,
            "ratio_compressed_tokens": row["f16_coded"] / row["stored_coded"],
            "ratio_before_deflate": row["f16_coded"] / row["payload_coded"],
            "ratio_whole_cache": row["f16_all"] / row["file"],
            "rel_error_k": sum(row["ek"]) / len(row["ek"]),
            "rel_error_v": sum(row["ev"]) / len(row["ev"]),
            "per_kind_ratio_compressed_tokens": {k: sum(v) / len(v) for k, v in row["per_kind"].items()},
            "per_kind_rel_error": {k: {"k": sum(x[0] for x in v) / len(v), "v": sum(x[1] for x in v) / len(v)} for k, v in row["per_kind_err"].items()},
        })
    result["bits_per_component"] = bits
    rjson = os.path.join(a.results, f"{a.name}.json")
    with open(rjson + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(rjson + ".tmp", rjson)

    # Figure 6: bits per component from the calibration's tables, drawn from the JSON.
    p = subprocess.run([sys.executable, os.path.join(TOP, "bench", "plots.py"), "bits", rjson, a.results])
    if p.returncode != 0:
        sys.exit("bench/plots.py bits failed (see above)")
    png = {k: f"bits_per_component_{k}.png" for k in ("keys", "values")}
    if a.name != "ratio":  # plots.py writes the fixed names; keep ratio.md's figures
        for k in png:
            os.replace(os.path.join(a.results, png[k]), os.path.join(a.results, f"{a.name}_bits_{k}.png"))
            png[k] = f"{a.name}_bits_{k}.png"

    p_features = json.loads(cal_meta["k.info"])["p"]
    L = [
        "# kvtc compression ratio on evaluation-corpus caches",
        "",
        f"- command: `{cmd}`",
        f"- commit: {result['commit']}",
        f"- machine: {result['machine']}",
        f"- model: {cal_meta.get('model_name', cal_meta.get('arch', '?'))} (p = {p_features:,} features per token for K and for V)",
        f"- calibration: {cal_meta.get('calib_tokens')} tokens from {cal_meta.get('calib_documents')} calibration documents, "
        f"{cal_meta.get('heldout_tokens')} held-out tokens, id {str(cal_meta.get('calibration_id'))[:16]}…",
    ] + calib_run_lines(a.calib) + [
        f"- data: {len(docs)} evaluation documents ({a.docs_per_kind} per kind: prose, docs, code, math), first {a.tokens} tokens each; "
        "sink 4 and window 128 tokens raw; DEFLATE level 6",
        "",
        "| nominal | measured, coded tokens | measured, whole cache | rel. error K | rel. error V | prose | docs | code | math |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in result["ratios"]:
        pk = x["per_kind_ratio_compressed_tokens"]
        L.append(f"| {x['nominal']}x | {x['ratio_compressed_tokens']:.2f}x | {x['ratio_whole_cache']:.2f}x | {x['rel_error_k']:.4f} | {x['rel_error_v']:.4f} | "
                 + " | ".join(f"{pk.get(k, 0):.1f}x" for k in ("prose", "docs", "code", "math")) + " |")
    L += [
        "",
        "Relative error: ||x − x̂||² / ||x||² over the coded (non-raw) tokens, K and V as llama.cpp stores",
        "them (keys with RoPE). Whole cache: all tokens' f16 K+V over the container's bytes (raw sink and",
        f"window tokens included; they weigh more at shorter contexts). The ratio is fixed by the DP table,",
        "so the kinds differ only by what DEFLATE finds; they differ in error (and beside them the",
        "calibration's held-out error, from CAL.json: the same squared error over the variance — mean",
        "removed, keys without RoPE — which a large constant part of the keys, as Qwen2's K bias gives,",
        "does not dilute):",
        "",
        "| nominal | " + " | ".join(f"{k}: error K / V" for k in ("prose", "docs", "code", "math")) + " | calibration held-out K / V |",
        "|---|---|---|---|---|---|",
    ]
    held = calib_heldout(a.calib)
    for x in result["ratios"]:
        pe = x["per_kind_rel_error"]
        h = held.get(str(x["nominal"]))
        L.append(f"| {x['nominal']}x | " + " | ".join(f"{pe[k]['k']:.4f} / {pe[k]['v']:.4f}" if k in pe else "–" for k in ("prose", "docs", "code", "math"))
                 + (f" | {h[0]:.4f} / {h[1]:.4f} |" if h else " | – |"))
    L += [
        "",
        "## Ratio by stage (coded tokens; the paper's Figure 2)",
        "",
        "| nominal | quantization alone (FP8 E4M3, one f16 scale per 64 values) | + PCA and DP (packed, before DEFLATE) | + DEFLATE (measured) |",
        "|---|---|---|---|",
    ]
    for x in result["ratios"]:
        L.append(f"| {x['nominal']}x | {16 / (8 + 16 / 64):.2f}x | {x['ratio_before_deflate']:.2f}x | {x['ratio_compressed_tokens']:.2f}x |")
    L += [
        "",
        "The first column is by construction (16 bits against 8 + 16/64), the other two are measured",
        "bytes (section headers included). Before DEFLATE the packed size sits just under the DP budget",
        "(the budget is an upper bound); DEFLATE then gains on the parameters and on the low-entropy codes.",
        "",
        "## DEFLATE level (16x, first document)",
        "",
        "| level | measured ratio, coded tokens | encode ms (whole container, this machine) |",
        "|---|---|---|",
    ] + [f"| {x['level']} | {x['ratio_compressed_tokens']:.2f}x | {x['encode_ms']:.0f} |" for x in levels] + [
        "",
        "Level 0 stores the packed planes as they are. The default is 6; issue 5 revisits the choice",
        "with the codec's timing broken down by stage.",
        "",
        "## Bits per component (the paper's Figure 6)",
        "",
        "From the calibration's DP tables: code bits per principal component (0 = dropped), by nominal ratio.",
        "",
        f"![keys]({png['keys']})",
        "",
        f"![values]({png['values']})",
    ]
    rmd = os.path.join(a.results, f"{a.name}.md")
    with open(rmd + ".tmp", "w") as f:
        f.write("\n".join(L) + "\n")
    os.replace(rmd + ".tmp", rmd)
    print("\n".join(L[9:16]))


if __name__ == "__main__":
    main()
