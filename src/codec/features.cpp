#include "kvtc/features.h"

#include <vector>

#include "kvtc/util.h"

namespace kvtc {

void gather_features(const KvBlock& b, KvKind kind, const RopeParams* rope, uint32_t t0, uint32_t t1, float* out) {
  const uint32_t p = feature_dim(b), D = b.head_dim, n = t1 - t0;
  const std::vector<uint16_t>& src = kind == KvKind::kKey ? b.k : b.v;
  std::vector<float> tmp(size_t(n) * D);
  for (uint32_t l = 0; l < b.n_layer(); ++l)
    for (uint32_t h = 0; h < b.n_head_kv; ++h) {
      const uint16_t* s = &src[b.index(l, h, t0, 0)];
      for (size_t i = 0; i < size_t(n) * D; ++i) tmp[i] = f16_to_f32(s[i]);
      if (kind == KvKind::kKey && rope) rope_rotate(tmp.data(), b.pos.data() + t0, n, *rope, /*inverse=*/true);
      const size_t f0 = (size_t(l) * b.n_head_kv + h) * D;
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t d = 0; d < D; ++d) out[size_t(t) * p + f0 + d] = tmp[size_t(t) * D + d];
    }
}

void scatter_features(float* in, KvKind kind, const RopeParams* rope, uint32_t t0, uint32_t t1, KvBlock& b) {
  const uint32_t p = feature_dim(b), D = b.head_dim, n = t1 - t0;
  std::vector<uint16_t>& dst = kind == KvKind::kKey ? b.k : b.v;
  std::vector<float> tmp(size_t(n) * D);
  for (uint32_t l = 0; l < b.n_layer(); ++l)
    for (uint32_t h = 0; h < b.n_head_kv; ++h) {
      const size_t f0 = (size_t(l) * b.n_head_kv + h) * D;
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t d = 0; d < D; ++d) tmp[size_t(t) * D + d] = in[size_t(t) * p + f0 + d];
      if (kind == KvKind::kKey && rope) rope_rotate(tmp.data(), b.pos.data() + t0, n, *rope, /*inverse=*/false);
      uint16_t* o = &dst[b.index(l, h, t0, 0)];
      for (size_t i = 0; i < size_t(n) * D; ++i) o[i] = f32_to_f16(tmp[i]);
    }
}

}  // namespace kvtc
