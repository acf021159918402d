// Internal (GPU path), kernel family (d): the projection on the PCA basis
// with cuBLAS, the device twin of the cblas_sgemm calls in encode.cpp /
// decode.cpp.
//   encode: Dt (component-major [ru][ldd], f32) = (X - mu) B[:ru]^T
//   decode: X ([n][p], f32) = D B[:ru] (+ X pre-filled with mu when beta = 1)
// Modes: f32 (cublasSgemm), tf32 (cublasGemmEx, FAST_TF32 compute),
// bf16 / f16 (cublasGemmEx on 16-bit X/D and basis, f32 accumulate and
// output). f32 differs from OpenBLAS only by summation order.
#pragma once

#include "common.cuh"

typedef struct cublasContext* cublasHandle_t;

namespace kvtc::cuda {

class Projector {
 public:
  Projector();
  ~Projector();
  Projector(const Projector&) = delete;
  Projector& operator=(const Projector&) = delete;
  void set_stream(cudaStream_t st);
  // x: [n][p] of type t (f32 when tf32); basis: [r][p] of type t.
  void encode(const void* x, ElemType t, bool tf32, const void* basis, uint32_t n, uint32_t p, uint32_t ru, float* dt, size_t ldd);
  // dt: component-major [ru][ldd] of type t; x: f32 [n][p] = D B[:ru] + beta x
  // (beta 1: x pre-filled with mu, as the CPU; beta 0: mu added later).
  void decode(const void* dt, ElemType t, bool tf32, size_t ldd, const void* basis, uint32_t n, uint32_t p, uint32_t ru, float* x, float beta);
  int version() const;

 private:
  cublasHandle_t h_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// out[i] = in[i] rounded to t (nearest even); for basis copies.
void launch_convert(const float* in, void* out, ElemType t, size_t n, cudaStream_t st);

}  // namespace kvtc::cuda
