#!/usr/bin/env python3
"""The entropy-coded encoder against the DP's at equal error (bench/encoder.sh).

Reads `kvtc-lab bench --out-json` files of one 8K cache on one machine: --now
with both codings, and optionally --control, the entropy-coded rows made by
an earlier binary (same options). For each DP row it finds, between the two
entropy-coded rows that bracket its error (the geometric mean of the K and V
relative errors, linear in log nominal ratio, as bench/grouped_report.py),
the compress and decompress times there and their ratio to the DP's; the
measured rows follow with their encoder stages. A control must have made
the same bytes (an encoder change that keeps them): exit 1 otherwise, or on
a file that is not a bench result.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_report import at_error, err, fail, load, provenance_args  # noqa: E402


def rows_of(rows, coding):
    """The rows of one coding at the file's first precision, by ratio."""
    prec = rows[0]["precision"] if rows else None
    out = []
    for r in rows:
        if r["coding"] == coding and r["precision"] == prec:
            r["decode_project_ms"] = r["decode_stages"]["project_ms"]  # what at_error reads besides the times
            out.append(r)
    return sorted(out, key=lambda r: r["nominal_ratio"])


def merged(paths, what):
    """One bench file's worth from several runs of the same options: per row
    the fastest compress (with its stages) and the fastest decompress; the
    runs must agree on the bytes and errors."""
    base, ctx, rows = load(paths[0], what)
    best = {(r["coding"], r["precision"], r["nominal_ratio"]): dict(r) for r in rows}
    gemm = [base["baselines"]]
    for p in paths[1:]:
        d, _, more = load(p, what)
        if d["calibration_id"] != base["calibration_id"]:
            fail(f"{p}: another calibration than {paths[0]}")
        gemm.append(d["baselines"])
        for r in more:
            k = (r["coding"], r["precision"], r["nominal_ratio"])
            b = best.get(k)
            if b is None:
                fail(f"{p}: a row ({k}) that {paths[0]} lacks")
            if (b["compressed_mb"], b["rel_error_k"], b["rel_error_v"]) != (r["compressed_mb"], r["rel_error_k"], r["rel_error_v"]):
                fail(f"{p}: {k} made other bytes than in {paths[0]}")
            if r["compress_ms"] < b["compress_ms"]:
                b["compress_ms"], b["encode_stages"] = r["compress_ms"], r["encode_stages"]
            if r["decompress_ms"] < b["decompress_ms"]:
                b["decompress_ms"], b["decode_stages"] = r["decompress_ms"], r["decode_stages"]
    base["gemm_runs"] = gemm
    return base, ctx, list(best.values())


def header(L, cols, extra):
    """A markdown table's header and rule for columns cols + extra."""
    cols = cols + extra
    L.append("| " + " | ".join(cols) + " |")
    L.append("|" + "---|" * len(cols))


def stages(r):
    s = r["encode_stages"]
    return " / ".join(f"{s[k]:.0f}" for k in ("gather_rope_ms", "center_ms", "project_ms", "quant_pack_ms", "entropy_ms"))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--now", required=True, nargs="+", help="runs of the current binary")
    ap.add_argument("--control", nargs="+", help="runs of the control binary")
    ap.add_argument("--control-name", default="control")
    provenance_args(ap)
    a = ap.parse_args()
    d, ctx, rows = merged(a.now, "--now")
    dp, ec = rows_of(rows, "dp"), rows_of(rows, "ecsq")
    if len(dp) < 1 or len(ec) < 2:
        fail(f"{a.now[0]}: needs dp rows and at least two ecsq rows")
    ctl = None
    if a.control:
        dc, _, crows = merged(a.control, "--control")
        ctl = rows_of(crows, "ecsq")
        if dc["calibration_id"] != d["calibration_id"]:
            fail(f"{a.control[0]}: calibration {dc['calibration_id'][:16]}… is not --now's {d['calibration_id'][:16]}…")
        by = {r["nominal_ratio"]: r for r in ctl}
        for r in ec:
            c = by.get(r["nominal_ratio"])
            if c is None:
                fail(f"{a.control[0]}: no entropy-coded row at {r['nominal_ratio']}x")
            if c["compressed_mb"] != r["compressed_mb"] or c["rel_error_k"] != r["rel_error_k"] or c["rel_error_v"] != r["rel_error_v"]:
                fail(f"{a.control[0]}: {r['nominal_ratio']}x made {c['compressed_mb']} MB (err {c['rel_error_k']}/{c['rel_error_v']}), "
                     f"--now {r['compressed_mb']} MB ({r['rel_error_k']}/{r['rel_error_v']}): not the same bytes")
    matched = []
    for r in dp:
        m = at_error(ec, err(r))
        mc = at_error(ctl, err(r)) if ctl else None
        matched.append({"dp": r["nominal_ratio"], "dp_compress_ms": r["compress_ms"], "dp_decompress_ms": r["decompress_ms"],
                        "dp_mb": r["compressed_mb"], "error": err(r), "ecsq": m, "control": mc})
    L = []
    L.append("# The entropy-coded encoder against the DP's at equal error (SmolLM2, 8K tokens)")
    L.append("")
    L.append(f"- command: `{a.command}`")
    L.append(f"- commit: {a.commit}")
    L.append(f"- machine: {a.machine}")
    L.append(f"- calibration: `{d['calibration']}` (id {d['calibration_id'][:16]}…), {d['threads']} threads, repeat {d['repeat']}, "
             f"projection {d.get('bf16_projection', '?')}")
    runs = f"{len(a.now)} run(s)" + (f" alternating with {len(a.control)} of the control" if ctl else "")
    L.append(f"- {runs}; per row the fastest compress and decompress over all runs and repeats")
    if ctl:
        L.append(f"- control: the entropy-coded rows by {a.control_name}'s kvtc-lab (the same bytes and errors, checked)")
    gl = lambda g: f"bf16 {g['gemm_codec_shape_gflops_bf16']:.0f} GFLOP/s, int8 {g['gemm_codec_shape_gops_int8']:.0f} GOP/s"
    L.append("- GEMM at the codec's shape per run (the machine's state): now " + "; ".join(gl(g) for g in d["gemm_runs"]) +
             ("; control " + "; ".join(gl(g) for g in dc["gemm_runs"]) if ctl else ""))
    L.append(f"- cache: {ctx['tokens']} tokens of real text, {ctx['raw_mb']:.1f} MB of f16 K+V; window 128 tokens at 8 bits, sink 4 at f16; "
             "int8 decode (the encoder projects in bf16)")
    L.append("- columns: wall ms, fastest of the repeats; error = geometric mean of the K and V relative squared errors; the "
             "entropy-coded point at a DP row's error is interpolated in log ratio between the two measured rows around it "
             "(listed); x DP = its time over the DP row's")
    L.append("")
    L.append("## At the DP's error")
    L.append("")
    header(L, ["DP", "error", "DP MB", "DP compress", "DP decompress", "ecsq between", "ecsq MB", "ecsq compress", "x DP",
               "ecsq decompress", "x DP"], [f"{a.control_name} compress", "x DP"] if ctl else [])
    for m in matched:
        e = m["ecsq"]
        if e is None:
            L.append(f"| {m['dp']:g}x | {m['error']:.5f} | {m['dp_mb']:.2f} | {m['dp_compress_ms']:.0f} | {m['dp_decompress_ms']:.0f} | "
                     "not bracketed | | | | | |" + (" | |" if ctl else ""))
            continue
        line = (f"| {m['dp']:g}x | {m['error']:.5f} | {m['dp_mb']:.2f} | {m['dp_compress_ms']:.0f} | {m['dp_decompress_ms']:.0f} | "
                f"{e['between'][0]:g}-{e['between'][1]:g}x | {e['compressed_mb']:.2f} | {e['compress_ms']:.0f} | "
                f"{e['compress_ms'] / m['dp_compress_ms']:.2f} | {e['decompress_ms']:.0f} | {e['decompress_ms'] / m['dp_decompress_ms']:.2f} |")
        if ctl:
            c = m["control"]
            line += f" {c['compress_ms']:.0f} | {c['compress_ms'] / m['dp_compress_ms']:.2f} |" if c else " | |"
        L.append(line)
    L.append("")
    L.append("## Measured rows")
    L.append("")
    L.append("Encoder stages: thread-ms summed over the workers, gather + RoPE / center / project / quant (the DP's quantizers; "
             "the entropy-coded rate control, its wall time) / entropy (DEFLATE; the entropy-coded chunks: quantize, tables, rANS).")
    L.append("")
    header(L, ["coding", "nominal", "MB", "error", "compress ms", "decompress ms", "encoder stages"],
           [f"{a.control_name} compress ms", f"{a.control_name} stages"] if ctl else [])
    cby = {r["nominal_ratio"]: r for r in ctl} if ctl else {}
    for r in dp + ec:
        line = (f"| {r['coding']} | {r['nominal_ratio']:g}x | {r['compressed_mb']:.2f} | {err(r):.5f} | {r['compress_ms']:.0f} | "
                f"{r['decompress_ms']:.0f} | {stages(r)} |")
        if ctl:
            c = cby.get(r["nominal_ratio"]) if r["coding"] == "ecsq" else None
            line += f" {c['compress_ms']:.0f} | {stages(c)} |" if c else " | |"
        L.append(line)
    L.append("")
    with open(a.out_md, "w") as f:
        f.write("\n".join(L))
    with open(a.out_json, "w") as f:
        json.dump({"command": a.command, "commit": a.commit, "machine": a.machine, "control": a.control_name if ctl else None,
                   "matched": matched, "rows": dp + ec, "control_rows": ctl}, f, indent=1)


if __name__ == "__main__":
    main()
