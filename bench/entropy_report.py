#!/usr/bin/env python3
"""bench/results/entropy.md and entropy.png from the bench/entropy.py JSONs
(and, when present, the equal-bytes quality run bench/results/entropy-quality.json
of `kvtc-lab eval`).

    python3 bench/entropy_report.py [LABEL=JSON ...]

Default: SmolLM2-135M=bench/results/entropy-smollm2.json and
Qwen2.5-Coder-1.5B=bench/results/entropy-qwen.json (those that exist).
The reading lives in bench/entropy-notes.md, appended as is.
"""
import json
import os
import subprocess
import sys

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(TOP, "bench", "results")


def pct(x):
    return "—" if x is None else f"{100 * x:.1f}%"


def ratio(x):
    return "—" if x is None else f"{x:.2f}x"


def model_section(label, r):
    out = [f"## {label}", "",
           f"- command: `{r['command']}`", f"- commit: {r['commit']}", f"- machine: {r['machine']}",
           f"- calibration: {r['calibration']}; documents: {', '.join(r['documents'])} (first {r['tokens']} tokens each, sink 4 and window 128 raw)", ""]
    variants = [v for v in sorted({p["variant"] for p in r["pooled"]}) if v != "dp"]
    variants.sort(key=lambda v: v != "ecsq")
    names = {"ecsq": "ecsq (rounding 0.35, the default)", "r50": "ecsq, rounding 0.5"}
    out += ["Equal error, per kind: at each DP point, the ratio on coded tokens at which the entropy-coded mode has the same",
            "relative squared error (log-log interpolation between its two nearest rate-controlled points), and the bytes it saves",
            "there (1 − DP bytes / ecsq bytes).", ""]
    head = "| DP nominal | DP ratio K / V | DP error K / V |" + "".join(f" {names.get(v, 'ecsq ' + v)}: ratio K / V | bytes saved K / V |" for v in variants)
    out += [head, "|" + "---|" * (3 + 2 * len(variants))]
    for row in r["compare"]:
        line = (f"| {row['nominal']}x | {ratio(row['dp_ratio'][0])} / {ratio(row['dp_ratio'][1])} | "
                f"{row['dp_err'][0]:.2e} / {row['dp_err'][1]:.4f} |")
        for v in variants:
            x = row[v]
            line += (f" {ratio(x['ratio_at_equal_error'][0])} / {ratio(x['ratio_at_equal_error'][1])} |"
                     f" **{pct(x['bytes_saved'][0])} / {pct(x['bytes_saved'][1])}** |")
        out.append(line)
    out += ["", "Every measured point (pooled over the documents: bytes add, errors are the documents' mean):", "",
            "| coding | target | ratio K / V | error K / V | components K / V | encode ms | decode ms |", "|---|---|---|---|---|---|---|"]
    for p in sorted(r["pooled"], key=lambda p: (p["variant"] != "dp", p["variant"], p["target"])):
        name = "dp" if p["variant"] == "dp" else f"ecsq {p['variant']}" if p["variant"] != "ecsq" else "ecsq"
        out.append(f"| {name} | {p['target']:g}x | {p['ratio'][0]:.2f} / {p['ratio'][1]:.2f} | {p['err'][0]:.2e} / {p['err'][1]:.4f} | "
                   f"{p['components'][0]:.0f} / {p['components'][1]:.0f} | {p['encode_ms']:.0f} | {p['decode_ms']:.0f} |")
    if r.get("speed"):
        if r.get("speed_command"):
            out += ["", f"Speed runs: `{r['speed_command']}`, commit {r['speed_commit']}."]
        out += ["", f"Speed on {r['speed_document']} (best of 3; ms of wall time for the whole cache; stage columns are thread-ms summed over",
                "the worker threads: `entropy` is DEFLATE/inflate, or rANS coding with the table choice, `quant` the DP's quantize/pack or",
                "ecsq's rate control (wall ms of the search); ecsq at the ratio the DP point measured (equal bytes) and at the ratio",
                "whose error equals the DP point's on the pooled curves above (equal error; K and V ratios' geometric mean). Decode",
                "GB/s: f16 bytes of the whole cache (coded and raw tokens) per second of decode wall time):", "",
                "| coding | at | ratio | components K / V | encode ms | decode ms | decode GB/s | enc. project / quant / entropy | dec. project / quant / entropy | rANS decode, M codes/s per core |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for s in r["speed"]:
            e, d = s["encode_stages"], s["decode_stages"]
            comps = s.get("components")
            codes = s["coded_tokens"] * sum(comps) if comps and "coded_tokens" in s else None
            mcs = codes / 1e6 / (d["entropy"] / 1e3) if codes and s["coding"] == "ecsq" and d["entropy"] > 0 else None
            gbs = s["f16_bytes_all"] / (s["decode_ms"] / 1e3) / 1e9 if s.get("f16_bytes_all") else None
            out.append(f"| {s['coding']} | {s.get('at', '—')} | {s['ratio_coded']:.2f}x | {'—' if not comps else f'{comps[0]} / {comps[1]}'} | "
                       f"{s['encode_ms']:.0f} | {s['decode_ms']:.0f} | {'—' if gbs is None else f'{gbs:.2f}'} | "
                       f"{e['project']:.0f} / {e['quant']:.0f} / {e['entropy']:.0f} | {d['project']:.0f} / {d['quant']:.0f} / {d['entropy']:.0f} | "
                       f"{'—' if mcs is None else f'{mcs:.0f}'} |")
    return out


def quality_section(path):
    with open(path) as f:
        q = json.load(f)
    out = ["## Model quality at equal bytes", ""]
    md = os.path.splitext(path)[0] + ".md"  # bench/quality.sh's report: its command, commit and machine lines
    if os.path.exists(md):
        with open(md) as f:
            out += [ln.rstrip() for ln in f if ln.startswith(("- command", "- commit", "- machine"))]
    out += [f"- model: {os.path.basename(q.get('model', '?'))}; calibration: {os.path.basename(q.get('calibration', '?'))}", ""]
    for ctx in q.get("contexts", []):
        metrics = []
        for m in ctx["methods"]:
            for k in m.get("scores", {}):
                if k not in metrics:
                    metrics.append(k)
        out += [f"Context {ctx['context']} tokens, {ctx.get('samples', '?')} prompts per task:", "",
                "| method | whole-cache ratio | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
        for m in ctx["methods"]:
            cells = []
            for k in metrics:
                v = m.get("scores", {}).get(k)
                h = (m.get("half_width") or {}).get(k)
                fmt = ".4f" if k in ("kld", "ppl") else ".1f"
                cells.append("—" if v is None else f"{v:{fmt}}" + (f" ± {h:{fmt}}" if h else ""))
            out.append(f"| {m['name']} | {m.get('ratio', 0):.2f}x | " + " | ".join(cells) + " |")
        out.append("")
    return out


def main(argv):
    specs = argv or [s for s in ("SmolLM2-135M=" + os.path.join(RES, "entropy-smollm2.json"),
                                 "Qwen2.5-Coder-1.5B=" + os.path.join(RES, "entropy-qwen.json")) if os.path.exists(s.split("=", 1)[1])]
    if not specs:
        sys.exit("entropy_report.py: no bench/entropy.py results (bench/results/entropy-*.json)")
    lines = ["# Entropy-coded quantization (container version 2) against DP + DEFLATE", "",
             "The paper's coder (DP allocation of int2/int4/fp8 blocks with per-token scales, then DEFLATE) against `--coding ecsq`:",
             "one uniform step for every PCA component, codes rANS-coded per component with static tables chosen per chunk",
             "(docs/format.md, \"Entropy-coded chunks\"). Rebuilt by `python3 bench/entropy_report.py` from the JSONs named below;",
             "the figure is bench/results/entropy.png.", ""]
    for spec in specs:
        label, path = spec.split("=", 1)
        with open(path) as f:
            lines += model_section(label, json.load(f)) + [""]
    qpath = os.path.join(RES, "entropy-quality.json")
    if os.path.exists(qpath):
        lines += quality_section(qpath)
    notes = os.path.join(TOP, "bench", "entropy-notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            lines += [f.read().rstrip(), ""]
    tmp = os.path.join(RES, "entropy.md.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    os.replace(tmp, os.path.join(RES, "entropy.md"))
    subprocess.run([sys.executable, os.path.join(TOP, "bench", "plots.py"), "entropy", os.path.join(RES, "entropy.png"), *specs], check=True)
    print(os.path.join(RES, "entropy.md"))


if __name__ == "__main__":
    main(sys.argv[1:])
