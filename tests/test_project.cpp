// The projection in bf16 against f32 (src/codec/project.h). Synthetic data:
// these tests are about the arithmetic, not the model. Features carry a
// large mean (as de-RoPEd keys do: per-channel offsets several times their
// spread), which is why centring happens before the rounding to bf16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "codec/project.h"
#include "core/util.h"
#include "kvtc/codec.h"
#include "kvtc/error.h"

using namespace kvtc;

namespace {

// A transform with an orthonormal basis (Gram-Schmidt on Gaussian rows).
Transform random_transform(uint32_t p, uint32_t r, std::mt19937& g) {
  std::normal_distribution<float> nd;
  Transform T;
  T.p = p, T.r = r;
  T.mu.resize(p);
  for (float& m : T.mu) m = 8.0f * nd(g);
  T.basis.resize(size_t(r) * p);
  for (uint32_t i = 0; i < r; ++i) {
    float* row = &T.basis[size_t(i) * p];
    for (uint32_t f = 0; f < p; ++f) row[f] = nd(g);
    for (uint32_t j = 0; j < i; ++j) {
      const float* q = &T.basis[size_t(j) * p];
      double dot = 0;
      for (uint32_t f = 0; f < p; ++f) dot += double(row[f]) * q[f];
      for (uint32_t f = 0; f < p; ++f) row[f] -= float(dot) * q[f];
    }
    double nn = 0;
    for (uint32_t f = 0; f < p; ++f) nn += double(row[f]) * row[f];
    for (uint32_t f = 0; f < p; ++f) row[f] = float(row[f] / std::sqrt(nn));
  }
  return T;
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += double(a[i] - b[i]) * (a[i] - b[i]), den += double(a[i]) * a[i];
  return std::sqrt(num / den);
}

}  // namespace

TEST(Precision, NamesParseAndResolve) {
  for (Precision p : {Precision::kAuto, Precision::kF32, Precision::kBF16}) EXPECT_EQ(parse_precision(precision_name(p)), p);
  EXPECT_THROW(parse_precision("fp16"), Error);
  std::string why;
  const bool bf16 = bf16_projection_available(&why);
  EXPECT_FALSE(why.empty());
  // auto: the integer decode where AVX2 runs it, unless bf16 is native and
  // the CPU lacks AVX-512 VNNI, or has AMX where the int8 matmul is not on
  // its tiles (then bf16); else f32.
  const CpuFeatures& cf = cpu_features();
  std::string int8_impl;
  const bool int8 = cf.avx2 && int8_projection_available(&int8_impl);
  const bool amx_int8 = int8 && int8_impl.find("amx") != std::string::npos;
  EXPECT_EQ(amx_int8, cf.amx_int8 && int8) << int8_impl;  // oneDNN 2.6 has the kernel wherever the CPU has AMX-INT8
  const bool bf16_wins = !amx_int8 && bf16 && (cf.amx_bf16 || !int8 || !cf.avx512_vnni);
  EXPECT_EQ(detail::resolve_precision(Precision::kAuto, "t"), bf16_wins ? Precision::kBF16 : int8 ? Precision::kInt8 : Precision::kF32);
  EXPECT_EQ(detail::resolve_precision(Precision::kF32, "t"), Precision::kF32);
  if (bf16)
    EXPECT_EQ(detail::resolve_precision(Precision::kBF16, "t"), Precision::kBF16);
  else
    EXPECT_THROW(detail::resolve_precision(Precision::kBF16, "t"), Error);
  // int8: a decode mode whose float GEMMs run as auto's.
  EXPECT_EQ(parse_precision("int8"), Precision::kInt8);
  EXPECT_STREQ(precision_name(Precision::kInt8), "int8");
  if (int8_projection_available(&why))
    EXPECT_EQ(detail::resolve_precision(Precision::kInt8, "t"), Precision::kInt8);
  else
    EXPECT_THROW(detail::resolve_precision(Precision::kInt8, "t"), Error);
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(detail::float_precision(Precision::kInt8), bf16 ? Precision::kBF16 : Precision::kF32);
  EXPECT_EQ(detail::float_precision(detail::resolve_precision(Precision::kAuto, "t")), bf16 ? Precision::kBF16 : Precision::kF32);
  EXPECT_EQ(detail::float_precision(Precision::kF32), Precision::kF32);
}

// The integer GEMM sums exactly at the ends of its operands' ranges: codes
// +-127 (16 - 1/8 in steps of 1/8: offset 0.125) against basis entries
// +-63, every product the same sign; and two codes past 8 bits come back
// whole. oneDNN's AVX2 kernel adds pairs of
// u8 x s8 products in 16 bits: with the basis at +-127 it saturates (here:
// 2,752,895 for 4,129,024; measured with a probe of oneDNN 2.6), which this
// would catch as a ~30% error. Synthetic on purpose: the arithmetic's
// bounds, not a model.
TEST(Projector, Int8GemmIsExactAtTheRangeEnds) {
  if (!int8_projection_available()) GTEST_SKIP() << "no native int8 GEMM on this CPU";
  const uint32_t n = 48, p = 80, r = 256;
  Transform T;
  T.p = p, T.r = r;
  T.mu.assign(p, 0.5f);
  T.basis.resize(size_t(r) * p);
  auto sj = [](uint32_t j) { return j % 3 == 1 ? -1 : 1; };
  auto sf = [](uint32_t f) { return f % 5 == 2 ? -1 : 1; };
  for (uint32_t j = 0; j < r; ++j)
    for (uint32_t f = 0; f < p; ++f) T.basis[size_t(j) * p + f] = 0.125f * float(sj(j) * sf(f));
  std::vector<int32_t> q(size_t(r) * n);
  for (uint32_t j = 0; j < r; ++j)
    for (uint32_t t = 0; t < n; ++t) q[size_t(j) * n + t] = 16 * sj(j) * (t % 2 ? -1 : 1);
  // Codes past 8 bits, rare enough to stay in the integer GEMM: clamped
  // there, their remainders added apart.
  q[size_t(5) * n + 0] = 1000 * sj(5);
  q[size_t(200) * n + 7] = -3000 * sj(200);
  const float step = 0.5f, offset = 0.125f;
  const detail::Projector P(T, r, Precision::kInt8);
  std::vector<float> y(size_t(n) * p);
  P.decode_codes(q.data(), n, step, offset, y.data(), nullptr);
  // Every term is (|q| - 0.125) * 0.5 * 0.125 * sign: exact in f32 as in double.
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t f = 0; f < p; ++f) {
      double want = 0.5;
      for (uint32_t j = 0; j < r; ++j) {
        const int32_t c = q[size_t(j) * n + t];
        want += (c < 0 ? -1 : 1) * (std::abs(c) - 0.125) * 0.5 * 0.125 * sj(j) * sf(f);
      }
      ASSERT_NEAR(y[size_t(t) * p + f], want, 1e-5 * std::fabs(want)) << "token " << t << ", feature " << f;
    }
}

// On chunks shaped like the codec's (Laplace codes whose spread falls along
// the components; the first ones mostly past the 8-bit range, most of the
// energy, in the float GEMM, the others' outliers added apart): near the
// float GEMM's result (measured 2.2e-3 against f32; bf16's own rounding,
// ~2^-9 per input, would add up to ~4e-3: bound 1e-2), and not equal to it
// (it ran in integers: above 1e-4). A
// chunk whose every component has a code past 8 bits runs wholly in the
// float GEMM: bit for bit what decode() gives.
TEST(Projector, Int8NearTheFloatGemmOnEntropyCodedChunks) {
  if (!int8_projection_available()) GTEST_SKIP() << "no native int8 GEMM on this CPU";
  std::mt19937 g(5);
  const uint32_t n = 256, p = 640, r = 320;
  const Transform T = random_transform(p, r, g);
  std::exponential_distribution<double> ex(1.0);
  std::vector<int32_t> q(size_t(r) * n);
  for (uint32_t j = 0; j < r; ++j)
    for (uint32_t t = 0; t < n; ++t) {
      const double v = (g() % 2 ? 1 : -1) * ex(g) * 40.0 * std::pow(0.98, j);
      q[size_t(j) * n + t] = int32_t(std::lround(v));
    }
  const float step = 0.25f, offset = 0.1f;
  const Precision fp = detail::float_precision(Precision::kInt8);
  const detail::Projector I(T, r, Precision::kInt8), F(T, r, fp);
  std::vector<float> yi(size_t(n) * p), yf(size_t(n) * p);
  I.decode_codes(q.data(), n, step, offset, yi.data(), nullptr);
  F.decode_codes(q.data(), n, step, offset, yf.data(), nullptr);
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t f = 0; f < p; ++f) yi[size_t(t) * p + f] -= T.mu[f], yf[size_t(t) * p + f] -= T.mu[f];
  const double diff = rel_diff(yf, yi);
  std::printf("  int8 against %s: rel. diff %.2e\n", precision_name(fp), diff);
  EXPECT_LT(diff, 1e-2);
  EXPECT_GT(diff, 1e-4);
  // Every code past 8 bits (|q| >= 17: 8 |q| - round(8 offset) >= 135):
  // the float GEMM alone.
  for (int32_t& c : q) c = c < 0 ? c - 17 : c + 17;
  I.decode_codes(q.data(), n, step, offset, yi.data(), nullptr);
  F.decode_codes(q.data(), n, step, offset, yf.data(), nullptr);
  EXPECT_EQ(yi, yf);
}

// bf16 rounds each input to 8 significant bits (relative error <= 2^-9 per
// value); over sums of ~p products of independent errors the result stays
// within ~2^-8 of f32 in relative RMS. Shapes: odd sizes, and the codec's
// own (256 tokens x 5760 features, 512 components).
TEST(Projector, Bf16WithinRoundingOfF32) {
  if (!bf16_projection_available()) GTEST_SKIP() << "no native bf16 projection on this CPU";
  std::mt19937 g(7);
  std::normal_distribution<float> nd;
  for (auto [n, p, r] : {std::array<uint32_t, 3>{7, 40, 3}, {33, 130, 17}, {256, 5760, 512}}) {
    SCOPED_TRACE(std::to_string(n) + " x " + std::to_string(p) + " x " + std::to_string(r));
    const Transform T = random_transform(p, r, g);
    std::vector<float> x(size_t(n) * p);
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t f = 0; f < p; ++f) x[size_t(t) * p + f] = T.mu[f] + nd(g);
    const detail::Projector f32(T, r, Precision::kF32), bf16(T, r, Precision::kBF16);
    std::vector<float> x1 = x, x2 = x, d1(size_t(n) * r), d2(size_t(n) * r);
    f32.encode(x1.data(), n, d1.data(), nullptr);
    bf16.encode(x2.data(), n, d2.data(), nullptr);
    const double de = rel_diff(d1, d2);
    EXPECT_LT(de, 6e-3);
    EXPECT_GT(de, 1e-5);  // and it did run in bf16
    std::printf("  %u x %u x %u: encode rel. diff %.2e", n, p, r, de);
    std::vector<float> y1(size_t(n) * p), y2(size_t(n) * p);
    f32.decode(d1.data(), n, y1.data(), nullptr);
    bf16.decode(d1.data(), n, y2.data(), nullptr);
    // The mean is added in f32 (the GEMM's bias): compare the projected part.
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t f = 0; f < p; ++f) y1[size_t(t) * p + f] -= T.mu[f], y2[size_t(t) * p + f] -= T.mu[f];
    const double dd = rel_diff(y1, y2);
    EXPECT_LT(dd, 6e-3);
    EXPECT_GT(dd, 1e-5);
    std::printf(", decode %.2e\n", dd);
  }
}

// Components past ru are not touched, and ru = 0 decodes to the mean.
TEST(Projector, ZeroComponentsIsTheMean) {
  std::mt19937 g(3);
  const Transform T = random_transform(24, 4, g);
  for (Precision p : {Precision::kF32, Precision::kBF16}) {
    if (p == Precision::kBF16 && !bf16_projection_available()) continue;
    const detail::Projector P(T, 0, p);
    std::vector<float> y(3 * 24, -1.0f);
    P.decode(nullptr, 3, y.data(), nullptr);
    for (uint32_t t = 0; t < 3; ++t)
      for (uint32_t f = 0; f < 24; ++f) EXPECT_EQ(y[t * 24 + f], T.mu[f]);
  }
}

// The rounded-basis cache is keyed by what the basis is, never where it is:
// a calibration freed and loaded again may hold its value basis where its
// key basis was (the Python tests' KvtcCaches did: values were coded on the
// keys' rows, KL 0.8-1.6 after a restore instead of 0.024). Here one
// Transform object holds the keys' basis, then the values' (same size, so
// the same buffer), under the same calibration id: each must project on
// its own rows. Then a key that does not name the content (bases changed
// after the id was set) is caught by the cache's probe.
TEST(Projector, CachedRowsFollowTheTransformNotItsAddress) {
  if (!bf16_projection_available()) GTEST_SKIP() << "no native bf16 projection on this CPU";
  std::mt19937 g(11);
  std::normal_distribution<float> nd;
  const uint32_t n = 16, p = 96, r = 24;
  Calibration cal;
  cal.id = "projector-cache-test-" + std::to_string(g());  // not a real calibration's: nothing else in the cache matches
  cal.blocks.resize(1);
  cal.blocks[0][0] = random_transform(p, r, g);
  cal.blocks[0][1] = random_transform(p, r, g);
  std::vector<float> x(size_t(n) * p);
  for (float& v : x) v = 8.0f * nd(g);
  auto encode = [&](const Transform& T, const std::string& key) {
    const detail::Projector P(T, r, Precision::kBF16, key);
    std::vector<float> xc = x, d(size_t(n) * r);
    P.encode(xc.data(), n, d.data(), nullptr);
    return d;
  };
  Transform T = cal.blocks[0][0];
  const float* at = T.basis.data();
  const std::vector<float> keys = encode(T, detail::transform_key(cal, 0, 0));
  EXPECT_EQ(keys, encode(cal.blocks[0][0], ""));  // the uncached rounding
  T = cal.blocks[0][1];
  ASSERT_EQ(T.basis.data(), at);  // the values' basis where the keys' was
  const std::vector<float> values = encode(T, detail::transform_key(cal, 0, 1));
  EXPECT_EQ(values, encode(cal.blocks[0][1], ""));
  EXPECT_GT(rel_diff(keys, values), 0.5);
  // A key naming the keys' transform, over the values' basis.
  EXPECT_EQ(encode(T, detail::transform_key(cal, 0, 0)), values);
  EXPECT_NE(detail::transform_key(cal, 0, 0), detail::transform_key(cal, 0, 1));
  Calibration unnamed;
  EXPECT_EQ(detail::transform_key(unnamed, 0, 0), "");
}
