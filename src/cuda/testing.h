// Internal (GPU path): test and benchmark support, kept out of the public
// CudaCodec (tests/test_cuda.cpp and bench/gpu/kvtc_gpu_bench.cpp use it).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "kvtc/cuda.h"

namespace kvtc::cuda {

// A capture of the given shape (host: geometry, positions, tokens,
// provenance; k/v ignored) whose features are mu + sum_j sigma[j] z_j B[j]
// with z_j ~ N(0,1) from a counter-based generator seeded by `seed`, keys
// then RoPE-rotated (when the codec's calibration removes RoPE) and
// rounded to f16 — all on the device, with the codec's mean and basis.
// sigma[b][kv] holds per-component standard deviations (missing
// components are 0).
CudaKvCapture synthesize(CudaCodec& codec, const KvCapture& shape, const std::vector<std::array<std::vector<float>, 2>>& sigma, uint64_t seed);

}  // namespace kvtc::cuda
