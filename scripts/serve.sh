#!/usr/bin/env bash
# make serve: kvtc-server on the default model (SmolLM2-135M-Instruct) with
# the default calibration (scripts/default_calib.sh), on 127.0.0.1. Prints
# the URL and the flags in effect, then runs in the foreground (Ctrl-C stops
# it; the disk tier keeps the compressed prompts for the next start).
# Settings (environment): PORT (8080), CACHE_RAM MiB of compressed prompts
# in RAM (1024), KVTC_RATIO (16), KVTC_DISK (out/serve/store), KVTC_DISK_MIB
# (4096), PARALLEL slots (2), CTX tokens in all (16384); SERVER_ARGS: more
# llama-server flags.
set -euo pipefail
build=${1:-build}
top=$(cd "$(dirname "$0")/.." && pwd)
server="$build/kvtc-server"
[ -x "$server" ] || { echo "serve: $server missing (run make)" >&2; exit 1; }
cal=$("$top/scripts/default_calib.sh" "$build/kvtc")
model="$top/.deps/models/SmolLM2-135M-Instruct.Q4_1.gguf"
port=${PORT:-8080}
disk=${KVTC_DISK:-$top/out/serve/store}
mkdir -p "$disk"
args=(-m "$model" --host 127.0.0.1 --port "$port" -c "${CTX:-16384}" --parallel "${PARALLEL:-2}" --metrics --slots
  --cache-ram "${CACHE_RAM:-1024}" --kvtc-calib "$cal" --kvtc-ratio "${KVTC_RATIO:-16}" --kvtc-disk "$disk"
  --kvtc-disk-mib "${KVTC_DISK_MIB:-4096}")
# shellcheck disable=SC2206
extra=(${SERVER_ARGS:-})
echo "kvtc-server: http://127.0.0.1:$port  (OpenAI-compatible: /v1/chat/completions; /completion, /health, /slots, /metrics)"
echo "flags: ${args[*]} ${extra[*]}"
echo "try:   curl -s http://127.0.0.1:$port/v1/chat/completions -H 'Content-Type: application/json' \\"
echo "         -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"max_tokens\":32}'"
echo
exec "$server" "${args[@]}" "${extra[@]}"
