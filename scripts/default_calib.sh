#!/usr/bin/env bash
# Prints the default model's calibration (make demo, make serve): the full
# one (make calibrate, 160K tokens, ~25 min) when it exists, else a quick
# one (16K tokens, ~2 min), fitted here once and cached in .deps/calib/.
# Usage: scripts/default_calib.sh KVTC_BIN   (messages on stderr)
set -euo pipefail
kvtc=${1:-build/kvtc}
top=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$top/.deps/calib"
full="$top/.deps/calib/smollm2-160k.safetensors"
quick="$top/.deps/calib/smollm2-quick16k.safetensors"
if [ -f "$full" ]; then
  echo "calibration: $full (160K tokens)" >&2
  echo "$full"
  exit 0
fi
if [ ! -f "$quick" ]; then
  echo "calibration: none yet; fitting a quick one on 16K calibration tokens (~2 min; make calibrate does the full 160K)" >&2
  "$kvtc" calibrate --tokens 16000 --heldout 2048 --doc-tokens 2048 -o "$quick" | sed -n 1,2p >&2
else
  echo "calibration: $quick (quick, 16K tokens; make calibrate for the full one)" >&2
fi
echo "$quick"
