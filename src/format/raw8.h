// Internal: window tokens at 8 bits (container version 3, section kind 5
// "raw8"; docs/format.md "Raw tokens at 8 bits"). Keys get one f16 scale
// per channel (layer, head, dim) over the section's tokens, values one per
// token (layer, head, token) over the head's dims: keys carry outlier
// channels (bench/results/key-outliers.md) that a per-token scale would
// spread over every other channel of the token, values do not (KIVI's
// split). Codes are int8 in [-127, 127]: x ~ code x scale, scale = the
// group's max |x| / 127 rounded to f16.
// Why: at 4K tokens the 128-token f16 window is ~1/3 of a 16x container;
// 8 bits per value plus the scales halve it.
// Thread safety: pure functions over caller buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvtc/cache.h"

namespace kvtc::container {

// Payload bytes of n tokens of kind kv (0 keys, 1 values) of a block:
// per (layer, head), its scales (head_dim for keys, n for values) as f16,
// then n x head_dim int8 codes [token][dim].
uint64_t raw8_bytes(const BlockGeometry& g, uint32_t kv, uint32_t n);

// Tokens [t0, t1) of kind kv of kb. Every value must be finite (compress
// refuses others with their place before it gets here); Error otherwise.
std::vector<uint8_t> raw8_encode(const KvBlock& kb, uint32_t kv, uint32_t t0, uint32_t t1);

// The inverse into the raw section's layout: out[(lh * n + t) * head_dim + d]
// f16 for lh < n_layer x n_head_kv (n x features values). len must be
// raw8_bytes(g, kv, n) (checked; Error names `where`).
void raw8_decode(const uint8_t* p, size_t len, const BlockGeometry& g, uint32_t kv, uint32_t n, uint16_t* out, const std::string& where);

}  // namespace kvtc::container
