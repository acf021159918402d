#!/usr/bin/env python3
"""Why fp8 and q4_0 caches fail on Qwen2 and not on SmolLM2: the keys'
constant channels (Qwen2's K projection has a bias) against the
quantizers' scale groups.

    python3 bench/key_outliers.py [--models qwen smollm2] [--tokens 512]

For each model: a capture of the first evaluation-split prose document
(`kvtc capture`), then, on keys and values, the largest per-channel mean
over tokens against the channels' spread over tokens, and the error of
three round trips simulated here in numpy the way lab/baselines.cpp and
llama.cpp do them:
  fp8    E4M3, one f16 scale (amax / 448) per head row (head_dim values);
  q8_0   int8, one f16 scale (amax / 127) per 32 values (llama.cpp);
  q4_0   4-bit, one f16 scale (signed max / -8) per 32 values (llama.cpp);
  fp8 centred: fp8 after subtracting each channel's mean over tokens
         (what kvtc's PCA does first), the mean added back.
Errors are given over two denominators: the whole signal ||x||^2, and its
token-varying part ||x - mean_t(x)||^2. A per-channel constant adds the same
q.b to every key's logit, which the softmax ignores; what the attention sees
is the token-varying part, so the second is the one that predicts damage.

Writes bench/results/key-outliers.{md,json}. Needs numpy (Debian 12:
python3-numpy, with python3-matplotlib; see bench/debian_python.py).
"""
import argparse
import json
import os
import platform
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import debian_python  # noqa: E402
import provenance  # noqa: E402

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(kvtc, *args):
    p = subprocess.run([kvtc, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"kvtc {' '.join(args)} failed:\n{p.stderr}")
    return p.stdout


def load_capture(np, path):
    """k, v as float32 arrays [layers, kv_heads, tokens, head_dim], and the metadata."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name in ("k", "v"):
        t = head[name]
        if t["dtype"] != "F16":
            sys.exit(f"{path}: tensor {name}: dtype {t['dtype']}, expected F16")
        s, e = t["data_offsets"]
        out[name] = np.frombuffer(data[s:e], dtype=np.float16).reshape(t["shape"]).astype(np.float32)
    return out["k"], out["v"], head.get("__metadata__", {})


def f16(np, x):
    return x.astype(np.float16).astype(np.float32)


def e4m3(np, y):
    """Round to the nearest E4M3 value (3 mantissa bits, normal exponents from
    -6, subnormal step 2^-9, saturating at 448); ties away from zero, which
    differs from lab's ties-to-even on a measure-zero set only."""
    a = np.abs(y)
    e = np.maximum(np.floor(np.log2(np.maximum(a, 1e-30))), -6.0)
    step = 2.0 ** (e - 3)
    return np.sign(y) * np.minimum(np.floor(a / step + 0.5) * step, 448.0)


def fp8_rows(np, x):
    s = f16(np, np.abs(x).max(-1, keepdims=True) / 448.0)
    s = np.where(s > 0, s, 1.0)
    return e4m3(np, x / s) * s


def groups(x):
    return x.reshape(*x.shape[:-1], -1, 32)


def q8_0(np, x):
    g = groups(x)
    d = f16(np, np.abs(g).max(-1, keepdims=True) / 127.0)
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    return (np.round(g * inv) * d).reshape(x.shape)


def q4_0(np, x):
    g = groups(x)
    idx = np.abs(g).argmax(-1)[..., None]
    mx = np.take_along_axis(g, idx, -1)  # the signed value of largest magnitude
    d = f16(np, mx / -8.0)
    inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0)
    q = np.minimum(15.0, np.trunc(g * inv + 8.5))
    return ((q - 8.0) * d).reshape(x.shape)


def fp8_centred(np, x):
    m = x.mean(2, keepdims=True)
    return fp8_rows(np, x - m) + m


METHODS = [("fp8", fp8_rows), ("q8_0", q8_0), ("q4_0", q4_0), ("fp8 centred", fp8_centred)]


def analyse(np, x):
    mean = x.mean(2)  # [layers, heads, channels]
    std = x.std(2)
    centred = x - mean[:, :, None, :]
    e_all, e_var = float((x * x).sum()), float((centred * centred).sum())
    li, hi, ci = (int(i) for i in np.unravel_index(np.abs(mean).argmax(), mean.shape))
    r = {
        "max_abs_channel_mean": float(np.abs(mean).max()),
        "at_layer_head_channel": [li, hi, ci],
        "its_std_over_tokens": float(std[li, hi, ci]),
        "median_channel_std": float(np.median(std)),
        "constant_share_of_energy": 1.0 - e_var / e_all,
        "methods": {},
    }
    for name, f in METHODS:
        d = f(np, x) - x
        err = float((d * d).sum())
        r["methods"][name] = {"rel_error": err / e_all, "rel_error_token_varying": err / e_var}
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvtc", default=os.path.join(TOP, "build", "kvtc"))
    ap.add_argument("--models", nargs="+", default=["qwen", "smollm2"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--work", default=os.path.join(TOP, "out", "bench-key-outliers"))
    ap.add_argument("--results", default=os.path.join(TOP, "bench", "results"))
    a = ap.parse_args()
    try:
        np = debian_python.require("numpy", "python3-numpy", __file__)
    except debian_python.Missing as e:
        sys.exit(f"bench/key_outliers.py: {e}")
    os.makedirs(a.work, exist_ok=True)
    doc = corpus.documents("eval", ["prose"], a.tokens)[0]
    models = {}
    for m in a.models:
        cap = os.path.join(a.work, f"{m}.{a.tokens}.safetensors")
        if not os.path.exists(cap):
            run(a.kvtc, "capture", "--model", m, "--text", corpus.path(doc), "--max-tokens", str(a.tokens),
                "--ctx", str(max(a.tokens, 512)), "-o", cap)
        k, v, meta = load_capture(np, cap)
        models[m] = {"model": meta.get("model_name", m), "arch": meta.get("arch"), "shape": list(k.shape), "k": analyse(np, k), "v": analyse(np, v)}
        print(f"[key-outliers] {m}: done", file=sys.stderr)

    info = json.loads(run(a.kvtc, "info", "--json"))
    cmd = "python3 bench/key_outliers.py --models " + " ".join(a.models) + f" --tokens {a.tokens}"
    result = {"command": cmd, "commit": provenance.result_commit(TOP),
              "machine": f"{info['cpu']['brand']}, {os.cpu_count()} threads, {platform.system()} {platform.release()}",
              "document": doc["id"], "tokens": a.tokens, "models": models}
    md = ["# Constant key channels against the quantizers' scale groups", "",
          f"- command: `{cmd}`", f"- commit: {result['commit']}", f"- machine: {result['machine']}",
          f"- data: the first {a.tokens} tokens of `{doc['id']}` (evaluation split, prose), one capture per model; "
          "quantizers simulated in numpy as lab/baselines.cpp (fp8) and llama.cpp (q8_0, q4_0) compute them", "",
          "Error = squared error of the round trip over the signal's energy: over all of it, and over its token-varying part "
          "(each channel's mean over tokens removed), which is what the softmax sees.", ""]
    for m, r in models.items():
        md += [f"## {r['model']} ({r['arch']}, cache {' x '.join(map(str, r['shape']))})", "",
               "| | largest channel mean (layer, head, channel) | its std over tokens | median channel std | constant share of energy |",
               "|---|---|---|---|---|"]
        for kind in ("k", "v"):
            x = r[kind]
            md.append(f"| {kind.upper()} | {x['max_abs_channel_mean']:.1f} ({', '.join(map(str, x['at_layer_head_channel']))}) | "
                      f"{x['its_std_over_tokens']:.2f} | {x['median_channel_std']:.2f} | {100 * x['constant_share_of_energy']:.1f}% |")
        md += ["", "| round trip | K error (all) | K error (token-varying) | V error (all) | V error (token-varying) |", "|---|---|---|---|---|"]
        for name, _ in METHODS:
            kk, vv = r["k"]["methods"][name], r["v"]["methods"][name]
            md.append(f"| {name} | {kk['rel_error']:.2e} | {kk['rel_error_token_varying']:.2e} | {vv['rel_error']:.2e} | {vv['rel_error_token_varying']:.2e} |")
        md.append("")
    os.makedirs(a.results, exist_ok=True)
    with open(os.path.join(a.results, "key-outliers.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    with open(os.path.join(a.results, "key-outliers.md"), "w") as f:
        f.write("\n".join(md))
    print(f"wrote {os.path.join(a.results, 'key-outliers.md')}")


if __name__ == "__main__":
    main()
