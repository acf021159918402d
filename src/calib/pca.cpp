#include "calib/pca.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "kvtc/error.h"

namespace kvtc {

CovAccumulator::CovAccumulator(uint32_t p) : p_(p), shift_(p, 0.0), sum_(p, 0.0), s_(size_t(p) * p, 0.0), tmp_(size_t(p) * p) {}

void CovAccumulator::add(const float* x, size_t n) {
  if (n == 0) return;
  if (n_ == 0) {
    for (size_t i = 0; i < n; ++i)
      for (uint32_t f = 0; f < p_; ++f) shift_[f] += x[i * p_ + f];
    for (auto& v : shift_) v /= double(n);
  }
  xc_.resize(n * p_);
  for (size_t i = 0; i < n; ++i)
    for (uint32_t f = 0; f < p_; ++f) {
      const float c = float(double(x[i * p_ + f]) - shift_[f]);
      xc_[i * p_ + f] = c;
      sum_[f] += c;
    }
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, int(p_), int(n), 1.0f, xc_.data(), int(p_), 0.0f, tmp_.data(), int(p_));
  for (uint32_t a = 0; a < p_; ++a)
    for (uint32_t b = a; b < p_; ++b) s_[size_t(a) * p_ + b] += tmp_[size_t(a) * p_ + b];
  n_ += n;
}

Pca CovAccumulator::finish(uint32_t r_max) const {
  require(n_ >= 2, "PCA: need at least 2 calibration tokens, have " + std::to_string(n_));
  const uint32_t r = std::min(r_max, p_);
  require(r >= 1, "PCA: rank must be at least 1");
  Pca out;
  out.p = p_;
  out.r = r;
  out.n_tokens = n_;
  std::vector<double> m(p_);  // mean of shifted rows
  for (uint32_t f = 0; f < p_; ++f) m[f] = sum_[f] / double(n_);
  out.mu.resize(p_);
  for (uint32_t f = 0; f < p_; ++f) out.mu[f] = float(shift_[f] + m[f]);
  std::vector<double> cov(size_t(p_) * p_, 0.0);
  for (uint32_t a = 0; a < p_; ++a)
    for (uint32_t b = a; b < p_; ++b) cov[size_t(a) * p_ + b] = s_[size_t(a) * p_ + b] / double(n_) - m[a] * m[b];
  for (uint32_t f = 0; f < p_; ++f) out.total_variance += cov[size_t(f) * p_ + f];
  std::vector<double> w(p_), z(size_t(p_) * r);
  std::vector<lapack_int> isuppz(2 * size_t(r));
  lapack_int found = 0;
  // Eigenvalues il..iu in ascending order: the top r are p-r+1..p.
  lapack_int info = LAPACKE_dsyevr(LAPACK_ROW_MAJOR, 'V', 'I', 'U', lapack_int(p_), cov.data(), lapack_int(p_), 0.0, 0.0, lapack_int(p_ - r + 1),
                                   lapack_int(p_), 0.0, &found, w.data(), z.data(), lapack_int(r), isuppz.data());
  require(info == 0 && found == lapack_int(r), "PCA: LAPACK dsyevr failed (info " + std::to_string(info) + ")");
  out.basis.resize(size_t(r) * p_);
  out.variance.resize(r);
  for (uint32_t j = 0; j < r; ++j) {
    const uint32_t col = r - 1 - j;  // descending
    out.variance[j] = std::max(0.0, w[col]);
    // Sign convention: largest-magnitude entry positive (stable across runs).
    double best = 0;
    for (uint32_t f = 0; f < p_; ++f)
      if (std::fabs(z[size_t(f) * r + col]) > std::fabs(best)) best = z[size_t(f) * r + col];
    const double sgn = best < 0 ? -1.0 : 1.0;
    for (uint32_t f = 0; f < p_; ++f) out.basis[size_t(j) * p_ + f] = float(sgn * z[size_t(f) * r + col]);
  }
  return out;
}

void pca_project(const Pca& pca, const float* x, size_t n, float* d) {
  std::vector<float> xc(n * pca.p);
  for (size_t i = 0; i < n; ++i)
    for (uint32_t f = 0; f < pca.p; ++f) xc[i * pca.p + f] = x[i * pca.p + f] - pca.mu[f];
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(pca.r), int(pca.p), 1.0f, xc.data(), int(pca.p), pca.basis.data(), int(pca.p),
              0.0f, d, int(pca.r));
}

namespace {

// Orthonormalises the columns of z (p x l, row-major) in place (QR via
// LAPACK dgeqrf + dorgqr in double).
void orthonormalize(std::vector<double>& z, uint32_t p, uint32_t l) {
  std::vector<double> tau(l);
  lapack_int info = LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, lapack_int(p), lapack_int(l), z.data(), lapack_int(l), tau.data());
  require(info == 0, "randomized PCA: dgeqrf failed (info " + std::to_string(info) + ")");
  info = LAPACKE_dorgqr(LAPACK_ROW_MAJOR, lapack_int(p), lapack_int(l), lapack_int(l), z.data(), lapack_int(l), tau.data());
  require(info == 0, "randomized PCA: dorgqr failed (info " + std::to_string(info) + ")");
}

}  // namespace

Pca randomized_pca(RowSource& src, uint32_t r, const RandomizedOptions& opt) {
  const uint32_t p = src.p();
  r = std::min(r, p);
  require(r >= 1, "randomized PCA: rank must be at least 1");
  const uint32_t l = std::min(p, r + opt.oversample);
  constexpr size_t kChunk = 512;
  std::vector<float> rows(kChunk * p);
  // Pass 1: mean and total variance.
  std::vector<double> sum(p, 0.0), sq(p, 0.0);
  uint64_t n = 0;
  src.reset();
  for (size_t m; (m = src.next(rows.data(), kChunk)) > 0; n += m)
    for (size_t i = 0; i < m; ++i)
      for (uint32_t f = 0; f < p; ++f) {
        const double x = rows[i * p + f];
        sum[f] += x;
        sq[f] += x * x;
      }
  require(n >= 2, "randomized PCA: need at least 2 rows");
  Pca out;
  out.p = p;
  out.r = r;
  out.n_tokens = n;
  out.mu.resize(p);
  for (uint32_t f = 0; f < p; ++f) {
    const double m = sum[f] / double(n);
    out.mu[f] = float(m);
    out.total_variance += sq[f] / double(n) - m * m;
  }
  // Z: Gaussian p x l, orthonormalised.
  std::mt19937_64 rng(opt.seed);
  std::normal_distribution<double> g(0.0, 1.0);
  std::vector<double> z(size_t(p) * l);
  for (auto& v : z) v = g(rng);
  orthonormalize(z, p, l);
  std::vector<float> zf(size_t(p) * l), az(kChunk * l), w(size_t(p) * l);
  auto center = [&](size_t m) {
    for (size_t i = 0; i < m; ++i)
      for (uint32_t f = 0; f < p; ++f) rows[i * p + f] -= out.mu[f];
  };
  for (uint32_t it = 0; it < opt.power_iters; ++it) {
    for (size_t i = 0; i < z.size(); ++i) zf[i] = float(z[i]);
    std::fill(w.begin(), w.end(), 0.0f);
    src.reset();
    for (size_t m; (m = src.next(rows.data(), kChunk)) > 0;) {
      center(m);
      // az = X Z (m x l); w += X' az (p x l).
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(m), int(l), int(p), 1.0f, rows.data(), int(p), zf.data(), int(l), 0.0f, az.data(),
                  int(l));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(p), int(l), int(m), 1.0f, rows.data(), int(p), az.data(), int(l), 1.0f, w.data(),
                  int(l));
    }
    for (size_t i = 0; i < z.size(); ++i) z[i] = w[i];
    orthonormalize(z, p, l);
  }
  // Rayleigh-Ritz: T = (A Z)'(A Z) / n, l x l, then Z's rotation by T's eigenvectors.
  for (size_t i = 0; i < z.size(); ++i) zf[i] = float(z[i]);
  std::vector<double> t(size_t(l) * l, 0.0);
  std::vector<float> tf(size_t(l) * l);
  src.reset();
  for (size_t m; (m = src.next(rows.data(), kChunk)) > 0;) {
    center(m);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(m), int(l), int(p), 1.0f, rows.data(), int(p), zf.data(), int(l), 0.0f, az.data(),
                int(l));
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, int(l), int(m), 1.0f, az.data(), int(l), 0.0f, tf.data(), int(l));
    for (uint32_t a = 0; a < l; ++a)
      for (uint32_t b = a; b < l; ++b) t[size_t(a) * l + b] += tf[size_t(a) * l + b];
  }
  for (auto& v : t) v /= double(n);
  std::vector<double> ev(l);
  lapack_int info = LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', lapack_int(l), t.data(), lapack_int(l), ev.data());
  require(info == 0, "randomized PCA: dsyevd failed (info " + std::to_string(info) + ")");
  out.basis.assign(size_t(r) * p, 0.0f);
  out.variance.resize(r);
  for (uint32_t j = 0; j < r; ++j) {
    const uint32_t col = l - 1 - j;  // descending
    out.variance[j] = std::max(0.0, ev[col]);
    std::vector<double> v(p, 0.0);
    for (uint32_t f = 0; f < p; ++f) {
      double acc = 0;
      for (uint32_t k = 0; k < l; ++k) acc += z[size_t(f) * l + k] * t[size_t(k) * l + col];
      v[f] = acc;
    }
    double best = 0;
    for (double x : v)
      if (std::fabs(x) > std::fabs(best)) best = x;
    const double sgn = best < 0 ? -1.0 : 1.0;
    for (uint32_t f = 0; f < p; ++f) out.basis[size_t(j) * p + f] = float(sgn * v[f]);
  }
  return out;
}

}  // namespace kvtc
