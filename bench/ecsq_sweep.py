#!/usr/bin/env python3
"""Decode and encode time of the entropy-coded mode against the DP at equal
error, per setting of an ecsq option (e.g. --min-sd), on one capture.

    python3 bench/ecsq_sweep.py --capture CAP.safetensors --calib CAL.safetensors \\
        --set 'sd0.5=--min-sd 0.5' --set 'sd0.7=--min-sd 0.7' [--dp 8,16,32,64] \\
        [--ecsq 16,24,32,44,64] [--out out/ecsq-sweep.json]

DP at each --dp ratio, each set at each --ecsq ratio: best of 2 encodes and
3 decodes (`kvtc compress/decompress --json`), relative error of K and V from
`--reference`. At every DP point, the ecsq ratio with the same error (K and
V together: where the mean of log(error / DP's error) over K and V crosses 0,
log-log interpolation between the two ecsq points around it) and the decode
and encode times interpolated there. Only the standard library here.
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(kvtc, *a):
    return json.loads(subprocess.run([kvtc, *a], check=True, capture_output=True, text=True).stdout)


def point(a, coding, ratio, extra, out):
    c = min((run(a.kvtc, "compress", a.capture, "--calib", a.calib, "-r", str(ratio), "--coding", coding, *extra, "-o", out, "--json")
             for _ in range(2)), key=lambda c: c["encode_ms"])
    d = min((run(a.kvtc, "decompress", out, "--calib", a.calib, "--reference", a.capture, "--json") for _ in range(3)),
            key=lambda d: d["decode_ms"])
    with open(out, "rb") as f:
        b = f.read()
    (hl,) = struct.unpack_from("<I", b, 8)
    alloc = json.loads(b[20:20 + hl])["blocks"][0]["alloc"]
    comps = [sum(x[1] for x in al if x[2] or coding == "ecsq") for al in alloc]
    return {"ratio": c["ratio_compressed_tokens"], "err": [d["rel_error_k"], d["rel_error_v"]], "decode_ms": d["decode_ms"],
            "encode_ms": c["encode_ms"], "components": comps, "decode_stages": d["stage_thread_ms"], "encode_stages": c["stage_thread_ms"]}


def at_equal_error(dp, pts):
    f = lambda p: 0.5 * sum(math.log(p["err"][kv] / dp["err"][kv]) for kv in (0, 1))
    pts = sorted(pts, key=lambda p: p["ratio"])
    for a, b in zip(pts, pts[1:]):
        fa, fb = f(a), f(b)
        if fa <= 0 <= fb and fb > fa:
            w = -fa / (fb - fa)
            lerp = lambda k: a[k] + w * (b[k] - a[k])
            r = math.exp(math.log(a["ratio"]) + w * (math.log(b["ratio"]) - math.log(a["ratio"])))
            return {"ratio": r, "bytes_saved": 1 - dp["ratio"] / r, "decode_ms": lerp("decode_ms"), "encode_ms": lerp("encode_ms")}
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capture", required=True)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--set", action="append", default=[], help="NAME=ARGS, kvtc compress options of one ecsq setting")
    ap.add_argument("--dp", default="8,16,32,64")
    ap.add_argument("--ecsq", default="16,24,32,44,64")
    ap.add_argument("--kvtc", default=os.path.join(TOP, "build", "kvtc"))
    ap.add_argument("--out", default=os.path.join(TOP, "out", "ecsq-sweep.json"))
    a = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp = a.out + ".kvtc"
    res = {"dp": [point(a, "dp", float(r), [], tmp) for r in a.dp.split(",")]}
    for s in a.set or ["ecsq="]:
        name, args = s.split("=", 1)
        res[name] = [point(a, "ecsq", float(r), args.split(), tmp) for r in a.ecsq.split(",")]
    os.remove(tmp)
    res["command"] = "python3 bench/ecsq_sweep.py " + " ".join(sys.argv[1:])
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for dp in res["dp"]:
        print(f"DP {dp['ratio']:.2f}x error K {dp['err'][0]:.4g} V {dp['err'][1]:.4g}: decode {dp['decode_ms']:.0f} ms, encode {dp['encode_ms']:.0f} ms")
        for name in res:
            if name in ("dp", "command"):
                continue
            e = at_equal_error(dp, res[name])
            if e:
                print(f"  {name}: {e['ratio']:.2f}x ({e['bytes_saved']:.1%} fewer bytes), decode {e['decode_ms']:.0f} ms "
                      f"({e['decode_ms'] / dp['decode_ms']:.2f}x), encode {e['encode_ms']:.0f} ms ({e['encode_ms'] / dp['encode_ms']:.2f}x)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
