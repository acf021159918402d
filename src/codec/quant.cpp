#include "codec/quant.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/scalar.h"

namespace kvtc {

const char* qtype_name(QType t) {
  switch (t) {
    case QType::kNone: return "none";
    case QType::kInt2: return "int2";
    case QType::kInt4: return "int4";
    case QType::kFp8: return "fp8";
    case QType::kEcsq: return "ecsq";
  }
  return "?";
}

uint32_t qtype_code_bits(QType t) {
  switch (t) {
    case QType::kNone: return 0;
    case QType::kInt2: return 2;
    case QType::kInt4: return 4;
    case QType::kFp8: return 8;
    case QType::kEcsq: return 0;  // variable: entropy-coded
  }
  return 0;
}

uint32_t qtype_param_bits(QType t) {
  switch (t) {
    case QType::kNone: return 0;
    case QType::kInt2:
    case QType::kInt4: return 32;  // f16 minimum + f16 step
    case QType::kFp8: return 16;   // f16 scale
    case QType::kEcsq: return 0;
  }
  return 0;
}

void quantize_block(QType t, const float* x, size_t n, uint8_t* codes, uint16_t params[2]) {
  params[0] = params[1] = 0;
  if (t == QType::kNone) return;
  if (t == QType::kFp8) {
    float amax = 0;
    for (size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
    params[0] = fp8_block_scale(amax);
    const float s = f16_to_f32(params[0]);
    for (size_t i = 0; i < n; ++i) codes[i] = fp8_code(x[i], s);
    return;
  }
  const int levels = (1 << qtype_code_bits(t)) - 1;
  float lo = x[0], hi = x[0];
  for (size_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  int_block_params(lo, hi, levels, &params[0], &params[1]);
  const float lo_r = f16_to_f32(params[0]), st = f16_to_f32(params[1]);
  for (size_t i = 0; i < n; ++i) codes[i] = int_code(x[i], lo_r, st, levels);
}

void dequantize_block(QType t, const uint8_t* codes, size_t n, const uint16_t params[2], float* out) {
  switch (t) {
    case QType::kNone: std::fill(out, out + n, 0.0f); return;
    case QType::kFp8: {
      const float s = f16_to_f32(params[0]);
      for (size_t i = 0; i < n; ++i) out[i] = e4m3_to_f32(codes[i]) * s;
      return;
    }
    default: {
      const float lo = f16_to_f32(params[0]), st = f16_to_f32(params[1]);
      for (size_t i = 0; i < n; ++i) out[i] = lo + float(codes[i]) * st;
    }
  }
}

void quantize_roundtrip(QType t, const float* x, size_t n, float* out) {
  std::vector<uint8_t> codes(n);
  uint16_t p[2];
  quantize_block(t, x, n, codes.data(), p);
  dequantize_block(t, codes.data(), n, p, out);
}

double block_sq_error(QType t, const float* x, size_t n) {
  double e = 0;
  if (t == QType::kNone) {
    for (size_t i = 0; i < n; ++i) e += double(x[i]) * x[i];
    return e;
  }
  constexpr size_t kMax = 1024;  // the largest DP block size
  uint8_t codes[kMax];
  float y[kMax];
  uint16_t p[2];
  for (size_t off = 0; off < n; off += kMax) {  // longer runs: coded as consecutive blocks
    const size_t m = std::min(kMax, n - off);
    quantize_block(t, x + off, m, codes, p);
    dequantize_block(t, codes, m, p, y);
    for (size_t i = 0; i < m; ++i) e += double(x[off + i] - y[i]) * (x[off + i] - y[i]);
  }
  return e;
}

}  // namespace kvtc
