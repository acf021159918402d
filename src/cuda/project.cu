#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "kvtc/error.h"
#include "project.cuh"

namespace kvtc::cuda {

namespace {

void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw Error(std::string("cuBLAS error in ") + what + ": " + cublasGetStatusString(s));
}

cudaDataType_t dtype(ElemType t) {
  return t == ElemType::kF32 ? CUDA_R_32F : t == ElemType::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
}

__global__ void convert_bf16(const float* __restrict__ in, __nv_bfloat16* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) out[i] = __float2bfloat16_rn(in[i]);
}
__global__ void convert_f16(const float* __restrict__ in, __half* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) out[i] = __float2half_rn(in[i]);
}

}  // namespace

Projector::Projector() {
  cublas_check(cublasCreate(&h_), "cublasCreate");
  cublas_check(cublasSetPointerMode(h_, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
}

Projector::~Projector() {
  if (h_) cublasDestroy(h_);
}

void Projector::set_stream(cudaStream_t st) {
  cublas_check(cublasSetStream(h_, st), "cublasSetStream");
  stream_ = st;
}

int Projector::version() const {
  int v = 0;
  cublasGetVersion(h_, &v);
  return v;
}

void Projector::encode(const void* x, ElemType t, bool tf32, const void* basis, uint32_t n, uint32_t p, uint32_t ru, float* dt, size_t ldd) {
  if (n == 0 || ru == 0) return;
  const float one = 1.0f, zero = 0.0f;
  // Column-major view: X is p x n (ld p), B is p x r (ld p), Dt is n x ru (ld ldd).
  if (t == ElemType::kF32 && !tf32) {
    cublas_check(cublasSgemm(h_, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(ru), int(p), &one, static_cast<const float*>(x), int(p),
                             static_cast<const float*>(basis), int(p), &zero, dt, int(ldd)),
                 "encode GEMM (sgemm)");
    return;
  }
  const cublasComputeType_t ct = t == ElemType::kF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  cublas_check(cublasGemmEx(h_, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(ru), int(p), &one, x, dtype(t), int(p), basis, dtype(t), int(p), &zero, dt,
                            CUDA_R_32F, int(ldd), ct, CUBLAS_GEMM_DEFAULT),
               "encode GEMM (gemmEx)");
}

void Projector::decode(const void* dt, ElemType t, bool tf32, size_t ldd, const void* basis, uint32_t n, uint32_t p, uint32_t ru, float* x,
                       float beta) {
  if (n == 0) return;
  if (ru == 0) {
    if (beta == 0.0f) check(cudaMemsetAsync(x, 0, size_t(n) * p * 4, stream_), "decode zero rows");
    return;
  }
  const float one = 1.0f;
  // Column-major view: B is p x r (ld p), Dt is n x ru (ld ldd), X is p x n (ld p).
  if (t == ElemType::kF32 && !tf32) {
    cublas_check(cublasSgemm(h_, CUBLAS_OP_N, CUBLAS_OP_T, int(p), int(n), int(ru), &one, static_cast<const float*>(basis), int(p),
                             static_cast<const float*>(dt), int(ldd), &beta, x, int(p)),
                 "decode GEMM (sgemm)");
    return;
  }
  const cublasComputeType_t ct = t == ElemType::kF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  cublas_check(cublasGemmEx(h_, CUBLAS_OP_N, CUBLAS_OP_T, int(p), int(n), int(ru), &one, basis, dtype(t), int(p), dt, dtype(t), int(ldd), &beta, x,
                            CUDA_R_32F, int(p), ct, CUBLAS_GEMM_DEFAULT),
               "decode GEMM (gemmEx)");
}

void launch_convert(const float* in, void* out, ElemType t, size_t n, cudaStream_t st) {
  if (n == 0) return;
  const unsigned g = grid_blocks(n, 256, 1u << 20);
  if (t == ElemType::kBf16)
    convert_bf16<<<g, 256, 0, st>>>(in, static_cast<__nv_bfloat16*>(out), n);
  else if (t == ElemType::kF16)
    convert_f16<<<g, 256, 0, st>>>(in, static_cast<__half*>(out), n);
  else
    check(cudaMemcpyAsync(out, in, n * 4, cudaMemcpyDeviceToDevice, st), "convert copy");
  check_launch("convert");
}

}  // namespace kvtc::cuda
