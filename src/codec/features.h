// Internal: the per-token feature vector of docs/method.md §1 — all layers and KV
// heads of one cache block concatenated, keys with RoPE removed.
//
// Feature index f = (layer * n_head_kv + head) * head_dim + dim, so
// p = n_layer * n_head_kv * head_dim (5,760 for SmolLM2-135M).
// Thread safety: pure functions over caller-owned buffers.
#pragma once

#include <cstdint>

#include "kvtc/cache.h"

namespace kvtc {

enum class KvKind { kKey, kValue };

// out[t - t0][f] for tokens t0..t1-1 of block b; keys are de-RoPEd with
// `rope` at each token's position (nullptr: as stored; values never).
void gather_features(const KvBlock& b, KvKind kind, const Rope* rope, uint32_t t0, uint32_t t1, float* out);

// Inverse: re-applies RoPE to keys and writes f16 into b (rounding to
// nearest even) for tokens t0..t1-1; `in` is [t1 - t0][p] and is modified
// (used as scratch).
void scatter_features(float* in, KvKind kind, const Rope* rope, uint32_t t0, uint32_t t1, KvBlock& b);

}  // namespace kvtc
