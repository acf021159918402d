#!/usr/bin/env bash
# make demo: the main job on the embedded defaults — SmolLM2-135M-Instruct,
# a real document from the evaluation corpus — captured from llama.cpp,
# written to a file, restored into a fresh sequence and continued.
# Writes out/demo/session.safetensors.
set -euo pipefail
kvtc=${1:-build/kvtc}
top=$(cd "$(dirname "$0")/.." && pwd)
out="$top/out/demo"
mkdir -p "$out"
tokens=${KVTC_DEMO_TOKENS:-2048}
# First evaluation-split prose document in manifest order (stable).
doc=$(python3 - "$top/.deps/corpus/manifest.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
d = next(d for d in m["documents"] if d["split"] == "eval" and d["kind"] == "prose" and d["tokens"] >= 2048)
print(d["file"])
PY
)
text="$top/.deps/corpus/$doc"
echo "== kvtc demo: capture a real llama.cpp session and restore it"
"$kvtc" info | sed -n 1,3p
echo
echo "== 1. prefill $tokens tokens of $doc and capture the KV cache"
"$kvtc" capture --text "$text" --max-tokens "$tokens" -o "$out/session.safetensors"
echo
echo "== 2. restore it into a fresh sequence, continue, and check against recomputing the prefix"
"$kvtc" restore "$out/session.safetensors" --generate 32 --verify
echo
echo "The capture is plain safetensors (k, v, pos, tokens + metadata): $out/session.safetensors"
echo "Compression arrives with the codec (issue 3); this is the raw f16 baseline it will shrink."
