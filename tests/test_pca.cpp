// Streamed PCA on synthetic data with a known covariance: mean, spectrum,
// orthonormal basis, full-rank round trip (this tests the algorithm).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "calib/pca.h"
#include "core/parallel.h"
#include "kvtc/error.h"

using namespace kvtc;

TEST(Pca, RecoversAKnownSpectrumFromChunks) {
  const uint32_t p = 40;
  std::mt19937 rng(5);
  std::normal_distribution<double> g(0.0, 1.0);
  // A random orthonormal basis Q (Gram-Schmidt) and variances 100 * 0.7^j.
  std::vector<double> q(p * p);
  for (auto& v : q) v = g(rng);
  for (uint32_t j = 0; j < p; ++j) {
    for (uint32_t k = 0; k < j; ++k) {
      double dot = 0;
      for (uint32_t f = 0; f < p; ++f) dot += q[j * p + f] * q[k * p + f];
      for (uint32_t f = 0; f < p; ++f) q[j * p + f] -= dot * q[k * p + f];
    }
    double nrm = 0;
    for (uint32_t f = 0; f < p; ++f) nrm += q[j * p + f] * q[j * p + f];
    for (uint32_t f = 0; f < p; ++f) q[j * p + f] /= std::sqrt(nrm);
  }
  std::vector<double> sd(p), mean(p);
  for (uint32_t j = 0; j < p; ++j) sd[j] = 10.0 * std::pow(0.7, j / 2.0), mean[j] = 50.0 + j;  // large mean: cancellation check
  CovAccumulator acc(p);
  const size_t n = 20000;
  std::vector<float> x;
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> z(p);
    for (uint32_t j = 0; j < p; ++j) z[j] = g(rng) * sd[j];
    for (uint32_t f = 0; f < p; ++f) {
      double v = mean[f];
      for (uint32_t j = 0; j < p; ++j) v += z[j] * q[j * p + f];
      x.push_back(float(v));
    }
    if (x.size() == 777 * p || i + 1 == n) {  // uneven chunks
      acc.add(x.data(), x.size() / p);
      x.clear();
    }
  }
  Pca pca = acc.finish(p);
  EXPECT_EQ(pca.n_tokens, n);
  for (uint32_t f = 0; f < p; ++f) EXPECT_NEAR(pca.mu[f], mean[f], 0.3);
  for (uint32_t j = 0; j < 8; ++j) EXPECT_NEAR(pca.variance[j], sd[j] * sd[j], 0.06 * sd[j] * sd[j]) << j;
  for (uint32_t j = 1; j < p; ++j) EXPECT_GE(pca.variance[j - 1], pca.variance[j]);
  double tr = 0;
  for (double v : pca.variance) tr += v;
  EXPECT_NEAR(tr, pca.total_variance, 1e-6 * tr);
  // Orthonormal rows; the leading ones align with Q's.
  for (uint32_t a = 0; a < p; ++a)
    for (uint32_t b = a; b < p; ++b) {
      double dot = 0;
      for (uint32_t f = 0; f < p; ++f) dot += double(pca.basis[a * p + f]) * pca.basis[b * p + f];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5) << a << "," << b;
    }
  for (uint32_t j = 0; j < 4; ++j) {
    double dot = 0;
    for (uint32_t f = 0; f < p; ++f) dot += pca.basis[j * p + f] * q[j * p + f];
    EXPECT_GT(std::fabs(dot), 0.98) << j;
  }
  // Full rank: project and reconstruct is the identity (to f32 rounding).
  std::vector<float> row(p), d(p);
  for (uint32_t f = 0; f < p; ++f) row[f] = float(mean[f] + g(rng));
  pca_project(pca, row.data(), 1, d.data());
  for (uint32_t f = 0; f < p; ++f) {
    double v = pca.mu[f];
    for (uint32_t j = 0; j < p; ++j) v += d[j] * pca.basis[j * p + f];
    EXPECT_NEAR(v, row[f], 1e-3);
  }
  // Truncated rank keeps the top components.
  Pca top = acc.finish(5);
  EXPECT_EQ(top.r, 5u);
  for (uint32_t j = 0; j < 5; ++j) EXPECT_NEAR(top.variance[j], pca.variance[j], 1e-9 * pca.variance[0]);
}

namespace {

class VectorSource : public RowSource {
 public:
  VectorSource(std::vector<float> x, uint32_t p) : x_(std::move(x)), p_(p) {}
  uint32_t p() const override { return p_; }
  void reset() override { at_ = 0; }
  size_t next(float* rows, size_t max_rows) override {
    const size_t n = std::min(max_rows, x_.size() / p_ - at_);
    std::copy(x_.begin() + at_ * p_, x_.begin() + (at_ + n) * p_, rows);
    at_ += n;
    return n;
  }

 private:
  std::vector<float> x_;
  uint32_t p_;
  size_t at_ = 0;
};

// n rows of p features (synthetic low-rank-plus-noise data): a mean of
// base + slope * f / p, noise of sd `noise`, and k random directions whose
// coefficients have sd amp * decay^j.
std::vector<float> low_rank_rows(uint32_t p, uint32_t n, uint32_t k, float base, float slope, float noise, float amp, float decay, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> dirs(k * p);
  for (auto& v : dirs) v = g(rng);
  std::vector<float> x(size_t(n) * p);
  for (uint32_t i = 0; i < n; ++i) {
    for (uint32_t f = 0; f < p; ++f) x[size_t(i) * p + f] = base + slope * f / p + noise * g(rng);
    for (uint32_t j = 0; j < k; ++j) {
      const float c = g(rng) * amp * std::pow(decay, float(j));
      for (uint32_t f = 0; f < p; ++f) x[size_t(i) * p + f] += c * dirs[j * p + f];
    }
  }
  return x;
}

}  // namespace

// The two routes on the same rows: equal spectra and subspaces for the
// leading components (synthetic low-rank-plus-noise data).
TEST(Pca, RandomizedMatchesExact) {
  const uint32_t p = 300, n = 6000, k = 12;
  const std::vector<float> x = low_rank_rows(p, n, k, 3.0f, 0.0f, 0.05f, 5.0f, 0.75f, 9);
  CovAccumulator acc(p);
  acc.add(x.data(), n);
  const uint32_t r = 16;
  Pca ex = acc.finish(r);
  VectorSource src(x, p);
  Pca rd = randomized_pca(src, r);
  EXPECT_NEAR(rd.total_variance, ex.total_variance, 1e-4 * ex.total_variance);
  for (uint32_t f = 0; f < p; ++f) EXPECT_NEAR(rd.mu[f], ex.mu[f], 1e-3);
  for (uint32_t j = 0; j < k; ++j) {
    EXPECT_NEAR(rd.variance[j], ex.variance[j], 1e-3 * ex.variance[0]) << j;
    double dot = 0;
    for (uint32_t f = 0; f < p; ++f) dot += double(rd.basis[j * p + f]) * ex.basis[j * p + f];
    EXPECT_GT(std::fabs(dot), 0.999) << "component " << j;
  }
}

// Fewer rows than features: the Gram route (the default there) and the
// covariance route (keep_rows 0) on the same rows, fed in uneven chunks,
// give the same mean, total variance, spectrum and components; past p rows
// the accumulator switches to the covariance and says so; a rank it cannot
// support (r >= n) falls back to the covariance (synthetic data).
TEST(Pca, GramRouteMatchesCovariance) {
  const uint32_t p = 500, n = 320, k = 40;
  const std::vector<float> x = low_rank_rows(p, n, k, 20.0f, 0.5f, 0.02f, 4.0f, 0.85f, 11);  // large mean: cancellation check
  std::mt19937 rng(12);
  std::normal_distribution<float> g(0.0f, 1.0f);
  CovAccumulator gram(p), cov(p, 0);
  for (size_t at = 0, chunk = 37; at < n; at += chunk, chunk += 11) {
    const size_t m = std::min<size_t>(chunk, n - at);
    gram.add(&x[at * p], m);
    cov.add(&x[at * p], m);
  }
  const uint32_t r = 64;
  Pca a = gram.finish(r), b = cov.finish(r);
  EXPECT_TRUE(a.gram);
  EXPECT_FALSE(b.gram);
  ASSERT_EQ(a.r, r);
  EXPECT_EQ(a.n_tokens, n);
  EXPECT_NEAR(a.total_variance, b.total_variance, 1e-5 * b.total_variance);
  for (uint32_t f = 0; f < p; ++f) EXPECT_NEAR(a.mu[f], b.mu[f], 1e-4);
  for (uint32_t j = 0; j < r; ++j) {
    EXPECT_NEAR(a.variance[j], b.variance[j], 1e-5 * b.variance[0]) << j;
    if (j + 1 < r) {
      EXPECT_GE(a.variance[j], a.variance[j + 1]);
    }
  }
  for (uint32_t j = 0; j < k; ++j) {  // well separated: the same vector, the same sign
    double dot = 0;
    for (uint32_t f = 0; f < p; ++f) dot += double(a.basis[j * p + f]) * b.basis[j * p + f];
    EXPECT_GT(dot, 0.9999) << "component " << j;
  }
  for (uint32_t i = 0; i < r; ++i)
    for (uint32_t j = i; j < r; ++j) {
      double dot = 0;
      for (uint32_t f = 0; f < p; ++f) dot += double(a.basis[i * p + f]) * a.basis[j * p + f];
      EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-5) << i << "," << j;
    }
  // r >= n: the centred rows have rank n - 1, so the covariance route answers.
  Pca full = gram.finish(n);
  EXPECT_FALSE(full.gram);
  EXPECT_EQ(full.r, n);
  EXPECT_NEAR(full.variance[0], b.variance[0], 1e-5 * b.variance[0]);
  // Past p rows the kept rows join the covariance chunk by chunk, as the
  // covariance route summed them: the same bits, not only the same answer (a
  // calibration's id hashes its bits, and the quality records are keyed by
  // it). Two kept chunks, so one SYRK over both would round differently.
  std::vector<float> more(size_t(p) * p);
  for (auto& v : more) v = 20.0f + g(rng);
  CovAccumulator over(p), ref(p, 0);
  for (CovAccumulator* c : {&over, &ref}) {
    c->add(x.data(), n / 2);
    c->add(x.data() + size_t(n / 2) * p, n - n / 2);
    c->add(more.data(), p);
  }
  Pca o = over.finish(8), q = ref.finish(8);
  EXPECT_FALSE(o.gram);
  EXPECT_EQ(o.variance, q.variance);
  EXPECT_EQ(o.total_variance, q.total_variance);
  EXPECT_EQ(o.basis, q.basis);
  EXPECT_EQ(o.mu, q.mu);
  // The same when the Gram route declines with every row still kept (r >= n).
  CovAccumulator kept(p), streamed(p, 0);
  for (CovAccumulator* c : {&kept, &streamed}) {
    c->add(x.data(), n / 2);
    c->add(x.data() + size_t(n / 2) * p, n - n / 2);
  }
  Pca kf = kept.finish(n), sf = streamed.finish(n);
  EXPECT_FALSE(kf.gram);
  EXPECT_EQ(kf.variance, sf.variance);
  EXPECT_EQ(kf.basis, sf.basis);
}

// parallel_for holds OpenBLAS to one thread while its region runs and gives
// the count back after. OpenBLAS's count is one per process: two threads in
// parallel_for at once (a server's compression worker beside a restore, or
// beside the learner's fit with --kvtc-calib auto) must still leave it as it
// was, not at the 1 that one of them read while the other held it: every
// later BLAS call would then run on one thread, and a calibration's bytes
// depend on that count (docs/calibration-format.md "Reproducible calibration").
extern "C" int openblas_get_num_threads(void) __attribute__((weak));
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
TEST(Parallel, ConcurrentRegionsGiveOpenBlasItsThreadsBack) {
  if (!openblas_get_num_threads || !openblas_set_num_threads) GTEST_SKIP() << "not linked with OpenBLAS";
  openblas_set_num_threads(2);
  const int before = openblas_get_num_threads();
  ASSERT_EQ(before, 2);
  std::vector<std::thread> ts;
  for (int k = 0; k < 2; ++k)
    ts.emplace_back([] {
      for (int i = 0; i < 2000; ++i) kvtc::detail::parallel_for(2, 2, [](size_t) {});
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(openblas_get_num_threads(), before);
}

// The error a caller sees is the lowest failing index's, as a serial loop
// would throw, whichever thread fails first: index 5 sleeps before it
// throws, so the other thread reaches 40 and throws first (the old rule,
// "first thrown", reported 40).
TEST(Parallel, RethrowsTheLowestFailingIndex) {
  for (int rep = 0; rep < 3; ++rep) {
    try {
      kvtc::detail::parallel_for(64, 2, [](size_t i) {
        if (i == 5) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          throw kvtc::Error("5");
        }
        if (i == 40) throw kvtc::Error("40");
      });
      FAIL() << "no exception";
    } catch (const kvtc::Error& e) {
      EXPECT_STREQ(e.what(), "5");
    }
  }
}
