// kvtc calibration: streamed covariance and its eigendecomposition (the
// exact PCA route of docs/method.md §3).
//
// Memory is p x p doubles (265 MB for p = 5,760) whatever the number of
// tokens: rows are added in chunks and, past p rows, never kept. Up to p
// rows are kept as f32 instead (at most p x p floats) and finish() works on
// their n x n Gram matrix: the same eigenpairs, at (n/p)^3 of the
// eigensolver's cost (3,000 tokens of p = 5,760: ~2 s instead of ~14 s a
// matrix on 2 EPYC cores).
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
  bool gram = false;             // exact route through the n x n Gram matrix (n <= p), not the p x p covariance
};

class CovAccumulator {
 public:
  // keep_rows: rows kept for the Gram route (default p, where it stops
  // paying: its eigensolver is n x n); 0 forces the covariance route.
  explicit CovAccumulator(uint32_t p, size_t keep_rows = size_t(-1));
  // x: [n][p] row-major. Rows are shifted by the first chunk's mean before
  // the f32 SYRK and summed into f64, which keeps the cancellation in
  // cov = E[xx'] - mu mu' harmless at 10^5-10^6 rows.
  void add(const float* x, size_t n);
  uint64_t n() const { return n_; }
  // Top-r eigenpairs of the covariance (LAPACK dsyevr), through the Gram
  // matrix of the kept rows when there are no more than keep_rows of them
  // and r < n (the centred rows have rank at most n - 1).
  // With `groups` (the first feature of each group, ascending, starting at
  // 0; more than one entry), a layer-grouped PCA instead: the eigenpairs of
  // each diagonal block [groups[i], groups[i+1]) of the covariance (the last
  // block ends at p), each component zero outside its block, all blocks'
  // components merged by decreasing variance (ties: the earlier block
  // first) and the top r kept. Always through the covariance.
  Pca finish(uint32_t r_max, const std::vector<uint32_t>& groups = {}) const;

 private:
  void add_kept(std::vector<float>& tmp, std::vector<double>& s) const;  // s += the kept rows' x'x, chunk by chunk
  Pca finish_gram(uint32_t r) const;
  std::vector<double> start(Pca& out) const;  // p, n_tokens, mu; the shifted rows' mean

  uint32_t p_;
  size_t keep_rows_;
  uint64_t n_ = 0;
  std::vector<double> shift_, sum_, s_;  // s_: upper triangle of sum (x-shift)(x-shift)', allocated past keep_rows
  std::vector<float> tmp_, xc_, kept_;   // kept_: [n][p] shifted rows while n <= keep_rows
  std::vector<size_t> kept_chunks_;      // rows of each add() in kept_, in order
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
