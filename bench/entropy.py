#!/usr/bin/env python3
"""The entropy-coded mode (container version 2, `kvtc compress --coding
ecsq`) against the paper's DP + DEFLATE (version 1), at equal error:
ratio-error curves per kind (keys, values) on evaluation-corpus caches.

    python3 bench/entropy.py --calib CAL.safetensors [--model smollm2|qwen]
        [--docs-per-kind 1] [--tokens 4096] [--name entropy-smollm2]

For each capture: DP at nominal 8/16/32/64x and ecsq rate-controlled to a
grid of ratios; bytes of each kind's chunk sections (headers included)
parsed from the container, relative squared error of each kind from
`kvtc decompress --reference`. At every DP point, the ecsq ratio with the
same error is interpolated (log ratio against log error, between the two
ecsq points around it): "bytes saved" = 1 - DP bytes / ecsq bytes at that
error. Writes bench/results/NAME.json; bench/entropy_report.py writes the
Markdown and the figure from all NAME.json files.
Only the standard library here.
"""
import argparse
import json
import math
import os
import platform
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import provenance  # noqa: E402
from ratio import run  # noqa: E402  (the same kvtc runner)

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DP_RATIOS = [8, 16, 32, 64]
ECSQ_RATIOS = [8, 11.3, 16, 22.6, 32, 45.3, 64, 90.5, 128]


def chunk_bytes(path):
    """{kv: bytes of the chunk sections incl. their 44-byte headers}, and the header (docs/format.md)."""
    with open(path, "rb") as f:
        b = f.read()
    (hl,) = struct.unpack_from("<I", b, 8)
    header = json.loads(b[20:20 + hl])
    off, out = 20 + hl, {0: 0, 1: 0}
    while off < len(b):
        kind, _blk, kv, _t0, _t1 = struct.unpack_from("<5I", b, off)
        _raw, stored, _x = struct.unpack_from("<3Q", b, off + 20)
        if kind == 4:
            out[kv] += 44 + stored
        off += 44 + stored
    return out, header


def point(kvtc, cap, calib, work, coding, ratio, extra=()):
    out = os.path.join(work, f"{coding}.kvtc")
    t0 = time.time()
    c = json.loads(run(kvtc, "compress", cap, "--calib", calib, "-r", str(ratio), "--coding", coding, *extra, "-o", out, "--json"))
    enc = time.time() - t0
    e = json.loads(run(kvtc, "decompress", out, "--calib", calib, "--reference", cap, "--json"))
    by, header = chunk_bytes(out)
    f16 = c["f16_bytes_compressed"] / 2  # per kind
    used = [sum(x[1] for x in a if x[2]) if a else 0 for a in header["blocks"][0]["alloc"]]
    return {"coding": coding, "target": ratio, "ratio": [f16 / by[0], f16 / by[1]], "err": [e["rel_error_k"], e["rel_error_v"]],
            "bytes": [by[0], by[1]], "f16_bytes": f16, "components": used, "encode_ms": c["encode_ms"], "decode_ms": e["decode_ms"],
            "encode_stages": c.get("stage_thread_ms"), "decode_stages": e.get("stage_thread_ms"), "wall_s": enc}


def equal_error_ratio(compare, nominal):
    """The ecsq ratio whose error equals DP-`nominal`'s (geometric mean of the
    K and V ratios at equal error from the pooled curves), or None."""
    for row in compare or []:
        r = row.get("ecsq", {}).get("ratio_at_equal_error")
        if row["nominal"] == nominal and r and None not in r:
            return math.sqrt(r[0] * r[1])
    return None


def speed(kvtc, cap, calib, work, ratios, repeat, compare=None):
    """Best of `repeat` encode and decode times, with stage thread-ms, for
    DP at each nominal ratio, ecsq at the ratio that DP point measured
    (equal bytes) and, given `compare`, ecsq at the ratio of equal error."""
    rows = []
    for r in ratios:
        runs = [("dp", r, "—"), ("ecsq", None, "equal bytes")]
        ee = equal_error_ratio(compare, r)
        if ee:
            runs.append(("ecsq", ee, "equal error"))
        for coding, target, at in runs:
            target = target if target is not None else rows[-1]["ratio_coded"]
            out = os.path.join(work, f"speed-{coding}.kvtc")
            best_c = best_d = None
            for _ in range(repeat):
                c = json.loads(run(kvtc, "compress", cap, "--calib", calib, "-r", f"{target:.4f}", "--coding", coding, "-o", out, "--json"))
                d = json.loads(run(kvtc, "decompress", out, "--calib", calib, "-o", os.path.join(work, "speed.safetensors"), "--json"))
                best_c = c if best_c is None or c["encode_ms"] < best_c["encode_ms"] else best_c
                best_d = d if best_d is None or d["decode_ms"] < best_d["decode_ms"] else best_d
            by, header = chunk_bytes(out)
            comps = [sum(x[1] for x in a if x[2]) for a in header["blocks"][0]["alloc"]]
            rows.append({"coding": coding, "nominal": r, "at": at, "ratio_coded": best_c["ratio_compressed_tokens"], "chunk_bytes": by[0] + by[1],
                         "components": comps, "coded_tokens": best_c["compressed_tokens"], "f16_bytes_all": best_c["f16_bytes_all"],
                         "tokens": best_c["tokens"], "encode_ms": best_c["encode_ms"], "decode_ms": best_d["decode_ms"],
                         "encode_stages": best_c["stage_thread_ms"], "decode_stages": best_d["stage_thread_ms"]})
    return rows


def interp_ratio(points, kv, err):
    """log-log interpolation of ratio at error `err` along points sorted by ratio; None outside."""
    pts = sorted((p["ratio"][kv], p["err"][kv]) for p in points)
    for (r0, e0), (r1, e1) in zip(pts, pts[1:]):
        if min(e0, e1) <= err <= max(e0, e1) and e0 != e1:
            w = (math.log(err) - math.log(e0)) / (math.log(e1) - math.log(e0))
            return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--docs-per-kind", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--name", default=None)
    ap.add_argument("--kvtc", default=os.path.join(TOP, "build", "kvtc"))
    ap.add_argument("--work", default=os.path.join(TOP, "out", "bench-entropy"))
    ap.add_argument("--variants", nargs="*", default=[], help="extra ecsq variants as NAME=ARGS, e.g. dz=--rounding=0.35")
    ap.add_argument("--speed-repeat", type=int, default=3, help="speed runs (best of) on the first document; 0: none")
    ap.add_argument("--speed-only", action="store_true", help="rerun only the speed runs into the existing NAME.json")
    a = ap.parse_args()
    a.name = a.name or f"entropy-{a.model}"
    work = os.path.join(a.work, a.name)
    os.makedirs(work, exist_ok=True)
    docs = corpus.per_kind(a.docs_per_kind, a.tokens)
    info = json.loads(run(a.kvtc, "info", "--json"))
    if a.speed_only:
        path = os.path.join(TOP, "bench", "results", a.name + ".json")
        with open(path) as f:
            res = json.load(f)
        cap0 = os.path.join(work, os.path.basename(docs[0]["file"]) + f".{a.tokens}.safetensors")
        res["speed"] = speed(a.kvtc, cap0, a.calib, work, [16, 32], max(1, a.speed_repeat), res.get("compare"))
        res["speed_command"] = f"python3 bench/entropy.py --calib {os.path.relpath(a.calib, TOP)} --model {a.model} --speed-only"
        res["speed_commit"] = provenance.result_commit(TOP)
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"wrote {path} (speed)")
        return
    variants = [("ecsq", [])] + [(v.split("=", 1)[0], v.split("=", 1)[1].split()) for v in a.variants]
    per_doc = []
    for d in docs:
        cap = os.path.join(work, os.path.basename(d["file"]) + f".{a.tokens}.safetensors")
        if not os.path.exists(cap):
            run(a.kvtc, "capture", "--model", a.model, "--text", corpus.path(d), "--max-tokens", str(a.tokens), "-o", cap)
        pts = [point(a.kvtc, cap, a.calib, work, "dp", r) for r in DP_RATIOS]
        for name, extra in variants:
            for r in ECSQ_RATIOS:
                p = point(a.kvtc, cap, a.calib, work, "ecsq", r, extra)
                p["variant"] = name
                pts.append(p)
        per_doc.append({"document": d["id"], "kind": d["kind"], "points": pts})
        print(f"[entropy] {d['id']}: done", file=sys.stderr)
    # Pooled curves: bytes and squared errors add over documents at each setting.
    pooled = []
    keys = sorted({(p["coding"], p.get("variant", "dp"), p["target"]) for doc in per_doc for p in doc["points"]})
    for coding, variant, target in keys:
        ps = [p for doc in per_doc for p in doc["points"] if p["coding"] == coding and p.get("variant", "dp") == variant and p["target"] == target]
        f16 = sum(p["f16_bytes"] for p in ps)
        pooled.append({"coding": coding, "variant": variant, "target": target,
                       "ratio": [f16 / sum(p["bytes"][kv] for p in ps) for kv in (0, 1)],
                       "err": [sum(p["err"][kv] for p in ps) / len(ps) for kv in (0, 1)],
                       "components": [sum(p["components"][kv] for p in ps) / len(ps) for kv in (0, 1)],
                       "encode_ms": sum(p["encode_ms"] for p in ps) / len(ps), "decode_ms": sum(p["decode_ms"] for p in ps) / len(ps)})
    compare = []
    for p in (q for q in pooled if q["coding"] == "dp"):
        row = {"nominal": p["target"], "dp_ratio": p["ratio"], "dp_err": p["err"]}
        for name, _ in variants:
            curve = [q for q in pooled if q["variant"] == name]
            r = [interp_ratio(curve, kv, p["err"][kv]) for kv in (0, 1)]
            row[name] = {"ratio_at_equal_error": r, "bytes_saved": [None if x is None else 1 - p["ratio"][kv] / x for kv, x in enumerate(r)]}
        compare.append(row)
    cap0 = os.path.join(work, os.path.basename(docs[0]["file"]) + f".{a.tokens}.safetensors")
    speeds = speed(a.kvtc, cap0, a.calib, work, [16, 32], a.speed_repeat, compare) if a.speed_repeat > 0 else []
    cmd = f"python3 bench/entropy.py --calib {os.path.relpath(a.calib, TOP)} --model {a.model} --docs-per-kind {a.docs_per_kind} --tokens {a.tokens}"
    if a.variants:
        cmd += " --variants " + " ".join(f"'{v}'" for v in a.variants)
    res = {"command": cmd, "commit": provenance.result_commit(TOP),
           "machine": f"{info['cpu']['brand']}, {os.cpu_count()} threads, {platform.system()} {platform.release()}",
           "model": a.model, "calibration": os.path.relpath(a.calib, TOP), "documents": [d["id"] for d in docs], "tokens": a.tokens,
           "pooled": pooled, "compare": compare, "speed": speeds, "speed_document": docs[0]["id"], "per_document": per_doc}
    os.makedirs(os.path.join(TOP, "bench", "results"), exist_ok=True)
    path = os.path.join(TOP, "bench", "results", a.name + ".json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    for row in compare:
        print(row["nominal"], [f"{x:.2f}" for x in row["dp_ratio"]], {n: [None if x is None else f"{x:.1%}" for x in row[n]["bytes_saved"]] for n, _ in variants})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
