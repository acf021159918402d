#include "format/quantizers.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvtc/error.h"
#include "kvtc/internal/lab_support.h"  // quantize_roundtrip, qtype_code_bits

namespace kvtc {

const char* qtype_name(QType t) {
  const container::Quantizer* q = container::find_quantizer(uint32_t(t));
  return q ? q->name : "?";
}

uint32_t header_type_code(const Allocation& a, const BlockAlloc& b) {
  return a.coding == Coding::kEntropy ? container::kEcsqTypeCode : uint32_t(b.type);
}

uint32_t qtype_code_bits(QType t) {
  return container::quantizer(t).code_bits;
}

void quantize_roundtrip(QType t, const float* x, size_t n, float* out) {
  const container::Quantizer& q = container::quantizer(t);
  std::vector<uint8_t> codes(n);
  uint16_t p[2];
  container::quantize_block(q, x, n, codes.data(), p);
  container::dequantize_block(q, codes.data(), n, p, out);
}

}  // namespace kvtc

namespace kvtc::container {

const Quantizer& quantizer(QType t) {
  const Quantizer* q = find_quantizer(uint32_t(t));
  require(q != nullptr, "quantizer: type code " + std::to_string(unsigned(t)) + " is not a fixed-rate quantizer (src/format/quantizers.h)");
  return *q;
}

size_t quantizer_index(QType t) {
  return size_t(&quantizer(t) - kQuantizers.data());
}

void quantize_block(const Quantizer& q, const float* x, size_t n, uint8_t* codes, uint16_t params[2]) {
  params[0] = params[1] = 0;
  switch (q.rule) {
    case QRule::kZero: return;
    case QRule::kE4M3: {
      float amax = 0;
      for (size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
      params[0] = fp8_block_scale(amax);
      const float s = f16_to_f32(params[0]);
      for (size_t i = 0; i < n; ++i) codes[i] = fp8_code(x[i], s);
      return;
    }
    case QRule::kAffine: {
      const int levels = (1 << q.code_bits) - 1;
      float lo = x[0], hi = x[0];
      for (size_t i = 1; i < n; ++i) {
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
      }
      int_block_params(lo, hi, levels, &params[0], &params[1]);
      const float lo_r = f16_to_f32(params[0]), st = f16_to_f32(params[1]);
      for (size_t i = 0; i < n; ++i) codes[i] = int_code(x[i], lo_r, st, levels);
      return;
    }
  }
}

void dequantize_block(const Quantizer& q, const uint8_t* codes, size_t n, const uint16_t params[2], float* out) {
  switch (q.rule) {
    case QRule::kZero: std::fill(out, out + n, 0.0f); return;
    case QRule::kE4M3: {
      const float s = f16_to_f32(params[0]);
      for (size_t i = 0; i < n; ++i) out[i] = e4m3_to_f32(codes[i]) * s;
      return;
    }
    case QRule::kAffine: {
      const float lo = f16_to_f32(params[0]), st = f16_to_f32(params[1]);
      for (size_t i = 0; i < n; ++i) out[i] = lo + float(codes[i]) * st;
      return;
    }
  }
}

double block_sq_error(const Quantizer& q, const float* x, size_t n) {
  double e = 0;
  if (q.rule == QRule::kZero) {
    for (size_t i = 0; i < n; ++i) e += double(x[i]) * x[i];
    return e;
  }
  constexpr size_t kMax = 1024;  // the largest DP block size
  uint8_t codes[kMax];
  float y[kMax];
  uint16_t p[2];
  for (size_t off = 0; off < n; off += kMax) {  // longer runs: coded as consecutive blocks
    const size_t m = std::min(kMax, n - off);
    quantize_block(q, x + off, m, codes, p);
    dequantize_block(q, codes, m, p, y);
    for (size_t i = 0; i < m; ++i) e += double(x[off + i] - y[i]) * (x[off + i] - y[i]);
  }
  return e;
}

}  // namespace kvtc::container
