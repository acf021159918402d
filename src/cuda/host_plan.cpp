#include "host_plan.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "kvtc/error.h"
#include "kvtc/features.h"
#include "kvtc/quant.h"

namespace kvtc::cuda {

using namespace container;

uint32_t chunk_tokens_fitting(const AllocationSet& alloc, uint32_t limit, size_t max_bytes) {
  uint32_t best = 0;
  for (uint32_t n = 16; n <= limit; n += 16) {
    bool ok = true;
    for (const auto& bk : alloc)
      for (const Allocation& a : bk) ok = ok && packed_chunk_bytes(a.blocks, n) <= max_bytes;
    if (!ok) break;  // bytes grow with n
    best = n;
  }
  return best;
}

size_t append_chunk_segments(const std::vector<BlockAlloc>& alloc, uint32_t row0, uint32_t n, uint64_t off, bool include_none,
                             std::vector<QSeg>& segs) {
  size_t bytes = 0;
  for (const BlockAlloc& a : alloc) {
    if (a.type == QType::kNone) {
      if (include_none) segs.push_back({off + bytes, row0, n, a.start, a.size, uint32_t(a.type), 0});
      continue;
    }
    segs.push_back({off + bytes, row0, n, a.start, a.size, uint32_t(a.type), 0});
    bytes += size_t(n) * qtype_param_bits(a.type) / 8;
    bytes += (size_t(n) * a.size * qtype_code_bits(a.type) + 7) / 8;
  }
  return bytes;
}

void append_encode_tiles(const std::vector<QSeg>& segs, size_t first, std::vector<QTile>& tiles) {
  for (size_t i = first; i < segs.size(); ++i) {
    const QSeg& s = segs[i];
    if (QType(s.type) == QType::kNone) continue;
    const size_t bytes = (size_t(s.n) * s.size * qtype_code_bits(QType(s.type)) + 7) / 8;
    for (size_t b = 0; b < bytes; b += kEncTileBytes) tiles.push_back({uint32_t(i), uint32_t(b)});
  }
}

void append_decode_tiles(const std::vector<QSeg>& segs, size_t first, std::vector<QTile>& tiles) {
  for (size_t i = first; i < segs.size(); ++i) {
    const size_t codes = size_t(segs[i].n) * segs[i].size;
    for (size_t c = 0; c < codes; c += kDecTileCodes) tiles.push_back({uint32_t(i), uint32_t(c)});
  }
}

// ---------------------------------------------------------------- encode

static void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
static void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}

void put_file_header(uint8_t* dst, const std::string& json) {
  std::memcpy(dst, kMagic, 4);
  put32(dst + 4, kContainerVersion);
  put32(dst + 8, uint32_t(json.size()));
  put64(dst + 12, xxh64(reinterpret_cast<const uint8_t*>(json.data()), json.size()));
  std::memcpy(dst + kFileHeaderBytes, json.data(), json.size());
}

void put_section_header(uint8_t* dst, uint32_t kind, uint32_t block, uint32_t kv, uint32_t t0, uint32_t t1, uint64_t raw_len, uint64_t stored_len,
                        uint64_t xxh) {
  put32(dst, kind);
  put32(dst + 4, block);
  put32(dst + 8, kv);
  put32(dst + 12, t0);
  put32(dst + 16, t1);
  put64(dst + 20, raw_len);
  put64(dst + 28, stored_len);
  put64(dst + 36, xxh);
}

// ---------------------------------------------------------------- decode

DecodePlan plan_decode(const uint8_t* bytes, size_t size, const Calibration& cal, const std::string& origin, int threads) {
  return container::plan_decode(container::parse(bytes, size, origin, threads), cal, origin);
}

}  // namespace kvtc::cuda
