#include "format/chunk.h"

#include <algorithm>
#include <array>
#include <string>

#include "core/scalar.h"
#include "format/ecsq.h"
#include "format/quantizers.h"
#include "kvtc/error.h"

namespace kvtc::container {

std::vector<PlaneSpan> chunk_layout(const std::vector<BlockAlloc>& alloc, uint32_t n) {
  std::vector<PlaneSpan> out;
  out.reserve(alloc.size());
  size_t off = 0;
  for (const BlockAlloc& b : alloc) {
    const Quantizer& q = quantizer(b.type);
    PlaneSpan s;
    s.blk = b;
    s.params = off;
    s.codes = off + size_t(n) * 2 * q.n_params;
    s.end = s.codes + (size_t(n) * b.size * q.code_bits + 7) / 8;
    off = s.end;
    out.push_back(s);
  }
  return out;
}

size_t packed_bytes(const Allocation& alloc, uint32_t n) {
  // Entropy-coded: the worst case, every code escaped with a 25-bit value
  // and a 20-bit shift (at most 62 bits, under 8 bytes; kLanes32's symbol
  // words take 2 bytes a code but its escapes and shifts together 31 bits
  // at most), plus rANS flush slack; the larger of the layouts' fixed parts.
  if (is_ecsq(alloc)) {
    require(alloc.blocks.size() == 1, "an entropy-coded allocation must be one block, found " + std::to_string(alloc.blocks.size()));
    return ecsq_fixed_bytes(alloc.blocks[0].size, EcsqLayout::kLanes32) + size_t(n) * alloc.blocks[0].size * 8 + 64;
  }
  size_t bytes = 0;
  for (const BlockAlloc& b : alloc.blocks) {
    const Quantizer& q = quantizer(b.type);
    bytes += size_t(n) * 2 * q.n_params + (size_t(n) * b.size * q.code_bits + 7) / 8;
  }
  return bytes;
}

uint32_t r_used(const std::vector<BlockAlloc>& alloc) {
  return alloc.empty() ? 0 : alloc.back().start + alloc.back().size;
}

std::vector<uint8_t> pack_chunk(const float* d, uint32_t n, uint32_t ld, const std::vector<BlockAlloc>& alloc) {
  const std::vector<PlaneSpan> layout = chunk_layout(alloc, n);
  std::vector<uint8_t> packed(layout.empty() ? 0 : layout.back().end, 0);
  std::vector<uint16_t> params(size_t(n) * 2);
  std::vector<uint8_t> all_codes;
  for (const PlaneSpan& ps : layout) {
    const BlockAlloc& blk = ps.blk;
    const Quantizer& q = quantizer(blk.type);
    if (q.rule == QRule::kZero) continue;
    all_codes.resize(size_t(n) * blk.size);
    for (uint32_t t = 0; t < n; ++t)
      quantize_block(q, d + size_t(t) * ld + blk.start, blk.size, &all_codes[size_t(t) * blk.size], &params[size_t(t) * 2]);
    // Parameters as a low-byte plane then a high-byte plane (the high bytes,
    // sign and exponent, repeat a lot), codes component-major (one
    // component's codes for all tokens share a distribution): +1.5% ratio,
    // measured (docs/format.md).
    uint8_t* pp = &packed[ps.params];
    for (uint32_t k = 0; k < q.n_params; ++k, pp += 2 * size_t(n))
      for (uint32_t t = 0; t < n; ++t) {
        pp[t] = uint8_t(params[size_t(t) * 2 + k]);
        pp[n + t] = uint8_t(params[size_t(t) * 2 + k] >> 8);
      }
    // Code j (= component * n + token) at bit j * cb; cb divides 8
    // (quantizers_are_consistent), so a code never straddles a byte.
    const uint32_t cb = q.code_bits;
    uint8_t* o = &packed[ps.codes];
    size_t j = 0;
    for (uint32_t i = 0; i < blk.size; ++i)
      for (uint32_t t = 0; t < n; ++t, ++j) {
        const size_t bit = j * cb;
        o[bit >> 3] = uint8_t(o[bit >> 3] | (all_codes[size_t(t) * blk.size + i] << (bit & 7)));
      }
  }
  return packed;
}

void unpack_chunk(const uint8_t* buf, const std::vector<BlockAlloc>& alloc, uint32_t n, uint32_t r_used, float* d) {
  std::fill(d, d + size_t(n) * r_used, 0.0f);
  // E4M3 decodes through a 256-entry table (the same function's values).
  static const std::array<float, 256> e4m3 = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[size_t(i)] = e4m3_to_f32(uint8_t(i));
    return t;
  }();
  std::vector<float> lo(n), st(n);
  for (const PlaneSpan& ps : chunk_layout(alloc, n)) {
    const BlockAlloc& b = ps.blk;
    const Quantizer& q = quantizer(b.type);
    if (q.rule == QRule::kZero) continue;
    // Parameter k: its low-byte plane, then its high-byte plane. lo holds
    // the first (int: minimum, fp8: scale), st the second (int: step).
    const uint8_t* pp = buf + ps.params;
    for (uint32_t t = 0; t < n; ++t) lo[t] = f16_to_f32(uint16_t(pp[t] | pp[n + t] << 8));
    if (q.n_params > 1)
      for (uint32_t t = 0; t < n; ++t) st[t] = f16_to_f32(uint16_t(pp[2 * size_t(n) + t] | pp[3 * size_t(n) + t] << 8));
    const uint32_t cb = q.code_bits;
    const uint8_t mask = uint8_t((1u << cb) - 1);
    const uint8_t* in = buf + ps.codes;
    size_t j = 0;
    for (uint32_t i = 0; i < b.size; ++i) {
      float* col = d + b.start + i;
      if (q.rule == QRule::kE4M3) {  // 8-bit codes: one per byte
        for (uint32_t t = 0; t < n; ++t, ++j) col[size_t(t) * r_used] = e4m3[in[j]] * lo[t];
      } else {  // kAffine
        for (uint32_t t = 0; t < n; ++t, ++j) {
          const size_t bit = j * cb;
          col[size_t(t) * r_used] = lo[t] + float((in[bit >> 3] >> (bit & 7)) & mask) * st[t];
        }
      }
    }
  }
}

}  // namespace kvtc::container
