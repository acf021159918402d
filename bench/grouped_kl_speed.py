#!/usr/bin/env python3
"""The point of bench/grouped_kl_speed.sh: the layer-grouped entropy-coded
rows of several kvtc-lab bench runs (each row its fastest decompress),
interpolated at the error of one PCA's DP-16x row (--dp, a bench JSON of
make bench-grouped) as bench/grouped_report.py matches points."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_report import at_error, err, fail, load  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("runs", nargs="+")
ap.add_argument("--dp", required=True)
a = ap.parse_args()
rows = {}
raw = None
for path in a.runs:
    d, ctx, rs = load(path, "a run")
    raw = ctx["raw_mb"]
    print(f"{path}: int8 GEMM {d['baselines']['gemm_codec_shape_gops_int8']:.0f} GOP/s at the codec shape")
    for x in rs:
        x["decode_project_ms"] = x["decode_stages"]["project_ms"]  # what at_error reads
        k = x["nominal_ratio"]
        if k not in rows or x["decompress_ms"] < rows[k]["decompress_ms"]:
            rows[k] = x
rs = sorted(rows.values(), key=lambda x: x["nominal_ratio"])
for x in rs:
    print(f"{x['nominal_ratio']:g}x: {x['compressed_mb']:.2f} MB, err {x['rel_error_k']:.5f} / {x['rel_error_v']:.5f}, "
          f"decompress {x['decompress_ms']:.0f} ms ({raw / x['decompress_ms']:.3f} GB/s)")
_, _, drows = load(a.dp, "--dp")
dp = [x for x in drows if x["coding"] == "dp" and x["nominal_ratio"] == 16]
if not dp:
    fail(f"{a.dp}: no DP 16x row")
m = at_error(rs, err(dp[0]))
if m is None:
    fail("the rows do not bracket DP-16x's error")
print(f"at one PCA DP-16x's error ({dp[0]['rel_error_k']:.5f} / {dp[0]['rel_error_v']:.5f}, {dp[0]['compressed_mb']:.2f} MB): "
      f"between {m['between'][0]:g}x and {m['between'][1]:g}x, {m['compressed_mb']:.2f} MB, "
      f"decompress {m['decompress_ms']:.0f} ms, {raw / m['decompress_ms']:.3f} GB/s")
