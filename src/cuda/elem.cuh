// Internal (GPU path), device only: storing an f32 as the GEMM's element
// type (f32; bf16 / f16 rounded to nearest even), for the kernels that
// write feature rows or coefficient planes (rope_gather.cu, quant.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kvtc::cuda {

template <typename T>
__device__ __forceinline__ void store_elem(T* p, float v);
template <>
__device__ __forceinline__ void store_elem<float>(float* p, float v) {
  *p = v;
}
template <>
__device__ __forceinline__ void store_elem<__nv_bfloat16>(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ void store_elem<__half>(__half* p, float v) {
  *p = __float2half_rn(v);
}

}  // namespace kvtc::cuda
