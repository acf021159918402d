#include "baselines.h"

#include <libdeflate.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvtc/error.h"
#include "kvtc/quant.h"
#include "kvtc/util.h"

namespace kvtc::baselines {

KvCapture fp8_per_token(const KvCapture& c, uint64_t* bytes) {
  KvCapture out = c;
  *bytes = 0;
  for (KvBlock& b : out.blocks)
    for (auto* x : {&b.k, &b.v}) {
      std::vector<float> row(b.head_dim), y(b.head_dim);
      std::vector<uint8_t> codes(b.head_dim);
      for (uint32_t l = 0; l < b.n_layer(); ++l)
        for (uint32_t h = 0; h < b.n_head_kv; ++h)
          for (uint32_t t = 0; t < b.n_tokens(); ++t) {
            uint16_t* p = &(*x)[b.index(l, h, t, 0)];
            for (uint32_t d = 0; d < b.head_dim; ++d) row[d] = f16_to_f32(p[d]);
            uint16_t params[2];
            quantize_block(QType::kFp8, row.data(), b.head_dim, codes.data(), params);
            dequantize_block(QType::kFp8, codes.data(), b.head_dim, params, y.data());
            for (uint32_t d = 0; d < b.head_dim; ++d) p[d] = f32_to_f16(y[d]);
            *bytes += b.head_dim + 2;
          }
    }
  return out;
}

KvCapture kivi(const KvCapture& c, int bits, uint32_t group, uint32_t recent, uint64_t* bytes) {
  require(bits == 2 || bits == 4, "kivi: bits must be 2 or 4");
  const QType q = bits == 2 ? QType::kInt2 : QType::kInt4;
  KvCapture out = c;
  *bytes = 0;
  for (KvBlock& b : out.blocks) {
    const uint32_t n = b.n_tokens();
    const uint32_t n_q = n > recent ? n - recent : 0;  // tokens before the recent window
    const uint32_t n_kq = n_q / group * group;         // keys: whole token groups only
    std::vector<float> x(std::max(group, b.head_dim)), y(x.size());
    std::vector<uint8_t> codes(x.size());
    uint16_t params[2];
    for (uint32_t l = 0; l < b.n_layer(); ++l)
      for (uint32_t h = 0; h < b.n_head_kv; ++h) {
        // Keys: per channel d, groups of `group` tokens.
        for (uint32_t d = 0; d < b.head_dim; ++d)
          for (uint32_t t0 = 0; t0 < n_kq; t0 += group) {
            for (uint32_t i = 0; i < group; ++i) x[i] = f16_to_f32(b.k[b.index(l, h, t0 + i, d)]);
            quantize_block(q, x.data(), group, codes.data(), params);
            dequantize_block(q, codes.data(), group, params, y.data());
            for (uint32_t i = 0; i < group; ++i) b.k[b.index(l, h, t0 + i, d)] = f32_to_f16(y[i]);
            *bytes += (uint64_t(group) * bits + 7) / 8 + 4;
          }
        *bytes += uint64_t(n - n_kq) * b.head_dim * 2;  // f16 keys
        // Values: per token, groups of `group` channels.
        for (uint32_t t = 0; t < n_q; ++t)
          for (uint32_t d0 = 0; d0 < b.head_dim; d0 += group) {
            const uint32_t g = std::min(group, b.head_dim - d0);
            uint16_t* p = &b.v[b.index(l, h, t, d0)];
            for (uint32_t i = 0; i < g; ++i) x[i] = f16_to_f32(p[i]);
            quantize_block(q, x.data(), g, codes.data(), params);
            dequantize_block(q, codes.data(), g, params, y.data());
            for (uint32_t i = 0; i < g; ++i) p[i] = f32_to_f16(y[i]);
            *bytes += (uint64_t(g) * bits + 7) / 8 + 4;
          }
        *bytes += uint64_t(n - n_q) * b.head_dim * 2;  // f16 values
      }
  }
  return out;
}

uint64_t lossless_bytes(const KvCapture& c, const std::string& coder) {
  std::vector<uint8_t> raw;
  for (const KvBlock& b : c.blocks)
    for (const auto* x : {&b.k, &b.v}) {
      const auto* p = reinterpret_cast<const uint8_t*>(x->data());
      raw.insert(raw.end(), p, p + x->size() * 2);
    }
  if (coder == "zstd") {
    std::vector<uint8_t> out(ZSTD_compressBound(raw.size()));
    size_t n = ZSTD_compress(out.data(), out.size(), raw.data(), raw.size(), 19);
    require(!ZSTD_isError(n), std::string("zstd: ") + ZSTD_getErrorName(n));
    return n;
  }
  require(coder == "deflate", "lossless: coder must be zstd or deflate");
  libdeflate_compressor* cmp = libdeflate_alloc_compressor(12);
  require(cmp != nullptr, "libdeflate: cannot allocate a compressor");
  std::vector<uint8_t> out(libdeflate_deflate_compress_bound(cmp, raw.size()));
  size_t n = libdeflate_deflate_compress(cmp, raw.data(), raw.size(), out.data(), out.size());
  libdeflate_free_compressor(cmp);
  require(n > 0, "libdeflate: compression failed");
  return n;
}

}  // namespace kvtc::baselines
