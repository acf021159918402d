#include "kvtc/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvtc/util.h"

namespace kvtc {

const char* qtype_name(QType t) {
  switch (t) {
    case QType::kNone: return "none";
    case QType::kInt2: return "int2";
    case QType::kInt4: return "int4";
    case QType::kFp8: return "fp8";
  }
  return "?";
}

uint32_t qtype_code_bits(QType t) {
  switch (t) {
    case QType::kNone: return 0;
    case QType::kInt2: return 2;
    case QType::kInt4: return 4;
    case QType::kFp8: return 8;
  }
  return 0;
}

uint32_t qtype_param_bits(QType t) {
  switch (t) {
    case QType::kNone: return 0;
    case QType::kInt2:
    case QType::kInt4: return 32;  // f16 minimum + f16 step
    case QType::kFp8: return 16;   // f16 scale
  }
  return 0;
}

float e4m3_to_f32(uint8_t v) {
  const int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
  float x;
  if (e == 0)
    x = std::ldexp(float(m), -9);  // subnormal: m/8 * 2^-6
  else if (e == 15 && m == 7)
    x = NAN;
  else
    x = std::ldexp(1.0f + float(m) / 8.0f, e - 7);
  return s ? -x : x;
}

uint8_t f32_to_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (!(a == a)) return 0;                       // NaN input: code 0 (inputs are finite in practice)
  if (a >= 464.0f) return sign | 0x7e;           // 464 is halfway between 448 and the (absent) 480: saturate
  if (a < std::ldexp(1.0f, -6)) {                // subnormal range: steps of 2^-9
    const float m = std::nearbyint(a * 512.0f);  // ties to even under the default rounding mode
    return sign | uint8_t(m);                    // m == 8 is exactly the smallest normal's code (0x08)
  }
  int e;
  const float f = std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  float m = std::nearbyint((f * 2.0f - 1.0f) * 8.0f);
  int ef = e - 1 + 7;
  if (m == 8.0f) {
    m = 0;
    ++ef;
  }
  if (ef > 15 || (ef == 15 && m == 7.0f)) return sign | 0x7e;
  return sign | uint8_t(ef << 3) | uint8_t(m);
}

void quantize_block(QType t, const float* x, size_t n, uint8_t* codes, uint16_t params[2]) {
  params[0] = params[1] = 0;
  if (t == QType::kNone) return;
  if (t == QType::kFp8) {
    float amax = 0;
    for (size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
    const uint16_t s16 = f32_to_f16(amax / 448.0f);
    const float s = f16_to_f32(s16);
    params[0] = s16;
    for (size_t i = 0; i < n; ++i) codes[i] = s > 0 ? f32_to_e4m3(x[i] / s) : 0;
    return;
  }
  const int levels = (1 << qtype_code_bits(t)) - 1;
  float lo = x[0], hi = x[0];
  for (size_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const uint16_t lo16 = f32_to_f16(lo);
  const float lo_r = f16_to_f32(lo16);
  // Round the step up so that hi stays reachable after lo was rounded.
  float step = (hi - lo_r) / float(levels);
  uint16_t st16 = f32_to_f16(step);
  if (f16_to_f32(st16) < step) st16 = uint16_t(st16 + 1);
  const float st = f16_to_f32(st16);
  params[0] = lo16;
  params[1] = st16;
  for (size_t i = 0; i < n; ++i) {
    float q = st > 0 ? std::nearbyint((x[i] - lo_r) / st) : 0.0f;
    codes[i] = uint8_t(std::clamp(q, 0.0f, float(levels)));
  }
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
