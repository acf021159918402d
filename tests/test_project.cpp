// The projection in bf16 against f32 (src/codec/project.h). Synthetic data:
// these tests are about the arithmetic, not the model. Features carry a
// large mean (as de-RoPEd keys do: per-channel offsets several times their
// spread), which is why centring happens before the rounding to bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
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

namespace {

// A layer-grouped transform (FitOptions::layer_groups): runs of features
// [0, 96) and [96, 320) (uneven on purpose) with features 300..319 in no
// component, each run's components orthonormal there and zero elsewhere,
// interleaved as a merge by variance would leave them. Synthetic: the
// projection's arithmetic, not a model.
Transform grouped_transform(std::mt19937& g) {
  const uint32_t p = 320, w0 = 96, w1 = 204;  // run 1: features 96..299 carry it
  Transform a = random_transform(w0, w0, g), b = random_transform(w1, w1, g);
  Transform T;
  T.p = p, T.r = w0 + w1;
  T.mu.resize(p);
  std::normal_distribution<float> nd;
  for (float& m : T.mu) m = 4.0f * nd(g);
  T.basis.assign(size_t(T.r) * p, 0.0f);
  uint32_t ia = 0, ib = 0;
  for (uint32_t j = 0; j < T.r; ++j) {
    const bool from_a = ia < a.r && (j % 3 == 0 || ib == b.r);  // every third component is run 0's
    float* row = &T.basis[size_t(j) * p];
    if (from_a)
      std::copy_n(&a.basis[size_t(ia++) * w0], w0, row);
    else
      std::copy_n(&b.basis[size_t(ib++) * w1], w1, row + w0);
  }
  return T;
}

}  // namespace

// The runs are found in the basis; a dense basis is one run; a run that
// would save under 10% of the multiply-adds is not split.
TEST(GroupedProjection, FindsTheRunsInTheBasis) {
  std::mt19937 g(11);
  const Transform T = grouped_transform(g);
  const detail::GroupedBasis G = detail::find_groups(T, T.r);
  ASSERT_EQ(G.groups.size(), 2u);
  EXPECT_EQ(G.groups[0].c0, 0u);
  EXPECT_EQ(G.groups[0].w, 96u);
  EXPECT_EQ(G.groups[1].c0, 96u);
  EXPECT_EQ(G.groups[1].w, 224u);  // the untouched features 300..319 join the run before them
  EXPECT_EQ(G.groups[0].comps.size(), 96u);
  EXPECT_EQ(G.groups[1].comps.size(), 204u);
  EXPECT_EQ(G.groups[0].comps[1], 3u);
  EXPECT_EQ(G.groups[1].comps[0], 1u);
  // The first 2 components alone: one of each run.
  EXPECT_EQ(detail::find_groups(T, 2).groups.size(), 2u);
  EXPECT_EQ(detail::find_groups(T, 1).groups.size(), 0u);
  EXPECT_EQ(detail::find_groups(random_transform(64, 32, g), 32).groups.size(), 0u);
  // One component on features 0..7, the other 239 on 8..319: splitting
  // saves 2.4% of the multiply-adds, not worth two GEMMs.
  Transform t = T;
  for (uint32_t j = 0; j < t.r; ++j) {
    float* row = &t.basis[size_t(j) * t.p];
    std::fill(row, row + t.p, 0.0f);
    if (j == 0)
      std::fill(row, row + 8, 0.25f);
    else
      row[8 + j % 312] = 1.0f, row[319] = 0.5f;
  }
  EXPECT_EQ(detail::find_groups(t, t.r).groups.size(), 0u);
  for (uint32_t j = 1; j < t.r; ++j)
    t.basis[size_t(j) * t.p + 319] = 0.0f, t.basis[size_t(j) * t.p + 8 + j % 312] = 0.0f, t.basis[size_t(j) * t.p + 200] = 1.0f;
  EXPECT_EQ(detail::find_groups(t, t.r).groups.size(), 2u);  // now the 239 span one feature
}

// Run by run against one dense GEMM over the zeros (set_grouped_projection
// off), in every precision this CPU runs: encode token- and
// component-major, decode of all rows and of a prefix, and the entropy-coded
// chunks' integer decode. The same products less the zeros', summed in
// another order: measured rel. diff 0 in f32 and <= 1.9e-8 in bf16 and
// int8 (Zen 4 EPYC): bound 1e-5. A projection whose runs were swapped or
// whose components went to the wrong run is off by ~1 (a gather shifted by
// one component failed 5 of these checks).
TEST(GroupedProjection, RunByRunEqualsTheDenseGemm) {
  std::mt19937 g(12);
  const Transform T = grouped_transform(g);
  const uint32_t n = 96, p = T.p, r = T.r;
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n) * p);
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t f = 0; f < p; ++f) x[size_t(t) * p + f] = T.mu[f] + nd(g) * (f < 300 ? 1.0f : 0.0f);
  std::exponential_distribution<double> ex(1.0);
  std::vector<int32_t> q(size_t(r) * n);
  for (uint32_t j = 0; j < r; ++j)
    for (uint32_t t = 0; t < n; ++t) q[size_t(j) * n + t] = int32_t(std::lround((g() % 2 ? 1 : -1) * ex(g) * 3.0 * std::pow(0.995, j)));
  std::vector<Precision> precs{Precision::kF32};
  if (bf16_projection_available()) precs.push_back(Precision::kBF16);
  if (int8_projection_available()) precs.push_back(Precision::kInt8);
  for (Precision prec : precs) {
    SCOPED_TRACE(precision_name(prec));
    struct Out {
      std::vector<float> enc, enc_cm, dec, dec_prefix, codes, wide, mixed, mixed_float;
    };
    auto run = [&](bool grouped) {
      detail::set_grouped_projection(grouped);
      const detail::Projector P(T, r, prec);  // no key: made here, not from the cache
      detail::set_grouped_projection(true);
      EXPECT_EQ(P.groups(), grouped ? 2u : 1u);
      Out o;
      std::vector<float> xc = x;
      o.enc.resize(size_t(n) * r);
      P.encode(xc.data(), n, o.enc.data(), nullptr);
      xc = x;
      o.enc_cm.resize(size_t(n) * r);
      P.encode(xc.data(), n, o.enc_cm.data(), nullptr, true);
      o.dec.resize(size_t(n) * p);
      P.decode(o.enc.data(), n, o.dec.data(), nullptr);
      // A prefix (as the int8 path's leading components): the first 50 rows of the component-major D.
      const detail::Projector P50(T, 50, prec);
      o.dec_prefix.resize(size_t(n) * p);
      std::vector<float> cm50(o.enc_cm.begin(), o.enc_cm.begin() + size_t(50) * n);
      P50.decode(cm50.data(), n, o.dec_prefix.data(), nullptr, true);
      // Entropy-coded chunks whose integer/float split is the same either
      // way: small codes (every component in the integer GEMM on the int8
      // path, a few past 8 bits added apart), then all past 8 bits (every
      // component in the float GEMM).
      o.codes.resize(size_t(n) * p);
      P.decode_codes(q.data(), n, 0.25f, 0.1f, o.codes.data(), nullptr);
      std::vector<int32_t> wide = q;
      for (int32_t& c : wide) c = c < 0 ? c - 17 : c + 17;
      o.wide.resize(size_t(n) * p);
      P.decode_codes(wide.data(), n, 0.25f, 0.1f, o.wide.data(), nullptr);
      // A mixed chunk (the leading components past 8 bits): the runs round
      // their float share up to 32 each, so it differs from the dense
      // split; against the float decode instead.
      std::vector<int32_t> mixed = q;
      for (uint32_t j = 0; j < 40; ++j)
        for (uint32_t t = 0; t < n; ++t) mixed[size_t(j) * n + t] *= 12;
      o.mixed.resize(size_t(n) * p);
      P.decode_codes(mixed.data(), n, 0.25f, 0.1f, o.mixed.data(), nullptr);
      std::vector<float> d(mixed.size());
      for (size_t i = 0; i < d.size(); ++i) d[i] = (mixed[i] < 0 ? -1 : mixed[i] > 0 ? 1 : 0) * (std::abs(mixed[i]) - 0.1f) * 0.25f;
      o.mixed_float.resize(size_t(n) * p);
      P.decode(d.data(), n, o.mixed_float.data(), nullptr, true);
      return o;
    };
    const Out dense = run(false), grouped = run(true);
    std::printf("  %s run by run against dense: enc %.1e, enc cm %.1e, dec %.1e, prefix %.1e, codes %.1e, wide %.1e; mixed against float %.1e\n",
                precision_name(prec), rel_diff(dense.enc, grouped.enc), rel_diff(dense.enc_cm, grouped.enc_cm), rel_diff(dense.dec, grouped.dec),
                rel_diff(dense.dec_prefix, grouped.dec_prefix), rel_diff(dense.codes, grouped.codes), rel_diff(dense.wide, grouped.wide),
                rel_diff(grouped.mixed_float, grouped.mixed));
    EXPECT_LT(rel_diff(dense.enc, grouped.enc), 1e-5);
    EXPECT_LT(rel_diff(dense.enc_cm, grouped.enc_cm), 1e-5);
    EXPECT_LT(rel_diff(dense.dec, grouped.dec), 1e-5);
    EXPECT_LT(rel_diff(dense.dec_prefix, grouped.dec_prefix), 1e-5);
    EXPECT_LT(rel_diff(dense.codes, grouped.codes), 1e-5);
    EXPECT_LT(rel_diff(dense.wide, grouped.wide), 1e-5);
    // int8 against float: measured 1.0e-3 (the basis in 7 bits), bound 1e-2 as Int8NearTheFloatGemm.
    EXPECT_LT(rel_diff(grouped.mixed_float, grouped.mixed), prec == Precision::kInt8 ? 1e-2 : 1e-5);
    // The round trip itself: x back within bf16's rounding (f32: exact but
    // for the 20 features no component spans, which carry only the mean here).
    EXPECT_LT(rel_diff(x, grouped.dec), prec == Precision::kF32 ? 1e-5 : 1e-2);
  }
}

// The int8 decode's conversion of codes (synthetic: about the arithmetic).
// The AVX-512BW path (16 x 16 tiles transposed in registers) must give the
// scalar path's bytes and outliers exactly, also for token and component
// counts that leave tails (124 tokens: a chunk's last; 37 components) and
// codes past 8 bits (the leading components, step-sized spreads of ~40).
TEST(Int8Codes, VectorPathGivesTheScalarBytesAndOutliers) {
  std::mt19937 g(11);
  std::normal_distribution<float> nd;
  struct Shape {
    uint32_t n, k;
    float spread;
  };
  for (const Shape sh : {Shape{256, 2100, 6.0f}, Shape{124, 2093, 6.0f}, Shape{256, 37, 40.0f}, Shape{7, 3, 100.0f}, Shape{16, 16, 30.0f}})
    for (const float offset : {0.3f, -0.45f, 0.0f}) {
      std::vector<int32_t> c(size_t(sh.n) * sh.k);
      for (uint32_t j = 0; j < sh.k; ++j)
        for (uint32_t t = 0; t < sh.n; ++t) c[size_t(j) * sh.n + t] = int32_t(std::lround(nd(g) * sh.spread * std::exp(-float(j) / 600.0f)));
      std::vector<int8_t> a;
      std::vector<std::array<int32_t, 3>> o;
      detail::int8_codes(c.data(), sh.k, sh.n, offset, false, &a, &o);
      // The scalar path against the definition: v = sign(c) (8 |c| - ro), clamped, remainder apart.
      const int32_t ro = int32_t(std::lround(8.0 * offset));
      size_t n_over = 0;
      for (uint32_t t = 0; t < sh.n; ++t)
        for (uint32_t j = 0; j < sh.k; ++j) {
          const int32_t q = c[size_t(j) * sh.n + t], v = q == 0 ? 0 : (q > 0 ? 1 : -1) * (8 * std::abs(q) - ro);
          ASSERT_EQ(int32_t(a[size_t(t) * sh.k + j]), std::clamp(v, -127, 127)) << "token " << t << " component " << j;
          n_over += std::abs(v) > 127;
        }
      ASSERT_EQ(o.size(), n_over);
      for (const auto& x : o) {
        const int32_t q = c[size_t(x[1]) * sh.n + x[0]], v = (q > 0 ? 1 : -1) * (8 * std::abs(q) - ro);
        EXPECT_EQ(x[2], v - std::clamp(v, -127, 127));
      }
      if (!detail::int8_codes_vector_path()) continue;
      std::vector<int8_t> av;
      std::vector<std::array<int32_t, 3>> ov;
      detail::int8_codes(c.data(), sh.k, sh.n, offset, true, &av, &ov);
      EXPECT_EQ(av, a) << sh.n << " tokens, " << sh.k << " components";
      // One token's outliers in the same order (add_outliers' float sums depend on it).
      std::vector<std::vector<std::array<int32_t, 3>>> per(sh.n), perv(sh.n);
      for (const auto& x : o) per[x[0]].push_back(x);
      for (const auto& x : ov) perv[x[0]].push_back(x);
      EXPECT_EQ(perv, per) << sh.n << " tokens, " << sh.k << " components";
    }
  if (!detail::int8_codes_vector_path()) GTEST_SKIP() << "no AVX-512BW here: the scalar path checked alone";
}
