// kvtc calibration: streamed covariance and its eigendecomposition (the
// exact PCA route of docs/method.md §3).
//
// Memory is p x p doubles (265 MB for p = 5,760) whatever the number of
// tokens: rows are added in chunks and never kept.
// Thread safety: one accumulator per thread; BLAS/LAPACK use their own threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtc {

struct Pca {
  uint32_t p = 0;                // features
  uint32_t r = 0;                // components kept
  uint64_t n_tokens = 0;         // rows the covariance was estimated from
  std::vector<float> mu;         // [p]
  std::vector<float> basis;      // [r][p], row j = component j (unit norm), by decreasing variance
  std::vector<double> variance;  // [r] eigenvalues (variance along each component)
  double total_variance = 0;     // trace of the covariance
};

class CovAccumulator {
 public:
  explicit CovAccumulator(uint32_t p);
  // x: [n][p] row-major. Rows are shifted by the first chunk's mean before
  // the f32 SYRK and summed into f64, which keeps the cancellation in
  // cov = E[xx'] - mu mu' harmless at 10^5-10^6 rows.
  void add(const float* x, size_t n);
  uint64_t n() const { return n_; }
  // Top-r eigenpairs of the covariance (LAPACK dsyevr).
  Pca finish(uint32_t r_max) const;

 private:
  uint32_t p_;
  uint64_t n_ = 0;
  std::vector<double> shift_, sum_, s_;  // s_: upper triangle of sum (x-shift)(x-shift)'
  std::vector<float> tmp_, xc_;
};

// Rows that can be read more than once (the randomized route makes several
// passes). next() fills up to max_rows rows of p floats and returns how many
// it wrote (0 at the end); reset() starts over.
class RowSource {
 public:
  virtual ~RowSource() = default;
  virtual uint32_t p() const = 0;
  virtual void reset() = 0;
  virtual size_t next(float* rows, size_t max_rows) = 0;
};

// Randomized PCA (Halko, Martinsson & Tropp 2011, subspace iteration): for
// p too large for a p x p covariance. Memory O(p * (r + oversample)); it
// reads the source 2 + power_iters times: the mean; power_iters products
// W = A'(A Z) with re-orthonormalisation (A = rows - mean); then a
// Rayleigh-Ritz step on the l x l matrix (A Z)'(A Z). total_variance is
// exact (a trace, summed in the mean pass).
struct RandomizedOptions {
  uint32_t oversample = 16;
  uint32_t power_iters = 8;  // the paper's setting
  uint64_t seed = 1;
};
Pca randomized_pca(RowSource& src, uint32_t r, const RandomizedOptions& opt = {});

// d[n][r] = (x[n][p] - mu) basis'  (SGEMM).
void pca_project(const Pca& pca, const float* x, size_t n, float* d);

}  // namespace kvtc
