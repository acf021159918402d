#include "codec/features.h"

#include <cstring>
#include <vector>

#include "codec/rope.h"
#include "core/util.h"
#include "kvtc/calibration.h"
#include "kvtc/error.h"
#include "kvtc/internal/lab_support.h"  // feature_rows, set_feature_rows

namespace kvtc {

void gather_features(const KvBlock& b, KvKind kind, const Rope* rope, uint32_t t0, uint32_t t1, float* out) {
  const uint32_t p = b.features(), D = b.head_dim, n = t1 - t0;
  const std::vector<uint16_t>& src = kind == KvKind::kKey ? b.k : b.v;
  std::vector<float> tmp(size_t(n) * D);
  RopeTable rt;
  if (kind == KvKind::kKey && rope) rt = rope_table(b.pos.data() + t0, n, *rope, b.head_dim, /*inverse=*/true);
  for (uint32_t l = 0; l < b.n_layer(); ++l)
    for (uint32_t h = 0; h < b.n_head_kv; ++h) {
      f16_to_f32_n(&src[b.index(l, h, t0, 0)], tmp.data(), size_t(n) * D);
      rope_apply(tmp.data(), rt);
      const size_t f0 = (size_t(l) * b.n_head_kv + h) * D;
      for (uint32_t t = 0; t < n; ++t) std::memcpy(&out[size_t(t) * p + f0], &tmp[size_t(t) * D], D * sizeof(float));
    }
}

void scatter_features(float* in, KvKind kind, const Rope* rope, uint32_t t0, uint32_t t1, KvBlock& b) {
  const uint32_t p = b.features(), D = b.head_dim, n = t1 - t0;
  std::vector<uint16_t>& dst = kind == KvKind::kKey ? b.k : b.v;
  RopeTable rt;
  rt.head_dim = D, rt.n_tok = n;  // no rotation: values, or keys stored with theirs
  if (kind == KvKind::kKey && rope) rt = rope_table(b.pos.data() + t0, n, *rope, b.head_dim, /*inverse=*/false);
  const RopeExpanded ex = rope_expand(rt);  // the cos/sin per dimension, shared by every layer and head
  for (uint32_t l = 0; l < b.n_layer(); ++l)
    for (uint32_t h = 0; h < b.n_head_kv; ++h) {
      const size_t f0 = (size_t(l) * b.n_head_kv + h) * D;
      rope_apply_f16(in + f0, p, rt, ex, &dst[b.index(l, h, t0, 0)]);
    }
}

std::vector<float> feature_rows(const KvBlock& b, bool keys, bool derope, uint32_t t0, uint32_t t1) {
  require(t0 <= t1 && t1 <= b.n_tokens() && b.k.size() == b.numel() && b.v.size() == b.numel(),
          "feature_rows: tokens out of range or K/V of the wrong size");
  if (keys && derope) require_rope_supported(b.rope, "feature_rows");
  std::vector<float> out(size_t(t1 - t0) * b.features());
  gather_features(b, keys ? KvKind::kKey : KvKind::kValue, keys && derope ? &b.rope : nullptr, t0, t1, out.data());
  return out;
}

void set_feature_rows(KvBlock& b, bool keys, bool rerope, uint32_t t0, uint32_t t1, std::vector<float> rows) {
  require(t0 <= t1 && t1 <= b.n_tokens() && b.k.size() == b.numel() && b.v.size() == b.numel() && rows.size() == size_t(t1 - t0) * b.features(),
          "set_feature_rows: tokens out of range, or rows or K/V of the wrong size");
  if (keys && rerope) require_rope_supported(b.rope, "set_feature_rows");
  scatter_features(rows.data(), keys ? KvKind::kKey : KvKind::kValue, keys && rerope ? &b.rope : nullptr, t0, t1, b);
}

}  // namespace kvtc
