// The entropy-coded chunks (container version 2, src/format/ecsq.h): the
// normative tables, bit-exact round trips, the rate estimate, escapes and
// shifts, and corrupt payloads. Synthetic coefficients on purpose: these
// test the coder; tests/test_codec_cli.py runs the mode on a real model's
// cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

#include "core/util.h"
#include "format/ecsq.h"
#include "kvtc/error.h"

using namespace kvtc;
using namespace kvtc::container;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// n x ru coefficients, component j with standard deviation sd0 * decay^j,
// Laplace-distributed (heavier than Gaussian, as PCA coefficients of caches).
std::vector<float> coeffs(uint32_t n, uint32_t ru, double sd0, double decay, uint32_t seed) {
  std::mt19937 rng(seed);
  std::exponential_distribution<double> ex(1.0);
  std::bernoulli_distribution sign(0.5);
  std::vector<float> d(size_t(n) * ru);
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < ru; ++j) {
      const double b = sd0 * std::pow(decay, j) / std::sqrt(2.0);
      d[size_t(t) * ru + j] = float((sign(rng) ? 1 : -1) * ex(rng) * b);
    }
  return d;
}

// The encoder's layout: component-major, d'[j * n + t].
std::vector<float> cm(const std::vector<float>& d, uint32_t n, uint32_t ru) {
  std::vector<float> o(d.size());
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < ru; ++j) o[size_t(j) * n + t] = d[size_t(t) * ru + j];
  return o;
}

// What the decoder must give for coefficient x: the code's reconstruction.
void expect_close(const std::vector<float>& d, const std::vector<float>& out, float step) {
  ASSERT_EQ(d.size(), out.size());
  for (size_t i = 0; i < d.size(); ++i) ASSERT_LE(std::fabs(d[i] - out[i]), step * 1.0f + 1e-6f * std::fabs(d[i])) << "coefficient " << i;
}

// ecsq_decode_codes gives the codes whose reconstructions ecsq_decode_chunk
// writes (component-major), bit for bit.
void expect_codes_agree(const std::vector<uint8_t>& bytes, uint32_t n, uint32_t ru) {
  std::vector<float> values(size_t(n) * ru, -1);
  std::vector<int32_t> codes(size_t(n) * ru, -1);
  ecsq_decode_chunk(bytes.data(), bytes.size(), n, ru, values.data(), "chunk", true);
  ecsq_decode_codes(bytes.data(), bytes.size(), n, ru, codes.data(), "chunk");
  const float step = ecsq_chunk_step(bytes.data(), bytes.size(), "chunk"), offset = ecsq_chunk_offset(bytes.data(), bytes.size(), "chunk");
  for (size_t i = 0; i < codes.size(); ++i) {
    const int32_t c = codes[i];
    const float a = c == 0 ? 0.0f : (float(std::abs(c)) - offset) * step;
    ASSERT_EQ(values[i], c < 0 ? -a : a) << "value " << i << ", code " << c;
  }
}

}  // namespace

// The table file is the one docs/format.md names (its SHA-256), and every
// table is a distribution over 4096 with an escape.
TEST(Ecsq, TablesAreTheSpecifiedOnes) {
  const std::string text = slurp(std::string(KVTC_SOURCE_DIR) + "/src/format/ecsq_tables.inc");
  ASSERT_FALSE(text.empty());
  const std::string sha = sha256_bytes({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
  const std::string spec = slurp(std::string(KVTC_SOURCE_DIR) + "/docs/format.md");
  EXPECT_NE(spec.find(sha), std::string::npos) << "docs/format.md does not record the tables' SHA-256 " << sha;
  ASSERT_EQ(ecsq_table_count(), 82u);
  for (uint32_t k = 0; k < ecsq_table_count(); ++k) {
    const uint16_t* f = ecsq_table(k);
    uint32_t sum = 0;
    for (int u = 0; u < 64; ++u) sum += f[u];
    EXPECT_EQ(sum, 4096u) << "table " << k;
    EXPECT_GE(f[63], 1u) << "table " << k;
  }
}

TEST(Ecsq, RoundTripsAndEstimatesItsSize) {
  for (uint32_t n : {1u, 16u, 256u})
    for (float step : {0.05f, 0.3f, 2.0f}) {
      SCOPED_TRACE("n " + std::to_string(n) + ", step " + std::to_string(step));
      const uint32_t ru = 48;
      const std::vector<float> d = coeffs(n, ru, 20.0, 0.85, n + 7);
      EcsqParams p;
      p.step = step;
      const std::vector<uint8_t> bytes = ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p);
      std::vector<float> out(d.size(), -1);
      ecsq_decode_chunk(bytes.data(), bytes.size(), n, ru, out.data(), "chunk");
      expect_close(d, out, step);
      expect_codes_agree(bytes, n, ru);
      // The same bytes again (the encoder is deterministic).
      EXPECT_EQ(bytes, ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p));
      const double est = ecsq_estimate_bytes(cm(d, n, ru).data(), n, ru, p);
      EXPECT_NEAR(est, double(bytes.size()), 0.02 * double(bytes.size()) + 24) << "estimate";
      EXPECT_EQ(ecsq_chunk_step(bytes.data(), bytes.size(), "chunk"), step);
    }
}

// A step far below the coefficients: shifts and escapes carry codes up to
// 2^24; beyond, codes clamp (the error grows, the stream stays valid).
TEST(Ecsq, LargeCodesUseShiftsAndEscapes) {
  const uint32_t n = 64, ru = 6;
  std::vector<float> d = coeffs(n, ru, 1.0, 1.0, 3);
  for (uint32_t t = 0; t < n; ++t) {
    d[size_t(t) * ru + 0] *= 1e5f;                         // ~1e5 steps: shifted
    d[size_t(t) * ru + 1] = t == 5 ? 3e3f : 0.0f;          // one outlier in zeros: escaped
    d[size_t(t) * ru + 2] = 0.0f;                          // all zero: id 0
    d[size_t(t) * ru + 3] = float(t % 2 ? 1 : -1) * 5e7f;  // beyond 2^24 steps: clamped
  }
  EcsqParams p;
  p.step = 1.0f;
  const std::vector<uint8_t> bytes = ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p);
  EXPECT_EQ(bytes[8 + 2], 0) << "an all-zero component has id 0";
  std::vector<float> out(d.size());
  ecsq_decode_chunk(bytes.data(), bytes.size(), n, ru, out.data(), "chunk");
  expect_codes_agree(bytes, n, ru);
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < ru; ++j) {
      const float x = d[size_t(t) * ru + j], y = out[size_t(t) * ru + j];
      if (j == 3)
        EXPECT_NEAR(std::fabs(y), float(1 << 24), 0.5f) << "clamped at 2^24 steps";
      else
        EXPECT_LE(std::fabs(x - y), 1.0f) << "t " << t << " j " << j;
    }
}

// Any truncation or byte change of a payload is an Error or a valid decode
// (the container's checksum catches the rest), never a crash or an
// out-of-range write; a payload of another size or component count too.
TEST(Ecsq, CorruptPayloadsAreErrors) {
  const uint32_t n = 32, ru = 12;
  const std::vector<float> d = coeffs(n, ru, 8.0, 0.8, 11);
  EcsqParams p;
  p.step = 0.25f;
  const std::vector<uint8_t> good = ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p);
  std::vector<float> out(size_t(n) * ru);
  std::vector<int32_t> codes(size_t(n) * ru);
  for (size_t len = 0; len < good.size(); ++len) {
    EXPECT_THROW(ecsq_decode_chunk(good.data(), len, n, ru, out.data(), "truncated"), Error) << "length " << len;
    EXPECT_THROW(ecsq_decode_codes(good.data(), len, n, ru, codes.data(), "truncated"), Error) << "length " << len;
  }
  std::vector<uint8_t> longer = good;
  longer.push_back(0);
  EXPECT_THROW(ecsq_decode_chunk(longer.data(), longer.size(), n, ru, out.data(), "longer"), Error);
  std::mt19937 rng(5);
  int errors = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> b = good;
    b[rng() % b.size()] ^= uint8_t(1 + rng() % 255);
    try {
      ecsq_decode_chunk(b.data(), b.size(), n, ru, out.data(), "flipped");
    } catch (const Error&) {
      ++errors;
    }
    // The integer decoder makes the same checks (the step's and offset's
    // aside: its caller reads them apart).
    if (std::equal(b.begin(), b.begin() + 8, good.begin())) {
      bool threw = false;
      try {
        ecsq_decode_codes(b.data(), b.size(), n, ru, codes.data(), "flipped");
      } catch (const Error&) {
        threw = true;
      }
      bool threw_float = false;
      try {
        ecsq_decode_chunk(b.data(), b.size(), n, ru, out.data(), "flipped");
      } catch (const Error&) {
        threw_float = true;
      }
      EXPECT_EQ(threw, threw_float) << "trial " << trial;
    }
  }
  EXPECT_GT(errors, 1000) << "the end-of-stream check catches most changes";
  std::vector<uint8_t> bad_id = good;
  bad_id[8] = 240;
  try {
    ecsq_decode_chunk(bad_id.data(), bad_id.size(), n, ru, out.data(), "chunk X");
    ADD_FAILURE() << "decoded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("chunk X: table id 240 of component 0"), std::string::npos) << e.what();
  }
  std::vector<uint8_t> bad_step = good;
  bad_step[3] = 0xff;  // NaN
  EXPECT_THROW(ecsq_decode_chunk(bad_step.data(), bad_step.size(), n, ru, out.data(), "nan"), Error);
}

// Coding the same data more finely costs more bytes and errs less: the
// knob rate control turns is monotone where it searches.
TEST(Ecsq, BytesFallAsTheStepGrows) {
  const uint32_t n = 256, ru = 64;
  const std::vector<float> d = coeffs(n, ru, 10.0, 0.9, 21);
  double prev = 1e30;
  for (float step : {0.01f, 0.03f, 0.1f, 0.3f, 1.0f, 3.0f}) {
    EcsqParams p;
    p.step = step;
    const double b = double(ecsq_encode_chunk(cm(d, n, ru).data(), n, ru, p).size());
    EXPECT_LT(b, prev) << "step " << step;
    prev = b;
  }
}
