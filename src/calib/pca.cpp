#include "pca.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cmath>
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

}  // namespace kvtc
