#!/usr/bin/env python3
"""The layer-grouped PCA against one PCA at equal error (bench/grouped.sh).

Reads `kvtc-lab bench --out-json` files of the same 8K cache on the same
machine: one PCA, one or more layer-grouped calibrations (labelled by the
runs their projection found), the first grouped one multiplied as one dense
GEMM (--dense) and, optionally, the last one with the decoder's scalar
conversion kernels (--scalar, kvtc-lab bench --scalar-kernels). For each (calibration, coding,
precision) it finds, between the two measured rows that bracket it, the
nominal ratio whose error equals one PCA's DP at 16x and at 32x (the
geometric mean of the K and V relative errors, linear in log ratio), and
reads the bytes and the decode time there by the same interpolation: the
rows are measured, the matched points are interpolated between neighbours
(their nominal ratios are listed). Exit 1 with a message on a file that is
not a bench result or a target no series brackets.
"""
import argparse
import json
import math
import sys


def fail(msg):
    print(f"grouped_report: {msg}", file=sys.stderr)
    sys.exit(1)


def load(path, what):
    try:
        with open(path) as f:
            d = json.load(f)
        ctx = d["contexts"][0]
        rows = ctx["ratios"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        fail(f"{path}: not a kvtc-lab bench result ({what}): {e}")
    if ctx.get("tiled"):
        fail(f"{path}: the context is tiled; the comparison needs a real capture")
    return d, ctx, rows


def base_precision(p):
    return p.split(", ")[0]  # "int8 (enc bf16), 2 runs" -> "int8 (enc bf16)"


def err(r):
    return math.sqrt(r["rel_error_k"] * r["rel_error_v"])


def series(rows, label):
    out = {}
    for r in rows:
        out.setdefault((label, r["coding"], base_precision(r["precision"])), []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r["nominal_ratio"])
    return out


def at_error(rows, target):
    """Interpolated (in log nominal ratio) values where err(r) == target, or None."""
    for a, b in zip(rows, rows[1:]):
        ea, eb = math.log(err(a)), math.log(err(b))
        lt = math.log(target)
        if (ea - lt) * (eb - lt) <= 0 and ea != eb:
            w = (lt - ea) / (eb - ea)
            mix = lambda k: a[k] + w * (b[k] - a[k])
            return {
                "between": [a["nominal_ratio"], b["nominal_ratio"]],
                "weight": w,
                "ratio": mix("ratio"),
                "compressed_mb": mix("compressed_mb"),
                "decompress_ms": mix("decompress_ms"),
                "compress_ms": mix("compress_ms"),
                "decode_project_ms": mix("decode_project_ms"),
                "macs": mix("projection_macs_per_token"),
                "rel_error_k": mix("rel_error_k"),
                "rel_error_v": mix("rel_error_v"),
            }
    return None


def provenance_args(ap):
    """What every committed report names (the bench/*.sh wrapper passes them) and where it goes."""
    for name in ("--command", "--commit", "--machine", "--out-md", "--out-json"):
        ap.add_argument(name, required=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one", required=True)
    ap.add_argument("--grouped", required=True, action="append", help="a grouped calibration's bench JSON (repeat for each)")
    ap.add_argument("--dense", required=True)
    ap.add_argument("--scalar", help="the last grouped calibration with --scalar-kernels")
    provenance_args(ap)
    a = ap.parse_args()
    files = {"one PCA": load(a.one, "one PCA")}
    grouped_labels = []
    for path in a.grouped:
        f = load(path, "grouped")
        runs = max(r.get("projection_groups", 1) for r in f[2])
        if runs <= 1:
            fail(f"{path}: no row ran the projection by runs (is it a layer-grouped calibration? kvtc calibrate --layer-groups)")
        if f[0]["calibration_id"] == files["one PCA"][0]["calibration_id"]:
            fail(f"--one and --grouped {path} are the same calibration")
        label = f"{runs} runs"
        if label in files:
            fail(f"{path}: a second calibration of {label}")
        files[label] = f
        grouped_labels.append(label)
    dense = load(a.dense, "dense")
    if dense[0]["calibration_id"] != files[grouped_labels[0]][0]["calibration_id"]:
        fail("--dense must be a run of the first --grouped calibration")
    if any(r.get("projection_groups", 1) != 1 for r in dense[2]):
        fail("--dense: a row ran by runs; was it made with kvtc-lab bench --dense?")
    files[f"{grouped_labels[0]}, dense GEMM"] = dense
    if a.scalar:
        sc = load(a.scalar, "scalar kernels")
        if sc[0]["calibration_id"] != files[grouped_labels[-1]][0]["calibration_id"]:
            fail("--scalar must be a run of the last --grouped calibration")
        if sc[0].get("vector_kernels", True):
            fail("--scalar: made without kvtc-lab bench --scalar-kernels")
        files[f"{grouped_labels[-1]}, scalar kernels"] = sc
    raw_mb = files["one PCA"][1]["raw_mb"]
    for label, (_, _, rows) in files.items():
        for r in rows:
            r["decode_project_ms"] = r["decode_stages"]["project_ms"]
            r.setdefault("projection_macs_per_token", float("nan"))
    S = {}
    for label, (_, _, rows) in files.items():
        S.update(series(rows, label))
    # Targets: one PCA's DP at 16x and 32x, the int8 row (the DP's codes do not depend on the decode precision).
    one_dp = {r["nominal_ratio"]: r for r in files["one PCA"][2] if r["coding"] == "dp" and r["precision"].startswith("int8")}
    targets = {}
    for nom in (16.0, 32.0):
        if nom not in one_dp:
            fail(f"--one: no DP int8 row at {nom:g}x")
        targets[f"DP-{nom:g}x"] = (err(one_dp[nom]), one_dp[nom])
    matched = {}
    for tname, (t, _) in targets.items():
        for key, rows in sorted(S.items()):
            m = at_error(rows, t)
            if m is not None:
                matched.setdefault(tname, {})[" / ".join(key)] = m

    md = [f"# Layer-grouped PCA in the codec: {' and '.join(grouped_labels)} of layers against one PCA (SmolLM2, 8K tokens)", ""]
    md.append(f"- command: `{a.command}`")
    md.append(f"- commit: {a.commit}")
    md.append(f"- machine: {a.machine}")
    for label, (d, ctx, _) in files.items():
        md.append(f"- {label}: `{d['calibration']}` (id {d['calibration_id'][:16]}…), {d['threads']} threads, repeat {d['repeat']}")
    md.append(f"- cache: {ctx['tokens']} tokens of real text, {raw_mb:.1f} MB of f16 K+V; window 128 tokens at 8 bits, sink 4 at f16")
    md.append(
        "- columns: compress / decompress = wall ms, fastest of the repeats; MACs/token = the projection's multiply-adds per token over "
        "K and V as it ran (a run's components x its features, summed; dense: components x 5,760); dec proj = the decoder's GEMM "
        "thread-ms; err = relative squared error of the coded tokens, K / V; scalar kernels: the decoder's int8 code conversion and "
        "re-RoPE in their scalar forms (the same bits), the control for their AVX-512 kernels"
    )
    md.append("")
    md.append("## Measured rows")
    md.append("")
    md.append("| calibration | coding | nominal | proj | ratio | MB | compress ms | decompress ms | dec GB/s | MACs/token | dec proj ms | err K / V |")
    md.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, (_, _, rows) in files.items():
        for r in sorted(rows, key=lambda r: (r["coding"], r["precision"], r["nominal_ratio"])):
            md.append(
                f"| {label} | {r['coding']} | {r['nominal_ratio']:g}x | {r['precision']} | {r['ratio']:.2f}x | {r['compressed_mb']:.2f} | "
                f"{r['compress_ms']:.0f} | {r['decompress_ms']:.0f} | {r['decode_gbs']:.2f} | {r['projection_macs_per_token']:,.0f} | "
                f"{r['decode_project_ms']:.0f} | {r['rel_error_k']:.5f} / {r['rel_error_v']:.5f} |"
            )
    md.append("")
    md.append("## At equal error")
    md.append("")
    md.append(
        "Each series interpolated (log nominal ratio) between its two measured rows that bracket the target error (the geometric mean "
        "of K's and V's); bytes and times against one PCA's entropy-coded mode at the same error and precision."
    )
    for tname, (t, ref) in targets.items():
        md.append("")
        md.append(
            f"### {tname}'s error (one PCA's DP: K {ref['rel_error_k']:.5f}, V {ref['rel_error_v']:.5f}; {ref['compressed_mb']:.2f} MB, "
            f"decode {ref['decompress_ms']:.0f} ms with int8)"
        )
        md.append("")
        md.append("| series | between | ratio | MB | bytes vs one PCA ecsq | decompress ms | dec GB/s | vs one PCA ecsq | MACs/token | compress ms |")
        md.append("|---|---|---|---|---|---|---|---|---|---|")
        for name, m in sorted(matched.get(tname, {}).items()):
            label, coding, prec = name.split(" / ")
            ref_e = matched[tname].get(f"one PCA / ecsq / {prec}")
            vs_b = f"{m['compressed_mb'] / ref_e['compressed_mb'] - 1:+.1%}" if ref_e else "-"
            vs_t = f"{ref_e['decompress_ms'] / m['decompress_ms']:.2f}x faster" if ref_e else "-"
            md.append(
                f"| {name} | {m['between'][0]:g}-{m['between'][1]:g}x | {m['ratio']:.2f}x | {m['compressed_mb']:.2f} | {vs_b} | "
                f"{m['decompress_ms']:.0f} | {raw_mb / m['decompress_ms']:.2f} | {vs_t} | {m['macs']:,.0f} | "
                f"{m['compress_ms']:.0f} |"
            )
    if a.scalar:
        vec_label, sc_label = grouped_labels[-1], f"{grouped_labels[-1]}, scalar kernels"
        vec = {(r["coding"], r["nominal_ratio"], base_precision(r["precision"])): r for r in files[vec_label][2]}
        md.append("")
        md.append(f"### Decoder stages, {vec_label}: the AVX-512 conversion kernels against their scalar forms")
        md.append("")
        md.append(
            "The same calibration, files and bits; only the int8 path's code conversion (`quant`) and the re-RoPE with f16 "
            "rounding (`gather`) differ. Stages in thread-ms summed over the worker threads; decompress in wall ms."
        )
        md.append("")
        md.append("| coding | nominal | kernels | decompress ms | dec GB/s | gather + re-RoPE | quant | entropy | project |")
        md.append("|---|---|---|---|---|---|---|---|---|")
        for r in sorted(files[sc_label][2], key=lambda r: (r["coding"], r["nominal_ratio"])):
            v = vec.get((r["coding"], r["nominal_ratio"], base_precision(r["precision"])))
            for name, x in (("scalar", r), ("AVX-512", v)):
                if x is None:
                    continue
                st = x["decode_stages"]
                md.append(
                    f"| {x['coding']} | {x['nominal_ratio']:g}x | {name} | {x['decompress_ms']:.0f} | {x['decode_gbs']:.2f} | "
                    f"{st['gather_rope_ms']:.0f} | {st['quant_pack_ms']:.0f} | {st['entropy_ms']:.0f} | {st['project_ms']:.0f} |"
                )
    md.append("")
    with open(a.out_md, "w") as f:
        f.write("\n".join(md))
    with open(a.out_json, "w") as f:
        json.dump(
            {
                "command": a.command,
                "commit": a.commit,
                "machine": a.machine,
                "targets": {k: v[0] for k, v in targets.items()},
                "matched": matched,
                "runs": {label: d for label, (d, _, _) in files.items()},
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
