#include "host_plan.h"

#include <cstring>

#include "core/scalar.h"
#include "format/ecsq.h"
#include "format/quantizers.h"

namespace kvtc::cuda {

uint32_t chunk_tokens_fitting(const AllocationSet& alloc, uint32_t limit, size_t max_bytes) {
  uint32_t best = 0;
  for (uint32_t n = 16; n <= limit; n += 16) {
    bool ok = true;
    for (const auto& bk : alloc)
      for (const Allocation& a : bk) ok = ok && container::packed_bytes(a, n) <= max_bytes;
    if (!ok) break;  // bytes grow with n
    best = n;
  }
  return best;
}

size_t append_chunk_segments(const std::vector<BlockAlloc>& alloc, uint32_t row0, uint32_t n, uint64_t off, bool include_none,
                             std::vector<QSeg>& segs) {
  size_t end = 0;
  for (const container::PlaneSpan& ps : container::chunk_layout(alloc, n)) {
    end = ps.end;
    const container::Quantizer& q = container::quantizer(ps.blk.type);
    if (q.rule == QRule::kZero && !include_none) continue;
    QSeg s;
    s.off = off + ps.params;
    s.row0 = row0;
    s.n = n;
    s.comp0 = ps.blk.start;
    s.size = ps.blk.size;
    s.rule = q.rule;
    s.code_bits = uint8_t(q.code_bits);
    s.n_params = uint8_t(q.n_params);
    segs.push_back(s);
  }
  return end;
}

void append_encode_tiles(const std::vector<QSeg>& segs, size_t first, std::vector<QTile>& tiles) {
  for (size_t i = first; i < segs.size(); ++i) {
    const QSeg& s = segs[i];
    if (s.rule == QRule::kZero) continue;
    const size_t bytes = (size_t(s.n) * s.size * s.code_bits + 7) / 8;
    for (size_t b = 0; b < bytes; b += kEncTileBytes) tiles.push_back({uint32_t(i), uint32_t(b)});
  }
}

void append_decode_tiles(const std::vector<QSeg>& segs, size_t first, std::vector<QTile>& tiles) {
  for (size_t i = first; i < segs.size(); ++i) {
    const size_t codes = size_t(segs[i].n) * segs[i].size;
    for (size_t c = 0; c < codes; c += kDecTileCodes) tiles.push_back({uint32_t(i), uint32_t(c)});
  }
}

uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);  // NaN: quiet, sign kept
  x += 0x7fff + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

void ecsq_chunk_to_plane(const uint8_t* payload, size_t len, container::EcsqLayout layout, uint32_t row0, uint32_t n, uint32_t ru, void* dt,
                         size_t ld, ElemType et, const std::string& where, std::vector<float>& scratch) {
  scratch.resize(size_t(n) * ru);
  container::ecsq_decode_chunk(payload, len, n, ru, layout, scratch.data(), where, true);  // scratch[j * n + t]
  for (uint32_t j = 0; j < ru; ++j) {
    const float* src = scratch.data() + size_t(j) * n;
    const size_t at = size_t(j) * ld + row0;
    switch (et) {
      case ElemType::kF32: std::memcpy(static_cast<float*>(dt) + at, src, size_t(n) * 4); break;
      case ElemType::kBf16:
        for (uint32_t t = 0; t < n; ++t) static_cast<uint16_t*>(dt)[at + t] = f32_to_bf16(src[t]);
        break;
      case ElemType::kF16:
        for (uint32_t t = 0; t < n; ++t) static_cast<uint16_t*>(dt)[at + t] = f32_to_f16(src[t]);
        break;
    }
  }
}

}  // namespace kvtc::cuda
