#include "calib/pca.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "kvtc/error.h"

namespace kvtc {

CovAccumulator::CovAccumulator(uint32_t p, size_t keep_rows) : p_(p), keep_rows_(std::min<size_t>(keep_rows, p)), shift_(p, 0.0), sum_(p, 0.0) {}

namespace {

// s (upper triangle, p x p f64) += xc' xc for n rows of p; tmp: p x p f32 scratch.
void syrk_add(const float* xc, size_t n, uint32_t p, std::vector<float>& tmp, std::vector<double>& s) {
  tmp.resize(size_t(p) * p);
  s.resize(size_t(p) * p, 0.0);
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, int(p), int(n), 1.0f, xc, int(p), 0.0f, tmp.data(), int(p));
  for (uint32_t a = 0; a < p; ++a)
    for (uint32_t b = a; b < p; ++b) s[size_t(a) * p + b] += tmp[size_t(a) * p + b];
}

// Row j of the basis from eigenvector column col of z ([p][ld], f64), with
// the sign convention: largest-magnitude entry positive (stable across runs).
void store_component(const double* z, size_t ld, uint32_t col, double scale, uint32_t p, float* out) {
  double best = 0;
  for (uint32_t f = 0; f < p; ++f)
    if (std::fabs(z[size_t(f) * ld + col]) > std::fabs(best)) best = z[size_t(f) * ld + col];
  const double sgn = best < 0 ? -scale : scale;
  for (uint32_t f = 0; f < p; ++f) out[f] = float(sgn * z[size_t(f) * ld + col]);
}

}  // namespace

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
  if (s_.empty() && n_ + n <= keep_rows_) {
    kept_.insert(kept_.end(), xc_.begin(), xc_.end());
    kept_chunks_.push_back(n);
  } else {
    if (!kept_.empty()) {  // past keep_rows: the kept rows join the covariance, and no more are kept
      add_kept(tmp_, s_);
      kept_.clear();
      kept_.shrink_to_fit();
      kept_chunks_.clear();
    }
    syrk_add(xc_.data(), n, p_, tmp_, s_);
  }
  n_ += n;
}

// One f32 SYRK per add() as it came, not one over all kept rows: the f32 sums
// then run over the same rows as on the covariance route (keep_rows 0), so
// both give the same bits and a calibration does not depend on keep_rows
// (the quality records are keyed by a calibration's id, a hash of its bits).
void CovAccumulator::add_kept(std::vector<float>& tmp, std::vector<double>& s) const {
  size_t row = 0;
  for (size_t n : kept_chunks_) {
    syrk_add(kept_.data() + row * p_, n, p_, tmp, s);
    row += n;
  }
}

// p, n_tokens and mu of out; returns the mean of the shifted rows (both routes centre by it).
std::vector<double> CovAccumulator::start(Pca& out) const {
  out.p = p_;
  out.n_tokens = n_;
  std::vector<double> m(p_);
  for (uint32_t f = 0; f < p_; ++f) m[f] = sum_[f] / double(n_);
  out.mu.resize(p_);
  for (uint32_t f = 0; f < p_; ++f) out.mu[f] = float(shift_[f] + m[f]);
  return m;
}

namespace {

// The top r eigenpairs of the w x w symmetric matrix a (upper triangle,
// row-major f64; clobbered): eigenvalues descending in `val`, eigenvectors
// as rows of w in `vec` (sign: the largest-magnitude entry positive).
void top_eigenpairs(std::vector<double>& a, uint32_t w, uint32_t r, std::vector<double>& val, std::vector<float>& vec) {
  std::vector<double> ev(w), z(size_t(w) * r);
  std::vector<lapack_int> isuppz(2 * size_t(r));
  lapack_int found = 0;
  // Eigenvalues il..iu in ascending order: the top r are w-r+1..w.
  lapack_int info = LAPACKE_dsyevr(LAPACK_ROW_MAJOR, 'V', 'I', 'U', lapack_int(w), a.data(), lapack_int(w), 0.0, 0.0, lapack_int(w - r + 1),
                                   lapack_int(w), 0.0, &found, ev.data(), z.data(), lapack_int(r), isuppz.data());
  require(info == 0 && found == lapack_int(r), "PCA: LAPACK dsyevr failed (info " + std::to_string(info) + ")");
  val.resize(r);
  vec.resize(size_t(r) * w);
  for (uint32_t j = 0; j < r; ++j) {
    const uint32_t col = r - 1 - j;  // descending
    val[j] = std::max(0.0, ev[col]);
    store_component(z.data(), r, col, 1.0, w, &vec[size_t(j) * w]);
  }
}

}  // namespace

Pca CovAccumulator::finish(uint32_t r_max, const std::vector<uint32_t>& groups) const {
  require(n_ >= 2, "PCA: need at least 2 calibration tokens, have " + std::to_string(n_));
  const uint32_t r = std::min(r_max, p_);
  require(r >= 1, "PCA: rank must be at least 1");
  const bool grouped = groups.size() > 1;
  if (grouped) {
    require(groups[0] == 0, "PCA: the first layer group must start at feature 0");
    for (size_t i = 1; i < groups.size(); ++i)
      require(groups[i] > groups[i - 1] && groups[i] < p_, "PCA: layer groups must start at ascending features below " + std::to_string(p_));
  }
  if (!grouped && s_.empty() && r < n_) {
    Pca g = finish_gram(r);
    if (g.r == r) return g;
  }
  std::vector<double> kept_sum;  // rows still kept (the Gram route declined or a grouped fit): their covariance now
  std::vector<float> tmp;
  if (s_.empty()) add_kept(tmp, kept_sum);
  const std::vector<double>& s = s_.empty() ? kept_sum : s_;
  Pca out;
  out.r = r;
  const std::vector<double> m = start(out);
  for (uint32_t f = 0; f < p_; ++f) out.total_variance += s[size_t(f) * p_ + f] / double(n_) - m[f] * m[f];
  // The covariance of features [c0, c1) (upper triangle).
  auto block = [&](uint32_t c0, uint32_t c1) {
    const uint32_t w = c1 - c0;
    std::vector<double> cov(size_t(w) * w, 0.0);
    for (uint32_t a = c0; a < c1; ++a)
      for (uint32_t b = a; b < c1; ++b) cov[size_t(a - c0) * w + (b - c0)] = s[size_t(a) * p_ + b] / double(n_) - m[a] * m[b];
    return cov;
  };
  if (!grouped) {
    std::vector<double> cov = block(0, p_), val;
    std::vector<float> vec;
    top_eigenpairs(cov, p_, r, val, vec);
    out.basis = std::move(vec);
    out.variance = std::move(val);
    return out;
  }
  struct Part {
    uint32_t c0, w;
    std::vector<double> val;
    std::vector<float> vec;
  };
  out.basis.assign(size_t(r) * p_, 0.0f);
  out.variance.resize(r);
  std::vector<Part> parts;
  for (size_t i = 0; i < groups.size(); ++i) {
    const uint32_t c0 = groups[i], c1 = i + 1 < groups.size() ? groups[i + 1] : p_;
    Part pt{c0, c1 - c0, {}, {}};
    std::vector<double> cov = block(c0, c1);
    top_eigenpairs(cov, pt.w, std::min(r, pt.w), pt.val, pt.vec);
    parts.push_back(std::move(pt));
  }
  // Merge by decreasing variance; on a tie the earlier group first (the
  // order, and so the file's bytes, must not depend on the sort's library).
  std::vector<size_t> at(parts.size(), 0);
  for (uint32_t j = 0; j < r; ++j) {
    size_t best = parts.size();
    for (size_t g = 0; g < parts.size(); ++g)
      if (at[g] < parts[g].val.size() && (best == parts.size() || parts[g].val[at[g]] > parts[best].val[at[best]])) best = g;
    require(best < parts.size(), "PCA: layer groups hold fewer components than the rank");
    const Part& pt = parts[best];
    out.variance[j] = pt.val[at[best]];
    std::copy_n(&pt.vec[at[best] * pt.w], pt.w, &out.basis[size_t(j) * p_ + pt.c0]);
    ++at[best];
  }
  return out;
}

// The covariance C = X'X / n of the n centred rows X (n x p) and the Gram
// matrix G = X X' / n share their nonzero eigenvalues, and C's eigenvector
// for lambda is X'u / sqrt(n lambda) where G u = lambda u. Returns r = 0 when
// a wanted eigenvalue is not clearly positive (rows of lower rank than r):
// those directions are arbitrary, and the covariance route picks them.
Pca CovAccumulator::finish_gram(uint32_t r) const {
  const size_t n = size_t(n_);
  Pca out;
  out.gram = true;
  const std::vector<double> m = start(out);
  std::vector<double> x(n * p_);
  for (size_t i = 0; i < n; ++i)
    for (uint32_t f = 0; f < p_; ++f) {
      const double c = double(kept_[i * p_ + f]) - m[f];
      x[i * p_ + f] = c;
      out.total_variance += c * c;
    }
  out.total_variance /= double(n);
  std::vector<double> g(n * n);
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, int(n), int(p_), 1.0 / double(n), x.data(), int(p_), 0.0, g.data(), int(n));
  std::vector<double> w(n), u(n * r);
  std::vector<lapack_int> isuppz(2 * size_t(r));
  lapack_int found = 0;
  lapack_int info = LAPACKE_dsyevr(LAPACK_ROW_MAJOR, 'V', 'I', 'U', lapack_int(n), g.data(), lapack_int(n), 0.0, 0.0, lapack_int(n - r + 1),
                                   lapack_int(n), 0.0, &found, w.data(), u.data(), lapack_int(r), isuppz.data());
  require(info == 0 && found == lapack_int(r), "PCA: LAPACK dsyevr on the Gram matrix failed (info " + std::to_string(info) + ")");
  // 1e-10 of the top eigenvalue: the basis then stays orthonormal to ~1e-6
  // (the back-projection's error grows as lambda_1 / lambda_j).
  if (!(w[0] > 1e-10 * w[r - 1])) return out;
  std::vector<double> v(size_t(p_) * r);  // X'U: [p][r]
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(p_), int(r), int(n), 1.0, x.data(), int(p_), u.data(), int(r), 0.0, v.data(), int(r));
  out.r = r;
  out.basis.resize(size_t(r) * p_);
  out.variance.resize(r);
  for (uint32_t j = 0; j < r; ++j) {
    const uint32_t col = r - 1 - j;  // descending
    out.variance[j] = w[col];
    store_component(v.data(), r, col, 1.0 / std::sqrt(double(n) * w[col]), p_, &out.basis[size_t(j) * p_]);
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
