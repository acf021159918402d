#!/usr/bin/env python3
"""Compression ratio and reconstruction error of kvtc on evaluation-corpus
caches, and the bits-per-component plots (the paper's Figure 6).

    python3 bench/ratio.py --calib CAL.safetensors [--docs-per-kind 2] [--tokens 4096]

Writes bench/results/ratio.md, bench/results/ratio.json and
bench/results/bits_per_component_{keys,values}.png. Only the standard
library: the PNGs come from the tiny writer below.
"""
import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import zlib

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIOS = [8, 16, 32, 64]


def run(kvtc, *args):
    p = subprocess.run([kvtc, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"kvtc {' '.join(args)} failed:\n{p.stderr}")
    return p.stdout


def safetensors_meta(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)).get("__metadata__", {})


# ---- a minimal PNG line plot --------------------------------------------
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
FONT = {  # 3x5 digits for axis labels
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111", "4": "101101111001001",
    "5": "111100111001111", "6": "111100111101111", "7": "111001001001001", "8": "111101111101111", "9": "111101111001111",
    "x": "000101010101000", " ": "000000000000000",
}


def png(path, w, h, pix):
    raw = b"".join(b"\x00" + bytes(v for px in pix[y * w:(y + 1) * w] for v in px) for y in range(h))
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    with open(path + ".tmp", "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    os.replace(path + ".tmp", path)


def plot(path, series, x_max, y_max=8):
    """series: [(label, color, [bits per component])]: steps over component index."""
    W, H, L, B, T, R = 900, 420, 50, 40, 20, 150
    pix = [(255, 255, 255)] * (W * H)

    def put(x, y, c):
        if 0 <= x < W and 0 <= y < H:
            pix[y * W + x] = c

    def text(x, y, s, c=(0, 0, 0)):
        for k, ch in enumerate(s):
            g = FONT.get(ch, FONT[" "])
            for i in range(15):
                if g[i] == "1":
                    for dy in range(2):
                        for dx in range(2):
                            put(x + k * 8 + (i % 3) * 2 + dx, y + (i // 3) * 2 + dy, c)

    pw, ph = W - L - R, H - T - B
    for yb in range(0, y_max + 1, 2):  # grid and y labels (bits)
        yy = T + ph - int(ph * yb / y_max)
        for x in range(L, L + pw):
            put(x, yy, (225, 225, 225))
        text(L - 14, yy - 5, str(yb))
    for xi in range(0, 6):  # x labels (component index)
        xv = int(x_max * xi / 5)
        xx = L + int(pw * xi / 5)
        for y in range(T, T + ph):
            put(xx, y, (235, 235, 235))
        text(xx - 8, T + ph + 8, str(xv))
    for x in range(L, L + pw):
        put(x, T + ph, (0, 0, 0))
    for y in range(T, T + ph):
        put(L, y, (0, 0, 0))
    for si, (label, color, bits) in enumerate(series):
        prev = None
        for xx in range(pw):
            i = min(len(bits) - 1, int(xx * x_max / pw)) if bits else 0
            b = bits[i] if i < len(bits) else 0
            yy = T + ph - int(ph * b / y_max) - si  # offset so equal steps stay visible
            if prev is not None:
                for y in range(min(prev, yy), max(prev, yy) + 1):
                    put(L + xx, y, color)
            put(L + xx, yy, color)
            put(L + xx, yy + 1, color)
            prev = yy
        for dx in range(20):
            for dy in range(3):
                put(W - R + 15 + dx, T + 20 + 22 * si + dy, color)
        text(W - R + 40, T + 16 + 22 * si, label, color)
    png(path, W, H, pix)


def bits_per_component(table, r):
    bits = [0.0] * r
    for start, size, typ in table["blocks"]:
        code = {0: 0, 1: 2, 2: 4, 3: 8}[typ]
        for i in range(start, start + size):
            bits[i] = code
    return bits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvtc", default=os.path.join(TOP, "build", "kvtc"))
    ap.add_argument("--calib", required=True)
    ap.add_argument("--docs-per-kind", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--work", default=os.path.join(TOP, "out", "bench-ratio"))
    ap.add_argument("--results", default=os.path.join(TOP, "bench", "results"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.results, exist_ok=True)
    corpus = os.path.join(TOP, ".deps", "corpus")
    with open(os.path.join(corpus, "manifest.json")) as f:
        manifest = json.load(f)
    docs = []
    for kind in ("prose", "docs", "code", "math"):
        docs += [d for d in manifest["documents"] if d["split"] == "eval" and d["kind"] == kind and d["tokens"] >= a.tokens][: a.docs_per_kind]
    info = json.loads(run(a.kvtc, "info", "--json"))
    cal_meta = safetensors_meta(a.calib)
    rows = {r: {"f16_coded": 0, "stored_coded": 0, "payload_coded": 0, "f16_all": 0, "file": 0, "ek": [], "ev": [], "per_kind": {}} for r in RATIOS}
    for d in docs:
        cap = os.path.join(a.work, os.path.basename(d["file"]) + f".{a.tokens}.safetensors")
        if not os.path.exists(cap):
            run(a.kvtc, "capture", "--text", os.path.join(corpus, d["file"]), "--max-tokens", str(a.tokens), "-o", cap)
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
        print(f"[ratio] {d['id']}: done", file=sys.stderr)

    # DEFLATE level: size and encode time at 16x on the first document.
    levels = []
    cap0 = os.path.join(a.work, os.path.basename(docs[0]["file"]) + f".{a.tokens}.safetensors")
    for lv in (0, 1, 3, 6, 9, 12):
        c = json.loads(run(a.kvtc, "compress", cap0, "--calib", a.calib, "-r", "16", "--level", str(lv), "-o", os.path.join(a.work, "lv.kvtc"), "--json"))
        levels.append({"level": lv, "ratio_compressed_tokens": c["ratio_compressed_tokens"], "encode_ms": c["encode_ms"]})

    commit = subprocess.run(["git", "-C", TOP, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", TOP, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    cmd = "python3 bench/ratio.py --calib " + os.path.relpath(a.calib, TOP) + f" --docs-per-kind {a.docs_per_kind} --tokens {a.tokens}"
    result = {"command": cmd, "commit": commit + ("+dirty" if dirty else ""), "machine": f"{info['cpu']['brand']}, {os.cpu_count()} threads, {platform.system()} {platform.release()}",
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
        })
    with open(os.path.join(a.results, "ratio.json.tmp"), "w") as f:
        json.dump(result, f, indent=1)
    os.replace(os.path.join(a.results, "ratio.json.tmp"), os.path.join(a.results, "ratio.json"))

    # Figure 6: bits per component from the calibration's tables.
    for kind, name in (("k", "keys"), ("v", "values")):
        cinfo = json.loads(cal_meta[f"{kind}.info"])
        series = []
        for i, r in enumerate(RATIOS):
            t = cinfo["tables"].get(str(r))
            if t:
                series.append((f"{r}x", COLORS[i], bits_per_component(t, cinfo["r"])))
        used = max((max((s + z for s, z, ty in cinfo["tables"][str(r)]["blocks"] if ty), default=0) for r in RATIOS if str(r) in cinfo["tables"]), default=1)
        plot(os.path.join(a.results, f"bits_per_component_{name}.png"), series, x_max=max(64, int(used * 1.1)))

    L = [
        "# kvtc compression ratio on evaluation-corpus caches",
        "",
        f"- command: `{cmd}`",
        f"- commit: {result['commit']}",
        f"- machine: {result['machine']}",
        f"- model: SmolLM2-135M-Instruct (p = 5,760 features per token for K and for V)",
        f"- calibration: {cal_meta.get('calib_tokens')} tokens from {cal_meta.get('calib_documents')} calibration documents, "
        f"{cal_meta.get('heldout_tokens')} held-out tokens, id {str(cal_meta.get('calibration_id'))[:16]}…",
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
        f"window tokens included; they weigh more at shorter contexts).",
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
        "![keys](bits_per_component_keys.png)",
        "",
        "![values](bits_per_component_values.png)",
    ]
    with open(os.path.join(a.results, "ratio.md.tmp"), "w") as f:
        f.write("\n".join(L) + "\n")
    os.replace(os.path.join(a.results, "ratio.md.tmp"), os.path.join(a.results, "ratio.md"))
    print("\n".join(L[9:16]))


if __name__ == "__main__":
    main()
