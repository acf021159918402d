// kvtc device build only: a plain OpenMP cblas_sgemm (see fallback/cblas.h).
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fallback/cblas.h"

extern "C" void cblas_sgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE ta, const enum CBLAS_TRANSPOSE tb, const blasint m,
                            const blasint n, const blasint k, const float alpha, const float* a, const blasint lda, const float* b, const blasint ldb,
                            const float beta, float* c, const blasint ldc) {
  if (order != CblasRowMajor) {
    std::fprintf(stderr, "cblas_sgemm fallback: row-major only\n");
    std::abort();
  }
  const bool at = ta != CblasNoTrans, bt = tb != CblasNoTrans;
#pragma omp parallel for schedule(static)
  for (blasint i = 0; i < m; ++i) {
    float* ci = c + size_t(i) * ldc;
    std::vector<float> acc(size_t(n), 0.0f);
    if (!at && bt) {  // C[i][j] = dot(A[i][:], B[j][:])
      const float* ai = a + size_t(i) * lda;
      for (blasint j = 0; j < n; ++j) {
        const float* bj = b + size_t(j) * ldb;
        float s = 0;
        for (blasint p = 0; p < k; ++p) s += ai[p] * bj[p];
        acc[size_t(j)] = s;
      }
    } else {  // C[i][:] += A(i,p) * B(p,:)
      for (blasint p = 0; p < k; ++p) {
        const float aip = at ? a[size_t(p) * lda + i] : a[size_t(i) * lda + p];
        if (aip == 0.0f) continue;
        if (!bt) {
          const float* bp = b + size_t(p) * ldb;
          for (blasint j = 0; j < n; ++j) acc[size_t(j)] += aip * bp[j];
        } else {
          for (blasint j = 0; j < n; ++j) acc[size_t(j)] += aip * b[size_t(j) * ldb + p];
        }
      }
    }
    for (blasint j = 0; j < n; ++j) ci[j] = alpha * acc[size_t(j)] + (beta == 0.0f ? 0.0f : beta * ci[j]);
  }
}
