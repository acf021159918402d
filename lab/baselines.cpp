#include "baselines.h"

#include <cblas.h>
#include <lapacke.h>
#include <libdeflate.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvtc/internal/lab_support.h"
#include "kvtc/kvtc.h"

namespace kvtc::baselines {

KvCapture fp8_per_token(const KvCapture& c, uint64_t* bytes) {
  KvCapture out = c;
  *bytes = 0;
  for (KvBlock& b : out.blocks)
    for (auto* x : {&b.k, &b.v}) {
      std::vector<float> row(b.head_dim);
      for (uint32_t l = 0; l < b.n_layer(); ++l)
        for (uint32_t h = 0; h < b.n_head_kv; ++h)
          for (uint32_t t = 0; t < b.n_tokens(); ++t) {
            uint16_t* p = &(*x)[b.index(l, h, t, 0)];
            f16_to_f32_n(p, row.data(), b.head_dim);
            quantize_roundtrip(QType::kFp8, row.data(), b.head_dim, row.data());
            f32_to_f16_n(row.data(), p, b.head_dim);
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
    std::vector<float> x(std::max(group, b.head_dim));
    std::vector<uint16_t> h16(x.size());
    for (uint32_t l = 0; l < b.n_layer(); ++l)
      for (uint32_t h = 0; h < b.n_head_kv; ++h) {
        // Keys: per channel d, groups of `group` tokens.
        for (uint32_t d = 0; d < b.head_dim; ++d)
          for (uint32_t t0 = 0; t0 < n_kq; t0 += group) {
            for (uint32_t i = 0; i < group; ++i) h16[i] = b.k[b.index(l, h, t0 + i, d)];
            f16_to_f32_n(h16.data(), x.data(), group);
            quantize_roundtrip(q, x.data(), group, x.data());
            f32_to_f16_n(x.data(), h16.data(), group);
            for (uint32_t i = 0; i < group; ++i) b.k[b.index(l, h, t0 + i, d)] = h16[i];
            *bytes += (uint64_t(group) * bits + 7) / 8 + 4;
          }
        *bytes += uint64_t(n - n_kq) * b.head_dim * 2;  // f16 keys
        // Values: per token, groups of `group` channels.
        for (uint32_t t = 0; t < n_q; ++t)
          for (uint32_t d0 = 0; d0 < b.head_dim; d0 += group) {
            const uint32_t g = std::min(group, b.head_dim - d0);
            uint16_t* p = &b.v[b.index(l, h, t, d0)];
            f16_to_f32_n(p, x.data(), g);
            quantize_roundtrip(q, x.data(), g, x.data());
            f32_to_f16_n(x.data(), p, g);
            *bytes += (uint64_t(g) * bits + 7) / 8 + 4;
          }
        *bytes += uint64_t(n - n_q) * b.head_dim * 2;  // f16 values
      }
  }
  return out;
}

uint64_t lossless_bytes(const KvCapture& c, const std::string& coder, int level) {
  std::vector<uint8_t> raw;
  for (const KvBlock& b : c.blocks)
    for (const auto* x : {&b.k, &b.v}) {
      const auto* p = reinterpret_cast<const uint8_t*>(x->data());
      raw.insert(raw.end(), p, p + x->size() * 2);
    }
  if (coder == "zstd") {
    std::vector<uint8_t> out(ZSTD_compressBound(raw.size()));
    size_t n = ZSTD_compress(out.data(), out.size(), raw.data(), raw.size(), level < 0 ? 19 : level);
    require(!ZSTD_isError(n), std::string("zstd: ") + ZSTD_getErrorName(n));
    return n;
  }
  require(coder == "deflate", "lossless: coder must be zstd or deflate");
  libdeflate_compressor* cmp = libdeflate_alloc_compressor(level < 0 ? 12 : level);
  require(cmp != nullptr, "libdeflate: cannot allocate a compressor");
  std::vector<uint8_t> out(libdeflate_deflate_compress_bound(cmp, raw.size()));
  size_t n = libdeflate_deflate_compress(cmp, raw.data(), raw.size(), out.data(), out.size());
  libdeflate_free_compressor(cmp);
  require(n > 0, "libdeflate: compression failed");
  return n;
}

KvCapture streaming_evict(const KvCapture& c, double ratio, uint32_t sink, uint64_t* bytes) {
  require(ratio >= 1, "streaming: ratio must be >= 1");
  KvCapture out;
  out.model_sha256 = c.model_sha256;
  out.meta = c.meta;
  *bytes = 0;
  for (size_t bi = 0; bi < c.blocks.size(); ++bi) {
    const KvBlock& b = c.blocks[bi];
    const uint32_t n = b.n_tokens();
    const uint32_t keep = std::min<uint32_t>(n, uint32_t(std::ceil(double(n) / ratio)));
    const uint32_t s = std::min(sink, keep);
    std::vector<uint32_t> idx;
    for (uint32_t t = 0; t < s; ++t) idx.push_back(t);
    for (uint32_t t = n - (keep - s); t < n; ++t) idx.push_back(t);
    KvBlock o;
    static_cast<BlockGeometry&>(o) = b.geometry();
    for (uint32_t t : idx) o.pos.push_back(b.pos[t]);
    o.k.resize(o.numel());
    o.v.resize(o.numel());
    for (uint32_t l = 0; l < b.n_layer(); ++l)
      for (uint32_t h = 0; h < b.n_head_kv; ++h)
        for (size_t i = 0; i < idx.size(); ++i) {
          std::copy_n(&b.k[b.index(l, h, idx[i], 0)], b.head_dim, &o.k[o.index(l, h, uint32_t(i), 0)]);
          std::copy_n(&b.v[b.index(l, h, idx[i], 0)], b.head_dim, &o.v[o.index(l, h, uint32_t(i), 0)]);
        }
    if (bi == 0 && !c.tokens.empty())
      for (uint32_t t : idx) out.tokens.push_back(c.tokens[t]);
    *bytes += uint64_t(o.numel()) * 2 * 2;
    out.blocks.push_back(std::move(o));
  }
  return out;
}

namespace {

// Rounds every value to f16, as the factors would be stored.
void f16_round(float* x, size_t n) {
  std::vector<uint16_t> h(n);
  f32_to_f16_n(x, h.data(), n);
  f16_to_f32_n(h.data(), x, n);
}

// Rank-r approximation of row-major X [n x m] in place, centred on its
// column mean; factors rounded to f16 as they would be stored.
void lowrank_inplace(float* X, uint32_t n, uint32_t m, uint32_t r) {
  std::vector<float> mu(m, 0.0f);
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < m; ++j) mu[j] += X[size_t(t) * m + j];
  for (float& x : mu) x /= float(n);
  f16_round(mu.data(), mu.size());
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < m; ++j) X[size_t(t) * m + j] -= mu[j];
  r = std::min({r, n, m});
  if (r > 0) {
    // Right singular vectors = top eigenvectors of X^T X (m x m, in double).
    std::vector<float> g(size_t(m) * m);
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, int(m), int(n), 1.0f, X, int(m), 0.0f, g.data(), int(m));
    std::vector<double> gd(g.begin(), g.end()), w(m), z(size_t(m) * r);
    std::vector<lapack_int> isuppz(2 * size_t(m));
    lapack_int found = 0;
    const lapack_int info = LAPACKE_dsyevr(LAPACK_ROW_MAJOR, 'V', 'I', 'U', lapack_int(m), gd.data(), lapack_int(m), 0.0, 0.0, lapack_int(m - r + 1),
                                           lapack_int(m), 0.0, &found, w.data(), z.data(), lapack_int(r), isuppz.data());
    require(info == 0 && found == lapack_int(r), "svd baseline: LAPACK dsyevr failed (info " + std::to_string(info) + ")");
    std::vector<float> B(size_t(r) * m), A(size_t(n) * r);  // B = V_r^T [r x m], A = X V_r [n x r]
    for (uint32_t i = 0; i < r; ++i)
      for (uint32_t j = 0; j < m; ++j) B[size_t(i) * m + j] = float(z[size_t(j) * r + i]);
    f16_round(B.data(), B.size());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(r), int(m), 1.0f, X, int(m), B.data(), int(m), 0.0f, A.data(), int(r));
    f16_round(A.data(), A.size());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(m), int(r), 1.0f, A.data(), int(r), B.data(), int(m), 0.0f, X, int(m));
  } else {
    std::fill_n(X, size_t(n) * m, 0.0f);
  }
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < m; ++j) X[size_t(t) * m + j] += mu[j];
}

}  // namespace

KvCapture svd_lowrank(const KvCapture& c, uint64_t target_bytes, uint32_t group_layers, uint32_t sink, uint32_t window, uint64_t* bytes) {
  require(group_layers >= 1, "svd: group_layers must be >= 1");
  KvCapture out = c;
  // Raw tokens first; what is left of the budget goes to the factors.
  uint64_t raw = 0, groups = 0;
  for (const KvBlock& b : c.blocks) {
    const uint32_t n = b.n_tokens(), s = std::min(sink, n), w = std::min(window, n - s);
    raw += uint64_t(s + w) * b.n_layer() * b.n_head_kv * b.head_dim * 2 * 2;
    groups += 2 * ((b.n_layer() + group_layers - 1) / group_layers);
  }
  const uint64_t per = target_bytes > raw ? (target_bytes - raw) / groups : 0;
  *bytes = raw;
  for (size_t bi = 0; bi < out.blocks.size(); ++bi) {
    KvBlock& b = out.blocks[bi];
    const uint32_t n = b.n_tokens(), s = std::min(sink, n), w = std::min(window, n - s), t0 = s, t1 = n - w;
    if (t1 <= t0) continue;
    const uint32_t T = t1 - t0, p = b.features(), hd = b.n_head_kv * b.head_dim;
    std::vector<float> G;
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<float> X = feature_rows(b, kv == 0, true, t0, t1);
      for (uint32_t l0 = 0; l0 < b.n_layer(); l0 += group_layers) {
        const uint32_t m = std::min(group_layers, b.n_layer() - l0) * hd;
        // bytes = 2 (T r + r m + m) <= per.
        const uint64_t r = per / 2 > m ? (per / 2 - m) / (uint64_t(T) + m) : 0;
        G.resize(size_t(T) * m);
        for (uint32_t t = 0; t < T; ++t) std::copy_n(&X[size_t(t) * p + size_t(l0) * hd], m, &G[size_t(t) * m]);
        lowrank_inplace(G.data(), T, m, uint32_t(r));
        for (uint32_t t = 0; t < T; ++t) std::copy_n(&G[size_t(t) * m], m, &X[size_t(t) * p + size_t(l0) * hd]);
        *bytes += 2 * (uint64_t(T) * std::min<uint64_t>(r, std::min(T, m)) + std::min<uint64_t>(r, std::min(T, m)) * m + m);
      }
      set_feature_rows(b, kv == 0, true, t0, t1, std::move(X));
    }
  }
  return out;
}

}  // namespace kvtc::baselines
