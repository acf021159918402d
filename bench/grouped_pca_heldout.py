#!/usr/bin/env python3
"""Layer-grouped PCA on held-out KV of the real model: bits and decode
multiply-adds at equal error (issue 32 item 3; checks grouped_pca_estimate.py,
whose figures are an in-sample Gaussian bound).

    /usr/bin/python3 bench/grouped_pca_heldout.py CALIB.safetensors CAPTURE.safetensors ...
        [--groups 1 2 3 5] [--target K_ERR V_ERR ...] [--out bench/results/grouped-pca-heldout.md]

Captures are `kvtc capture` files of texts outside the calibration (the
corpus's eval split). Keys lose their RoPE (as the codec does) and every
token becomes one row of p = layers x heads x dims features, ordered
[layer][head][dim] as the calibration's; the first --sink and last --window
tokens of each capture are left out (the codec stores them exact).

One PCA over all layers is the calibration's own basis; a layer-grouped PCA
takes the eigenvectors of the calibration's covariance C = B^T diag(var) B
restricted to each run of consecutive layers (the in-sample fit a grouped
calibration would make). Every coefficient is quantized with one uniform step, and a
component is kept only where it removes more error than its bits cost at
that step (2 ln 2 step^2 / 12 per bit, the high-rate slope; the
entropy-coded mode keeps only the components that pay, and its decoder's
GEMM skips the rest); the step is bisected
until the held-out relative error (squared error over the tokens' squared
norm, kvtc-lab bench's rel. err) meets the target. Bits per token: the
zeroth-order entropy of each component's integer codes over the held-out
tokens, summed (an ideal static coder per component, not the codec's bytes:
no chunking, headers or coder overhead; its plug-in estimate is low by
~(symbols - 1) / (2 N ln 2) bits per component, ~0.003 here, alike for both
layouts). Decode MACs per token: kept components times their group's width.
Needs numpy (Debian's python3-numpy, via the bootstrap's python3-matplotlib).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_pca_estimate import load, provenance, report  # noqa: E402


def derope(k, pos, meta, path):
    """k: [L, H, T, D] f32 keys as llama.cpp stores them; returns them with
    the rotation undone (NORM pairs 2i, 2i+1; NEOX pairs i, i + n_rot/2)."""
    if meta.get("rope_scaling_type", "none") not in ("none", "linear"):
        sys.exit(f"{path}: rope_scaling_type {meta['rope_scaling_type']!r}: this check undoes plain RoPE only (no YaRN)")
    layout = meta.get("rope_type", "norm")
    if layout not in ("norm", "neox"):
        sys.exit(f"{path}: rope_type {layout!r}, expected norm or neox")
    n_rot = int(meta["n_rot"])
    base = float(meta["rope_freq_base"])
    scale = float(meta.get("rope_freq_scale", "1"))
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    th = scale * pos[:, None].astype(np.float64) * inv[None, :]  # [T, half]
    c, s = np.cos(th), np.sin(th)
    if layout == "norm":
        a, b = np.arange(0, n_rot, 2), np.arange(1, n_rot, 2)
    else:
        a, b = np.arange(half), np.arange(half, n_rot)
    x0, x1 = k[..., a].astype(np.float64), k[..., b].astype(np.float64)
    out = k.astype(np.float64)  # a new array
    out[..., a] = x0 * c + x1 * s  # the inverse rotation
    out[..., b] = -x0 * s + x1 * c
    return out


def read_capture(path, calib_meta, sink, window):
    meta, tensor, names = load(path, expect="kvtc-capture")
    if meta.get("model_sha256") != calib_meta.get("model_sha256"):
        sys.exit(f"{path}: model_sha256 {meta.get('model_sha256', '?')[:16]}… is not the calibration's "
                 f"{calib_meta.get('model_sha256', '?')[:16]}… (a capture of another model)")
    if "k_swa" in names:
        sys.exit(f"{path}: an iSWA capture; this check handles one cache block")
    k = np.asarray(tensor("k", "F16"), dtype=np.float32)
    v = np.asarray(tensor("v", "F16"), dtype=np.float32)
    pos = np.asarray(tensor("pos", "I32"))
    L, H, T, D = k.shape
    if T <= sink + window:
        sys.exit(f"{path}: {T} tokens, fewer than --sink {sink} + --window {window} + 1")
    k = derope(k, pos, meta, path)
    keep = slice(sink, T - window)
    # [L, H, T, D] -> [T, L, H, D] -> [T, p]: the calibration's feature order
    fk = np.ascontiguousarray(k[:, :, keep, :].transpose(2, 0, 1, 3)).reshape(-1, L * H * D)
    fv = np.ascontiguousarray(v[:, :, keep, :].transpose(2, 0, 1, 3)).reshape(-1, L * H * D).astype(np.float64)
    return fk, fv


def column_entropy(q):
    """Zeroth-order entropy (bits per token) of each column of q's integers [N, m]."""
    n, m = q.shape
    lo = q.min(axis=0)
    span = (q.max(axis=0) - lo + 1).astype(np.int64)
    off = np.concatenate([[0], np.cumsum(span)[:-1]])
    counts = np.bincount(((q - lo).astype(np.int64) + off[None, :]).ravel(), minlength=int(span.sum()))
    col = np.repeat(np.arange(m), span)
    p = counts / n
    nz = counts > 0
    h = np.zeros(m)
    np.add.at(h, col[nz], -p[nz] * np.log2(p[nz]))
    return h


# Price of a bit at step s, in squared error per token: a uniform quantizer
# at high rate has D = s^2 / 12 per component and dD/dR = -2 ln 2 D, so a
# component pays for its bits when it removes more than 2 ln 2 s^2 / 12 of
# error per bit (the entropy-coded mode's rate-distortion rule, issue 32
# item 1).
LAMBDA = 2.0 * np.log(2.0) / 12.0


def code(Y, energy, step, sd=None, min_sd=None):
    """Quantize Y [N, m] at one step with the rule above (or, with min_sd,
    the codec's own rule: a component is coded where its calibration
    standard deviation sd [m] is at least min_sd x step): the columns kept,
    the summed squared error, the bits per token."""
    q = np.rint(Y / step)
    qerr = np.square(Y - step * q).sum(axis=0, dtype=np.float64)
    h = column_entropy(q.astype(np.int32))
    if min_sd is None:
        keep = (energy - qerr) > LAMBDA * step * step * Y.shape[0] * h
    else:
        keep = sd >= min_sd * step
    keep &= h > 0
    return keep, float(qerr[keep].sum() + energy[~keep].sum()), float(h[keep].sum())


def time_layouts(layouts, chunk, n_tok, rounds=7):
    """Wall ms of the decoder's projection of n_tok tokens for each layout
    (kept rows per group, group width): per chunk of tokens and per group,
    codes [chunk, kept_g] x basis [kept_g, span] in f32. The layouts are
    timed in turn, round after round, and each keeps its fastest round, so
    that a machine whose speed drifts (2-3x seen on these VMs) moves all
    of them alike."""
    rng = np.random.default_rng(0)
    ops = [[(rng.standard_normal((chunk, k), dtype=np.float32), rng.standard_normal((k, span), dtype=np.float32))
            for k in kept if k] for kept, span in layouts]
    best = [1e300] * len(ops)
    for r in range(rounds + 1):  # round 0 warms up: threads started, pages touched
        for i, o in enumerate(ops):
            t0 = time.perf_counter()
            for _ in range(8):
                for c, b in o:
                    c @ b
            if r:
                best[i] = min(best[i], time.perf_counter() - t0)
    return [b / (8 * chunk) * n_tok * 1e3 for b in best]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calib")
    ap.add_argument("captures", nargs="+")
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--target", type=float, nargs="+", default=[0.0066, 0.045, 0.015, 0.10],
                    help="pairs K V of held-out relative errors (default: DP-16x's and DP-32x's on the 8K cache, speed-ecsq-avx2.md)")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--min-sd", type=float,
                    help="keep a component where its calibration deviation is >= this x step (the codec's rule, "
                         "kvtc compress --min-sd, 0.7 by default there) instead of where it pays")
    ap.add_argument("--gemm-chunk", type=int, default=256,
                    help="tokens per decode GEMM when timing each layout's projection (numpy f32 matmul, the BLAS numpy links)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if len(a.target) % 2:
        sys.exit("--target takes pairs: K error, V error")
    meta, tensor, _ = load(a.calib)
    layers = json.loads(meta["layers"])
    n_layer = len(layers)
    width = int(meta["n_head_kv"]) * int(meta["head_dim"])
    for g in a.groups:
        if g < 1 or n_layer % g:
            sys.exit(f"--groups {g}: must divide the {n_layer} layers of {a.calib}")
    if 1 not in a.groups:  # every row is read against one PCA's
        a.groups = [1] + a.groups
    feats = [read_capture(c, meta, a.sink, a.window) for c in a.captures]
    n_tok = sum(f[0].shape[0] for f in feats)
    targets = list(zip(a.target[0::2], a.target[1::2]))
    rows = []
    for ki, kind in enumerate(("k", "v")):
        X = np.concatenate([f[ki] for f in feats])
        norm = float(np.square(X).sum())
        mu = np.asarray(tensor(f"{kind}.mu"), dtype=np.float64)
        basis = np.asarray(tensor(f"{kind}.basis"), dtype=np.float64)
        var = np.asarray(tensor(f"{kind}.variance"), dtype=np.float64)
        r, p = basis.shape
        if r != p or p != n_layer * width or X.shape[1] != p:
            sys.exit(f"{a.calib}: {kind}.basis is [{r}, {p}], captures give {X.shape[1]} features; expected [{p}, {p}] (every component)")
        X -= mu
        cov = (basis.T * var) @ basis
        for g in a.groups:
            span = p // g
            if g == 1:
                Y = (X @ basis.T).astype(np.float32)  # the calibration's own components
                sd = np.sqrt(np.clip(var, 0, None))
            else:
                parts, sds = [], []
                for i in range(0, p, span):
                    w, U = np.linalg.eigh(cov[i:i + span, i:i + span])
                    parts.append(X[:, i:i + span] @ np.ascontiguousarray(U[:, ::-1]))  # a reversed view would miss BLAS
                    sds.append(np.sqrt(np.clip(w[::-1], 0, None)))
                Y = np.concatenate(parts, axis=1).astype(np.float32)
                sd = np.concatenate(sds)
            energy = np.square(Y).sum(axis=0, dtype=np.float64)
            for tk, tv in targets:
                t = tk if kind == "k" else tv
                lo, hi = 1e-3, 1e2  # log-bisection on the step: error grows with it
                for _ in range(24):
                    mid = np.sqrt(lo * hi)
                    e = code(Y, energy, mid, sd, a.min_sd)[1] / norm
                    lo, hi = (mid, hi) if e < t else (lo, mid)
                step = lo  # the largest step tried that meets the target
                mask, err, bits = code(Y, energy, step, sd, a.min_sd)
                kept_g = [int(mask[i:i + span].sum()) for i in range(0, p, span)]
                macs = sum(k * span for k in kept_g)
                rows.append(dict(kind=kind, t=t, groups=g, step=step, err=err / norm, bits=bits, kept=int(mask.sum()), macs=macs,
                                 layout=(kept_g, span)))
            del Y
        del X, cov, basis
    for r, ms in zip(rows, time_layouts([r["layout"] for r in rows], a.gemm_chunk, 8192)):
        r["ms"] = ms
    base = {(r["kind"], r["t"]): r for r in rows if r["groups"] == 1}
    L = [f"# Layer-grouped PCA on held-out KV ({os.path.basename(a.calib)})", "",
         f"- command: `/usr/bin/python3 bench/grouped_pca_heldout.py {a.calib} {' '.join(a.captures)} --groups {' '.join(map(str, a.groups))} "
         f"--target {' '.join(map(str, a.target))} --sink {a.sink} --window {a.window}"
         + (f" --min-sd {a.min_sd:g}`" if a.min_sd is not None else "`"),
         "- commit: {}; machine: {}".format(*provenance()),
         f"- calibration id {meta.get('calibration_id', '?')[:16]}…; {n_tok:,} held-out tokens from {len(a.captures)} captures "
         f"(sink {a.sink} and window {a.window} of each left out); p = {n_layer * width}",
         ("- one uniform step for every component, a component kept where it removes more error than its bits cost (2 ln 2 step^2/12 per bit),"
          if a.min_sd is None else
          f"- one uniform step for every component, a component kept where its calibration deviation is >= {a.min_sd:g} x step (the codec's rule),"),
         "  the step bisected to the target relative error; bits/token = summed zeroth-order entropy of each kept",
         "  component's codes (not the codec's bytes); decode MACs/token = kept components x their group's width", "",
         f"- GEMM ms / 8K = the decoder's projection of 8,192 tokens in that layout, timed: numpy f32 matmul of {a.gemm_chunk}-token",
         "  chunks of random codes by each group's kept rows, wall ms, every layout timed in turn for 7 rounds and its fastest kept",
         "  (this machine's BLAS, not the codec's int8 or bf16 path)", "",
         "| kind | target rel. err | layer groups | rel. err | step | bits/token | bits vs 1 group | kept components | decode MACs/token | MACs fewer by | GEMM ms / 8K | faster by |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b1 = base[(r["kind"], r["t"])]
        L.append(f"| {r['kind'].upper()} | {r['t']:g} | {r['groups']} | {r['err']:.5f} | {r['step']:.4g} | {r['bits']:,.0f} | "
                 f"{100 * (r['bits'] / b1['bits'] - 1):+.1f}% | {r['kept']:,} | {r['macs']:,} | {b1['macs'] / r['macs']:.2f}x | "
                 f"{r['ms']:,.0f} | {b1['ms'] / r['ms']:.2f}x |")
    L += ["", "K + V at each target pair:", "",
          "| target K / V | layer groups | bits/token K+V | bits vs 1 group | decode MACs/token K+V | MACs fewer by | GEMM ms / 8K K+V | faster by |",
          "|---|---|---|---|---|---|---|---|"]
    for tk, tv in targets:
        for g in a.groups:
            pair = [r for r in rows if r["groups"] == g and r["t"] == (tk if r["kind"] == "k" else tv)]
            one = [r for r in rows if r["groups"] == 1 and r["t"] == (tk if r["kind"] == "k" else tv)]
            b, m, ms = (sum(r[f] for r in pair) for f in ("bits", "macs", "ms"))
            b1, m1, ms1 = (sum(r[f] for r in one) for f in ("bits", "macs", "ms"))
            L.append(f"| {tk:g} / {tv:g} | {g} | {b:,.0f} | {100 * (b / b1 - 1):+.1f}% | {m:,} | {m1 / m:.2f}x | {ms:,.0f} | {ms1 / ms:.2f}x |")
    report("\n".join(L) + "\n", a.out)


if __name__ == "__main__":
    main()
