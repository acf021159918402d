/* kvtc device build only (bench/gpu): the one CBLAS routine the codec's CPU
 * path calls, for GPU machines without a BLAS. Implemented in
 * cblas_fallback.cpp (row-major, OpenMP); slower than OpenBLAS, used only by
 * the CPU reference in the GPU tests and the benchmark's cross-check. */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112, CblasConjTrans = 113 };
typedef int blasint;

void cblas_sgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE ta, const enum CBLAS_TRANSPOSE tb, const blasint m, const blasint n,
                 const blasint k, const float alpha, const float* a, const blasint lda, const float* b, const blasint ldb, const float beta, float* c,
                 const blasint ldc);

#ifdef __cplusplus
}
#endif
