#include "format/raw8.h"

#include <cmath>
#include <cstring>

#include "core/scalar.h"
#include "kvtc/error.h"

namespace kvtc::container {

namespace {

// The scale of a group whose largest magnitude is amax, as the f16 the
// payload stores and the f32 both sides compute with.
uint16_t scale_of(float amax) {
  return f32_to_f16(amax / 127.0f);
}

int8_t code_of(float x, float s) {
  if (s == 0.0f) return 0;
  const float q = std::nearbyint(x / s);  // round half to even (the default rounding mode)
  return int8_t(q > 127.0f ? 127 : q < -127.0f ? -127 : q);
}

}  // namespace

uint64_t raw8_bytes(const BlockGeometry& g, uint32_t kv, uint32_t n) {
  const uint64_t scales = kv == 0 ? g.head_dim : n;
  return uint64_t(g.n_layer()) * g.n_head_kv * (scales * 2 + uint64_t(n) * g.head_dim);
}

std::vector<uint8_t> raw8_encode(const KvBlock& kb, uint32_t kv, uint32_t t0, uint32_t t1) {
  const std::vector<uint16_t>& src = kv == 0 ? kb.k : kb.v;
  const uint32_t n = t1 - t0, D = kb.head_dim;
  std::vector<uint8_t> out(raw8_bytes(kb, kv, n));
  uint8_t* o = out.data();
  std::vector<float> x(size_t(n) * D);
  std::vector<uint16_t> s16(kv == 0 ? D : n);
  for (uint32_t l = 0; l < kb.n_layer(); ++l)
    for (uint32_t h = 0; h < kb.n_head_kv; ++h) {
      const uint16_t* in = &src[kb.index(l, h, t0, 0)];
      for (size_t i = 0; i < x.size(); ++i) {
        x[i] = f16_to_f32(in[i]);
        require(std::isfinite(x[i]), "raw8: a value that is not finite (compress checks the capture first)");
      }
      std::vector<float> amax(s16.size(), 0.0f);
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t d = 0; d < D; ++d) {
          float& m = amax[kv == 0 ? d : t];
          m = std::max(m, std::fabs(x[size_t(t) * D + d]));
        }
      for (size_t g = 0; g < s16.size(); ++g) {
        s16[g] = scale_of(amax[g]);
        o[2 * g] = uint8_t(s16[g]);
        o[2 * g + 1] = uint8_t(s16[g] >> 8);
      }
      o += 2 * s16.size();
      for (uint32_t t = 0; t < n; ++t)
        for (uint32_t d = 0; d < D; ++d) *o++ = uint8_t(code_of(x[size_t(t) * D + d], f16_to_f32(s16[kv == 0 ? d : t])));
    }
  return out;
}

void raw8_decode(const uint8_t* p, size_t len, const BlockGeometry& g, uint32_t kv, uint32_t n, uint16_t* out, const std::string& where) {
  require(len == raw8_bytes(g, kv, n),
          where + ": raw8 payload of " + std::to_string(len) + " bytes, " + std::to_string(raw8_bytes(g, kv, n)) + " expected");
  const uint32_t D = g.head_dim, groups = kv == 0 ? D : n;
  std::vector<float> s(groups);
  for (uint32_t lh = 0; lh < g.n_layer() * g.n_head_kv; ++lh) {
    for (uint32_t i = 0; i < groups; ++i) s[i] = f16_to_f32(uint16_t(p[2 * i] | p[2 * i + 1] << 8));
    p += 2 * size_t(groups);
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t d = 0; d < D; ++d) *out++ = f32_to_f16(float(int8_t(*p++)) * s[kv == 0 ? d : t]);
  }
}

}  // namespace kvtc::container
