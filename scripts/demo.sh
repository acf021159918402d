#!/usr/bin/env bash
# make demo: the main job on the embedded defaults — SmolLM2-135M-Instruct,
# a real document from the evaluation corpus — captured from llama.cpp,
# compressed with kvtc, decompressed, restored into a fresh sequence and
# continued, against recomputing the prefix. Writes out/demo/.
#
# Calibration: scripts/default_calib.sh (the full one when it exists, else a
# quick one fitted once).
set -euo pipefail
kvtc=${1:-build/kvtc}
lab=$(dirname "$kvtc")/kvtc-lab  # the multi-turn session (step 4) is research tooling
top=$(cd "$(dirname "$0")/.." && pwd)
out="$top/out/demo"
mkdir -p "$out" "$top/.deps/calib"
tokens=${KVTC_DEMO_TOKENS:-2048}
ratio=${KVTC_DEMO_RATIO:-16}
# First evaluation-split prose document in manifest order (stable).
doc=$(python3 - "$top/.deps/corpus/manifest.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
d = next(d for d in m["documents"] if d["split"] == "eval" and d["kind"] == "prose" and d["tokens"] >= 2048)
print(d["file"])
PY
)
text="$top/.deps/corpus/$doc"
echo "== kvtc demo: a real llama.cpp session, compressed ${ratio}x and restored"
"$kvtc" info | sed -n 1,3p
cal=$("$top/scripts/default_calib.sh" "$kvtc")
echo
echo "== 1. prefill $tokens tokens of $doc and capture the KV cache"
"$kvtc" capture --text "$text" --max-tokens "$tokens" -o "$out/session.safetensors"
echo
echo "== 2. compress it ${ratio}x (sink 4 tokens kept raw f16, the newest 128 raw at 8 bits)"
"$kvtc" compress "$out/session.safetensors" --calib "$cal" --ratio "$ratio" -o "$out/session.kvtc"
"$kvtc" inspect "$out/session.kvtc"
echo
echo "== 3. decompress, restore into a fresh sequence, continue, and compare with recomputing the prefix"
"$kvtc" decompress "$out/session.kvtc" --calib "$cal" -o "$out/restored.safetensors" --reference "$out/session.safetensors" --json >"$out/decompress.json"
set +e
"$kvtc" restore "$out/restored.safetensors" --generate 32 --verify --json >"$out/restore.json"
rc=$?
set -e
[ $rc -eq 0 ] || [ $rc -eq 3 ] || exit $rc
python3 - "$out/decompress.json" "$out/restore.json" <<'PY'
import json, sys
d, r = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
total = d["decode_ms"] + r["restore_ms"] + r["first_logits_ms"]
print(f"  decode {d['decode_ms']:.0f} ms (relative squared error on coded tokens: K {d['rel_error_k']:.4f}, V {d['rel_error_v']:.4f})")
print(f"  restore into llama.cpp {r['restore_ms']:.0f} ms, first logits {r['first_logits_ms']:.0f} ms")
print(f"  time to first token from the .kvtc file: {total:.0f} ms; recomputing the prefix: {r['recompute_ms']:.0f} ms ({r['recompute_ms'] / total:.1f}x)")
print(f"  continuation: {r['generated']!r}")
print(f"  greedy tokens matching the recomputed run: {r['greedy_agree']} of {r['greedy_total']}; max |logit difference| {r['max_abs_logit_diff']:.3f}")
PY
echo
# kvtc-lab is built only now (make demo builds the CLI first; with the CUDA
# toolkit the lab links the GPU path, whose kernels take a while to compile).
if [ -f "$(dirname "$kvtc")/CMakeCache.txt" ]; then
  echo "== (building kvtc-lab for step 4)"
  cmake --build "$(dirname "$kvtc")" --target kvtc-lab -j"$(nproc)" >"$out/lab-build.log" 2>&1 || { tail -20 "$out/lab-build.log"; exit 1; }
fi
echo "== 4. a multi-turn chat: between turns the cache rests as .kvtc; each turn restores it, or recomputes the whole history"
"$lab" session --calib "$cal" --ratio "$ratio" --turns "${KVTC_DEMO_TURNS:-4}" --turn-tokens 400 --reply 32 -o "$out/turns"
echo
echo "Files: $out/session.safetensors (raw f16 capture), $out/session.kvtc (compressed), $out/restored.safetensors, $out/turns/turn*.kvtc."
echo "A lossy restore continues the text but may pick other words than recomputing would (step 3 counts them)."
