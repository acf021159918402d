#include "core/scalar.h"
#include "synth.cuh"

namespace kvtc::cuda {

namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void gaussian_kernel(float* __restrict__ dt, size_t ld, uint32_t ru, uint32_t n, const float* __restrict__ sigma, uint64_t seed,
                                uint64_t row0) {
  const size_t total = size_t(ru) * n;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total; idx += size_t(gridDim.x) * blockDim.x) {
    const uint32_t i = uint32_t(idx / n), t = uint32_t(idx % n);
    const uint64_t h = splitmix64(seed ^ splitmix64((row0 + t) * 0x100000001b3ull + i));
    const float u1 = (float(uint32_t(h >> 40)) + 0.5f) * (1.0f / 16777216.0f);
    const float u2 = float(uint32_t(h & 0xffffff)) * (1.0f / 16777216.0f);
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    dt[size_t(i) * ld + t] = sigma[i] * z;
  }
}

__global__ void sq_err_kernel(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b, uint32_t lh, uint32_t n_tokens, uint32_t D,
                              uint32_t t_lo, uint32_t t_hi, double* __restrict__ acc) {
  const uint32_t nt = t_hi - t_lo;
  const size_t total = size_t(lh) * nt * D;
  double num = 0, den = 0;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total; idx += size_t(gridDim.x) * blockDim.x) {
    const uint32_t d = uint32_t(idx % D);
    const size_t rest = idx / D;
    const uint32_t t = t_lo + uint32_t(rest % nt), h = uint32_t(rest / nt);
    const size_t i = (size_t(h) * n_tokens + t) * D + d;
    const double x = f16_to_f32(a[i]), y = f16_to_f32(b[i]);
    num += (x - y) * (x - y);
    den += x * x;
  }
  __shared__ double sn[256], sd[256];
  sn[threadIdx.x] = num;
  sd[threadIdx.x] = den;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      sn[threadIdx.x] += sn[threadIdx.x + s];
      sd[threadIdx.x] += sd[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicAdd(acc, sn[0]);
    atomicAdd(acc + 1, sd[0]);
  }
}

}  // namespace

void launch_gaussian(float* dt, size_t ld, uint32_t ru, uint32_t n, const float* sigma, uint64_t seed, uint64_t row0, cudaStream_t st) {
  const size_t total = size_t(ru) * n;
  if (total == 0) return;
  gaussian_kernel<<<grid_blocks(total, 256, 1u << 20), 256, 0, st>>>(dt, ld, ru, n, sigma, seed, row0);
  check_launch("gaussian");
}

void launch_sq_err(const uint16_t* a, const uint16_t* b, uint32_t lh, uint32_t n_tokens, uint32_t head_dim, uint32_t t_lo, uint32_t t_hi, double* acc,
                   cudaStream_t st) {
  if (t_hi <= t_lo) return;
  const size_t total = size_t(lh) * (t_hi - t_lo) * head_dim;
  sq_err_kernel<<<grid_blocks(total, 256, 4096), 256, 0, st>>>(a, b, lh, n_tokens, head_dim, t_lo, t_hi, acc);
  check_launch("sq_err");
}

}  // namespace kvtc::cuda
