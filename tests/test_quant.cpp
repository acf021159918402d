// Quantizers: bounds per type and exact agreement of encoder and decoder
// (synthetic values: this tests the arithmetic).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/util.h"
#include "format/quantizers.h"
#include "kvtc/error.h"

using namespace kvtc;
using namespace kvtc::container;

TEST(E4M3, EveryCodeRoundTripsAndRoundingIsNearest) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN codes
    float v = e4m3_to_f32(uint8_t(c));
    if (c == 0x80) continue;  // -0 encodes as +0's sign-bit twin: same value
    EXPECT_EQ(f32_to_e4m3(v), c) << c;
  }
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(f32_to_e4m3(1e6f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-1e6f), 0xfe);
  // Nearest: brute force over all finite codes for many values.
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-500.0f, 500.0f);
  for (int i = 0; i < 20000; ++i) {
    float x = i < 10000 ? u(rng) : u(rng) * 1e-3f;
    float best = INFINITY;
    for (int c = 0; c < 256; ++c)
      if ((c & 0x7f) != 0x7f) best = std::min(best, std::fabs(e4m3_to_f32(uint8_t(c)) - std::clamp(x, -448.0f, 448.0f)));
    EXPECT_EQ(std::fabs(e4m3_to_f32(f32_to_e4m3(x)) - std::clamp(x, -448.0f, 448.0f)), best) << x;
  }
}

TEST(Quant, ErrorBoundsPerType) {
  std::mt19937 rng(2);
  std::normal_distribution<float> d(0.0f, 2.0f);
  for (size_t n : {1u, 16u, 64u, 256u, 1024u}) {
    std::vector<float> x(n), y(n);
    for (auto& v : x) v = d(rng);
    float lo = *std::min_element(x.begin(), x.end()), hi = *std::max_element(x.begin(), x.end());
    float amax = std::max(std::fabs(lo), std::fabs(hi));
    std::vector<uint8_t> codes(n);
    uint16_t p[2];
    for (QType t : {QType::kInt2, QType::kInt4}) {
      quantize_block(t, x.data(), n, codes.data(), p);
      dequantize_block(t, codes.data(), n, p, y.data());
      const float levels = float((1 << quantizer(t).code_bits) - 1);
      // Half a step, where the step is rounded up to f16, plus lo's f16 rounding.
      const float step = (hi - lo) / levels;
      for (size_t i = 0; i < n; ++i)
        EXPECT_LE(std::fabs(x[i] - y[i]), 0.5f * step * 1.002f + std::fabs(lo) * 1e-3f + 1e-6f) << qtype_name(t) << " n=" << n;
      for (size_t i = 0; i < n; ++i) EXPECT_LE(codes[i], levels);
      EXPECT_NEAR(
          block_sq_error(t, x.data(), n),
          [&] {
            double e = 0;
            for (size_t i = 0; i < n; ++i) e += double(x[i] - y[i]) * (x[i] - y[i]);
            return e;
          }(),
          1e-9);
    }
    quantize_block(QType::kFp8, x.data(), n, codes.data(), p);
    dequantize_block(QType::kFp8, codes.data(), n, p, y.data());
    // E4M3 has 3 mantissa bits: relative error <= 2^-4 for normals, plus the
    // f16 scale's rounding and the subnormal step near zero.
    for (size_t i = 0; i < n; ++i)
      EXPECT_LE(std::fabs(x[i] - y[i]), std::fabs(x[i]) * 0.0635f + amax * 1e-3f + amax / 448.0f * std::ldexp(1.0f, -10)) << n;
    std::vector<float> z(n, 0.0f);
    EXPECT_EQ(block_sq_error(QType::kNone, x.data(), n), [&] {
      double e = 0;
      for (float v : x) e += double(v) * v;
      return e;
    }());
    quantize_block(QType::kFp8, z.data(), n, codes.data(), p);
    dequantize_block(QType::kFp8, codes.data(), n, p, y.data());
    for (float v : y) EXPECT_EQ(v, 0.0f);
  }
  EXPECT_EQ(block_bits(QType::kInt2, 16), 2u * 16 + 32);
  EXPECT_EQ(block_bits(QType::kFp8, 64), 8u * 64 + 16);
  EXPECT_EQ(block_bits(QType::kNone, 1024), 0u);
}

TEST(Quant, ConstantBlocksAreExact) {
  std::vector<float> x(64, 3.25f), y(64);
  std::vector<uint8_t> codes(64);
  uint16_t p[2];
  for (QType t : {QType::kInt2, QType::kInt4, QType::kFp8}) {
    quantize_block(t, x.data(), 64, codes.data(), p);
    dequantize_block(t, codes.data(), 64, p, y.data());
    for (float v : y) EXPECT_NEAR(v, 3.25f, t == QType::kFp8 ? 3.25f * 0.07f : 1e-3f) << qtype_name(t);
  }
}

// The descriptor table is what docs/format.md says: codes (the QType values
// the container header and the calibration tables write), names, code and
// parameter widths; code 4 is the entropy-coded block's, no quantizer's.
TEST(Quant, DescriptorsAreTheFormats) {
  ASSERT_EQ(kQuantizers.size(), size_t(kNumQTypes));
  const struct {
    uint32_t code;
    const char* name;
    uint32_t code_bits, param_bits;
  } want[] = {{0, "none", 0, 0}, {1, "int2", 2, 32}, {2, "int4", 4, 32}, {3, "fp8", 8, 16}};
  for (size_t i = 0; i < kQuantizers.size(); ++i) {
    const Quantizer& q = kQuantizers[i];
    EXPECT_EQ(uint32_t(q.type), want[i].code);
    EXPECT_STREQ(q.name, want[i].name);
    EXPECT_STREQ(qtype_name(q.type), want[i].name);
    EXPECT_EQ(q.code_bits, want[i].code_bits);
    EXPECT_EQ(16 * q.n_params, want[i].param_bits);
    EXPECT_EQ(find_quantizer(want[i].code), &q);
    EXPECT_EQ(quantizer_index(q.type), i);
  }
  EXPECT_EQ(kEcsqTypeCode, 4u);
  EXPECT_EQ(find_quantizer(kEcsqTypeCode), nullptr);
  EXPECT_EQ(find_quantizer(5), nullptr);
  EXPECT_STREQ(qtype_name(QType(5)), "?");
  EXPECT_THROW(quantizer(QType(5)), Error);
}
