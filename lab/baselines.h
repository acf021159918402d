// kvtc-lab's baselines: other ways a user could store the same cache, each
// returning the decoded cache and its bytes at rest (codes, scales and
// offsets counted); lab/methods.cpp wraps them as eval methods. Reference
// implementations for quality comparison, not tuned for speed.
#pragma once

#include <cstdint>
#include <string>

#include "kvtc/cache.h"

namespace kvtc::baselines {

// FP8 E4M3 with one f16 scale per token, layer and head (absmax / 448).
KvCapture fp8_per_token(const KvCapture& c, uint64_t* bytes);

// KIVI-style asymmetric integers (Liu et al. 2024): keys per channel (groups
// of `group` tokens along the sequence), values per token (groups of
// `group` channels), min + step in f16 per group; the most recent `recent`
// tokens, and the tokens of an unfinished key group, kept in f16.
KvCapture kivi(const KvCapture& c, int bits, uint32_t group, uint32_t recent, uint64_t* bytes);

// Lossless coding of the raw f16 K+V bytes: "zstd" or "deflate" (libdeflate)
// at `level` (-1: the strongest, zstd 19 / libdeflate 12). Returns the
// compressed size; the cache is unchanged.
uint64_t lossless_bytes(const KvCapture& c, const std::string& coder, int level = -1);

// StreamingLLM-style eviction (Xiao et al. 2024): keep the first `sink`
// tokens and the most recent ones, ceil(n / ratio) tokens in all per block;
// the others are dropped (the returned capture is shorter; kept tokens keep
// their positions). bytes = kept tokens at f16.
KvCapture streaming_evict(const KvCapture& c, double ratio, uint32_t sink, uint64_t* bytes);

// Per-prompt low-rank SVD in the manner of xKV (Chang et al. 2025): for
// each group of `group_layers` adjacent layers and each of K (de-RoPEd, as
// ShadowKV/xKV factor pre-RoPE keys) and V, the tokens between the raw sink
// and window are centred and factored as X ~ A B with rank chosen so that
// A [T x r], B [r x m] and the mean [m], all f16, fit target_bytes split
// evenly over groups and K/V. Sink and window stay raw (as kvtc's do), so
// the sizes compare like for like. bytes = stored factors + raw tokens.
KvCapture svd_lowrank(const KvCapture& c, uint64_t target_bytes, uint32_t group_layers, uint32_t sink, uint32_t window, uint64_t* bytes);

}  // namespace kvtc::baselines
