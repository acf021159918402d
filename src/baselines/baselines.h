// kvtc eval baselines: other ways a user could store the same cache, each
// returning the decoded cache and its bytes at rest (codes, scales and
// offsets counted). Reference implementations for quality comparison, not
// tuned for speed.
#pragma once

#include <cstdint>
#include <string>

#include "kvtc/kv_capture.h"

namespace kvtc::baselines {

// FP8 E4M3 with one f16 scale per token, layer and head (absmax / 448).
KvCapture fp8_per_token(const KvCapture& c, uint64_t* bytes);

// KIVI-style asymmetric integers (Liu et al. 2024): keys per channel (groups
// of `group` tokens along the sequence), values per token (groups of
// `group` channels), min + step in f16 per group; the most recent `recent`
// tokens, and the tokens of an unfinished key group, kept in f16.
KvCapture kivi(const KvCapture& c, int bits, uint32_t group, uint32_t recent, uint64_t* bytes);

// Lossless coding of the raw f16 K+V bytes: "zstd" (level 19) or "deflate"
// (libdeflate level 12). Returns the compressed size; the cache is unchanged.
uint64_t lossless_bytes(const KvCapture& c, const std::string& coder);

}  // namespace kvtc::baselines
