#!/usr/bin/env python3
"""What a layer-grouped (block-diagonal) PCA would cost in bytes and save in
decode multiply-adds, estimated from a calibration file before building it
(issue 32 item 3: the decoder's time is the projection, components x p
multiply-adds per token, so fewer multiply-adds at equal error is the lever
past the int8 GEMM bound).

    python3 bench/grouped_pca_estimate.py CALIB.safetensors [--groups 1 2 3 5 ...]
        [--rel-err 0.005 0.01 ...] [--out bench/results/grouped-pca.md]

The calibration file holds every component (r = p) with its variance, so the
fitted covariance is C = B^T diag(variance) B ([p, p], features ordered
[layer][head][dim], docs/calibration-format.md). A grouped PCA fits one PCA
per run of consecutive layers: its spectra are those of C's diagonal blocks.
Both are scored by the Gaussian rate-distortion bound (reverse
water-filling: at squared error D per token, components with variance above
the water level theta are kept at 0.5 log2(variance / theta) bits each, the
rest dropped), which an entropy-coded uniform quantizer follows at a near
constant gap (~0.25 bit per kept component at high rate): the estimate
compares the two layouts on equal terms, not the codec's own bytes.
Decode multiply-adds per token: the kept components of each group times that
group's feature count. In-sample covariance (the calibration's own tokens),
so it says nothing about held-out error (a grouped fit has fewer parameters
per component; whether it generalises better is not measured here).
rel. err is the codec's: squared error per token over a token's mean squared
norm (variance + mean squared), as `kvtc-lab bench` reports rel. err K/V.
Needs numpy (Debian's python3-numpy, which the bootstrap's
python3-matplotlib brings: run it with /usr/bin/python3 where another
python3 comes first on PATH).
"""
import argparse
import json
import os
import platform
import struct
import subprocess
import sys

import numpy as np


def load(path, expect="kvtc-calibration"):
    """Metadata, a reader of one tensor by name (a read-only memmap) and the
    tensor names of a safetensors file whose __metadata__.format is expect."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        first = f.read(8)
        n = struct.unpack("<Q", first)[0] if len(first) == 8 else None
        if n is None or n > size - 8:
            sys.exit(f"{path}: not a safetensors file (header length {n} past the file's {size} bytes)")
        try:
            head = json.loads(f.read(n))
        except ValueError as e:
            sys.exit(f"{path}: safetensors header is not JSON ({e})")
    base = 8 + n
    meta = head.get("__metadata__", {})
    if meta.get("format") != expect:
        sys.exit(f"{path}: __metadata__.format is {meta.get('format')!r}, expected {expect!r}")
    dtypes = {"F32": "<f4", "F16": "<f2", "I32": "<i4"}

    def tensor(name, dtype="F32"):
        if name not in head:
            sys.exit(f"{path}: tensor {name!r} missing (expected a {expect} file with it)")
        t = head[name]
        if t["dtype"] != dtype:
            sys.exit(f"{path}: tensor {name!r} has dtype {t['dtype']}, expected {dtype}")
        a, b = t["data_offsets"]
        if not 0 <= a <= b <= size - base:
            sys.exit(f"{path}: tensor {name!r} data_offsets [{a}, {b}] lie past the file's {size - base} data bytes (truncated?)")
        arr = np.memmap(path, dtype=dtypes[dtype], mode="r", offset=base + a, shape=tuple(t["shape"]))
        if arr.nbytes != b - a:
            sys.exit(f"{path}: tensor {name!r} holds {b - a} bytes, its shape needs {arr.nbytes}")
        return arr

    return meta, tensor, [k for k in head if k != "__metadata__"]


def waterfill(lam, d):
    """Water level theta with sum(min(theta, lam)) = d; lam sorted descending."""
    lo, hi = 0.0, float(lam[0])
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.minimum(mid, lam).sum() < d:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def score(groups, d):
    """groups: list of (eigenvalues descending, feature count). Returns bits
    per token, kept components and multiply-adds per token at error d."""
    lam = np.concatenate([g for g, _ in groups])
    lam = np.sort(lam)[::-1]
    theta = waterfill(lam, d)
    bits, kept, macs = 0.0, 0, 0
    for g, width in groups:
        k = g > theta
        bits += 0.5 * np.log2(g[k] / theta).sum()
        kept += int(k.sum())
        macs += int(k.sum()) * width
    return bits, kept, macs


def report(text, out):
    """Print the report; with out, also write it there (temporary file, then rename)."""
    print(text)
    if out:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, out)


def provenance():
    """Commit (with +dirty when these scripts differ from it) and CPU model, for the report."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        # dirty = the scripts that made the figures differ from the commit (a
        # report or reading being edited beside them does not count)
        mine = [os.path.join(here, f) for f in ("grouped_pca_estimate.py", "grouped_pca_heldout.py")]
        if subprocess.run(["git", "-C", here, "status", "--porcelain", "--"] + mine, capture_output=True, text=True).stdout.strip():
            commit += "+dirty"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout)"
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return commit, f"{cpu}, {os.cpu_count()} cores, numpy {np.__version__}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calib")
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 3, 5, 6, 10, 15, 30],
                    help="numbers of layer groups to try (each must divide the layer count)")
    ap.add_argument("--rel-err", type=float, nargs="+", default=[0.0025, 0.0066, 0.015, 0.045, 0.10],
                    help="squared error per token over a token's mean squared norm (variance + mean^2), "
                         "as kvtc-lab bench's rel. err K/V")
    ap.add_argument("--out", help="markdown report (default: stdout only)")
    a = ap.parse_args()
    meta, tensor, _ = load(a.calib)
    layers = json.loads(meta["layers"])
    width = int(meta["n_head_kv"]) * int(meta["head_dim"])
    n_layer = len(layers)
    if int(meta.get("n_blocks", "1")) != 1:
        sys.exit(f"{a.calib}: n_blocks is {meta['n_blocks']}, this estimate handles one cache block")
    for g in a.groups:
        if g < 1 or n_layer % g:
            sys.exit(f"--groups {g}: must divide the {n_layer} layers of {a.calib}")
    rows = []
    for kind in ("k", "v"):
        basis = np.asarray(tensor(f"{kind}.basis"), dtype=np.float64)
        var = np.asarray(tensor(f"{kind}.variance"), dtype=np.float64)
        r, p = basis.shape
        if r != p or p != n_layer * width:
            sys.exit(f"{a.calib}: {kind}.basis is [{r}, {p}], expected [{n_layer * width}, {n_layer * width}] (every component)")
        cov = (basis.T * var) @ basis
        # The codec's relative error (kvtc-lab bench, reconstruction_error)
        # divides by the tokens' squared norm, not their variance: the mean
        # counts (keys' mean is large: outlier channels).
        total = float(var.sum()) + float(np.square(np.asarray(tensor(f"{kind}.mu"), dtype=np.float64)).sum())
        # One group's spectrum is the calibration's own variance (no 5,760^2
        # eigendecomposition to redo); the others are C's diagonal blocks'.
        spectra = {1: [(np.sort(np.clip(var, 0, None))[::-1], p)]}
        for g in a.groups:
            if g == 1:
                continue
            span = n_layer // g * width
            spectra[g] = [(np.sort(np.clip(np.linalg.eigvalsh(cov[i:i + span, i:i + span]), 0, None))[::-1], span)
                          for i in range(0, p, span)]
        for e in a.rel_err:
            b1, k1, m1 = score(spectra[1], e * total)
            for g in a.groups:
                b, k, m = score(spectra[g], e * total)
                rows.append((kind, e, g, b, k, m, b / b1, m1 / m))
        del cov, basis
    L = [f"# Layer-grouped PCA, estimated from {os.path.basename(a.calib)}", "",
         f"- command: `/usr/bin/python3 bench/grouped_pca_estimate.py {a.calib} --groups {' '.join(map(str, a.groups))} --rel-err {' '.join(map(str, a.rel_err))}`",
         "- commit: {}; machine: {}".format(*provenance()),
         f"- calibration id {meta.get('calibration_id', '?')[:16]}…, {n_layer} layers x {width} features per layer, p = {n_layer * width}",
         "- Gaussian reverse water-filling on the calibration's covariance (in-sample): bits per token and kept components at the same",
         "  squared error; multiply-adds per token of the decoder's projection; bytes and speed-up against one PCA over all layers",
         "- rel. err = squared error per token / a token's mean squared norm (the calibration's variance + its mean squared), as",
         "  `kvtc-lab bench` reports it; a bound for a Gaussian source of this covariance, not the codec's bytes", "",
         "| kind | rel. err | layer groups | bits/token | kept components | decode MACs/token | bits vs 1 group | MACs fewer by |",
         "|---|---|---|---|---|---|---|---|"]
    for kind, e, g, b, k, m, rb, rm in rows:
        L.append(f"| {kind.upper()} | {e:g} | {g} | {b:,.0f} | {k:,} | {m:,} | {100 * (rb - 1):+.1f}% | {rm:.2f}x |")
    report("\n".join(L) + "\n", a.out)


if __name__ == "__main__":
    main()
