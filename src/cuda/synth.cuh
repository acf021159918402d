// Internal (GPU path): synthetic data and error measurement on the device,
// for the tests and tools/kvtc_gpu_bench (no capture file needs to travel
// to a GPU machine): Gaussian PCA coefficients with a given spectrum from a
// counter-based generator, and the codec's reconstruction error.
#pragma once

#include "common.cuh"

namespace kvtc::cuda {

// dt[i * ld + t] = sigma[i] * z(seed, row0 + t, i), z ~ N(0, 1) (splitmix64
// counters, Box-Muller), for i < ru, t < n; sigma on the device.
void launch_gaussian(float* dt, size_t ld, uint32_t ru, uint32_t n, const float* sigma, uint64_t seed, uint64_t row0, cudaStream_t st);

// acc[0] += sum (a - b)^2, acc[1] += sum a^2 over tokens [t_lo, t_hi) of
// f16 caches [lh][n_tokens][head_dim] (acc: 2 doubles on the device).
void launch_sq_err(const uint16_t* a, const uint16_t* b, uint32_t lh, uint32_t n_tokens, uint32_t head_dim, uint32_t t_lo, uint32_t t_hi, double* acc,
                   cudaStream_t st);

}  // namespace kvtc::cuda
