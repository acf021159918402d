#!/usr/bin/env bash
# make check-long: a capture at the model's full trained context (8,192
# tokens for SmolLM2-135M), bytes per token checked against the geometry,
# then restored and compared with recomputing the prefix. Writes the figures
# to bench/results/capture.md with the command, commit and machine.
# Takes ~3 minutes on 2 cores (two 8K prefills).
set -euo pipefail
kvtc=${1:-build/kvtc}
top=$(cd "$(dirname "$0")/.." && pwd)
out="$top/out/long"
mkdir -p "$out"
info=$("$kvtc" info --json)
n_ctx=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["default_model"]["n_ctx_train"])' "$info")
doc=$(python3 - "$top/.deps/corpus/manifest.json" "$n_ctx" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
n = int(sys.argv[2])
d = next(d for d in m["documents"] if d["split"] == "eval" and d["tokens"] >= n)
print(d["file"])
PY
)
echo "== capture of $n_ctx tokens (the full trained context) of $doc"
"$kvtc" capture --text "$top/.deps/corpus/$doc" --max-tokens "$n_ctx" -o "$out/full.safetensors" --json | tee "$out/capture.json"
echo "== restore with 32 tokens of room, generate 32, compare with recomputing"
"$kvtc" restore "$out/full.safetensors" --ctx $((n_ctx + 32)) --generate 32 --verify --json | tee "$out/restore.json"
python3 - "$info" "$out/capture.json" "$out/restore.json" "$doc" "$top/bench/results/capture.md" <<'PY'
import json, os, platform, subprocess, sys
info, cap, res = json.loads(sys.argv[1]), json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
doc, dest = sys.argv[4], sys.argv[5]
m = info["default_model"]
want = m["n_layer"] * m["n_head_kv"] * m["head_dim"] * 2 * 2
assert cap["bytes_per_token"] == want, (cap["bytes_per_token"], want)
assert cap["tokens"] == m["n_ctx_train"], cap["tokens"]
assert res["greedy_agree"] == 32, res
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
lines = [
    "# Capture and restore at the full trained context",
    "",
    f"- command: `make check-long` (scripts/check_long.sh)",
    f"- commit: {commit}{' (with uncommitted changes)' if dirty else ''}",
    f"- machine: {info['cpu']['brand']}, {os.cpu_count()} threads, {platform.system()} {platform.release()}; llama.cpp {info['llama_cpp_commit']} ({info.get('llama_cpp_cpu', 'x86-64-v3')} build)",
    f"- model: {m['name']} ({m['desc']}), {m['n_layer']} layers x {m['n_head_kv']} KV heads x {m['head_dim']} dims",
    f"- text: .deps/corpus/{doc} (evaluation split)",
    "",
    "| quantity | value |",
    "|---|---|",
    f"| tokens captured | {cap['tokens']} (n_ctx {cap['n_ctx']}) |",
    f"| bytes per token (K+V, f16) | {cap['bytes_per_token']} = {m['n_layer']} x {m['n_head_kv']} x {m['head_dim']} x 2 x 2 |",
    f"| raw KV | {cap['kv_bytes'] / 2**20:.1f} MiB; capture file {cap['file_bytes'] / 2**20:.1f} MiB |",
    f"| prefill (llama.cpp, flash attention on) | {cap['prefill_ms']:.0f} ms ({cap['prefill_tokens_per_s']:.0f} tokens/s) |",
    f"| state get + parse | {cap['state_get_ms']:.0f} ms |",
    f"| capture file load | {res['capture_load_ms']:.0f} ms |",
    f"| state restore (blob rebuild + llama_state_seq_set_data) | {res['restore_ms']:.0f} ms |",
    f"| first logits after restore (re-decode last token) | {res['first_logits_ms']:.0f} ms |",
    f"| recompute of the prefix | {res['recompute_ms']:.0f} ms |",
    f"| restore + first logits vs recompute | {res['speedup']:.1f}x faster |",
    f"| max abs logit difference vs recompute | {res['max_abs_logit_diff']:g} |",
    f"| greedy tokens matching recompute | {res['greedy_agree']} of {res['greedy_total']} |",
    "",
    "Uncompressed restore: the file is read from the page cache. The codec",
    "(issue 3) replaces the raw f16 file with a compressed one.",
]
os.makedirs(os.path.dirname(dest), exist_ok=True)
open(dest, "w").write("\n".join(lines) + "\n")
print(f"wrote {dest}")
PY
