#!/usr/bin/env bash
# Codec speed, restore vs recompute (kvtc-lab bench), with the command, commit
# and machine on top. Usage: bench/speed.sh NAME [kvtc-lab bench options…]
# Writes bench/results/NAME.md and NAME.json.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
name=$1
shift
# shellcheck source=bench/lib.sh
. "$top/bench/lib.sh"
lab_result "$name" bench "$@"
commit=$(result_commit)
cpu=$(result_cpu features)
{
  echo "# kvtc speed: $name"
  echo
  echo "- command: \`bench/speed.sh $name $*\`"
  echo "- commit: $commit"
  echo "- machine: $cpu, $(nproc) threads, $(uname -sr)"
  # SPEED_MODEL: another model's description (bench/swa.sh), when -m names one.
  echo "- model: ${SPEED_MODEL:-SmolLM2-135M-Instruct Q4_1 (30 layers x 3 KV heads x 64 dims; 23,040 bytes of f16 K+V per token)}; llama.cpp built x86-64-v3 (AVX2/FMA/F16C), not -march=native"
  echo "- columns: proj = the projection's precision (auto = encode bf16 where oneDNN has an AVX512-BF16 or AMX kernel, else f32; decode int8 on AVX2 (on AMX where oneDNN has its int8 kernel), bf16 instead where native without AVX-512 VNNI);"
  echo "  compress/decompress = wall ms, fastest of --repeat runs; GB/s = raw f16 K+V bytes per second; stages = thread-ms summed over"
  echo "  threads (gather = f16->f32 + (de-)RoPE + layout, center = mean (bf16: with the rounding of the GEMM input), proj = GEMM,"
  echo "  quant = quantize+pack or unpack+dequantize, entropy = DEFLATE + raw sections); proj GFLOP/s = projection flops / its"
  echo "  thread-time x threads, encode/decode; rel. err K/V = relative squared error of the coded tokens after the round trip;"
  echo "  peak +MB = VmHWM growth over the codec calls;"
  echo "  restore = decompress + llama.cpp state load; recompute = llama.cpp prefill of the same tokens; (tiled) = past the model's"
  echo "  8K trained context, the real 8K capture repeated: codec time only"
  cat "$res/$name.body.part"
  # A hand-written reading of the figures, kept beside them (update it when they change).
  [ ! -f "$res/$name-reading.md" ] || cat "$res/$name-reading.md"
} >"$res/$name.md.part"
finish_result "$name"
